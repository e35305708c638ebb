"""A simulated device in host memory: numpy arrays, a hard capacity, counted copies, and the
model's ops in array code (engine/backend/array_ops.py).

The capacity is enforced on everything the device holds (standalone buffers plus mapped address
ranges), so a plan that does not fit a `sim:512MiB` device fails exactly where it would fail on a
512 MiB GPU. Address spaces are anonymous memory maps reserved without backing
(`MAP_NORESERVE`); `map` charges the capacity and `unmap` returns the pages to the OS with
`madvise(MADV_DONTNEED)`, so released regions really free host memory and read back as zeros.

`inject_fault` makes the n-th next call of one operation raise `DeviceError`, the way a CUDA call
can fail; the loan's rollback tests use it.
"""

from __future__ import annotations

import bisect
import mmap
import sys
import time
from typing import Any

import numpy as np

from engine.backend.array_ops import ArrayOps
from engine.backend.base import SIM_TRAITS, CopyStats, MemInfo
from engine.errors import DeviceError
from engine.gguf.quant import ExpertLayout
from engine.memory.sizes import format_mib

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
_FAULT_OPS = ("alloc", "map", "upload", "download")


class SimBackend(ArrayOps):
    """A device of `capacity_bytes` simulated with numpy (see the module docstring)."""

    async_copies = False  # every copy has finished when its call returns
    traits = SIM_TRAITS

    def __init__(self, capacity_bytes: int, *, name: str = "sim"):
        assert capacity_bytes > 0, capacity_bytes
        self.name = name
        self.device_index = None
        self.xp = np
        self.capacity_bytes = capacity_bytes
        self.stats = CopyStats()
        self._buffers: dict[int, np.ndarray] = {}  # id -> live standalone buffer
        self._buffer_bytes = 0
        self._mapped_bytes = 0  # over all address spaces
        self.peak_bytes = 0  # the most held at once (`strata bench`'s peak on this device)
        self._faults: dict[str, int] = {}  # op -> calls left before it fails

    # -- memory ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Device bytes held now: standalone buffers plus mapped address ranges."""
        return self._buffer_bytes + self._mapped_bytes

    def _charge(self, n_bytes: int) -> None:
        """Refuse `n_bytes` more past the capacity; else count them in the peak (the caller
        then adds them to what is held)."""
        free = self.capacity_bytes - self.used_bytes
        if n_bytes > free:
            raise DeviceError(
                f"out of simulated VRAM: asked {format_mib(n_bytes)} MiB, {format_mib(free)} MiB "
                f"free; raise --device sim:SIZE"
            )
        self.peak_bytes = max(self.peak_bytes, self.used_bytes + n_bytes)

    def alloc(self, n_bytes: int) -> np.ndarray:
        """A standalone zeroed uint8 buffer [n_bytes], charged to the capacity."""
        self._maybe_fail("alloc")
        self._charge(n_bytes)
        buf = np.zeros(n_bytes, dtype=np.uint8)  # [n_bytes]
        self._buffers[id(buf)] = buf
        self._buffer_bytes += n_bytes
        return buf

    def free(self, buf: np.ndarray) -> None:
        """Free a buffer from `alloc`."""
        assert id(buf) in self._buffers, "free() of a buffer this backend did not alloc()"
        del self._buffers[id(buf)]
        self._buffer_bytes -= buf.nbytes

    def reserve_address_space(self, n_bytes: int) -> SimAddressSpace:
        """Reserve `n_bytes` of addresses; nothing is charged until `map`."""
        return SimAddressSpace(self, n_bytes)

    def mem_info(self) -> MemInfo:
        """Capacity, capacity minus what is held, and what is held."""
        used = self.used_bytes
        return MemInfo(self.capacity_bytes, self.capacity_bytes - used, used)

    def decode_expert(self, blob: np.ndarray, layout: ExpertLayout
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decoded in place by the host CPU, the simulated device's processor (no copy)."""
        return layout.decode(blob)

    def chunk_arena(self, buf: np.ndarray) -> None:
        """None: NumPy temporaries are host memory, which the simulated device does not budget."""

    # -- copies ---------------------------------------------------------------------------------

    def upload(self, host: np.ndarray | list[np.ndarray], out: np.ndarray) -> None:
        """Copy host bytes (an array, or a list copied back to back) into `out` (same byte
        size; dtypes may differ); counted as one H2D copy."""
        self._maybe_fail("upload")
        if isinstance(host, list):
            host = np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in host])
        src = np.ascontiguousarray(host)
        assert src.nbytes == out.nbytes, f"upload of {src.nbytes} bytes into {out.nbytes}"
        if src.dtype == out.dtype and src.shape == out.shape:
            np.copyto(out, src)
        else:
            np.copyto(_as_bytes(out), _as_bytes(src))
        self.stats.count_h2d(src.nbytes)

    def upload_many(self, jobs: list[tuple[np.ndarray | list[np.ndarray], np.ndarray]], *,
                    after: list[Any] | None = None) -> None:
        """Each (host, out) `upload` in turn (there is no queue to order them after)."""
        for host, out in jobs:
            self.upload(host, out)

    def to_device(self, host: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of `host`; counted as H2D."""
        self._maybe_fail("upload")
        out = np.array(host, copy=True, order="C")
        self.stats.count_h2d(out.nbytes)
        return out

    def download(self, dev: np.ndarray) -> np.ndarray:
        """A host copy of `dev`; counted as D2H."""
        self._maybe_fail("download")
        host = np.array(dev, copy=True)
        self.stats.count_d2h(host.nbytes)
        return host

    def as_device(self, a: Any) -> np.ndarray:
        """`a` itself: host memory is the simulated device's memory (nothing to copy)."""
        return np.asarray(a)

    def mark(self) -> None:
        """Nothing to mark: no compute is ever queued."""

    def wait(self, event: object) -> None:
        """Nothing to wait for: every copy has finished."""

    def keep_for_upload(self, host: np.ndarray) -> None:
        """Nothing to do: the simulated device's uploads are memcpy."""

    def synchronize(self) -> None:
        """Nothing is queued on the sim device; every call has finished when it returns."""

    def time_mark(self) -> float:
        """The wall clock (every op has finished when it returns)."""
        return time.perf_counter()

    def seconds_between(self, start: float, end: float) -> float:
        return end - start

    def close(self) -> None:
        """Free every standalone buffer (address spaces are closed by their ledger)."""
        self._buffers.clear()
        self._buffer_bytes = 0

    # -- faults ---------------------------------------------------------------------------------

    def inject_fault(self, op: str, *, after: int = 0) -> None:
        """Make the call of `op` after `after` successful ones raise DeviceError (once)."""
        assert op in _FAULT_OPS, f"unknown op {op!r}; one of {_FAULT_OPS}"
        self._faults[op] = after

    def _maybe_fail(self, op: str) -> None:
        left = self._faults.get(op)
        if left is None:
            return
        if left > 0:
            self._faults[op] = left - 1
            return
        del self._faults[op]
        raise DeviceError(f"injected fault in {op} on the {self.name} device")


class SimAddressSpace:
    """An address range of the sim device: an anonymous map, charged per mapped range."""

    def __init__(self, backend: SimBackend, n_bytes: int):
        self.granularity_bytes = mmap.PAGESIZE
        assert n_bytes > 0 and n_bytes % self.granularity_bytes == 0, n_bytes
        self.n_bytes = n_bytes
        self._backend = backend
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._mm: mmap.mmap | None = mmap.mmap(-1, n_bytes, flags=flags)
        self._base = np.frombuffer(self._mm, dtype=np.uint8)  # [n_bytes]
        self._starts: list[int] = []  # sorted offsets of mapped ranges
        self._sizes: dict[int, int] = {}  # offset -> bytes

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped into this range now."""
        return sum(self._sizes.values())

    def map(self, offset: int, n_bytes: int) -> None:
        """Back [offset, offset + n_bytes) with memory charged to the device capacity."""
        g = self.granularity_bytes
        assert self._mm is not None, "map() on a closed address space"
        assert offset % g == 0 and n_bytes % g == 0 and n_bytes > 0, (offset, n_bytes)
        assert offset + n_bytes <= self.n_bytes, (offset, n_bytes, self.n_bytes)
        i = bisect.bisect_left(self._starts, offset)
        overlaps_next = i < len(self._starts) and self._starts[i] < offset + n_bytes
        overlaps_prev = i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] > offset
        assert not (overlaps_next or overlaps_prev), f"map() over a mapped range at {offset}"
        self._backend._maybe_fail("map")
        self._backend._charge(n_bytes)
        self._starts.insert(i, offset)
        self._sizes[offset] = n_bytes
        self._backend._mapped_bytes += n_bytes

    def unmap(self, offset: int, n_bytes: int) -> None:
        """Return the pages of a range one `map` call mapped; they read back as zeros."""
        assert self._sizes.get(offset) == n_bytes, f"unmap({offset}, {n_bytes}) of no mapping"
        assert self._mm is not None
        self._starts.remove(offset)
        del self._sizes[offset]
        self._backend._mapped_bytes -= n_bytes
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED, offset, n_bytes)
        else:  # pragma: no cover - platforms without madvise keep the pages but not the data
            self._base[offset : offset + n_bytes] = 0

    def view(self, offset: int, n_bytes: int) -> np.ndarray:
        """A uint8 view [n_bytes]; asserts that every byte of it is mapped."""
        end = offset + n_bytes
        assert 0 <= offset and end <= self.n_bytes, (offset, n_bytes, self.n_bytes)
        pos, starts = offset, self._starts
        i = bisect.bisect_right(starts, pos) - 1
        while pos < end:
            mapped = 0 <= i < len(starts) and starts[i] <= pos < starts[i] + self._sizes[starts[i]]
            assert mapped, f"view of unmapped byte {pos} (view {offset}+{n_bytes})"
            pos = starts[i] + self._sizes[starts[i]]
            i += 1
        return self._base[offset:end]

    def close(self) -> None:
        """Unmap everything; the address range is gone (views taken earlier must not be used)."""
        for offset in list(self._starts):
            self.unmap(offset, self._sizes[offset])
        # The map itself is dropped with the last view of it; closing it under live views fails.
        self._mm = None


def _as_bytes(a: np.ndarray) -> np.ndarray:
    assert a.flags.c_contiguous, "device copies need C-contiguous arrays"
    return a.reshape(-1).view(np.uint8)  # [nbytes]
