"""The expert cache: fill in profile order, lend the tail, refill byte-identical, same slots."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backend import SimBackend
from engine.errors import DeviceError
from engine.experts.cache import EMPTY, LENT, RESIDENT, ExpertCache
from engine.experts.host import ArrayHostExperts
from engine.experts.profile import ExpertProfile
from engine.experts.residency import ResidencyTable, residency_readers
from engine.memory.cache_layout import cache_region_bytes
from engine.memory.ledger import Ledger
from engine.memory.ring import StagingRing, split_prompt_buffer
from engine.memory.sizes import KiB, MiB

SEG = 64 * KiB
N_LAYER, N_EXPERT, BLOB = 3, 8, 3000  # a blob size that is not a power of two
BORROW = residency_readers(profile_present=True, borrow=True, chunk_tokens=512, token_graph=False)


def make_host(seed: int = 0, n_layer: int = N_LAYER, n_expert: int = N_EXPERT) -> ArrayHostExperts:
    rng = np.random.default_rng(seed)
    return ArrayHostExperts(rng.integers(0, 256, (n_layer, n_expert, BLOB), dtype=np.uint8))


def make_cache(n_slots: int, host: ArrayHostExperts | None = None, **kw: object) -> ExpertCache:
    ledger = Ledger(SimBackend(4 * MiB), segment_bytes=SEG)
    return ExpertCache(ledger, host or make_host(), n_slots, **kw)


def slot_bytes(cache: ExpertCache) -> np.ndarray:
    """Every slot's device bytes, read directly (not counted): uint8 [n_slots, blob]."""
    flat = cache.region.view(cache.table_bytes, cache.n_slots * BLOB)
    return np.array(flat).reshape(cache.n_slots, BLOB)


def order(host: ArrayHostExperts, seed: int = 1) -> list[tuple[int, int]]:
    counts = np.random.default_rng(seed).integers(0, 100, (host.n_layer, host.n_expert))
    return ExpertProfile.from_counts(counts).order()


def test_fill_uploads_in_profile_order() -> None:
    host = make_host()
    cache = make_cache(10, host)
    fill_order = order(host)
    assert cache.fill(fill_order) == 10
    data = slot_bytes(cache)  # [10, blob]
    for slot, (layer, expert) in enumerate(fill_order[:10]):
        assert np.array_equal(data[slot], host.blob(layer, expert))
        assert cache.lookup(layer, expert) == slot
    assert cache.lookup(*fill_order[10]) == -1
    assert (cache.n_hits, cache.n_misses) == (10, 1)
    stats = cache.backend.stats.snapshot()
    assert (stats.h2d_copies, stats.h2d_bytes) == (10, 10 * BLOB)  # table not staged yet
    assert (cache.states() == RESIDENT).all()
    assert cache.region.used_bytes == cache_region_bytes(N_LAYER, N_EXPERT, BLOB, 10)
    cache.check_integrity()


def test_lend_and_refill_restore_every_byte_and_row() -> None:
    host = make_host()
    cache = make_cache(12, host, on_trace=(lines := []).append)
    cache.fill(order(host))
    assert cache.stage_residency(BORROW) is None and cache.borrowing_available
    before_bytes, before_rows = slot_bytes(cache), cache.table.slot_of.copy()
    stats0 = cache.backend.stats.snapshot()

    lent = cache.lend_tail(5, chunk_tokens=512)
    assert (lent.first, lent.last, lent.n_slots, lent.view.nbytes) == (7, 11, 5, 5 * BLOB)
    assert cache.n_lent == 5 and list(cache.states()) == [RESIDENT] * 7 + [LENT] * 5
    assert not (cache.table.slot_of >= 7).any(), "a row still points at a lent slot"
    assert np.array_equal(np.array(cache.table_view()), cache.table.slot_of), "device table stale"
    with pytest.raises(AssertionError, match="lent to the prompt path"):
        cache.slot_view(9)
    cache.check_integrity()
    lent.view[:] = 0xEE  # the prompt path scribbles over everything it borrowed

    result = cache.refill(lent)
    assert np.array_equal(slot_bytes(cache), before_bytes)
    assert np.array_equal(cache.table.slot_of, before_rows)
    assert np.array_equal(np.array(cache.table_view()), before_rows)
    assert cache.n_lent == 0 and (cache.states() == RESIDENT).all()
    assert (result.n_slots, result.n_uploaded, result.still_lent) == (5, 5, 0)
    table_bytes = cache.table.slot_of.nbytes
    assert result.h2d_bytes == 5 * BLOB + table_bytes
    copies = cache.backend.stats.snapshot() - stats0
    assert copies.h2d_copies == 5 + 2  # five blobs, the table after lend and after refill
    assert re.fullmatch(
        r"strata trace: lent 5 slots \[7\.\.11\] for 512 tokens in \d+\.\d ms", lines[0]
    )
    assert re.fullmatch(
        r"strata trace: refilled 5 slots \[7\.\.11\] in \d+\.\d ms, 0 still lent", lines[1]
    )
    assert result.trace == lines[1]
    cache.check_integrity()


