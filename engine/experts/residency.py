"""The residency table: which cache slot holds which (layer, expert); the one truth about it.

`slot_of[layer, expert]` is a slot or -1; `owner_of[slot]` is the inverse, (-1, -1) for a slot
that holds nothing. A lent slot holds nothing the decode path may read, so no row points at it;
the cache remembers what it held to refill it.

The table is *staged* (copied to the device) for two readers: the token graph's hit path and the
prompt loan (seed 003). `residency_readers` says who needs it; they are decided independently, so
`--no-token-graph` does not take borrowing away.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.memory.cache_layout import TABLE_DTYPE


@dataclass(frozen=True)
class ResidencyReaders:
    """Who reads the staged residency table this run."""

    borrow: bool  # the prompt loan lends cache-tail slots and must know which rows it emptied
    graph: bool  # the token graph's hit path looks experts up on the device

    @property
    def any(self) -> bool:
        return self.borrow or self.graph


def residency_readers(
    *, profile_present: bool, borrow: bool, chunk_tokens: int, token_graph: bool
) -> ResidencyReaders:
    """Whether the table is needed, per reader; borrowing does not depend on the token graph."""
    return ResidencyReaders(
        borrow=profile_present and borrow and chunk_tokens > 0, graph=token_graph
    )


class ResidencyTable:
    """`[n_layer, n_expert] -> slot or -1` with its inverse `slot -> (layer, expert) or None`."""

    def __init__(self, n_layer: int, n_expert: int, n_slots: int):
        self.n_layer = n_layer
        self.n_expert = n_expert
        self.slot_of = np.full((n_layer, n_expert), -1, dtype=TABLE_DTYPE)  # [L, E]
        self.owner_of = np.full((n_slots, 2), -1, dtype=np.int32)  # [n_slots, (layer, expert)]
        self.lent = np.zeros(n_slots, dtype=bool)  # [n_slots]

    @property
    def n_slots(self) -> int:
        return len(self.owner_of)

    def lookup(self, layer: int, expert: int) -> int:
        """The slot holding (layer, expert), or -1."""
        return int(self.slot_of[layer, expert])

    def lookup_many(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Slots of several experts of one layer: [n] -> [n], -1 where not resident."""
        return self.slot_of[layer, experts]

    def owner(self, slot: int) -> tuple[int, int] | None:
        """The (layer, expert) in `slot`, or None."""
        layer, expert = self.owner_of[slot]
        return None if layer < 0 else (int(layer), int(expert))

    def assign(self, slot: int, layer: int, expert: int) -> None:
        """Record that `slot` now holds (layer, expert)."""
        assert not self.lent[slot], f"assign to lent slot {slot}"
        assert self.owner_of[slot, 0] < 0, f"slot {slot} already holds {self.owner(slot)}"
        assert self.slot_of[layer, expert] < 0, f"({layer}, {expert}) already in slot"
        self.slot_of[layer, expert] = slot
        self.owner_of[slot] = (layer, expert)

    def evict(self, slot: int) -> tuple[int, int] | None:
        """Forget what `slot` holds; returns it."""
        owner = self.owner(slot)
        if owner is not None:
            self.slot_of[owner] = -1
            self.owner_of[slot] = -1
        return owner

    def clear(self) -> None:
        """Forget everything (no slot may be lent)."""
        assert not self.lent.any(), "clear() with lent slots"
        self.slot_of.fill(-1)
        self.owner_of.fill(-1)

    def lend(self, slot: int) -> tuple[int, int] | None:
        """Mark `slot` lent: its row goes to -1; returns what it held (for the refill)."""
        assert not self.lent[slot], f"slot {slot} is already lent"
        owner = self.evict(slot)
        self.lent[slot] = True
        return owner

    def give_back(self, slot: int, owner: tuple[int, int] | None) -> None:
        """End the loan of `slot`; `owner` is what it holds again (already uploaded), or None."""
        assert self.lent[slot], f"slot {slot} is not lent"
        self.lent[slot] = False
        if owner is not None:
            self.assign(slot, *owner)

    def resize(self, n_slots: int) -> None:
        """Add empty slots at the end, or drop empty, unlent ones from the end."""
        n = self.n_slots
        if n_slots < n:
            assert (self.owner_of[n_slots:, 0] < 0).all() and not self.lent[n_slots:].any(), (
                f"shrinking to {n_slots} slots drops held or lent slots"
            )
            self.owner_of = self.owner_of[:n_slots].copy()
            self.lent = self.lent[:n_slots].copy()
        else:
            self.owner_of = np.concatenate([self.owner_of, np.full((n_slots - n, 2), -1, np.int32)])
            self.lent = np.concatenate([self.lent, np.zeros(n_slots - n, dtype=bool)])

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers: no slot owned twice, inverse consistent,
        no row pointing at a lent slot or past the end."""
        errors: list[str] = []
        layer_idx, expert_idx = np.nonzero(self.slot_of >= 0)
        slots = self.slot_of[layer_idx, expert_idx]  # [n_resident]
        if (slots >= self.n_slots).any():
            errors.append(f"rows point past {self.n_slots} slots: {sorted(set(slots.tolist()))}")
            inside = slots < self.n_slots
            slots, layer_idx, expert_idx = slots[inside], layer_idx[inside], expert_idx[inside]
        uniq, counts = np.unique(slots, return_counts=True)
        if (counts > 1).any():
            errors.append(f"slots owned twice: {uniq[counts > 1].tolist()}")
        lent_rows = slots[self.lent[slots]]
        if len(lent_rows):
            errors.append(f"rows point at lent slots: {lent_rows.tolist()}")
        owners = self.owner_of[slots]  # [n_resident, 2]
        bad = (owners[:, 0] != layer_idx) | (owners[:, 1] != expert_idx)
        if bad.any():
            errors.append(f"inverse disagrees for slots {slots[bad].tolist()}")
        n_owned = int((self.owner_of[:, 0] >= 0).sum())
        if n_owned != len(slots):
            errors.append(f"{n_owned} slots claim an owner, {len(slots)} rows are resident")
        if (self.owner_of[self.lent, 0] >= 0).any():
            errors.append(f"lent slots with an owner: {np.nonzero(self.lent)[0].tolist()}")
        if errors:
            raise AssertionError("residency: " + "; ".join(errors))
