"""The expert cache: device slots of one (layer, expert) blob each, filled in profile order.

Layout of the `experts.cache` region (engine/memory/cache_layout.py): the staged residency
table (int32 [L, E], 256-byte aligned), then `n_slots` slots of `blob_bytes` each (the largest
blob of any layer; a smaller one fills the front of its slot). The prompt loan borrows the *tail*:
`lend_tail(n)` hands the last n slots' bytes to the prompt path as one contiguous view and sets
their residency rows to -1; `refill(lent)` uploads every lent slot's previous expert back into
the same slot and restores its row. A loan may first `grow` the cache into memory freed by
decode-only regions; the new slots are empty, so lending them costs no refill. While decoding
plain, the MTP block's regions can be lent to the cache itself (engine/loan/cache_lend.py):
it grows, `fill_tail` uploads the next experts of the fill order into the new slots, and
`evict_tail` empties them before it shrinks back. While decoding, `promote` puts the experts
the admission policy chose (engine/experts/policy.py) into the slots it chose.

Trace lines (DESIGN §8) are returned on the results and passed to `on_trace`; the caller prints
them when STRATA_TRACE=1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.backend.base import DeviceArray
from engine.errors import StrataError
from engine.experts.host import HostExperts
from engine.experts.policy import Move
from engine.experts.residency import ResidencyReaders, ResidencyTable
from engine.memory.cache_layout import TABLE_DTYPE, cache_region_bytes, residency_table_bytes
from engine.memory.ledger import Ledger

# Slot states, as the UI's slot map draws them.
EMPTY, RESIDENT, LENT, REFILLING = 0, 1, 2, 3
STATE_NAMES = ("empty", "resident", "lent", "refilling")
REGION = "experts.cache"


@dataclass(frozen=True)
class LentRange:
    """Cache-tail slots [first..last] lent to the prompt path, and their bytes as one view."""

    first: int
    last: int
    view: DeviceArray  # uint8 [n_slots * blob_bytes]
    chunk_tokens: int
    elapsed_ms: float
    trace: str

    @property
    def n_slots(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class RefillResult:
    """What one `refill` did."""

    n_slots: int
    first: int
    last: int
    n_uploaded: int  # slots that held an expert (the rest were empty)
    h2d_bytes: int
    elapsed_ms: float
    still_lent: int
    trace: str


class ExpertCache:
    """`n_slots` expert slots in the ledger's `experts.cache` region (see the module docstring)."""

    def __init__(
        self,
        ledger: Ledger,
        host: HostExperts,
        n_slots: int,
        *,
        on_trace: Callable[[str], None] | None = None,
    ):
        assert 0 <= n_slots <= host.n_layer * host.n_expert, (n_slots, host.n_layer, host.n_expert)
        self.ledger = ledger
        self.backend = ledger.backend
        self.host = host
        self.blob_bytes = host.blob_bytes
        self.table_bytes = residency_table_bytes(host.n_layer, host.n_expert)
        self.on_trace = on_trace
        self.region = ledger.reserve(
            REGION, cache_region_bytes(host.n_layer, host.n_expert, host.blob_bytes, n_slots)
        )
        self.table = ResidencyTable(host.n_layer, host.n_expert, n_slots)
        self._states = np.zeros(n_slots, dtype=np.int8)  # [n_slots]
        self._lent_owner: dict[int, tuple[int, int] | None] = {}  # slot -> what it held
        self._slots = self._slot_views()  # [n_slots, blob_bytes]
        # Once staged, the device copy of the table follows every action; an upload that fails
        # un-stages it (borrowing off). A refill that fails midway leaves -1 on the device for
        # slots already refilled, which is safe (misses), and the next refill syncs them.
        self.staged = False
        self._borrow_ok = False
        self.n_hits = 0
        self.n_misses = 0
        self.n_promoted = 0  # experts `promote` uploaded while decoding
        self.order: list[tuple[int, int]] = []  # the fill order (most used first)

    # -- questions ------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return len(self._states)

    @property
    def n_lent(self) -> int:
        return int((self._states == LENT).sum())

    def lent_in(self, lent: LentRange) -> int:
        """How many slots of `lent` are still lent (a refill that failed leaves some)."""
        return int((self._states[lent.first : lent.last + 1] == LENT).sum())

    @property
    def borrowing_available(self) -> bool:
        """The prompt path may borrow the tail: the table was staged for the borrow reader."""
        return self._borrow_ok

    def states(self) -> np.ndarray:
        """int8 [n_slots] of EMPTY / RESIDENT / LENT / REFILLING (a copy)."""
        return self._states.copy()

    def replaceable(self) -> np.ndarray:
        """bool [n_slots]: slots `promote` may fill (empty or resident; not lent, not refilling)."""
        return (self._states == EMPTY) | (self._states == RESIDENT)

    def lookup(self, layer: int, expert: int) -> int:
        """The slot holding (layer, expert), or -1; counts hits and misses."""
        slot = self.table.lookup(layer, expert)
        if slot >= 0:
            self.n_hits += 1
        else:
            self.n_misses += 1
        return slot

    def slack_bytes(self) -> int:
        """Slot bytes the resident experts leave unused (their layer's blobs are smaller than
        a slot: mixed quant types across layers)."""
        layers = self.table.owner_of[:, 0]  # [n_slots] layer or -1
        held = layers[layers >= 0]
        return int(np.sum(self.blob_bytes - np.asarray(self.host.layer_blob_bytes)[held]))

    def slot_view(self, slot: int) -> DeviceArray:
        """uint8 [blob_bytes] device view of `slot` (not a lent one: the prompt path owns it)."""
        assert self._states[slot] != LENT, f"slot {slot} is lent to the prompt path"
        return self._slots[slot]

    @property
    def slots_address(self) -> int:
        """Device address of slot 0; slot i is `blob_bytes * i` after it (the token graph
        computes slot addresses from the staged table on the device). CUDA only."""
        return int(self._slots.data.ptr)

    def table_view(self) -> DeviceArray:
        """The staged residency table on the device: int32 [n_layer, n_expert]."""
        n_bytes = self.table.slot_of.nbytes
        return self.region.view(0, n_bytes).view(TABLE_DTYPE).reshape(self.table.slot_of.shape)

    # -- actions --------------------------------------------------------------------------------

    def fill(self, order: Sequence[tuple[int, int]]) -> int:
        """Upload experts into slots 0, 1, ... in `order` (most used first); returns how many."""
        assert self.n_lent == 0, f"fill() with {self.n_lent} slots lent"
        assert len(set(order)) == len(order), "fill order names an expert twice"
        self.order = list(order)
        self.table.clear()
        self._states.fill(EMPTY)
        for slot, (layer, expert) in enumerate(order[: self.n_slots]):
            self._put(slot, layer, expert)
            self.table.assign(slot, layer, expert)
            self._states[slot] = RESIDENT
        self._sync_table()
        return min(len(order), self.n_slots)

    def fill_tail(self, n: int, ranking: Sequence[tuple[int, int]] | None = None) -> int:
        """Upload the first experts of `ranking` (default: the fill order) that no slot holds
        into the last `n` slots (empty ones, as `grow` adds); returns how many were filled."""
        first = self.n_slots - n
        assert 0 <= first and (self._states[first:] == EMPTY).all(), "fill_tail of slots in use"
        wanted = (o for o in (self.order if ranking is None else ranking)
                  if self.table.lookup(*o) < 0)
        done = 0
        for slot, (layer, expert) in zip(range(first, self.n_slots), wanted):
            self._put(slot, layer, expert)
            self.table.assign(slot, layer, expert)
            self._states[slot] = RESIDENT
            done += 1
        self._sync_table()
        return done

    def evict_tail(self, n: int) -> None:
        """Empty the last `n` slots (none lent): their experts become misses again."""
        first = self.n_slots - n
        assert 0 <= first and not (self._states[first:] == LENT).any(), "evict_tail of lent slots"
        for slot in range(first, self.n_slots):
            self.table.evict(slot)
        self._states[first:] = EMPTY
        self._sync_table()

    def promote(self, moves: Sequence[Move]) -> int:
        """Upload each move's expert into its slot (evicting what the slot held); returns how
        many. The device table follows once, after the uploads: a step queued afterwards
        reads the new experts. On a failed upload that slot is left empty (a miss, never a
        wrong expert) and the error is raised after the table is synced."""
        done = 0
        try:
            for m in moves:
                assert self._states[m.slot] in (EMPTY, RESIDENT), f"promote into slot {m.slot}"
                assert self.table.lookup(m.layer, m.expert) < 0, f"({m.layer}, {m.expert}) held"
                self.table.evict(m.slot)
                self._states[m.slot] = EMPTY
                self._put(m.slot, m.layer, m.expert)
                self.table.assign(m.slot, m.layer, m.expert)
                self._states[m.slot] = RESIDENT
                done += 1
        finally:
            self.n_promoted += done
            self._sync_table()
        return done

    def stage_residency(self, readers: ResidencyReaders) -> str | None:
        """Copy the table to the device for its readers (seed 003).

        Returns a warning line when staging failed and only borrowing needed it: borrowing is then
        off for this run and the caller plans owned prompt buffers. Raises when the token graph
        needs the table.
        """
        self._borrow_ok = False
        if not readers.any:
            return None
        try:
            self.staged = True
            self._sync_table()
        except StrataError as e:
            self.staged = False
            if readers.graph:
                raise
            return (
                f"strata: warning: staging the expert residency table failed ({e}); prompt "
                f"borrowing is off for this run and the prompt path uses its own buffers"
            )
        self._borrow_ok = readers.borrow
        return None

    def lend_tail(self, n: int, *, chunk_tokens: int = 0) -> LentRange:
        """Lend the last `n` slots to the prompt path; their rows go to -1."""
        assert self._borrow_ok, "lend_tail() without a staged residency table for borrowing"
        assert self.n_lent == 0, f"lend_tail() while {self.n_lent} slots are lent"
        assert 0 < n <= self.n_slots, (n, self.n_slots)
        t0 = time.perf_counter()
        first, last = self.n_slots - n, self.n_slots - 1
        for slot in range(first, last + 1):
            self._lent_owner[slot] = self.table.lend(slot)
            self._states[slot] = LENT
        try:
            self._sync_table()
        except BaseException:  # nothing was lent: give every slot back as it was
            for slot in range(first, last + 1):
                owner = self._lent_owner.pop(slot)
                self.table.give_back(slot, owner)
                self._states[slot] = EMPTY if owner is None else RESIDENT
            raise
        view = self._slots[first:].reshape(-1)  # [n * blob_bytes], contiguous
        ms = (time.perf_counter() - t0) * 1e3
        trace = f"strata trace: lent {n} slots [{first}..{last}] for {chunk_tokens} tokens"
        trace += f" in {ms:.1f} ms"
        self._trace(trace)
        return LentRange(first, last, view, chunk_tokens, ms, trace)

    def refill(self, lent: LentRange, on_slot: Callable[[], None] | None = None) -> RefillResult:
        """Upload each still-lent slot of `lent` back into the same slot and restore its row.

        On a failed upload the slots refilled so far stay refilled and the rest stay lent, so
        calling `refill` again finishes the job; its trace line then counts the range's slots
        back across the attempts. `on_slot` runs before each slot (the prompt path's fault
        point).
        """
        t0 = time.perf_counter()
        before = self.backend.stats.snapshot()
        n_done = n_uploaded = 0
        n_earlier = lent.n_slots - self.lent_in(lent)  # refilled by an attempt that failed
        for slot in range(lent.first, lent.last + 1):
            if self._states[slot] != LENT:
                continue
            owner = self._lent_owner[slot]
            self._states[slot] = REFILLING
            try:
                if on_slot is not None:
                    on_slot()
                if owner is not None:
                    self._put(slot, *owner)
            except BaseException:
                self._states[slot] = LENT
                raise
            self.table.give_back(slot, owner)
            del self._lent_owner[slot]
            self._states[slot] = EMPTY if owner is None else RESIDENT
            n_done += 1
            n_uploaded += owner is not None
        self._sync_table()
        ms = (time.perf_counter() - t0) * 1e3
        still = self.n_lent
        trace = (
            f"strata trace: refilled {n_earlier + n_done} slots [{lent.first}..{lent.last}] in "
            f"{ms:.1f} ms, {still} still lent"
        )
        if n_earlier:
            trace += f" ({n_done} on this attempt, {n_earlier} before it failed)"
        self._trace(trace)
        h2d = (self.backend.stats.snapshot() - before).h2d_bytes
        return RefillResult(n_done, lent.first, lent.last, n_uploaded, h2d, ms, still, trace)

    def grow(self, n: int) -> None:
        """Add `n` empty slots at the end (memory a loan freed); slot addresses do not move."""
        self.ledger.grow(REGION, n * self.blob_bytes)
        self.table.resize(self.n_slots + n)
        self._states = np.concatenate([self._states, np.zeros(n, dtype=np.int8)])
        self._slots = self._slot_views()

    def shrink(self, n: int) -> None:
        """Drop the last `n` slots; they must be empty and not lent."""
        assert n <= self.n_slots and (self._states[self.n_slots - n :] == EMPTY).all(), (
            f"shrink({n}) drops slots that are not empty: {self._states[self.n_slots - n :]}"
        )
        self.ledger.shrink(REGION, n * self.blob_bytes)
        self.table.resize(self.n_slots - n)
        self._states = self._states[: self.n_slots - n].copy()
        self._slots = self._slot_views()

    def release(self) -> None:
        """Give the region back to the ledger (no slot may be lent)."""
        assert self.n_lent == 0, f"release() with {self.n_lent} slots lent"
        self.ledger.release(REGION)

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers when slots, states and the table disagree."""
        self.table.check_integrity()
        errors: list[str] = []
        held = self.table.owner_of[:, 0] >= 0  # [n_slots]
        lent = self._states == LENT
        expect = np.where(lent, LENT, np.where(held, RESIDENT, EMPTY))
        wrong = np.nonzero(expect != self._states)[0]
        if len(wrong):
            errors.append(
                f"slot states disagree with the table at {wrong[:8].tolist()}: "
                f"{self._states[wrong[:8]].tolist()} vs {expect[wrong[:8]].tolist()}"
            )
        if (lent != self.table.lent).any():
            errors.append(f"{int(lent.sum())} slots LENT, table has {int(self.table.lent.sum())}")
        lent_slots = np.nonzero(lent)[0]
        if len(lent_slots) and lent_slots[0] != self.n_slots - len(lent_slots):
            errors.append(f"lent slots {lent_slots.tolist()} are not the tail of {self.n_slots}")
        if sorted(self._lent_owner) != lent_slots.tolist():
            errors.append(f"remembered owners for {sorted(self._lent_owner)}, lent {lent_slots}")
        want = cache_region_bytes(self.table.n_layer, self.table.n_expert, self.blob_bytes, 0)
        want += self.n_slots * self.blob_bytes
        if self.region.used_bytes != want:
            errors.append(f"region holds {self.region.used_bytes} bytes, {want} expected")
        if errors:
            raise AssertionError("expert cache: " + "; ".join(errors))

    # -- helpers --------------------------------------------------------------------------------

    def _put(self, slot: int, layer: int, expert: int) -> None:
        """Upload (layer, expert) into the front of `slot` (a layer whose blobs are smaller
        than the slot leaves its tail unused)."""
        n = self.host.layer_blob_bytes[layer]
        self.backend.upload(self.host.pieces(layer, expert), self._slots[slot][:n])

    def _slot_views(self) -> DeviceArray:
        n_bytes = self.n_slots * self.blob_bytes
        flat = self.region.view(self.table_bytes, n_bytes)  # [n_slots * blob_bytes]
        return flat.reshape(self.n_slots, self.blob_bytes)  # [n_slots, blob_bytes]

    def _sync_table(self) -> None:
        if not self.staged:
            return
        try:
            self.backend.upload(self.table.slot_of, self.table_view())
        except BaseException:
            # The device copy may be stale now: no reader trusts it until it is staged again.
            self.staged = self._borrow_ok = False
            raise

    def _trace(self, line: str) -> None:
        if self.on_trace is not None:
            self.on_trace(line)
