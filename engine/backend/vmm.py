"""Device address spaces on the CUDA driver's virtual memory API (`cuda.bindings.driver`).

`VmmAddressSpace` reserves a range of device addresses (`cuMemAddressReserve`) and backs pieces
of it with physical allocations: `map` = `cuMemCreate` + `cuMemMap` + `cuMemSetAccess`, `unmap` =
`cuMemUnmap` + `cuMemRelease`, so unmapped memory goes back to the device (NVML's used memory
drops) while the addresses stay reserved: a range mapped again has the same addresses, and
views and captured graphs taken on it stay valid. Views are cupy uint8 arrays over
`cupy.cuda.UnownedMemory`.

`PlainAddressSpace` is the fallback for devices without VMM support
(`CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED` = 0): one `cudaMalloc` per `map`
call. Memory is really freed by `unmap`, but a range mapped again gets a new address and a view
must lie inside one mapping (one ledger segment), so loans and captured graphs need VMM.

Both charge the owning backend's budget through `charge(n)` / `uncharge(n)` before memory is
taken, so `--vram-limit` holds for mapped memory too.

A `VmmAddressSpace` nobody closed (its engine let go of without `Runtime.close`) gives its
memory back when it is garbage-collected: driver handles are not Python memory, so without
this every engine a process dropped kept its segments mapped to the end (`strata bench` once
peaked at 22,883 MiB so). Not at interpreter exit, when the context may already be gone.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from typing import Any

from engine.errors import DeviceError


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check(result: tuple[Any, ...], what: str) -> Any:
    """Raise DeviceError for a failed driver call; return its value (or None)."""
    drv = _driver()
    err, *rest = result
    if err != drv.CUresult.CUDA_SUCCESS:
        _, text = drv.cuGetErrorString(err)
        detail = text.decode() if isinstance(text, bytes) else str(err)
        raise DeviceError(f"{what} failed: {getattr(err, 'name', err)} ({detail})")
    return rest[0] if len(rest) == 1 else (tuple(rest) or None)


def _alloc_prop(device: int) -> Any:
    drv = _driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def vmm_supported(device: int) -> bool:
    """Whether the device supports the virtual memory management API."""
    drv = _driver()
    _check(drv.cuInit(0), "cuInit")
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    return bool(_check(drv.cuDeviceGetAttribute(attr, device), "cuDeviceGetAttribute"))


def vmm_granularity(device: int, *, recommended: bool = True) -> int:
    """Bytes a physical allocation must be a multiple of (2 MiB on H100/H200)."""
    drv = _driver()
    _check(drv.cuInit(0), "cuInit")
    flags = drv.CUmemAllocationGranularity_flags
    option = (
        flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        if recommended
        else flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    return int(
        _check(drv.cuMemGetAllocationGranularity(_alloc_prop(device), option), "granularity")
    )


def _uint8_view(ptr: int, n_bytes: int, owner: object, device: int) -> Any:
    import cupy

    mem = cupy.cuda.UnownedMemory(ptr, n_bytes, owner, device_id=device)
    return cupy.ndarray((n_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))


class _Mappings:
    """Sorted non-overlapping [offset, offset + n) ranges, each holding one handle."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.items: dict[int, tuple[int, Any]] = {}  # offset -> (n_bytes, handle)

    @property
    def n_bytes(self) -> int:
        return sum(n for n, _ in self.items.values())

    def add(self, offset: int, n_bytes: int, handle: Any) -> None:
        i = bisect.bisect_left(self.starts, offset)
        overlaps_next = i < len(self.starts) and self.starts[i] < offset + n_bytes
        prev = self.starts[i - 1] if i > 0 else None
        overlaps_prev = prev is not None and prev + self.items[prev][0] > offset
        assert not (overlaps_next or overlaps_prev), f"map() over a mapped range at {offset}"
        self.starts.insert(i, offset)
        self.items[offset] = (n_bytes, handle)

    def pop(self, offset: int, n_bytes: int) -> Any:
        assert self.items.get(offset, (None,))[0] == n_bytes, (
            f"unmap({offset}, {n_bytes}) of no mapping"
        )
        self.starts.remove(offset)
        return self.items.pop(offset)[1]

    def containing(self, offset: int, n_bytes: int) -> list[int]:
        """Starts of the mappings that cover [offset, offset + n_bytes); asserts full coverage."""
        end, pos, out = offset + n_bytes, offset, []
        i = bisect.bisect_right(self.starts, pos) - 1
        while pos < end:
            ok = (
                0 <= i < len(self.starts)
                and self.starts[i] <= pos < self.starts[i] + self.items[self.starts[i]][0]
            )
            assert ok, f"view of unmapped byte {pos} (view {offset}+{n_bytes})"
            out.append(self.starts[i])
            pos = self.starts[i] + self.items[self.starts[i]][0]
            i += 1
        return out