def test_borrowing_needs_the_staged_table_not_the_token_graph() -> None:
    readers = residency_readers(
        profile_present=True, borrow=True, chunk_tokens=8192, token_graph=False
    )
    assert readers.borrow and not readers.graph  # seed 003: --no-token-graph keeps borrowing
    assert not residency_readers(
        profile_present=True, borrow=True, chunk_tokens=0, token_graph=False
    ).any
    cache = make_cache(6)
    cache.fill(order(cache.host))
    assert not cache.borrowing_available
    with pytest.raises(AssertionError, match="without a staged residency table"):
        cache.lend_tail(2)


def test_failed_staging_disables_borrowing_only_when_the_graph_does_not_need_it() -> None:
    cache = make_cache(6)
    cache.fill(order(cache.host))
    cache.backend.inject_fault("upload")
    warning = cache.stage_residency(BORROW)
    assert warning is not None and warning.startswith(
        "strata: warning: staging the expert residency"
    )
    assert "injected fault in upload" in warning and "\n" not in warning
    assert not cache.borrowing_available and not cache.staged
    graph = residency_readers(profile_present=True, borrow=True, chunk_tokens=512, token_graph=True)
    cache.backend.inject_fault("upload")
    with pytest.raises(DeviceError, match="injected fault"):
        cache.stage_residency(graph)
    assert cache.stage_residency(graph) is None and cache.borrowing_available


def test_a_failed_refill_can_be_finished() -> None:
    host = make_host()
    cache = make_cache(9, host)
    cache.fill(order(host))
    cache.stage_residency(BORROW)
    before = slot_bytes(cache)
    lent = cache.lend_tail(4)
    lent.view[:] = 0
    cache.backend.inject_fault("upload", after=2)
    with pytest.raises(DeviceError):
        cache.refill(lent)
    assert cache.n_lent == 2 and list(cache.states()[5:]) == [RESIDENT, RESIDENT, LENT, LENT]
    cache.check_integrity()
    result = cache.refill(lent)
    assert (result.n_slots, result.still_lent) == (2, 0)
    assert np.array_equal(slot_bytes(cache), before)
    cache.check_integrity()


def test_a_failed_lend_lends_nothing_and_turns_borrowing_off() -> None:
    cache = make_cache(8)
    cache.fill(order(cache.host))
    cache.stage_residency(BORROW)
    rows = cache.table.slot_of.copy()
    cache.backend.inject_fault("upload")  # the table sync after marking the tail lent
    with pytest.raises(DeviceError):
        cache.lend_tail(3)
    assert cache.n_lent == 0 and np.array_equal(cache.table.slot_of, rows)
    assert (cache.states() == RESIDENT).all()
    assert not cache.borrowing_available and not cache.staged
    cache.check_integrity()


