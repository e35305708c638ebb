"""The simulated device: spec parsing, capacity enforcement, address spaces, counted copies."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backend import DEFAULT_SIM_BYTES, Backend, SimBackend, make_backend
from engine.errors import DeviceError, FlagError
from engine.memory.sizes import GiB, KiB, MiB, format_size, parse_size


@pytest.mark.parametrize(
    ("spec", "capacity"),
    [("sim", DEFAULT_SIM_BYTES), ("sim:8GiB", 8 * GiB), ("sim:512MiB", 512 * MiB),
     ("SIM:1.5G", 3 * GiB // 2), ("sim:1GB", 10**9)],
)  # fmt: skip
def test_make_backend_sim_sizes(spec: str, capacity: int) -> None:
    backend = make_backend(spec)
    assert isinstance(backend, Backend)
    assert backend.name == "sim" and backend.xp is np
    assert backend.capacity_bytes == capacity
    assert backend.mem_info().total_bytes == capacity


@pytest.mark.parametrize(
    ("spec", "words"),
    [("cuda", "CUDA backend not available yet"), ("cuda:1", "CUDA backend not available yet"),
     ("cuda:x", "not a GPU index"), ("tpu", "unknown device 'tpu'"),
     ("sim:lots", "'lots' is not a size"), ("sim:0MiB", "is zero")],
)  # fmt: skip
def test_make_backend_refuses(spec: str, words: str) -> None:
    with pytest.raises(DeviceError, match=words) as e:
        make_backend(spec)
    assert "\n" not in str(e.value)


def test_parse_and_format_sizes() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("64KiB") == 64 * KiB
    assert parse_size(" 512 MiB ") == 512 * MiB
    assert parse_size("8g") == 8 * GiB
    with pytest.raises(FlagError, match="--vram-limit '8 parsecs' is not a size"):
        parse_size("8 parsecs", what="--vram-limit")
    assert format_size(8 * GiB) == "8 GiB"
    assert format_size(3 * GiB // 2) == "1.5 GiB"
    assert format_size(512 * MiB) == "512 MiB"
    assert format_size(100) == "100 B"


def test_capacity_is_enforced_on_alloc() -> None:
    backend = SimBackend(4 * MiB)
    a = backend.alloc(3 * MiB)
    assert backend.mem_info().free_bytes == 1 * MiB
    assert backend.mem_info().process_bytes == 3 * MiB
    with pytest.raises(DeviceError) as e:
        backend.alloc(2 * MiB)
    assert str(e.value) == (
        "out of simulated VRAM: asked 2.0 MiB, 1.0 MiB free; raise --device sim:SIZE"
    )
    backend.free(a)
    assert backend.mem_info().free_bytes == 4 * MiB
    b = backend.alloc(4 * MiB)
    assert b.nbytes == 4 * MiB and b.dtype == np.uint8


def test_address_space_maps_against_capacity() -> None:
    backend = SimBackend(1 * MiB)
    aspace = backend.reserve_address_space(4 * MiB)  # reserving addresses costs nothing
    assert backend.mem_info().free_bytes == 1 * MiB
    aspace.map(0, 512 * KiB)
    aspace.map(512 * KiB, 512 * KiB)
    assert backend.mem_info().free_bytes == 0 and aspace.mapped_bytes == 1 * MiB
    with pytest.raises(DeviceError, match="out of simulated VRAM"):
        aspace.map(1 * MiB, 4 * KiB)
    aspace.unmap(0, 512 * KiB)
    assert backend.mem_info().free_bytes == 512 * KiB
    aspace.close()
    assert backend.mem_info().process_bytes == 0


def test_address_space_views_span_mappings_and_refuse_holes() -> None:
    backend = SimBackend(8 * MiB)
    aspace = backend.reserve_address_space(8 * MiB)
    aspace.map(0, 64 * KiB)
    aspace.map(64 * KiB, 64 * KiB)
    v = aspace.view(60 * KiB, 8 * KiB)  # crosses the boundary of two mappings
    v[:] = 7
    assert (aspace.view(64 * KiB, 4 * KiB) == 7).all()
    with pytest.raises(AssertionError, match="unmapped byte"):
        aspace.view(120 * KiB, 16 * KiB)
    aspace.map(192 * KiB, 64 * KiB)  # a hole at [128 KiB, 192 KiB)
    with pytest.raises(AssertionError, match="unmapped byte"):
        aspace.view(100 * KiB, 120 * KiB)
    with pytest.raises(AssertionError, match="over a mapped range"):
        aspace.map(0, 128 * KiB)


def test_unmapped_range_reads_back_zero_at_the_same_address() -> None:
    backend = SimBackend(8 * MiB)
    aspace = backend.reserve_address_space(8 * MiB)
    aspace.map(0, 1 * MiB)
    before = aspace.view(0, 1 * MiB)
    before[:] = 0xAB
    address = before.__array_interface__["data"][0]
    aspace.unmap(0, 1 * MiB)
    aspace.map(0, 1 * MiB)
    after = aspace.view(0, 1 * MiB)
    assert after.__array_interface__["data"][0] == address
    assert not after.any(), "unmapped memory kept its contents"


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_unmap_really_frees_host_memory() -> None:
    backend = SimBackend(1 * GiB)
    aspace = backend.reserve_address_space(1 * GiB)
    aspace.map(0, 256 * MiB)
    base = _rss_bytes()
    aspace.view(0, 256 * MiB)[:] = 1
    touched = _rss_bytes()
    assert touched - base > 200 * MiB
    aspace.unmap(0, 256 * MiB)
    assert touched - _rss_bytes() > 200 * MiB


def test_copies_are_real_and_counted() -> None:
    backend = SimBackend(1 * MiB)
    dev = backend.alloc(16)
    host = np.arange(4, dtype=np.float32)  # [4], 16 bytes into a uint8 [16] buffer
    backend.upload(host, dev)
    assert bytes(dev) == host.tobytes()
    back = backend.download(dev.view(np.float32))
    back[0] = 99.0  # a host copy: the device keeps its value
    assert dev.view(np.float32)[0] == 0.0
    counts = backend.stats.snapshot()
    assert (counts.h2d_bytes, counts.h2d_copies, counts.d2h_bytes, counts.d2h_copies) == (
        16, 1, 16, 1,
    )  # fmt: skip
    backend.upload(np.ones(8, np.uint8), dev[:8])
    assert (backend.stats.snapshot() - counts).h2d_bytes == 8
    with pytest.raises(AssertionError, match="upload of 4 bytes into 8"):
        backend.upload(np.ones(4, np.uint8), dev[:8])
    backend.stats.reset()
    assert backend.stats.snapshot().h2d_copies == 0


def test_injected_fault_fires_once_after_n_calls() -> None:
    backend = SimBackend(1 * MiB)
    dev = backend.alloc(4)
    backend.inject_fault("upload", after=1)
    backend.upload(np.ones(4, np.uint8), dev)
    with pytest.raises(DeviceError, match="injected fault in upload"):
        backend.upload(np.ones(4, np.uint8), dev)
    backend.upload(np.ones(4, np.uint8), dev)
    assert backend.stats.h2d_copies == 2
