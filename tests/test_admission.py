"""Expert-cache admission while decoding (`--cache-policy adaptive`, engine/experts/policy.py):
the rule, the cache's promotions, and an engine whose replies do not change while its hit rate
rises on the demo model's real routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineOptions
from engine.errors import DeviceError, FlagError
from engine.experts.cache import EMPTY, LENT, RESIDENT
from engine.experts.policy import BUDGET, MARGIN, SEED, Admission, Move
from engine.request.conversation import Conversation
from engine.request.sampler import SamplingParams
from engine.runtime.serve import ServeLoop
from tests.test_expert_cache import BORROW, make_cache, make_host, order, slot_bytes

L, E = 2, 6


def routes(*per_layer: list[int]) -> np.ndarray:
    """One step of one row: int [L, 1, k]."""
    return np.array([[ids] for ids in per_layer])


def table(resident: dict[tuple[int, int], int], n_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot_of [L, E], owner_of [n_slots, 2]) of {(layer, expert): slot}."""
    slot_of = np.full((L, E), -1)
    owner_of = np.full((n_slots, 2), -1)
    for (layer, expert), slot in resident.items():
        slot_of[layer, expert] = slot
        owner_of[slot] = (layer, expert)
    return slot_of, owner_of


def test_one_use_of_a_cold_expert_does_not_evict_a_seeded_one() -> None:
    slot_of, owner_of = table({(0, 0): 0, (1, 0): 1}, 2)
    adm = Admission(L, E, slot_of >= 0)
    moves = adm.step(routes([3], [4]), slot_of, owner_of, np.ones(2, bool))
    assert moves == []  # 1.0 < SEED * decay + MARGIN
    assert 1.0 < SEED * adm.decay + MARGIN


def test_an_expert_missed_often_replaces_the_coldest_resident_one() -> None:
    slot_of, owner_of = table({(0, 0): 0, (1, 0): 1}, 2)
    adm = Admission(L, E, slot_of >= 0)
    replaceable = np.ones(2, bool)
    moves: list[Move] = []
    n = 0
    while not moves:
        moves = adm.step(routes([3], [0]), slot_of, owner_of, replaceable)  # (1, 0) is used
        n += 1
    # (0, 3) overtook (0, 0), the resident expert no step used; (1, 0) stays
    assert moves == [Move(slot=0, layer=0, expert=3)] and n == 3


def test_empty_slots_are_taken_first_and_held_slots_never() -> None:
    slot_of, owner_of = table({(0, 0): 0}, 4)
    adm = Admission(L, E, slot_of >= 0)
    replaceable = np.array([True, True, True, False])  # slot 3 is lent to the prompt path
    moves = adm.step(routes([4, 5], [2, 3]), slot_of, owner_of, replaceable)
    assert len(moves) == BUDGET == 2
    assert {m.slot for m in moves} == {1, 2}  # not the resident one (it scores SEED), not 3
    slot_of, owner_of = table({(0, 0): 0, (0, 1): 2}, 4)
    adm = Admission(L, E, slot_of >= 0)
    moves = adm.step(routes([4, 5], [2, 3]), slot_of, owner_of, replaceable)
    assert [m.slot for m in moves] == [1]  # one empty slot left; the residents score more


def test_the_budget_bounds_a_step_and_nothing_is_admitted_twice() -> None:
    slot_of, owner_of = table({}, 6)  # every slot empty
    adm = Admission(L, E, slot_of >= 0, budget=3)
    moves = adm.step(np.array([[[0, 1], [1, 2]], [[3, 3], [4, 5]]]), slot_of, owner_of,
                     np.ones(6, bool))
    assert len(moves) == 3
    assert len({(m.layer, m.expert) for m in moves}) == 3 and len({m.slot for m in moves}) == 3
    # the experts two rows used score 2, first
    assert {(m.layer, m.expert) for m in moves[:2]} == {(0, 1), (1, 3)}


