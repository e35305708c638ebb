"""The device a model runs on, as one explicit object: array module, memory, counted copies.

Model code takes `xp` from a `Backend` and never imports numpy or cupy itself; every host<->device
copy goes through `upload`/`download`, so `stats` counts all PCIe traffic.

Device memory comes in two forms:

- `alloc(n_bytes)`: one standalone buffer, freed by `free`. Memory that no ledger region owns
  shows up as `unaccounted` in the ledger snapshot, so model code does not call it.
- `reserve_address_space(n_bytes)`: a range of device addresses with nothing behind it; the
  ledger maps and unmaps physical segments inside it (`map`/`unmap`). This is what CUDA's virtual
  memory API gives (`cuMemAddressReserve` + `cuMemCreate`/`cuMemMap`): a region's bytes are
  contiguous however its segments were obtained, unmapping really frees memory, and a range that
  is mapped again has the same addresses, so views and captured graphs taken earlier stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np

# A device array: numpy.ndarray on the sim backend, cupy.ndarray on CUDA.
DeviceArray = Any


@dataclass(frozen=True)
class MemInfo:
    """The process's device budget (the simulated capacity; on CUDA the whole-process
    `--vram-limit`), what is left of it, and the process's bytes (None where NVML cannot tell)."""

    total_bytes: int
    free_bytes: int
    process_bytes: int | None


@dataclass(frozen=True)
class CopyCounts:
    """A frozen reading of `CopyStats`; subtract two readings for the copies in between."""

    h2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    d2h_copies: int = 0

    def __sub__(self, other: CopyCounts) -> CopyCounts:
        return CopyCounts(
            *(getattr(self, f.name) - getattr(other, f.name) for f in fields(CopyCounts))
        )


@dataclass
class CopyStats:
    """Running host<->device copy counters of one backend."""

    h2d_bytes: int = 0
    h2d_copies: int = 0
    d2h_bytes: int = 0
    d2h_copies: int = 0

    def count_h2d(self, n_bytes: int) -> None:
        self.h2d_bytes += n_bytes
        self.h2d_copies += 1

    def count_d2h(self, n_bytes: int) -> None:
        self.d2h_bytes += n_bytes
        self.d2h_copies += 1

    def reset(self) -> None:
        """Zero every counter."""
        self.h2d_bytes = self.h2d_copies = self.d2h_bytes = self.d2h_copies = 0

    def snapshot(self) -> CopyCounts:
        """The counters now, frozen."""
        return CopyCounts(self.h2d_bytes, self.h2d_copies, self.d2h_bytes, self.d2h_copies)


@runtime_checkable
class AddressSpace(Protocol):
    """A reserved range of device addresses; physical memory is mapped into it piecewise.

    Offsets and sizes given to `map`/`unmap` are multiples of `granularity_bytes`; `unmap` takes
    exactly a range that one `map` call mapped (one physical allocation, as on CUDA).
    """

    n_bytes: int
    granularity_bytes: int

    @property
    def mapped_bytes(self) -> int:
        """Bytes of physical memory mapped into this range now."""
        ...

    def map(self, offset: int, n_bytes: int) -> None:
        """Back [offset, offset + n_bytes) with new physical memory; contents are undefined."""
        ...

    def unmap(self, offset: int, n_bytes: int) -> None:
        """Give the physical memory behind a mapped range back to the device."""
        ...

    def view(self, offset: int, n_bytes: int) -> DeviceArray:
        """A uint8 device view [n_bytes] of a mapped range."""
        ...

    def close(self) -> None:
        """Unmap everything and give the address range back."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A device: its array module, its memory and its (counted) copies."""

    name: str  # "sim" or "cuda:0"
    device_index: int | None  # the CUDA device's index; None on the simulated device
    xp: ModuleType  # numpy on sim, cupy on CUDA
    capacity_bytes: int
    stats: CopyStats

    def alloc(self, n_bytes: int) -> DeviceArray:
        """A standalone uint8 device buffer [n_bytes]; ledger regions do not use this."""
        ...

    def free(self, buf: DeviceArray) -> None:
        """Free a buffer that `alloc` returned."""
        ...

    def reserve_address_space(self, n_bytes: int) -> AddressSpace:
        """Reserve device addresses for a ledger region; no memory is taken until `map`."""
        ...

    def upload(self, host: np.ndarray | list[np.ndarray], out: DeviceArray) -> None:
        """Copy host bytes (an array, or a list of arrays back to back) into an existing
        device buffer or view of the same total byte size; counted as one copy."""
        ...

    def download(self, dev: DeviceArray) -> np.ndarray:
        """A host copy of a device array."""
        ...

    def keep_for_upload(self, host: np.ndarray) -> None:
        """`host` will be uploaded again and again (a loan's restore source: the decoded
        head): make those copies as fast as the device allows (page-locked on CUDA, so a
        restore is one DMA instead of a staged copy); nothing where copies are memcpy."""
        ...

    def mem_info(self) -> MemInfo:
        """Total, free and (where known) this process's device bytes."""
        ...

    def synchronize(self) -> None:
        """Wait for all queued device work and copies."""
        ...

    def close(self) -> None:
        """Give back what the backend holds itself (standalone buffers, cached blocks,
        page-locked host memory); ledger regions are closed by their ledger first. Idempotent."""
        ...
