"""Decode-only resources: verifier, native output head, MTP experts, draft head.

Each pairs the object that computes with it and the arena (ledger region) it lives in; the
loan releases them in that order and restores them in reverse. Release frees the region's
segments; restore reserves them again and re-creates the contents from the model file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from engine.memory.arena import Arena

# Release order (DESIGN §5); restore runs it backwards.
RELEASE_ORDER = ("verifier", "head.native", "mtp.experts", "mtp.draft_head")
LABELS = {
    "verifier": "verifier",
    "head.native": "head",
    "mtp.experts": "mtp experts",
    "mtp.draft_head": "draft head",
}


class Releasable(Protocol):
    """What uses a decode-only region (the verifier, the native head, the MTP experts, the
    draft head): it drops its arrays and makes them again. The one protocol for them: the loan
    holds them in `DecodeResource`s, the speculative decoder lists its own (this module sits
    below engine.speculative in engine/README.md's layers)."""

    @property
    def resident(self) -> bool: ...

    def release(self) -> int:
        """Free the device copy; returns the bytes freed."""
        ...

    def restore(self) -> int:
        """Re-create byte-identical contents (scratch buffers: zeroed); returns the bytes."""
        ...

    def check_integrity(self) -> None:
        """Its arrays agree with what it was made from (while resident)."""
        ...


class NativeHead:
    """The transformer's output head as a releasable object."""

    def __init__(self, transformer: Any, arena: Arena):
        self.transformer, self.arena = transformer, arena

    @property
    def resident(self) -> bool:
        return self.transformer.head is not None

    def release(self) -> int:
        self.transformer.release_head()
        return self.arena.n_bytes

    def restore(self) -> int:
        if self.transformer.head is None:
            self.transformer.load_head(self.arena.to_device)
        return self.arena.n_bytes

    def check_integrity(self) -> None:
        head = self.transformer.head
        if head is not None and int(head.nbytes) > self.arena.n_bytes:
            raise AssertionError(f"head of {head.nbytes} bytes in a {self.arena.n_bytes}-byte region")


@dataclass
class DecodeResource:
    """One decode-only region and the object using it."""

    region: str
    arena: Arena
    obj: Releasable
    last_restore_s: tuple[float, float] = (0.0, 0.0)  # the last restore: map, fill (seconds)

    @property
    def label(self) -> str:
        return LABELS[self.region]

    @property
    def n_bytes(self) -> int:
        return self.arena.n_bytes

    @property
    def resident(self) -> bool:
        return self.arena.resident

    def release(self) -> int:
        """Drop the object's arrays, then give the segments back. Returns bytes freed."""
        if not self.arena.resident:
            return 0
        self.obj.release()
        return self.arena.release()

    def restore(self) -> int:
        """Reserve the segments, then re-create the contents. Returns bytes restored."""
        if self.arena.resident:
            return 0
        t0 = time.perf_counter()
        self.arena.restore()
        t1 = time.perf_counter()
        try:
            self.obj.restore()
            self.last_restore_s = (t1 - t0, time.perf_counter() - t1)
        except BaseException:
            self.arena.release()
            raise
        return self.arena.n_bytes


class ResourceSet:
    """The decode-only resources present in this engine, in release order."""

    def __init__(self, items: list[DecodeResource]):
        order = {name: i for i, name in enumerate(RELEASE_ORDER)}
        self.items = sorted(items, key=lambda r: order[r.region])

    def get(self, region: str) -> DecodeResource | None:
        return next((r for r in self.items if r.region == region), None)

    def select(self, regions: frozenset[str]) -> list[DecodeResource]:
        return [r for r in self.items if r.region in regions]

    def all_resident(self) -> bool:
        return all(r.resident for r in self.items)

    def check_integrity(self) -> None:
        for r in self.items:
            assert r.obj.resident == r.arena.resident, (
                f"{r.region}: object resident={r.obj.resident} but region "
                f"resident={r.arena.resident}"
            )
            if r.arena.resident:
                r.obj.check_integrity()
