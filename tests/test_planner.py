"""The planner: a plan checked by hand, the shortfall table, and properties over random inputs."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.backend import SimBackend
from engine.errors import FlagError, ModelError, PlanError
from engine.memory.ledger import DECODE_ONLY_REGIONS, Ledger
from engine.memory.planner import (
    ModelCosts,
    PlanOptions,
    StartupPlan,
    fit_mtp_experts,
    format_plan_table,
    plan_loan,
    plan_prompt,
    plan_startup,
)
from engine.memory.ring import ring_slots_min, ring_slots_wanted
from engine.memory.sizes import KiB, MiB

SEG = 8 * MiB
# The hand-checked example: 4 layers x 16 experts (top-2), 4 MiB per expert blob.
COSTS = ModelCosts(
    dense_bytes=20 * MiB,  # 3 segments
    kv_bytes=8 * MiB,  # 1
    expert_blob_bytes=4 * MiB,
    n_layer=4,
    n_expert=16,
    n_expert_used=2,
    act_bytes_per_token=64 * KiB,
    act_bytes_fixed=2 * MiB,
    verifier_bytes=6 * MiB,  # 1
    head_bytes=10 * MiB,  # 2
)
OPTS = PlanOptions(segment_bytes=SEG, reserve_bytes=8 * MiB)  # reserve: 1 segment


def reserve_plan(plan: StartupPlan) -> Ledger:
    """Reserve the planned regions in a real ledger of the planned capacity."""
    ledger = Ledger(SimBackend(plan.capacity_bytes), segment_bytes=plan.segment_bytes)
    for r in plan.regions:
        ledger.reserve(r.name, r.n_bytes)
    ledger.check_integrity()
    return ledger


def test_hand_checked_borrowed_plan() -> None:
    plan = plan_startup(256 * MiB, COSTS, OPTS)
    # 32 segments; mandatory 3 + 1 + 1 + 1 + 2 = 8; 24 segments = 192 MiB left.
    # Cache auto: (192 MiB - 256 B table) // 4 MiB = 47 slots of 64 -> 24 segments.
    assert plan.n_segments == 32 and plan.n_cache_slots == 47
    assert plan.region_bytes("experts.cache") == 256 + 47 * 4 * MiB
    assert plan.free_bytes == 0
    # Lendable: min(47 - kept 8 (= 4 layers x top-2), floor(0.9 x 47) = 42) = 39 slots.
    # Chunk: ((39 - ring min 4) x 4 MiB - 2 MiB) // 64 KiB = 2,208 -> grid 2,048 tokens,
    # 2 + 128 = 130 MiB = 33 slots; ring = min(16 wanted, 39 - 33) = 6; lent ceil(154 / 4) = 39.
    g = plan.prompt
    assert (g.chunk_tokens, g.ring_slots, g.n_lent_slots, g.borrowed) == (2048, 6, 39, True)
    assert (g.chunk_bytes, g.ring_bytes) == (130 * MiB, 24 * MiB)
    assert plan.startup_prompt == g
    assert not {"prompt.chunk", "prompt.ring"} & {r.name for r in plan.regions}
    table = format_plan_table(plan)
    assert "prompt plan 2,048 / 6 (chunk tokens / ring slots), borrowed: 39" in table
    assert "| experts.cache | 192.0 |       24 |  75.0% |" in table
    assert "| total         | 256.0 |       32 | 100.0% |" in table
    assert reserve_plan(plan).free_bytes == plan.free_bytes


def test_hand_checked_startup_loan() -> None:
    opts = replace(OPTS, deferred=frozenset({"verifier", "head.native"}))
    plan = plan_startup(256 * MiB, COSTS, opts)
    assert plan.prompt.chunk_tokens == 2048 and plan.n_cache_slots == 47
    assert {r.name for r in plan.deferred} == {"verifier", "head.native"}
    assert plan.region_bytes("verifier") == 0 and plan.free_bytes == 3 * SEG
    # Loan: the cache maps 192 + 24 = 216 MiB -> 53 slots, 6 of them new and empty; 6 + 39 = 45
    # lendable. Chunk ((45 - 4) x 4 - 2) MiB // 64 KiB = 2,592 -> 2,560 tokens = 162 MiB = 41
    # slots; ring = min(16, 45 - 41) = 4; lent ceil((162 + 16) / 4) = 45.
    s = plan.startup_prompt
    assert (s.chunk_tokens, s.ring_slots, s.n_lent_slots) == (2560, 4, 45)
    assert "startup prompt plan 2,560 / 4" in format_plan_table(plan)
    assert "| verifier (deferred)    |   8.0 |        - |      - |" in format_plan_table(plan)
    assert reserve_plan(plan).free_bytes == 3 * SEG


def test_hand_checked_owned_plan() -> None:
    plan = plan_startup(256 * MiB, COSTS, replace(OPTS, borrow=False))
    # Owned auto keeps the cache floor (8 slots = 32 MiB + table -> 5 segments): 19 segments for
    # the prompt path, capped at 2,048 tokens: chunk 130 MiB = 17 segments, ring
    # min(16, 2 x 8 MiB // 4 MiB) = 4. The cache gets the other 5 segments: 9 slots.
    g = plan.prompt
    assert (g.chunk_tokens, g.ring_slots, g.n_lent_slots, g.borrowed) == (2048, 4, 0, False)
    assert plan.n_cache_slots == 9
    assert plan.region_bytes("prompt.chunk") == 130 * MiB
    assert plan.region_bytes("prompt.ring") == 16 * MiB
    assert "prompt plan 2,048 / 4 (chunk tokens / ring slots), owned" in format_plan_table(plan)
    assert reserve_plan(plan).free_bytes == plan.free_bytes == 0


def test_every_expert_resident_owns_instead_of_lending() -> None:
    costs = replace(COSTS, expert_blob_bytes=1 * MiB)  # 64 MiB of experts
    plan = plan_startup(512 * MiB, costs, OPTS)
    assert plan.n_cache_slots == 64 and not plan.prompt.borrowed
    assert plan.region_bytes("prompt.chunk") > 0
    reserve_plan(plan)


def test_mandatory_shortfall_table() -> None:
    with pytest.raises(PlanError) as e:
        plan_startup(48 * MiB, COSTS, OPTS)  # 6 segments for 8 needed
    assert str(e.value) == (
        "the mandatory items need 64.0 MiB, the device budget is 48.0 MiB: short by 16.0 MiB; "
        "lower --ctx, use a smaller --kv type or raise the device size"
    )
    lines = e.value.table.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == [
        "item", "MiB", "segments", "MiB in 8.0 MiB segments",
    ]  # fmt: skip
    rows = {
        cells[0]: cells[1:]
        for cells in ([c.strip() for c in x.split("|")[1:-1]] for x in lines[2:])
    }
    assert rows == {
        "weights.dense": ["20.0", "3", "24.0"],
        "kv": ["8.0", "1", "8.0"],
        "reserve": ["8.0", "1", "8.0"],
        "verifier": ["6.0", "1", "8.0"],
        "head.native": ["10.0", "2", "16.0"],
        "total needed": ["", "8", "64.0"],
        "device budget": ["", "6", "48.0"],
        "short by": ["", "2", "16.0"],
    }


def test_deferred_items_still_count_for_the_fit() -> None:
    opts = replace(OPTS, deferred=frozenset(DECODE_ONLY_REGIONS))
    with pytest.raises(PlanError) as e:
        plan_startup(48 * MiB, COSTS, opts)
    assert "verifier (deferred)" in e.value.table


def test_fixed_expert_cache_and_prefill() -> None:
    plan = plan_startup(256 * MiB, COSTS, replace(OPTS, expert_cache=20, prefill=768))
    assert plan.n_cache_slots == 20 and plan.prompt.chunk_tokens == 768
    loan = plan_loan(plan, 64 * MiB, COSTS, replace(OPTS, prefill=768))
    assert replace(loan, reasons=()) == replace(plan.prompt, reasons=())
    assert loan.reasons[-1] == "fixed --prefill: the loan keeps it"
    capped = plan_startup(1024 * MiB, COSTS, replace(OPTS, expert_cache=1000))
    assert capped.n_cache_slots == 64
    with pytest.raises(PlanError, match="--expert-cache 60 needs 31 segments, 24 are left"):
        plan_startup(256 * MiB, COSTS, replace(OPTS, expert_cache=60))
    with pytest.raises(PlanError, match="prompt path needs") as e:
        plan_startup(256 * MiB, COSTS, replace(OPTS, prefill=16384))
    assert "chunk (16,384 tokens)" in e.value.table
    # a cache sized by hand leaves too little: the message counts whole segments against what
    # the cache left (not the whole device), and names --expert-cache
    with pytest.raises(PlanError) as e:
        plan_startup(256 * MiB, COSTS, replace(OPTS, expert_cache=23, prefill=4096, borrow=False))
    need, left = (float(x) for x in re.findall(r"([\d.]+) MiB", str(e.value))[:2])
    assert need > left and "lower --expert-cache" in str(e.value) and "segments of" in str(e.value)


def test_prefill_zero_has_no_prompt_path() -> None:
    plan = plan_startup(256 * MiB, COSTS, replace(OPTS, prefill=0))
    assert plan.prompt.chunk_tokens == 0 and plan.n_cache_slots == 47
    assert "no prompt chunking" in format_plan_table(plan)


def test_options_and_costs_are_validated() -> None:
    with pytest.raises(FlagError) as e:
        PlanOptions(prefill=-1, expert_cache="most", max_lent_share=1.5)
    assert len(e.value.violations) == 3
    with pytest.raises(ModelError, match="n_expert_used=9 > n_expert=8"):
        replace(COSTS, n_expert=8, n_expert_used=9)


def test_scaled_kept_slots() -> None:
    assert COSTS.min_kept_slots() == 8  # 4 layers x top-2
    assert replace(COSTS, n_layer=48, n_expert=512, n_expert_used=10).min_kept_slots() == 128


costs_st = st.builds(
    ModelCosts,
    dense_bytes=st.integers(0, 64 * MiB),
    kv_bytes=st.integers(0, 64 * MiB),
    expert_blob_bytes=st.integers(64 * KiB, 6 * MiB),
    n_layer=st.integers(1, 48),
    n_expert=st.integers(4, 128),
    n_expert_used=st.integers(1, 4),
    act_bytes_per_token=st.integers(1 * KiB, 256 * KiB),
    act_bytes_fixed=st.integers(0, 8 * MiB),
    verifier_bytes=st.integers(0, 16 * MiB),
    head_bytes=st.integers(0, 16 * MiB),
    mtp_expert_bytes=st.integers(0, 16 * MiB),
    draft_head_bytes=st.integers(0, 8 * MiB),
)
opts_st = st.builds(
    PlanOptions,
    expert_cache=st.one_of(st.just("auto"), st.integers(0, 300)),
    prefill=st.one_of(st.just("auto"), st.just("auto"), st.integers(1, 4096)),
    deferred=st.frozensets(st.sampled_from(DECODE_ONLY_REGIONS)),
    borrow=st.booleans(),
    reserve_bytes=st.integers(0, 16 * MiB),
    segment_bytes=st.sampled_from([2 * MiB, 8 * MiB, 32 * MiB]),
    max_lent_share=st.sampled_from([0.5, 0.9, 1.0]),
)


@settings(max_examples=300, deadline=None)
@given(capacity_mib=st.integers(16, 2048), costs=costs_st, opts=opts_st)
def test_startup_plan_properties(capacity_mib: int, costs: ModelCosts, opts: PlanOptions) -> None:
    try:
        plan = plan_startup(capacity_mib * MiB, costs, opts)
    except PlanError:
        assume(False)
        return
    names = {r.name for r in plan.regions}
    g, blob = plan.prompt, costs.expert_blob_bytes
    assert sum(r.n_segments for r in plan.regions) <= plan.n_segments
    assert plan.n_cache_slots <= costs.n_blobs
    if opts.prefill == "auto" and g.chunk_tokens:
        assert g.chunk_tokens % opts.grid_tokens == 0 and g.chunk_tokens <= opts.max_chunk_tokens
    elif opts.prefill != "auto":
        assert g.chunk_tokens == opts.prefill
    if g.chunk_tokens:
        ring_min = ring_slots_min(costs.n_expert, costs.n_expert_used)
        wanted = ring_slots_wanted(g.chunk_tokens, costs.n_expert, costs.n_expert_used)
        assert min(ring_min, wanted) <= g.ring_slots <= wanted
    if g.borrowed:  # owned and borrowed never both
        assert not names & {"prompt.chunk", "prompt.ring"}
        kept = costs.min_kept_slots()
        assert g.n_lent_slots <= plan.n_cache_slots - kept
        assert g.n_lent_slots <= math.floor(opts.max_lent_share * plan.n_cache_slots)
        assert g.n_lent_slots == math.ceil((g.chunk_bytes + g.ring_bytes) / blob)
    elif g.chunk_tokens:
        assert {"prompt.chunk", "prompt.ring"} <= names and g.n_lent_slots == 0
    assert plan.startup_prompt.chunk_tokens >= g.chunk_tokens
    if not plan.deferred:
        assert plan.startup_prompt == g
    assert reserve_plan(plan).free_bytes == plan.free_bytes


@settings(max_examples=200, deadline=None)
@given(
    costs=costs_st,
    n_cache=st.integers(0, 400),
    borrow=st.booleans(),
    budgets=st.lists(st.integers(0, 1024 * MiB), min_size=2, max_size=6),
)
def test_auto_chunk_is_monotone_in_lendable_bytes(
    costs: ModelCosts, n_cache: int, borrow: bool, budgets: list[int]
) -> None:
    opts = PlanOptions(segment_bytes=2 * MiB, borrow=borrow)
    chunks = []
    for lendable in sorted(budgets):
        try:
            chunks.append(plan_prompt(lendable, costs, opts, n_cache).chunk_tokens)
        except PlanError:
            assert not chunks, "a larger budget failed where a smaller one fitted"
            continue
    assert chunks == sorted(chunks)


@settings(max_examples=200, deadline=None)
@given(capacity_mib=st.integers(64, 2048), costs=costs_st, freed_mib=st.integers(0, 512))
def test_a_loan_never_shrinks_the_chunk(
    capacity_mib: int, costs: ModelCosts, freed_mib: int
) -> None:
    opts = PlanOptions(segment_bytes=2 * MiB)
    try:
        plan = plan_startup(capacity_mib * MiB, costs, opts)
    except PlanError:
        assume(False)
        return
    loan = plan_loan(plan, freed_mib * MiB, costs, opts)
    assert loan.chunk_tokens >= plan.prompt.chunk_tokens and loan.borrowed == plan.prompt.borrowed
    if loan.borrowed:  # new empty slots (freed bytes + the cache's last partial segment)
        grown = (freed_mib * MiB + 2 * MiB) // costs.expert_blob_bytes
        assert loan.n_lent_slots <= opts.lendable_slots(plan.n_cache_slots, costs) + grown


def test_shapes_name_the_quant_types_the_kernels_need(demo_path) -> None:  # type: ignore[no-untyped-def]
    """The CUDA warm-up compiles the kernels of these types before the first request."""
    from engine.gguf import names
    from engine.memory.costs import Shapes
    from engine.model.loader import load_model

    model = load_model(demo_path, build=False)
    qtypes = Shapes.of(model).qtypes
    assert {q for lay in model.experts.layouts for q in lay.qtypes} <= set(qtypes)
    assert model.mf.tensor(names.TOKEN_EMBD).qtype in qtypes
    assert len(set(qtypes)) == len(qtypes)


# --- the nextn block's experts: all of them where they fit, else a partial region ------------

MTP_COSTS = replace(COSTS, mtp_expert_bytes=16 * 4 * MiB, mtp_blob_bytes=4 * MiB,
                    mtp_expert_slots=16)  # 64 MiB: 8 segments for all 16 nextn experts


def test_every_mtp_expert_stays_resident_where_they_fit() -> None:
    assert fit_mtp_experts(256 * MiB, MTP_COSTS, OPTS) == MTP_COSTS
    assert fit_mtp_experts(256 * MiB, COSTS, OPTS) == COSTS  # no --mtp: nothing to size


def test_a_tight_device_keeps_half_of_what_is_left_for_the_mtp_experts() -> None:
    # 24 segments; the others take 8 (dense 3, kv 1, reserve 1, verifier 1, head 2), the
    # smallest prompt path 5 (a 256-token chunk of 18 MiB = 3 segments beside a 4-slot ring of
    # 16 MiB = 2): 24 - 8 - 5 = 11 left, the full set's 8 fit
    assert fit_mtp_experts(192 * MiB, MTP_COSTS, OPTS) == MTP_COSTS
    # 18 segments: 18 - 8 - 5 = 5 left, the full set needs 8: half of 5 = 2 segments = 4 slots
    fitted = fit_mtp_experts(144 * MiB, MTP_COSTS, OPTS)
    assert fitted.mtp_expert_slots == 4 and fitted.mtp_expert_bytes == 16 * MiB
    plan = plan_startup(144 * MiB, fitted, OPTS)
    assert plan.region_bytes("mtp.experts") == 16 * MiB
    assert "mtp.experts holds 4 of the nextn block's 16 experts" in format_plan_table(plan)
    with pytest.raises(PlanError, match="the prompt path needs 40.0 MiB"):
        plan_startup(144 * MiB, MTP_COSTS, OPTS)  # all 16 of them leave 2 segments for it
    # nothing left: the floor is two draft tokens' experts (2 x top-2 = 4 slots)
    assert fit_mtp_experts(96 * MiB, MTP_COSTS, OPTS).mtp_expert_slots == 4


def test_mtp_expert_slots_as_asked() -> None:
    for asked, want in ((3, 3), (16, 16), (99, 16)):
        fitted = fit_mtp_experts(256 * MiB, MTP_COSTS, replace(OPTS, mtp_expert_slots=asked))
        assert fitted.mtp_expert_slots == want and fitted.mtp_expert_bytes == want * 4 * MiB
    with pytest.raises(FlagError, match="mtp-experts '0' must be auto or a count >= 1"):
        replace(OPTS, mtp_expert_slots=0)


def test_the_prompt_path_comes_before_the_cache_floor() -> None:
    """Owned, with too little left for the cache's floor and the smallest prompt path: the
    prompt path gets its segments and the cache what remains (none here), not a refusal."""
    costs = replace(COSTS, dense_bytes=20 * MiB + 18 * SEG)  # 21 mandatory segments of 32
    plan = plan_startup(256 * MiB, costs, replace(OPTS, borrow=False))
    g = plan.prompt
    assert g.chunk_tokens >= 256 and not g.borrowed
    assert plan.n_cache_slots < costs.min_kept_slots() == 8
    assert "the cache's floor of 8 slots does not fit beside the prompt path" in format_plan_table(plan)
    assert reserve_plan(plan).free_bytes == plan.free_bytes
