"""Arena: typed device arrays carved from one ledger region, filled by counted uploads.

Every array the engine computes with on the device lives in a named region; the arena is how
model code gets one (`to_device(host)` uploads a host array, `alloc(shape, dtype)` gives a
zeroed one). `release()` hands the region back to the ledger; `restore()` reserves it again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.memory.ledger import Ledger

ALIGN = 256
CONVERT_CACHE_MIN_BYTES = 1 << 20  # only big arrays (heads) are worth keeping converted


def padded(n_bytes: int) -> int:
    """Bytes one carved array takes, alignment included (what sizing must add up)."""
    return -(-n_bytes // ALIGN) * ALIGN


class Arena:
    """Bump allocation of typed views in the ledger region `name` of `n_bytes`."""

    def __init__(self, ledger: Ledger, name: str, n_bytes: int, reserve: bool = True,
                 float_dtype: Any = np.float32):
        self.ledger, self.name, self.n_bytes = ledger, name, max(n_bytes, ALIGN)
        self.float_dtype = np.dtype(float_dtype)  # weights' storage: float16 on CUDA
        # host arrays converted to float_dtype, kept so a loan's restore is a plain upload
        self._converted: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.region = ledger.reserve(name, self.n_bytes) if reserve else None

    @property
    def resident(self) -> bool:
        return self.region is not None

    def to_device(self, host: np.ndarray) -> Any:
        """Upload `host` into the next free bytes of the region; returns the typed view."""
        host = np.ascontiguousarray(host)
        if host.dtype == np.float32 and self.float_dtype != host.dtype:
            seen = self._converted.get(id(host))
            if seen is None or seen[0] is not host:
                seen = (host, host.astype(self.float_dtype))
                if host.nbytes >= CONVERT_CACHE_MIN_BYTES:  # a head: restored by every loan
                    self._converted[id(host)] = seen
                    self.ledger.backend.keep_for_upload(seen[1])
            host = seen[1]
        out = self.alloc(host.shape, host.dtype, zero=False)
        self.ledger.backend.upload(host, out)
        return out

    def alloc(self, shape: tuple[int, ...], dtype: Any, zero: bool = True) -> Any:
        assert self.region is not None, f"region {self.name} is released"
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = self.region.carve(max(n, 1), align=ALIGN)
        out = raw[:n].view(dtype).reshape(shape)
        if zero:
            out[...] = 0
        return out

    def release(self) -> int:
        """Give the region back; views carved from it must not be used any more."""
        if self.region is None:
            return 0
        self.ledger.release(self.name)
        self.region = None
        return self.n_bytes

    def restore(self) -> int:
        """Reserve the region again (same addresses on an elastic backend), carving from 0."""
        if self.region is None:
            self.region = self.ledger.reserve(self.name, self.n_bytes)
            self.region.reset_carve()
        return self.n_bytes