def test_grow_lend_refill_shrink_for_a_loan() -> None:
    host = make_host()
    cache = make_cache(8, host)
    cache.fill(order(host))
    cache.stage_residency(BORROW)
    before = slot_bytes(cache)
    address = cache.slot_view(0).__array_interface__["data"][0]
    cache.grow(3)  # memory a loan freed: three empty slots at the end
    assert cache.slot_view(0).__array_interface__["data"][0] == address
    assert list(cache.states()) == [RESIDENT] * 8 + [EMPTY] * 3
    lent = cache.lend_tail(6)
    lent.view[:] = 1
    result = cache.refill(lent)
    assert (result.n_slots, result.n_uploaded, result.h2d_bytes - cache.table.slot_of.nbytes) == (
        6, 3, 3 * BLOB,
    )  # fmt: skip
    cache.shrink(3)
    assert np.array_equal(slot_bytes(cache), before)
    cache.check_integrity()
    cache.ledger.check_integrity()


def test_ring_in_the_lent_tail_stages_each_expert_once() -> None:
    host = make_host()
    cache = make_cache(12, host)
    cache.fill(order(host))
    cache.stage_residency(BORROW)
    before = slot_bytes(cache)
    lent = cache.lend_tail(6)
    chunk, ring_slots = split_prompt_buffer(lent.view, 2 * BLOB + 10, 3, BLOB)  # [.., 3 x blob]
    assert chunk.nbytes == 2 * BLOB + 10 and ring_slots.shape == (3, BLOB)
    ring = StagingRing(cache.backend, ring_slots)
    for expert in (0, 1, 0, 2, 3, 0):  # 3 evicts 0 from ring slot 0, then 0 evicts 1 from slot 1
        view = ring.stage(2, expert, host.blob)
        assert np.array_equal(view, host.blob(2, expert))
    assert (ring.n_uploads, ring.n_reused) == (5, 1)
    assert np.array_equal(np.array(ring_slots[0]), host.blob(2, 3))
    assert np.array_equal(np.array(ring_slots[1]), host.blob(2, 0))
    cache.refill(lent)
    assert np.array_equal(slot_bytes(cache), before)


def test_integrity_catches_a_row_pointing_at_a_lent_slot() -> None:
    cache = make_cache(6)
    cache.fill(order(cache.host))
    cache.stage_residency(BORROW)
    cache.lend_tail(2)
    cache.table.slot_of[0, 0] = 5  # a row pointing into the lent tail
    with pytest.raises(AssertionError, match="rows point at lent slots: \\[5\\]"):
        cache.check_integrity()


def test_residency_table_inverse() -> None:
    table = ResidencyTable(2, 4, 3)
    table.assign(2, 1, 3)
    assert table.lookup(1, 3) == 2 and table.owner(2) == (1, 3) and table.owner(0) is None
    assert list(table.lookup_many(1, np.array([3, 0]))) == [2, -1]
    assert table.lend(2) == (1, 3) and table.lookup(1, 3) == -1
    table.check_integrity()
    table.give_back(2, (1, 3))
    table.owner_of[0] = (0, 0)  # an inverse entry without its row
    with pytest.raises(AssertionError, match="2 slots claim an owner, 1 rows are resident"):
        table.check_integrity()


@settings(max_examples=60, deadline=None)
@given(
    n_slots=st.integers(1, N_LAYER * N_EXPERT),
    n_filled=st.integers(0, N_LAYER * N_EXPERT),
    lend_share=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_refill_restores_any_cache(
    n_slots: int, n_filled: int, lend_share: float, seed: int
) -> None:
    host = make_host(seed)
    cache = make_cache(n_slots, host)
    cache.fill(order(host, seed)[:n_filled])
    cache.stage_residency(BORROW)
    before, rows = slot_bytes(cache), cache.table.slot_of.copy()
    n_lend = max(1, int(lend_share * n_slots))
    lent = cache.lend_tail(n_lend)
    cache.check_integrity()
    lent.view[:] = np.random.default_rng(seed).integers(0, 256, lent.view.nbytes, dtype=np.uint8)
    result = cache.refill(lent)
    filled = min(n_filled, n_slots)
    assert result.n_uploaded == max(0, filled - (n_slots - n_lend))
    assert np.array_equal(slot_bytes(cache)[:filled], before[:filled])
    assert np.array_equal(cache.table.slot_of, rows) and cache.n_lent == 0
    cache.check_integrity()
    cache.ledger.check_integrity()