def test_promote_uploads_the_expert_and_moves_the_row() -> None:
    host = make_host()
    cache = make_cache(4, host)
    cache.fill(order(host))
    cache.stage_residency(BORROW)
    evicted = cache.table.owner(2)
    target = next((la, e) for la in range(host.n_layer) for e in range(host.n_expert)
                  if cache.table.lookup(la, e) < 0)
    assert cache.promote([Move(2, *target)]) == 1
    assert cache.table.lookup(*target) == 2 and cache.table.lookup(*evicted) == -1
    assert np.array_equal(slot_bytes(cache)[2], host.blob(*target))
    assert np.array_equal(np.array(cache.table_view()), cache.table.slot_of), "device table stale"
    assert cache.n_promoted == 1 and (cache.states() == RESIDENT).all()
    cache.check_integrity()


def test_a_failed_promotion_leaves_an_empty_slot_not_a_wrong_expert() -> None:
    host = make_host()
    cache = make_cache(4, host)
    cache.fill(order(host))
    cache.stage_residency(BORROW)
    free = [(la, e) for la in range(host.n_layer) for e in range(host.n_expert)
            if cache.table.lookup(la, e) < 0]
    cache.backend.inject_fault("upload", after=1)  # the second expert's upload fails
    with pytest.raises(DeviceError):
        cache.promote([Move(0, *free[0]), Move(1, *free[1])])
    assert cache.table.lookup(*free[0]) == 0 and cache.table.lookup(*free[1]) == -1
    assert cache.table.owner(1) is None and cache.states()[1] == EMPTY
    assert np.array_equal(np.array(cache.table_view()), cache.table.slot_of)
    cache.check_integrity()


def test_no_promotion_while_the_prompt_path_holds_slots() -> None:
    host = make_host()
    cache = make_cache(6, host)
    cache.fill(order(host))
    cache.stage_residency(BORROW)
    cache.lend_tail(2)
    assert list(cache.replaceable()) == [True] * 4 + [False] * 2
    assert list(cache.states()[4:]) == [LENT, LENT]


PROMPTS = ("Define the word gravity.", "What is a lantern?", "Tell me about rivers.")


def _replies(policy: str) -> tuple[list[str], int, int, int]:
    """Greedy replies of the demo model with 32 of its 128 experts cached."""
    opts = EngineOptions(model="demo", device="sim", ctx=2048, expert_cache=32,
                         cache_policy=policy)
    loop = ServeLoop.create(opts)
    texts, hits, misses, promoted = [], 0, 0, 0
    for p in PROMPTS:
        reply = loop.chat(Conversation(), p, SamplingParams(), max_new=96)
        texts.append(reply.text)
        t = reply.timing
        hits, misses = hits + t.decode_hits, misses + t.decode_misses
        promoted += t.decode_promoted
    loop.rt.cache.check_integrity()
    loop.close()
    return texts, hits, misses, promoted


def test_adaptive_raises_the_hit_rate_and_the_replies_stay() -> None:
    static, s_hits, s_misses, s_promoted = _replies("static")
    adaptive, a_hits, a_misses, a_promoted = _replies("adaptive")
    assert adaptive == static  # where an expert is read from never changes what it computes
    assert s_promoted == 0 < a_promoted
    assert s_hits + s_misses == a_hits + a_misses  # the same routing
    assert a_hits > s_hits
    assert a_promoted < a_misses / 5  # promotions are a small share of the link's reads


def test_the_policy_is_an_option_checked_and_changed_while_running() -> None:
    with pytest.raises(FlagError, match="--cache-policy lru must be one of auto, adaptive, st"):
        EngineOptions(cache_policy="lru")
    loop = ServeLoop.create(EngineOptions(model="demo", device="sim", ctx=1024, expert_cache=32))
    assert loop.rt.experts.policy == "static"  # auto: adaptive on CUDA only
    assert loop.rt.experts.admission is None
    opts = loop.rt.options.with_changes(cache_policy="adaptive")
    assert loop.set_flags(loop.rt.flags, opts) == []  # from the next request on
    reply = loop.chat(Conversation(), "What is a lantern?", SamplingParams(), max_new=24)
    assert loop.rt.experts.policy == "adaptive" and loop.rt.experts.admission is not None
    assert reply.timing.decode_promoted > 0
    loop.close()


def test_auto_admits_on_cuda_only() -> None:
    from engine.devices import cache_policy, device_traits

    auto, cuda, sim = EngineOptions(), device_traits("cuda:0"), device_traits("sim")
    assert cache_policy(cuda, auto) == "adaptive" and cache_policy(sim, auto) == "static"
    assert cache_policy(sim, EngineOptions(cache_policy="adaptive")) == "adaptive"
    assert cache_policy(cuda, EngineOptions(cache_policy="static")) == "static"