class VmmAddressSpace:
    """Reserved device addresses with physical chunks mapped and unmapped in place."""

    def __init__(
        self,
        device: int,
        n_bytes: int,
        granularity_bytes: int,
        charge: Callable[[int], None],
        uncharge: Callable[[int], None],
        synchronize: Callable[[], None],
        *,
        forget: Callable[[int], None] | None = None,
    ):
        """`forget(n)`: what the finalizer tells the owner instead of `uncharge` (it may run
        when a newer engine owns the pool)."""
        assert n_bytes > 0, n_bytes
        self.device = device
        self.granularity_bytes = granularity_bytes
        self.n_bytes = -(-n_bytes // granularity_bytes) * granularity_bytes
        self._charge, self._uncharge, self._sync = charge, uncharge, synchronize
        self._prop = _alloc_prop(device)
        drv = _driver()
        self._access = drv.CUmemAccessDesc()
        self._access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = device
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._current()
        ptr = _check(
            drv.cuMemAddressReserve(self.n_bytes, granularity_bytes, 0, 0), "cuMemAddressReserve"
        )
        self.base = int(ptr)
        self._maps = _Mappings()
        self._closed = False
        # its arguments must not hold self: the finalizer runs when self is unreachable
        self._collect = weakref.finalize(self, _release_range, device, self.base, self.n_bytes,
                                         self._maps.items, forget or uncharge)
        self._collect.atexit = False

    def _current(self) -> None:
        import cupy

        cupy.cuda.runtime.setDevice(self.device)  # makes the primary context current here

    @property
    def mapped_bytes(self) -> int:
        """Bytes of physical memory mapped into this range now."""
        return self._maps.n_bytes

    def map(self, offset: int, n_bytes: int) -> None:
        """Back [offset, offset + n_bytes) with a new physical allocation; contents undefined."""
        g = self.granularity_bytes
        assert not self._closed, "map() on a closed address space"
        assert offset % g == 0 and n_bytes % g == 0 and n_bytes > 0, (offset, n_bytes, g)
        assert offset + n_bytes <= self.n_bytes, (offset, n_bytes, self.n_bytes)
        drv = _driver()
        self._current()
        self._charge(n_bytes)
        handle = None
        try:
            handle = _check(drv.cuMemCreate(n_bytes, self._prop, 0), f"cuMemCreate({n_bytes})")
            ptr = drv.CUdeviceptr(self.base + offset)
            _check(drv.cuMemMap(ptr, n_bytes, 0, handle, 0), "cuMemMap")
            try:
                _check(drv.cuMemSetAccess(ptr, n_bytes, [self._access], 1), "cuMemSetAccess")
            except DeviceError:
                drv.cuMemUnmap(ptr, n_bytes)
                raise
        except BaseException:
            if handle is not None:
                drv.cuMemRelease(handle)
            self._uncharge(n_bytes)
            raise
        self._maps.add(offset, n_bytes, handle)

    def unmap(self, offset: int, n_bytes: int) -> None:
        """Unmap a range one `map` call mapped and give its memory back to the device."""
        handle = self._maps.pop(offset, n_bytes)
        drv = _driver()
        self._current()
        self._sync()  # queued kernels or copies may still touch the range
        _check(drv.cuMemUnmap(drv.CUdeviceptr(self.base + offset), n_bytes), "cuMemUnmap")
        _check(drv.cuMemRelease(handle), "cuMemRelease")
        self._uncharge(n_bytes)

    def view(self, offset: int, n_bytes: int) -> Any:
        """A cupy uint8 view [n_bytes]; every byte of it must be mapped."""
        assert 0 <= offset and offset + n_bytes <= self.n_bytes, (offset, n_bytes, self.n_bytes)
        self._maps.containing(offset, n_bytes)
        return _uint8_view(self.base + offset, n_bytes, self, self.device)

    def close(self) -> None:
        """Unmap everything and free the address range (views taken earlier must not be used)."""
        if self._closed:
            return
        for offset in list(self._maps.starts):
            self.unmap(offset, self._maps.items[offset][0])
        drv = _driver()
        self._current()
        _check(drv.cuMemAddressFree(drv.CUdeviceptr(self.base), self.n_bytes), "cuMemAddressFree")
        self._closed = True
        self._collect.detach()


def _release_range(device: int, base: int, n_bytes: int, items: dict[int, tuple[int, Any]],
                   forget: Callable[[int], None]) -> None:
    """The end of a `VmmAddressSpace` that was never closed: wait for the device, unmap and
    release every mapping (`items`: offset -> (n_bytes, handle)), free the address range."""
    import cupy

    drv = _driver()
    cupy.cuda.runtime.setDevice(device)
    cupy.cuda.runtime.deviceSynchronize()  # nothing may still read the memory
    for offset, (n, handle) in list(items.items()):
        drv.cuMemUnmap(drv.CUdeviceptr(base + offset), n)
        drv.cuMemRelease(handle)
        forget(n)
    items.clear()
    drv.cuMemAddressFree(drv.CUdeviceptr(base), n_bytes)


class PlainAddressSpace:
    """Fallback without VMM: each `map` is one `cudaMalloc`; see the module docstring."""

    def __init__(
        self,
        device: int,
        n_bytes: int,
        granularity_bytes: int,
        charge: Callable[[int], None],
        uncharge: Callable[[int], None],
        synchronize: Callable[[], None],
    ):
        self.device = device
        self.granularity_bytes = granularity_bytes
        self.n_bytes = -(-n_bytes // granularity_bytes) * granularity_bytes
        self._charge, self._uncharge, self._sync = charge, uncharge, synchronize
        self._maps = _Mappings()

    @property
    def mapped_bytes(self) -> int:
        return self._maps.n_bytes

    def map(self, offset: int, n_bytes: int) -> None:
        import cupy

        g = self.granularity_bytes
        assert offset % g == 0 and n_bytes % g == 0 and offset + n_bytes <= self.n_bytes
        self._charge(n_bytes)
        try:
            with cupy.cuda.Device(self.device):
                mem = cupy.cuda.memory.Memory(n_bytes)
        except cupy.cuda.memory.OutOfMemoryError as e:
            self._uncharge(n_bytes)
            raise DeviceError(f"cudaMalloc of {n_bytes} bytes failed: {e}") from None
        self._maps.add(offset, n_bytes, mem)

    def unmap(self, offset: int, n_bytes: int) -> None:
        self._sync()
        self._maps.pop(offset, n_bytes)  # the Memory is freed with its last reference
        self._uncharge(n_bytes)

    def view(self, offset: int, n_bytes: int) -> Any:
        starts = self._maps.containing(offset, n_bytes)
        if len(starts) != 1:
            raise DeviceError(
                f"view {offset}+{n_bytes} spans {len(starts)} plain allocations; "
                f"device memory without VMM needs views inside one segment (use a driver with "
                f"virtual memory management)"
            )
        start = starts[0]
        mem = self._maps.items[start][1]
        return _uint8_view(mem.ptr + offset - start, n_bytes, mem, self.device)

    def close(self) -> None:
        for offset in list(self._maps.starts):
            self.unmap(offset, self._maps.items[offset][0])
