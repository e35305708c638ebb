"""The ledger: whole segments per region, stable addresses, conservation after any sequence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backend import SimBackend
from engine.errors import DeviceError, LedgerError
from engine.memory.ledger import REGION_NAMES, Ledger, LedgerSnapshot
from engine.memory.sizes import KiB

SEG = 64 * KiB


def make_ledger(n_segments: int = 16, **kw: object) -> Ledger:
    backend = SimBackend(n_segments * SEG + 1000)  # the remainder is not a whole segment
    return Ledger(backend, backend.capacity_bytes, segment_bytes=SEG, **kw)


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_regions_take_whole_segments() -> None:
    ledger = make_ledger(16)
    assert ledger.capacity_bytes == 16 * SEG and ledger.free_bytes == 16 * SEG
    kv = ledger.reserve("kv", SEG + 1)
    assert (kv.used_bytes, kv.n_segments, kv.mapped_bytes) == (SEG + 1, 2, 2 * SEG)
    ledger.reserve("reserve", 0)
    assert ledger.region_bytes("kv") == 2 * SEG and ledger.region_bytes("verifier") == 0
    snap = ledger.snapshot()
    assert snap.free_bytes == 14 * SEG
    assert snap.segment_map == ("kv", "kv") + ("",) * 14
    assert snap.region("kv").n_segments == 2 and snap.region("reserve").n_segments == 0
    assert ledger.backend.mem_info().process_bytes == 2 * SEG
    ledger.check_integrity()


def test_reserve_past_the_budget_is_refused_before_anything_changes() -> None:
    ledger = make_ledger(4)
    ledger.reserve("kv", 3 * SEG)
    assert ledger.can_reserve(SEG) and not ledger.can_reserve(SEG + 1)
    before = ledger.snapshot()
    with pytest.raises(LedgerError) as e:
        ledger.reserve("verifier", 2 * SEG)
    assert str(e.value).startswith("region verifier needs 2 more segments for 0.1 MiB, 1 free")
    assert ledger.snapshot() == before
    with pytest.raises(LedgerError, match="region kv needs 2 more segments"):
        ledger.grow("kv", SEG + 1)


def test_region_view_is_contiguous_across_segments() -> None:
    ledger = make_ledger(8)
    ledger.reserve("reserve", SEG)  # so `kv` does not start at budget unit 0
    kv = ledger.reserve("kv", 3 * SEG)
    data = np.random.default_rng(0).integers(0, 256, 3 * SEG, dtype=np.uint8)
    kv.view(0, 3 * SEG)[:] = data
    assert np.array_equal(kv.view(SEG - 10, 20), data[SEG - 10 : SEG + 10])
    with pytest.raises(AssertionError, match="outside"):
        kv.view(3 * SEG - 4, 8)


def test_grow_and_shrink_keep_addresses_and_bytes() -> None:
    ledger = make_ledger(8)
    cache = ledger.reserve("experts.cache", SEG)
    head = cache.view(0, SEG)
    head[:] = 5
    ledger.reserve("kv", SEG)  # grow must get a non-adjacent budget unit
    ledger.grow("experts.cache", 2 * SEG)
    assert cache.segments == [0, 2, 3] and cache.used_bytes == 3 * SEG
    whole = cache.view(0, 3 * SEG)
    assert address(whole) == address(head) and (whole[:SEG] == 5).all()
    ledger.shrink("experts.cache", 2 * SEG - 1)
    assert cache.n_segments == 2 and ledger.free_bytes == 5 * SEG
    assert (cache.view(0, SEG)[:] == 5).all()
    ledger.check_integrity()


def test_release_frees_device_memory_and_restore_keeps_addresses() -> None:
    ledger = make_ledger(8)
    verifier = ledger.reserve("verifier", 2 * SEG)
    old = address(verifier.view(0, 8))
    ledger.reserve("kv", SEG)
    assert ledger.release("verifier") == 2 * SEG
    assert ledger.backend.mem_info().process_bytes == SEG
    assert not ledger.has("verifier") and ledger.snapshot().region("verifier") is None
    with pytest.raises(AssertionError, match="released region"):
        verifier.view(0, 8)
    ledger.reserve("mtp.experts", 2 * SEG)  # takes the freed budget units
    again = ledger.reserve("verifier", 2 * SEG)
    assert again.segments == [3, 4] and address(again.view(0, 8)) == old
    ledger.check_integrity()


def test_failed_map_leaves_the_ledger_unchanged() -> None:
    ledger = make_ledger(8)
    ledger.reserve("kv", SEG)
    ledger.backend.inject_fault("map", after=2)
    before = ledger.snapshot()
    with pytest.raises(DeviceError, match="injected fault in map"):
        ledger.reserve("experts.cache", 4 * SEG)
    assert ledger.snapshot() == before
    assert ledger.backend.mem_info().process_bytes == SEG
    ledger.check_integrity()
    ledger.reserve("experts.cache", 4 * SEG)
    ledger.check_integrity()


def test_on_change_gets_a_snapshot_after_every_action() -> None:
    seen: list[LedgerSnapshot] = []
    ledger = make_ledger(4, on_change=seen.append)
    ledger.reserve("kv", SEG)
    ledger.grow("kv", SEG)
    ledger.shrink("kv", SEG)
    ledger.release("kv")
    assert [s.seq for s in seen] == [1, 2, 3, 4]
    assert [s.free_bytes for s in seen] == [3 * SEG, 2 * SEG, 3 * SEG, 4 * SEG]
    ledger.can_reserve(SEG)
    ledger.snapshot()
    assert len(seen) == 4, "questions must not publish"


def test_unaccounted_counts_device_memory_outside_regions() -> None:
    ledger = make_ledger(8)
    ledger.reserve("kv", SEG)
    assert ledger.snapshot().unaccounted_bytes == 0
    stray = ledger.backend.alloc(1000)
    assert ledger.snapshot().unaccounted_bytes == 1000
    ledger.backend.free(stray)


def test_carve_is_a_bump_allocator() -> None:
    ledger = make_ledger(4)
    chunk = ledger.reserve("prompt.chunk", 4096)
    a = chunk.carve(100)
    b = chunk.carve(100)
    assert address(b) - address(a) == 256
    chunk.carve(4096 - 356, align=1)  # up to the last used byte
    with pytest.raises(AssertionError, match="outside"):
        chunk.carve(1, align=1)
    chunk.reset_carve()
    assert address(chunk.carve(8)) == address(a)


def test_check_integrity_reports_the_numbers() -> None:
    ledger = make_ledger(8)
    ledger.reserve("kv", 2 * SEG)
    ledger.reserve("reserve", SEG)
    ledger._owner[5] = "kv"  # a corrupted segment map
    with pytest.raises(AssertionError) as e:
        ledger.check_integrity()
    assert "bytes not conserved: regions 196608 + free 262144 != capacity 524288" in str(e.value)
    assert "kv: segment map has 3 segments, region 2" in str(e.value)


def test_close_returns_everything() -> None:
    with make_ledger(8) as ledger:
        ledger.reserve("kv", 3 * SEG)
        ledger.reserve("experts.cache", 2 * SEG)
        backend = ledger.backend
    assert backend.mem_info().process_bytes == 0


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "grow", "shrink", "release"]),
        st.sampled_from(REGION_NAMES),
        st.integers(0, 6 * SEG),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(n_segments=st.integers(1, 24), actions=ACTIONS)
def test_bytes_are_conserved_after_any_sequence(n_segments: int, actions: list) -> None:
    ledger = make_ledger(n_segments)
    used: dict[str, int] = {}  # the model: what each live region asked for
    for op, name, n_bytes in actions:
        live = ledger.has(name)
        fits = ledger.can_reserve(n_bytes) if not live else ledger.can_grow(name, n_bytes)
        if op == "reserve" and not live:
            if fits:
                ledger.reserve(name, n_bytes)
                used[name] = n_bytes
            else:
                with pytest.raises(LedgerError):
                    ledger.reserve(name, n_bytes)
        elif op == "grow" and live:
            if fits:
                ledger.grow(name, n_bytes)
                used[name] += n_bytes
            else:
                with pytest.raises(LedgerError):
                    ledger.grow(name, n_bytes)
        elif op == "shrink" and live:
            cut = min(n_bytes, used[name])
            ledger.shrink(name, cut)
            used[name] -= cut
        elif op == "release" and live:
            ledger.release(name)
            del used[name]
        ledger.check_integrity()
        snap = ledger.snapshot()
        mapped = sum(r.mapped_bytes for r in snap.regions)
        assert mapped + snap.free_bytes == snap.capacity_bytes
        assert {r.name: r.used_bytes for r in snap.regions} == used
        assert sum(1 for o in snap.segment_map if o) * SEG == mapped
        assert ledger.backend.mem_info().process_bytes == mapped
