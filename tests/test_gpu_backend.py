"""The CUDA backend on a real GPU: VMM segments, the --vram-limit budget, counted copies.

Marked `gpu`; skipped where CuPy is missing or finds no device.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import DeviceError, LedgerError
from engine.memory.sizes import GiB, MiB

pytestmark = pytest.mark.gpu


@pytest.fixture
def backend(cp):
    from engine.backend.cuda import CudaBackend

    b = CudaBackend(0, limit_bytes=4 * GiB)
    yield b
    b.close()


def _device_used_bytes() -> int:
    from engine.backend.telemetry import Telemetry

    t = Telemetry.open(0)
    assert t is not None, "NVML is needed for this test"
    try:
        return t.memory()[2]
    finally:
        t.close()


def test_make_backend_routes_cuda(cp) -> None:
    from engine.backend import Backend, make_backend

    b = make_backend("cuda:0", limit_bytes=2 * GiB)
    assert isinstance(b, Backend) and b.name == "cuda:0" and b.xp is cp
    assert 0 < b.capacity_bytes < 2 * GiB and b.capacity_bytes % (2 * MiB) == 0
    with pytest.raises(DeviceError, match="CUDA devices"):
        make_backend("cuda:99")


def test_vmm_unmap_frees_memory_and_remap_keeps_addresses(backend, cp) -> None:
    seg = 256 * MiB
    aspace = backend.reserve_address_space(2 * GiB)
    assert aspace.granularity_bytes % (2 * MiB) == 0
    used0 = _device_used_bytes()
    aspace.map(0, seg)
    aspace.map(seg, seg)
    used1 = _device_used_bytes()
    assert used1 - used0 >= 2 * seg - 8 * MiB, (used0, used1)
    view = aspace.view(0, 2 * seg)  # one contiguous range over two physical chunks
    ptr = view.data.ptr
    rng = np.random.default_rng(0)
    first = rng.integers(0, 256, 2 * seg, dtype=np.uint8)
    backend.upload(first, view)
    assert np.array_equal(backend.download(view), first)

    aspace.unmap(seg, seg)
    backend.synchronize()
    used2 = _device_used_bytes()
    assert used1 - used2 >= seg - 8 * MiB, (used1, used2)
    assert aspace.mapped_bytes == seg
    assert np.array_equal(backend.download(aspace.view(0, seg)), first[:seg])  # kept part intact

    aspace.map(seg, seg)
    assert _device_used_bytes() - used2 >= seg - 8 * MiB
    again = aspace.view(0, 2 * seg)
    assert again.data.ptr == ptr  # same addresses after release and restore
    second = rng.integers(0, 256, seg, dtype=np.uint8)
    backend.upload(second, aspace.view(seg, seg))  # a re-mapped segment is re-uploadable
    got = backend.download(again)
    assert np.array_equal(got[:seg], first[:seg]) and np.array_equal(got[seg:], second)
    aspace.close()
    assert _device_used_bytes() <= used0 + 32 * MiB


def test_ledger_regions_on_vmm_keep_addresses_across_release(backend) -> None:
    from engine.memory.ledger import Ledger

    ledger = Ledger(backend, backend.capacity_bytes, segment_bytes=64 * MiB)
    kv = ledger.reserve("kv", 100 * MiB)
    ptr = kv.view(0, 100 * MiB).data.ptr
    ledger.grow("kv", 100 * MiB)
    assert kv.view(0, 200 * MiB).data.ptr == ptr
    ledger.reserve("verifier", 64 * MiB)
    ledger.check_integrity()
    ledger.release("kv")
    ledger.check_integrity()
    again = ledger.reserve("kv", 150 * MiB)
    assert again.view(0, 150 * MiB).data.ptr == ptr
    snap = ledger.snapshot()
    assert snap.unaccounted_bytes is None or snap.unaccounted_bytes >= 0
    ledger.close()


def test_vram_limit_is_enforced(cp) -> None:
    from engine.backend.cuda import CudaBackend
    from engine.memory.ledger import Ledger

    b = CudaBackend(0, limit_bytes=2 * GiB)
    assert b.limit_bytes == 2 * GiB and b.outside_bytes > 0  # the context, at least
    assert b.budget_bytes == 2 * GiB - b.outside_bytes - b.margin_bytes
    assert b.capacity_bytes <= b.budget_bytes - b.workspace_bytes
    aspace = b.reserve_address_space(4 * GiB)
    with pytest.raises(DeviceError, match="out of planned VRAM") as e:
        aspace.map(0, 2 * GiB)
    assert "\n" not in str(e.value) and aspace.mapped_bytes == 0
    with pytest.raises(DeviceError, match="out of planned VRAM"):
        b.alloc(b.capacity_bytes + 2 * MiB)
    with pytest.raises(cp.cuda.memory.OutOfMemoryError):  # temporaries are inside the budget too
        cp.empty(2 * GiB, dtype=cp.uint8)
    ledger = Ledger(b, b.capacity_bytes, segment_bytes=64 * MiB)
    with pytest.raises(LedgerError):
        ledger.reserve("experts.cache", b.capacity_bytes + 64 * MiB)
    ledger.reserve("experts.cache", ledger.capacity_bytes)  # exactly the capacity fits
    ledger.check_integrity()
    with pytest.raises(DeviceError):
        b.alloc(64 * MiB)
    ledger.close()
    aspace.close()
    buf = b.alloc(min(64 * MiB, b.capacity_bytes))  # released memory is usable again
    b.free(buf)
    b.close()


def test_uploads_are_counted_and_correct(backend, cp) -> None:
    rng = np.random.default_rng(1)
    n = 80 * MiB + 12345  # several staging halves and a ragged end
    host = rng.integers(0, 256, n, dtype=np.uint8)
    dev = cp.empty(n, dtype=cp.uint8)
    before = backend.stats.snapshot()
    backend.upload(host, dev)
    assert cp.array_equal(dev, cp.asarray(host))  # compute after upload() sees the bytes
    pinned = backend.host_buffer(n)
    pinned[:] = host[::-1]
    backend.upload(pinned, dev)
    back = backend.download(dev)
    assert np.array_equal(back, host[::-1])
    floats = rng.standard_normal((300, 7)).astype(np.float32)
    fdev = cp.empty((300, 7), dtype=cp.float32)
    backend.upload(floats, fdev)
    assert np.array_equal(backend.download(fdev), floats)
    diff = backend.stats.snapshot() - before
    assert diff.h2d_copies == 3 and diff.h2d_bytes == 2 * n + floats.nbytes
    assert diff.d2h_copies == 2 and diff.d2h_bytes == n + floats.nbytes


def test_upload_async_overlaps_and_joins(backend, cp) -> None:
    n = 64 * MiB
    host = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    dev = cp.empty(n, dtype=cp.uint8)
    event = backend.upload_async(host, dev, after_compute=False)
    backend.wait(event)
    total = int(dev.sum(dtype=cp.uint64))
    assert total == int(host.sum(dtype=np.uint64))


def test_mem_info_reports_the_whole_process_limit_and_process(backend) -> None:
    info = backend.mem_info()
    assert info.total_bytes == backend.limit_bytes == 4 * GiB
    assert 0 <= info.free_bytes <= info.total_bytes
    assert info.process_bytes is None or info.process_bytes > 0


def test_a_restored_head_uploads_from_page_locked_memory(backend, cp) -> None:
    """A loan restores the head from its converted host copy; that copy is page-locked once,
    so every restore is one DMA (not a staged copy), and the bytes arrive intact."""
    from engine.memory.arena import Arena
    from engine.memory.ledger import Ledger

    ledger = Ledger(backend, backend.capacity_bytes, segment_bytes=64 * MiB)
    head = Arena(ledger, "head.native", 64 * MiB, float_dtype=np.float16)
    rows = np.random.default_rng(0).standard_normal((4096, 1024), dtype=np.float32)  # 16 MiB
    for _ in range(2):  # startup, then a loan's release and restore
        dev = head.to_device(rows)
        (_, converted), = head._converted.values()
        assert backend._is_pinned(converted.ctypes.data, converted.nbytes)
        assert cp.array_equal(dev, cp.asarray(rows.astype(np.float16)))
        head.release()
        head.restore()
    ledger.close()
