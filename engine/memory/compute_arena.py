"""What a prompt chunk's temporaries took in the arena the backend gave them (`chunk_arena`:
inside the chunk buffer on CUDA, engine/backend/cuda_arena.py; none on the simulated device,
whose temporaries are host memory)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.backend.base import PromptArena


@dataclass(frozen=True)
class ArenaStats:
    """What one chunk's temporaries took: the buffer, the most in use at once, the overflow."""

    n_bytes: int
    peak_bytes: int
    spilled_bytes: int

    @classmethod
    def of(cls, arena: PromptArena) -> ArenaStats:
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

