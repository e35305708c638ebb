"""The staging ring: expert-sized device slots the prompt path uploads missing experts into.

Ring size rule (the planner's; `ring_slots_wanted` and `ring_slots_min`):

- wanted: one layer's worth of staging, `min(n_expert, chunk_tokens * n_expert_used)`: every
  distinct expert a chunk can route to in one layer, assuming none of them is resident (true for
  the lent tail and for small caches). With that many slots a layer never waits for a slot;
- minimum: `min(n_expert, 2 * n_expert_used)`: one token's experts, double-buffered, so an upload
  can overlap the matmul that reads the previous one;
- chunk first: the planner picks the largest chunk that fits with the minimum ring and gives the
  ring what is left, up to `wanted`. The bytes a prefill streams over PCIe are (chunks x missing
  experts per chunk), so the chunk size sets the traffic; the ring size only sets how often an
  upload waits for a free slot.

The ring lies at the end of the prompt buffer, slot-aligned, so when the prompt path borrows the
cache tail each ring slot is exactly one lent cache slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backend.base import Backend, DeviceArray


def ring_slots_wanted(chunk_tokens: int, n_expert: int, n_expert_used: int) -> int:
    """Slots to stage every expert one layer of a `chunk_tokens` chunk can route to."""
    return min(n_expert, chunk_tokens * n_expert_used)


def ring_slots_min(n_expert: int, n_expert_used: int) -> int:
    """The smallest useful ring: one token's experts, double-buffered."""
    return min(n_expert, 2 * n_expert_used)


def split_prompt_buffer(
    buf: DeviceArray, chunk_bytes: int, ring_slots: int, slot_bytes: int
) -> tuple[DeviceArray, DeviceArray]:
    """Cut a prompt buffer into (chunk bytes [chunk_bytes], ring [ring_slots, slot_bytes]).

    The ring takes the last `ring_slots * slot_bytes` bytes; the chunk the first `chunk_bytes`.
    """
    ring_bytes = ring_slots * slot_bytes
    assert chunk_bytes + ring_bytes <= buf.nbytes, (chunk_bytes, ring_bytes, buf.nbytes)
    ring = buf[buf.nbytes - ring_bytes :].reshape(ring_slots, slot_bytes)  # [S, blob]
    return buf[:chunk_bytes], ring


class StagingRing:
    """Round-robin upload slots; an expert already in the ring is not uploaded again.

    Overwriting a slot is safe without a host synchronisation: the backend orders every upload
    after the compute already queued (which includes every kernel that read the slot's old
    expert), or, once `release` said the slot's readers are queued (the backend's `mark`),
    after just those readers, so on CUDA the upload overlaps the compute queued since.
    `stage(..., wait=False)` (prefetch, CUDA) queues the copy without making the compute wait
    for it; the wait is queued when the expert is first asked for with `wait=True`.
    """

    def __init__(self, backend: Backend, slots: DeviceArray):
        assert slots.ndim == 2 and len(slots) > 0, slots.shape
        self.backend = backend
        self.slots = slots  # [n_slots, slot_bytes]
        self._held: list[tuple[int, int] | None] = [None] * len(slots)
        self._where: dict[tuple[int, int], int] = {}  # (layer, expert) -> ring slot
        self._next = 0
        self._pending: dict[int, object] = {}  # slot -> copy event compute has not waited for
        self._free_after: dict[int, object] = {}  # slot -> event past its last reader (release)
        self.n_uploads = 0
        self.bytes_uploaded = 0
        self.n_reused = 0

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    def stage(
        self, layer: int, expert: int,
        host_blob: Callable[[int, int], np.ndarray | list[np.ndarray]], wait: bool = True,
    ) -> DeviceArray:
        """Device bytes [slot_bytes] of (layer, expert); uploads `host_blob(layer, expert)`
        into the next slot unless the ring already holds it. `wait=False`: compute queued
        later does not wait for this copy until the expert is staged again with `wait=True`
        (on a backend whose copies run beside compute; elsewhere every copy is done anyway)."""
        return self.stage_group(layer, [expert], host_blob, wait)[0]

    def stage_group(
        self, layer: int, experts: list[int],
        host_blob: Callable[[int, int], np.ndarray | list[np.ndarray]], wait: bool = True,
    ) -> list[DeviceArray]:
        """`stage` for several experts that are read (or prefetched) together: none of them is
        evicted to make room for another (so at most `n_slots` of them), and their uploads go
        as one batch behind one wait, with one event (`upload_many`)."""
        assert len(experts) <= self.n_slots, (len(experts), self.n_slots)
        keep = {self._where[(layer, e)] for e in experts if (layer, e) in self._where}
        slots, jobs, fresh, afters = [], [], [], []
        for e in experts:
            key = (layer, e)
            slot = self._where.get(key)
            if slot is not None:
                self.n_reused += 1
                self._free_after.pop(slot, None)  # read again: released again after that read
            else:
                while self._next in keep:  # skip the group's own slots
                    self._next = (self._next + 1) % self.n_slots
                slot = self._next
                old = self._held[slot]
                if old is not None:
                    del self._where[old]
                self._pending.pop(slot, None)  # a later copy on the same stream supersedes it
                afters.append(self._free_after.pop(slot, None))
                blob = host_blob(layer, e)
                n = _nbytes(blob)
                jobs.append((blob, self.slots[slot][:n]))  # a smaller blob: the slot's front
                self.bytes_uploaded += n
                fresh.append(slot)
                self._held[slot] = key
                self._where[key] = slot
                self._next = (slot + 1) % self.n_slots
                self.n_uploads += 1
            keep.add(slot)
            slots.append(slot)
        if jobs:
            self._upload(jobs, afters, fresh, wait)
        if wait:
            for slot in slots:
                if slot in self._pending:
                    self.backend.wait(self._pending.pop(slot))
        return [self.slots[slot] for slot in slots]

    def _upload(self, jobs: list[tuple[Any, DeviceArray]], afters: list[object | None],
                fresh: list[int], wait: bool) -> None:
        """One batch of uploads into the `fresh` slots: after the compute that last read them
        (their release events, or all compute queued when one has none)."""
        after = None if any(a is None for a in afters) else list(dict.fromkeys(afters))
        event = self.backend.upload_many(jobs, after=after)
        for slot in fresh:
            self._pending[slot] = event

    def release(self, layer: int, experts: list[int]) -> None:
        """The compute that reads these experts' slots is queued (the MoE kernels decoded
        them): a later upload into one of them waits for that compute only, not for all the
        compute queued before it. Experts the ring does not hold are ignored."""
        slots = [self._where[(layer, e)] for e in experts if (layer, e) in self._where]
        if not slots:
            return
        event = self.backend.mark()
        for slot in slots:
            self._free_after[slot] = event

    def reset(self) -> None:
        """Forget what the ring holds (its memory is about to be reused or refilled)."""
        self._held = [None] * self.n_slots
        self._where.clear()
        self._next = 0
        self._pending.clear()
        self._free_after.clear()


def _nbytes(blob: np.ndarray | list[np.ndarray]) -> int:
    return sum(int(p.nbytes) for p in blob) if isinstance(blob, list) else int(blob.nbytes)
