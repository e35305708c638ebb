"""The prompt chunk's temporaries, allocated inside the chunk buffer the planner sized.

The planner gives a prompt chunk `chunk_bytes` of activations, carved from lent cache-tail slots
(or from the owned `prompt.chunk` region). On the simulated device that buffer holds the
residual stream; on CUDA the compute's temporaries (q/k/v, score blocks, the MoE kernels'
gathered rows, fp16 weights and GEMM outputs, CuPy's elementwise results) are the bulk of it.
`ChunkArena` routes them there: inside `with arena:` every CuPy allocation of this thread comes
from a private `cupy.cuda.MemoryPool` whose only memory is the chunk buffer (handed to the
pool once, as one block that the pool splits and merges), so loan-sized chunks do not outgrow
the backend's small workspace and the loan's geometry is the geometry that runs.

What does not fit (the pool found no free block big enough) is allocated from the backend's
workspace pool instead and counted in `spilled_bytes`: the run goes on, and the count tells the
planner's activation estimate was short. `peak_bytes` is the largest amount in use at once.

Leaving the arena is checked: the lent buffer is refilled with expert bytes right after the
prompt, so an array that still lives in it would read garbage later. `close()` raises if the
pool still has bytes in use (the caller must copy what it keeps out of the arena first).
"""

from __future__ import annotations

import gc
from typing import Any, Self

import cupy

_UNIT = 512  # CuPy's pool rounds every request up to this


class ChunkArena:
    """Temporaries of the prompt path inside `buf` (uint8 cupy array), see the module doc."""

    def __init__(self, buf: Any):
        self.buf = buf
        self.n_bytes = buf.nbytes // _UNIT * _UNIT
        self.peak_bytes = 0
        self.spilled_bytes = 0
        self._handed_out = False
        self._pool = cupy.cuda.MemoryPool(allocator=self._underlying)
        self._outer = cupy.cuda.get_allocator()
        self._ctx: Any = None
        if self.n_bytes:  # give the whole buffer to the pool as one free block
            self._pool.malloc(self.n_bytes)

    def _underlying(self, size: int) -> Any:
        """What the pool asks for when no free block fits: the buffer once, then spills."""
        if not self._handed_out and size == self.n_bytes:
            self._handed_out = True
            mem = cupy.cuda.UnownedMemory(self.buf.data.ptr, self.n_bytes, self.buf)
            return cupy.cuda.MemoryPointer(mem, 0)
        self.spilled_bytes += size
        return self._outer(size)

    def malloc(self, size: int) -> Any:
        """The allocator CuPy calls inside the arena."""
        ptr = self._pool.malloc(size)
        used = self._pool.used_bytes()
        self.peak_bytes = max(self.peak_bytes, used)
        return ptr

    def __enter__(self) -> Self:
        self._ctx = cupy.cuda.using_allocator(self.malloc)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        ctx, self._ctx = self._ctx, None
        ctx.__exit__(*exc)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of arena blocks some array still holds."""
        return int(self._pool.used_bytes())

    def close(self) -> None:
        """Give everything back; raises if an array still lives in the chunk buffer."""
        if self._pool.used_bytes():
            gc.collect()  # reference cycles (tracebacks, frames) may hold a temporary
        left = self.in_use_bytes
        self._pool.free_all_blocks()
        if left:
            raise RuntimeError(
                f"{left} bytes of prompt temporaries outlive the chunk buffer they live in "
                "(copy what is kept out of the arena before leaving it)"
            )

