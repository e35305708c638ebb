"""Where a prompt chunk's temporaries live: inside the chunk buffer on CUDA, anywhere on the CPU.

`open_arena(xp, buf)` returns a `ChunkArena` (engine/backend/cuda_arena.py) when `xp` is CuPy,
else None: NumPy temporaries are host memory, which the simulated device does not budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArenaStats:
    """What one chunk's temporaries took: the buffer, the most in use at once, the overflow."""

    n_bytes: int
    peak_bytes: int
    spilled_bytes: int

    @classmethod
    def of(cls, arena: Any) -> ArenaStats:
        return cls(arena.n_bytes, arena.peak_bytes, arena.spilled_bytes)

    def merge(self, earlier: ArenaStats | None) -> ArenaStats:
        """Over several chunks: the largest buffer and peak, the total spilled."""
        if earlier is None:
            return self
        return ArenaStats(max(self.n_bytes, earlier.n_bytes), max(self.peak_bytes, earlier.peak_bytes),
                          self.spilled_bytes + earlier.spilled_bytes)

    def line(self) -> str:
        mib = lambda n: n / (1 << 20)
        return (f"prompt temporaries: peak {mib(self.peak_bytes):,.0f} MiB of the "
                f"{mib(self.n_bytes):,.0f} MiB chunk buffer, spilled {mib(self.spilled_bytes):,.0f} MiB")


def open_arena(xp: Any, buf: Any) -> Any:
    """A context manager routing `xp`'s allocations into `buf`, or None where nothing needs it."""
    if xp.__name__ != "cupy":
        return None
    from engine.backend.cuda_arena import ChunkArena

    return ChunkArena(buf)
