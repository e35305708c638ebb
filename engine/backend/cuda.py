"""A CUDA device behind the `Backend` protocol: CuPy arrays, VMM segments, counted copies; its
ops are the kernels' (`CudaOps`, engine/backend/cuda_ops.py).

Budget (engine/memory/budget.py). `--vram-limit N` bounds the whole process as NVML counts it:
CUDA context, cuBLAS handle and workspace, kernel modules and CuPy's pool included, not only
the planned regions. Before planning, the backend warms up (the cuBLAS handle and a GEMM, and
the caller's `warm_up`: the engine's shape-free kernel modules), then measures what the process
holds outside the ledger and the pool (NVML's process bytes minus both) and divides the rest:
N = outside + margin + workspace (CuPy's pool) + `capacity_bytes` (what the planner and the
ledger divide into regions). Without a limit, N is what the process holds plus what the device
has free, less 512 MiB. Enforced: mapped segments + `alloc` buffers never pass
`capacity_bytes`; those plus the pool never pass N - outside - margin (the pool's limit follows
every map and unmap, and shrinks when `refresh_outside` finds the outside grew). Passing either
raises `DeviceError` with one line. `mem_info()` is (N, N - process bytes, process bytes).

Copies. `upload` takes host numpy arrays. Pages that `pin` registered (or `host_buffer`
allocated) are copied straight by DMA; pageable arrays go through a reusable pinned staging
buffer in two halves, so the host-side copy of one half overlaps the DMA of the other. Copies
run on a dedicated copy stream; events order them after the compute already queued on the
current stream (which may still read `out`) and before any compute queued after the upload;
a caller that knows when `out`'s last reader was queued passes that point (`mark()`) as
`after`, so the copy need not wait for compute queued since (the staging ring does: an expert's
upload overlaps the GEMMs of the group before it). `upload_async` returns the copy's event
without making compute wait, for prefetching into a buffer nothing reads yet; `wait(event)`
joins it later.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cupy
import numpy as np

from engine.backend.base import CUDA_TRAITS, CopyStats, MemInfo
from engine.backend.cuda_arena import ChunkArena
from engine.backend.cuda_ops import CudaOps
from engine.backend.process_memory import ProcessMemory
from engine.backend.vmm import PlainAddressSpace, VmmAddressSpace, vmm_granularity, vmm_supported
from engine.errors import DeviceError
from engine.memory.budget import (
    DEVICE_MARGIN_BYTES,
    GROWTH_MARGIN_BYTES,
    ProcessBudget,
    plan_budget,
)
from engine.memory.sizes import MiB, format_mib

_H2D = 1  # cudaMemcpyHostToDevice
_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped
_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
_ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
_live: weakref.WeakSet[CudaBackend] = weakref.WeakSet()  # backends of this process not closed
ASSUMED_OUTSIDE_BYTES = 640 * MiB  # without NVML: a CuPy context, cuBLAS and kernels (H200)
DEFAULT_STAGING_BYTES = 64 * MiB
_PARALLEL_COPY_BYTES = 4 * MiB  # host copies larger than this are split over threads


class CudaBackend(CudaOps):
    """One GPU as a `Backend` (see the module docstring); its ops are `CudaOps`."""

    async_copies = True  # uploads run on their own stream beside compute
    traits = CUDA_TRAITS

    def __init__(
        self,
        device: int = 0,
        limit_bytes: int | None = None,
        *,
        segment_granularity: int = 2 * MiB,
        workspace_bytes: int | None = None,
        margin_bytes: int = GROWTH_MARGIN_BYTES,
        device_margin_bytes: int = DEVICE_MARGIN_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        elastic: bool = True,
        use_vmm: bool | None = None,
        warm_up: Callable[[], None] | None = None,
    ):
        try:
            n_devices = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise DeviceError(f"--device cuda:{device}: no usable CUDA device ({e})") from None
        if not 0 <= device < n_devices:
            raise DeviceError(f"--device cuda:{device}: there are {n_devices} CUDA devices")
        self.device = self.device_index = device
        self.name = f"cuda:{device}"
        self.xp = cupy
        self.stats = CopyStats()
        self._closed = False
        self._memory = ProcessMemory.open(device)  # before the context: the fallback's baseline
        self._dev = cupy.cuda.Device(device)
        self._dev.use()
        # `elastic` (--vram-elastic) is a policy the guards read; the ledger needs contiguous,
        # stable region addresses either way, so VMM is used wherever the driver has it.
        self.elastic = elastic
        self.use_vmm = vmm_supported(device) if use_vmm is None else use_vmm
        granularity = vmm_granularity(device) if self.use_vmm else 2 * MiB
        if segment_granularity % granularity:
            raise DeviceError(
                f"segment granularity {segment_granularity} B is not a multiple of the "
                f"device's mapping granularity {granularity} B"
            )
        self.granularity_bytes = segment_granularity
        self._mapped_bytes = 0
        self._buffers: dict[int, Any] = {}  # id -> live alloc() buffer
        self._buffer_bytes = 0
        self._pool = cupy.get_default_memory_pool()
        self._copy_stream = cupy.cuda.Stream(non_blocking=True)
        half = max(staging_bytes // 2, 1 * MiB)
        self._staging = [cupy.cuda.alloc_pinned_memory(half) for _ in range(2)]
        self._staging_views = [np.frombuffer(m, dtype=np.uint8, count=half) for m in self._staging]
        self._staging_free = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
        for ev in self._staging_free:
            ev.record(self._copy_stream)
        self._pinned: dict[int, tuple[int, Any]] = {}  # host ptr -> (n_bytes, owner or None)
        self._unpin: dict[int, weakref.finalize] = {}  # host ptr -> its registration's end
        self._n_copy_threads = min(8, os.cpu_count() or 1)
        self._copy_pool = ThreadPoolExecutor(max_workers=self._n_copy_threads)
        _live.add(self)
        self._warm_up(warm_up)
        free, total = cupy.cuda.runtime.memGetInfo()
        self.device_total_bytes = int(total)
        outside, self.outside_source = self._measure_outside()
        self.budget: ProcessBudget = plan_budget(
            limit_bytes, int(free), outside, granularity_bytes=segment_granularity,
            margin_bytes=margin_bytes, device_margin_bytes=device_margin_bytes,
            workspace_bytes=workspace_bytes,
        )
        self.outside_bytes = outside  # the highest measure so far (`refresh_outside`)
        self.limit_bytes = self.budget.limit_bytes  # the whole process
        self.budget_bytes = self.budget.inside_bytes  # ledger + pool
        self.workspace_bytes = self.budget.workspace_bytes
        self.margin_bytes = self.budget.margin_bytes
        self.capacity_bytes = self.budget.capacity_bytes
        self._update_pool_limit()

    def _warm_up(self, extra: Callable[[], None] | None) -> None:
        """Load what every engine loads before the outside is measured: the cuBLAS handle
        with its workspace and kernels (one small fp16 GEMM), then `extra` (the engine's
        kernel modules). Blocks that engines of this process let go of are freed first."""
        self._pool.free_all_blocks()
        self._pool.set_limit(size=0)  # no limit until the budget is known (0: none)
        a = cupy.ones((64, 64), dtype=cupy.float16)  # [64, 64]
        (a @ a).sum()
        if extra is not None:
            extra()
        self.synchronize()
        del a
        self._pool.free_all_blocks()

    def _measure_outside(self) -> tuple[int, str]:
        """(bytes, source): what the process holds on this device that neither the ledger's
        mappings and `alloc` buffers, nor CuPy's pool, nor another live engine's ledger
        account for; assumed without NVML. (Two engines alive in one process, as some tests
        hold, each get the limit less the shared part: one engine is bounded whole.)"""
        if self._memory is None:
            return ASSUMED_OUTSIDE_BYTES, "assumed (no NVML)"
        r = self._memory.read()
        held = sum(b.used_bytes for b in list(_live) if b.device == self.device)
        return max(0, r.n_bytes - held - self._pool.total_bytes()), r.source

    def refresh_outside(self) -> int:
        """Measure the outside again (kernels loaded, graphs captured and local memory grown
        since); growth past the highest measure so far comes off the pool's limit, so the
        process stays inside `limit_bytes`. The bytes outside (the highest measure)."""
        if self._memory is not None and not self._closed:
            now, _ = self._measure_outside()
            if now > self.outside_bytes:
                self.outside_bytes = now
                self._update_pool_limit()
        return self.outside_bytes

    def memory_line(self) -> str:
        """A trace line (STRATA_TRACE=1): the process's bytes now and their parts, in MiB."""
        mib = MiB
        pool = self._pool.total_bytes()
        pool_limit = self.budget.pool_limit_bytes(self.used_bytes, self.outside_bytes)
        process = self._process_bytes()
        now = "n/a" if process is None else f"{process / mib:,.0f}"
        return (
            f"strata trace: vram process {now} MiB (limit {self.limit_bytes / mib:,.0f}) = ledger "
            f"{self.used_bytes / mib:,.0f} + pool {pool / mib:,.0f} (of {pool_limit / mib:,.0f}) "
            f"+ outside {self._measure_outside()[0] / mib:,.0f} (planned "
            f"{self.budget.outside_bytes / mib:,.0f} + margin {self.margin_bytes / mib:,.0f})"
        )

    # -- memory ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes held through the ledger: mapped segments plus `alloc` buffers."""
        return self._mapped_bytes + self._buffer_bytes

    def _update_pool_limit(self) -> None:
        self._pool.set_limit(size=self.budget.pool_limit_bytes(self.used_bytes, self.outside_bytes))

    def _check_budget(self, n_bytes: int) -> None:
        free = self.capacity_bytes - self.used_bytes
        if n_bytes > free:
            raise DeviceError(
                f"{self.name}: out of planned VRAM: asked {format_mib(n_bytes)} MiB, "
                f"{format_mib(free)} MiB left of {format_mib(self.capacity_bytes)} MiB "
                f"(--vram-limit / free memory)"
            )
        if self.used_bytes + self._pool.total_bytes() + n_bytes > self.budget_bytes:
            self._pool.free_all_blocks()  # cached temporaries give way to planned memory
        pool = self._pool.total_bytes()
        if self.used_bytes + pool + n_bytes > self.budget_bytes:
            raise DeviceError(
                f"{self.name}: {format_mib(pool)} MiB of temporaries leave no room for "
                f"{format_mib(n_bytes)} MiB within the {format_mib(self.budget_bytes)} MiB budget"
            )

    def _charge(self, n_bytes: int) -> None:
        self._check_budget(n_bytes)
        self._mapped_bytes += n_bytes
        self._update_pool_limit()

    def _uncharge(self, n_bytes: int) -> None:
        self._mapped_bytes -= n_bytes
        assert self._mapped_bytes >= 0, self._mapped_bytes
        self._update_pool_limit()

    def alloc(self, n_bytes: int) -> Any:
        """A standalone uint8 buffer [n_bytes] (cudaMalloc), charged to the capacity."""
        self._check_budget(n_bytes)
        try:
            with self._dev:
                mem = cupy.cuda.memory.Memory(n_bytes)
        except cupy.cuda.memory.OutOfMemoryError as e:
            raise DeviceError(
                f"{self.name}: cudaMalloc of {format_mib(n_bytes)} MiB: {e}"
            ) from None
        self._buffer_bytes += n_bytes
        self._update_pool_limit()
        buf = cupy.ndarray((n_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        self._buffers[id(buf)] = buf
        return buf

    def free(self, buf: Any) -> None:
        """Free a buffer from `alloc` (the memory goes when the last view of it is dropped)."""
        assert id(buf) in self._buffers, "free() of a buffer this backend did not alloc()"
        del self._buffers[id(buf)]
        self._buffer_bytes -= buf.nbytes
        self._update_pool_limit()

    def reserve_address_space(self, n_bytes: int) -> VmmAddressSpace | PlainAddressSpace:
        """Reserve device addresses (VMM), or the plain fallback where VMM is missing."""
        args = (self.device, n_bytes, self.granularity_bytes, self._charge, self._uncharge,
                self.synchronize)
        if self.use_vmm:
            return VmmAddressSpace(*args, forget=self._forget)
        return PlainAddressSpace(*args)

    def _forget(self, n_bytes: int) -> None:
        """Memory a collected address space gave back: off the count, the pool's limit left
        alone (a newer engine may own the pool by now)."""
        self._mapped_bytes -= n_bytes

    def mem_info(self) -> MemInfo:
        """The whole-process limit, what is left of it, and the process's bytes (NVML; None
        without it, then the left part counts the outside as measured)."""
        process = self._process_bytes()
        held = self.used_bytes + self._pool.total_bytes() + self.outside_bytes
        left = self.limit_bytes - (held if process is None else process)
        return MemInfo(self.limit_bytes, max(0, left), process)

    def chunk_arena(self, buf: Any) -> ChunkArena:
        """A prompt chunk's temporaries inside `buf` (engine/backend/cuda_arena.py)."""
        return ChunkArena(buf)

    def device_mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device (`cudaMemGetInfo`)."""
        with self._dev:
            free, total = cupy.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def _process_bytes(self) -> int | None:
        if self._memory is None or self._closed:
            return None
        return self._memory.read().n_bytes

    def close(self) -> None:
        """Give back what this backend holds itself: `alloc` buffers, the pool's cached blocks,
        page-locked host memory (the model file's registration, the staging halves,
        `host_buffer`s), the copy threads and the NVML handle. Ledger regions are the ledger's
        to close, first. Idempotent; the backend is unusable afterwards."""
        if self._closed:
            return
        self.synchronize()
        self._closed = True
        _live.discard(self)
        self._buffers.clear()
        self._buffer_bytes = 0
        for unpin in list(self._unpin.values()):
            unpin()  # a weakref.finalize runs once: the array's own end does nothing later
        self._pinned.clear()
        self._staging, self._staging_views = [], []
        self._copy_pool.shutdown(wait=True)
        self._pool.free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
        if self._memory is not None:
            self._memory.close()

    # -- copies ---------------------------------------------------------------------------------

    def host_buffer(self, n_bytes: int) -> np.ndarray:
        """A pinned host uint8 array [n_bytes]; uploads from it skip the staging copy."""
        mem = cupy.cuda.alloc_pinned_memory(n_bytes)
        arr = np.frombuffer(mem, dtype=np.uint8, count=n_bytes)
        self._pinned[arr.ctypes.data] = (n_bytes, mem)
        return arr

    def pin(self, host: np.ndarray) -> None:
        """Page-lock an existing host array (e.g. a memory-mapped GGUF) for direct DMA.

        The pages are also mapped into the device's address space (`mapped_address`). Read-only
        maps are registered read-only. The registration ends when `host` is garbage-collected
        (before a memory map goes away with it)."""
        assert host.flags.c_contiguous, "pin() needs a contiguous array"
        flags = _HOST_REGISTER_MAPPED | (0 if host.flags.writeable else _HOST_REGISTER_READ_ONLY)
        ptr = host.ctypes.data
        try:
            cupy.cuda.runtime.hostRegister(ptr, host.nbytes, flags)
        except cupy.cuda.runtime.CUDARuntimeError as e:
            raise DeviceError(
                f"{self.name}: cannot page-lock {format_mib(host.nbytes)} MiB of host memory ({e})"
            ) from None
        self._pinned[ptr] = (host.nbytes, None)
        self._unpin[ptr] = weakref.finalize(host, self._unregister, ptr)  # or at close()

    def keep_for_upload(self, host: np.ndarray) -> None:
        """Page-lock `host` (a restore source) so each upload of it is one DMA; where the
        host cannot lock it, uploads keep going through the staging buffer."""
        if host.flags.c_contiguous and not self._is_pinned(host.ctypes.data, host.nbytes):
            try:
                self.pin(host)
            except DeviceError:
                pass

    def _unregister(self, ptr: int) -> None:
        _, owner = self._pinned.pop(ptr)
        del self._unpin[ptr]
        assert owner is None, "a host_buffer() is never unregistered"
        cupy.cuda.runtime.hostUnregister(ptr)

    def mapped_address(self, host: np.ndarray) -> int | None:
        """The device address kernels read `host` at (over PCIe, no copy), or None when the
        bytes are not page-locked by `pin` or the device cannot use the host address for them
        (cudaDevAttrCanUseHostPointerForRegisteredMem: true on 64-bit Linux with UVA)."""
        ptr = host.ctypes.data
        if not self._is_pinned(ptr, host.nbytes):
            return None
        attr = cupy.cuda.runtime.deviceGetAttribute(_ATTR_HOST_POINTER_FOR_REGISTERED_MEM, self.device)
        return ptr if attr else None

    def _is_pinned(self, ptr: int, n_bytes: int) -> bool:
        return any(p <= ptr and ptr + n_bytes <= p + n for p, (n, _) in self._pinned.items())

    def upload_async(self, host: np.ndarray | list[np.ndarray], out: Any, *,
                     after_compute: bool = True, after: Any = None) -> Any:
        """Queue host -> `out` on the copy stream; returns the event that marks it done.
        `host` is an array or a list of arrays copied back to back (one counted copy).

        `after_compute`: order the copy after the compute already queued on the current
        stream (it may still read `out`); pass False only for a buffer nothing reads now.
        `after`: an event from `mark()` queued after the last compute that reads `out`: the
        copy waits for it instead of for all compute queued so far.
        """
        return self.upload_many([(host, out)], after_compute=after_compute,
                                after=None if after is None else [after])

    def upload_many(self, jobs: list[tuple[np.ndarray | list[np.ndarray], Any]], *,
                    after_compute: bool = True, after: list[Any] | None = None) -> Any:
        """`upload_async` of several (host, out) copies behind one wait, with one event for
        them all (the staging ring queues a layer's experts so: a few microseconds of host
        time each instead of an event per expert). `after`: events that together follow
        every reader of every `out`."""
        stream = self._copy_stream
        if after is not None:
            for event in after:
                stream.wait_event(event)
        elif after_compute:
            stream.wait_event(cupy.cuda.get_current_stream().record())
        for host, out in jobs:
            pieces = host if isinstance(host, list) else [host]
            srcs = [np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in pieces]  # [n_i]
            n = sum(s.nbytes for s in srcs)
            assert n == out.nbytes, f"upload of {n} bytes into {out.nbytes}"
            assert out.flags.c_contiguous, "upload into a non-contiguous device array"
            dst = out.data.ptr
            for src in srcs:
                self._copy_in(src, dst, stream)
                dst += src.nbytes
            self.stats.count_h2d(n)
        return stream.record()

    def _copy_in(self, src: np.ndarray, dst: int, stream: Any) -> None:
        """Queue one host range -> device address on `stream`: DMA where pinned, else staged."""
        n = src.nbytes
        if self._is_pinned(src.ctypes.data, n):
            cupy.cuda.runtime.memcpyAsync(dst, src.ctypes.data, n, _H2D, stream.ptr)
            return
        half = self._staging_views[0].nbytes
        for k, off in enumerate(range(0, n, half)):
            m = min(half, n - off)
            slot = k % 2
            self._staging_free[slot].synchronize()  # its previous DMA has finished
            self._host_copy(self._staging_views[slot][:m], src[off : off + m])
            cupy.cuda.runtime.memcpyAsync(
                dst + off, self._staging_views[slot].ctypes.data, m, _H2D, stream.ptr
            )
            self._staging_free[slot].record(stream)

    def upload(self, host: np.ndarray | list[np.ndarray], out: Any, *, after: Any = None) -> None:
        """Copy host bytes into `out` (same byte size); compute queued afterwards sees them.
        `after`: as for `upload_async`."""
        self.wait(self.upload_async(host, out, after=after))

    def mark(self) -> Any:
        """An event at the current point of the compute stream (for `upload`'s `after`)."""
        return cupy.cuda.get_current_stream().record()

    def wait(self, event: Any) -> None:
        """Make the current stream wait for `event` (no host synchronisation)."""
        cupy.cuda.get_current_stream().wait_event(event)

    def _host_copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = src.nbytes
        n_parts = min(self._n_copy_threads, max(1, n // _PARALLEL_COPY_BYTES))
        if n_parts == 1:
            np.copyto(dst, src)
            return
        step = -(-n // n_parts)
        jobs = [
            self._copy_pool.submit(np.copyto, dst[i : i + step], src[i : i + step])
            for i in range(0, n, step)
        ]
        for job in jobs:
            job.result()

    def upload_inline(self, host: np.ndarray, out: Any) -> None:
        """Copy `host` into `out` on the compute stream itself (`ndarray.set`), for a few bytes
        that must land in stream order before the next launch (a captured graph's inputs);
        counted as H2D."""
        out.set(host)
        self.stats.count_h2d(host.nbytes)

    def to_device(self, host: np.ndarray) -> Any:
        """A new device array holding a copy of `host` (`cupy.asarray`: a copy on the compute
        stream, for activations; weights and experts go through `upload`); counted as H2D."""
        dev = cupy.asarray(host)
        self.stats.count_h2d(dev.nbytes)
        return dev

    def as_device(self, a: Any) -> Any:
        """`a` itself when it is a CuPy array, else `to_device(a)`."""
        return a if isinstance(a, cupy.ndarray) else self.to_device(a)

    def download(self, dev: Any) -> np.ndarray:
        """A host copy of `dev` (waits for the work that writes it); counted as D2H."""
        host = cupy.asnumpy(dev)
        self.stats.count_d2h(host.nbytes)
        return host

    def synchronize(self) -> None:
        """Wait for all queued kernels and copies."""
        cupy.cuda.get_current_stream().synchronize()
        self._copy_stream.synchronize()

    def time_mark(self) -> Any:
        """A CUDA event recorded on the current stream (no host synchronisation)."""
        event = cupy.cuda.Event()
        event.record()
        return event

    def seconds_between(self, start: Any, end: Any) -> float:
        """GPU seconds between two `time_mark` events (waits for `end`)."""
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3