def _script():  # scripts/ is not a package: load the file
    import importlib.util
    import sys

    path = Path(__file__).parent.parent / "scripts" / "cache_policy.py"
    spec = importlib.util.spec_from_file_location("cache_policy", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def test_the_study_replays_what_the_engine_does() -> None:
    """scripts/cache_policy.py replays recorded routing through the shipped rule: its hits and
    promotions are the engine's own, for the static and the adaptive cache."""
    mod = _script()
    questions = mod.prompts(4)
    steps, fill, n_layer, n_expert = mod.record("demo", 48, questions)
    assert steps and all(s.shape[0] == n_layer for s in steps)
    for policy in ("static", "adaptive"):
        loop = ServeLoop.create(EngineOptions(model="demo", device="sim", ctx=4096,
                                              expert_cache=32, cache_policy=policy))
        hits = promoted = 0
        for q in questions:
            t = loop.chat(Conversation(), q, SamplingParams(), max_new=48).timing
            hits, promoted = hits + t.decode_hits, promoted + t.decode_promoted
        loop.close()
        r = mod.replay(steps, fill, n_layer, n_expert, 32, policy)
        assert (r.hits, r.promoted) == (hits, promoted), policy
    table = mod.markdown(steps, fill, n_layer, n_expert, (0.25,))
    assert "| 32 (25%) | recency |" in table and table.count("\n| 32 (25%)") == 3


def test_ranking_is_by_score_with_the_fill_order_breaking_ties() -> None:
    slot_of, _ = table({(0, 0): 0}, 2)
    adm = Admission(L, E, slot_of >= 0)
    order = [(0, 0), (1, 5), (0, 2), (1, 1)]
    adm.score[1, 1] = 3.0
    assert adm.ranking(order) == [(1, 1), (0, 0), (1, 5), (0, 2)]


def test_the_mtp_lend_fills_its_slots_with_what_decoding_uses(random_demo_path: Path) -> None:
    """Lending the MTP regions to the cache (engine/loan/cache_lend.py) fills the new slots by
    the admission scores: the experts decoding used most that the cache lacks."""
    opts = EngineOptions(model=str(random_demo_path), device="sim:40MiB", ctx=2048, mtp=True,
                         spec=2, draft_vocab=3000, expert_cache=40, cache_policy="adaptive",
                         cache_lend=True)
    loop = ServeLoop.create(opts)
    rt = loop.rt
    cache, adm = rt.cache, rt.experts.admission
    missing = [o for o in reversed(cache.order) if cache.table.lookup(*o) < 0][:3]
    for i, (layer, expert) in enumerate(missing):  # the profile's last, decoding's first
        adm.score[layer, expert] = 10.0 - i
    n0 = cache.n_slots
    rt.spec.lender.lend()
    assert rt.spec.lender.grown >= 3
    assert [cache.table.owner(s) for s in range(n0, n0 + 3)] == missing
    rt.spec.lender.repay()
    rt.check_integrity()
    loop.close()


def test_observe_takes_the_token_graphs_one_array_or_a_list_per_layer() -> None:
    """The eager forward gives a list of [T, k] per layer, the token graph one [L, T, k]
    array (read back in one copy); either promotes the same experts."""
    moved = []
    for as_array in (False, True):
        loop = ServeLoop.create(EngineOptions(model="demo", device="sim", ctx=1024,
                                              expert_cache=32, cache_policy="adaptive"))
        experts, cache = loop.rt.experts, loop.rt.cache
        experts.admission.margin, experts.admission.score[:] = 0.0, 0.0
        missing = [e for e in range(32) if cache.table.lookup(0, e) < 0][:4]
        hp = loop.rt.model.hp
        step = np.array([[missing]] * hp.n_layer)  # [L, 1, 4]: layer 0's misses everywhere
        experts.observe(step if as_array else [step[i] for i in range(hp.n_layer)])
        assert experts.counters.promoted == 2  # the budget
        held = (cache.table.owner(s) for s in range(cache.n_slots))
        moved.append(sorted(o for o in held if o is not None))
        cache.check_integrity()
        loop.close()
    assert moved[0] == moved[1]
