"""CPU-side checks of the CUDA prompt path's host logic: MoE grouping, arena accounting,
the two-layer ring, the GPU chunk's fixed bytes, expert pieces and piecewise uploads."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from engine_helpers import prefill_request

from engine.backend import SimBackend
from engine.config import EngineOptions
from engine.kernels.moe import ROW_ALIGN, _groups
from engine.memory.compute_arena import ArenaStats
from engine.memory.costs import Shapes, gpu_chunk_fixed_bytes, model_costs
from engine.memory.planner import PlanOptions, plan_startup
from engine.memory.sizes import MiB
from engine.synth.model import PRESETS
from tests.test_planner import COSTS, OPTS


def test_groups_cap_padding_under_skewed_routing() -> None:
    n_per = [6000, 900, 800, 700, 50, 40, 30, 20, 10, 5]  # rows per used expert
    by_count = sorted(range(len(n_per)), key=lambda i: -n_per[i])
    groups = _groups(by_count, n_per, group=4, row_cap=4000)
    assert [u for g in groups for u in g] == by_count  # every expert once, in order
    assert groups[0] == [0]  # the busiest expert alone: nothing padded to 6,000 rows
    for g in groups:
        assert len(g) <= 4
        assert len(g) == 1 or len(g) * n_per[g[0]] <= 4000
    padded = sum(len(g) * n_per[g[0]] for g in groups)
    assert padded < 2 * sum(n_per)  # the old fixed groups of 4 padded to 24,000 + ...


def test_groups_of_even_routing_fill_up() -> None:
    n_per = [64] * 10
    assert [len(g) for g in _groups(list(range(10)), n_per, group=4, row_cap=320)] == [4, 4, 2]


def test_arena_stats_merge_over_chunks() -> None:
    a = ArenaStats(100 * MiB, 60 * MiB, 0)
    b = ArenaStats(80 * MiB, 70 * MiB, 3 * MiB)
    m = b.merge(a)
    assert (m.n_bytes, m.peak_bytes, m.spilled_bytes) == (100 * MiB, 70 * MiB, 3 * MiB)
    assert a.merge(None) == a
    assert "peak 70 MiB of the 100 MiB chunk buffer, spilled 3 MiB" in m.line()


def test_no_arena_on_the_simulated_device() -> None:
    assert SimBackend(1 * MiB).chunk_arena(np.zeros(16, dtype=np.uint8)) is None


def test_a_two_layer_ring_takes_what_is_left() -> None:
    one = plan_startup(256 * MiB, COSTS, OPTS).prompt
    two = plan_startup(256 * MiB, COSTS, replace(OPTS, ring_layers=2)).prompt
    assert two.chunk_tokens == one.chunk_tokens  # chunk first: the ring only gets the rest
    assert two.ring_slots >= one.ring_slots
    assert any("2 layers'" in r for r in two.reasons)
    with pytest.raises(Exception, match="ring_layers"):
        PlanOptions(ring_layers=0)


def test_gpu_fixed_chunk_bytes_scale_with_the_model() -> None:
    qwen = _shapes("qwen3-30b-a3b")
    fixed = gpu_chunk_fixed_bytes(qwen, 32768, kv_kind="int8")
    kv_read = 2 * 32768 * qwen.hp.kv_dim * 6  # int8 K and V: float32 + an fp16 copy
    q4 = gpu_chunk_fixed_bytes(qwen, 32768, kv_kind="q4_0")
    assert fixed - q4 == 2 * 32768 * qwen.hp.kv_dim * 4  # q4_0: decoded straight to fp16
    assert q4 - gpu_chunk_fixed_bytes(qwen, 32768) == 2 * 32768 * qwen.hp.kv_dim * 2  # f16: in place
    aligned = qwen.hp.n_expert * (ROW_ALIGN - 1) * 2 * qwen.hp.n_embd  # MoE rows rounded up
    # expert scratch; the flash kernel keeps no scores
    assert fixed == 256 * MiB + aligned + kv_read
    decoded = 2 * qwen.hp.q_dim * qwen.hp.n_embd  # --dense quant: the largest weight in fp16
    assert gpu_chunk_fixed_bytes(qwen, 32768, quant=True, kv_kind="int8") == fixed + decoded
    odd = replace(qwen, hp=replace(qwen.hp, head_dim=72))  # no flash kernel: a score block
    assert gpu_chunk_fixed_bytes(odd, 32768, kv_kind="int8") == (512 * MiB + aligned
                                                                 + 2 * 32768 * odd.hp.kv_dim * 6)
    tiny = _shapes("tiny")
    assert gpu_chunk_fixed_bytes(tiny, 2048) < 64 * MiB  # a tiny model asks for little
    gpu = model_costs(tiny, EngineOptions(ctx=2048), 2, gpu=True)
    cpu = model_costs(tiny, EngineOptions(ctx=2048), 4)
    assert gpu.act_bytes_fixed - cpu.act_bytes_fixed == gpu_chunk_fixed_bytes(tiny, 2048, kv_kind="f16")


def _shapes(preset: str) -> Shapes:
    return Shapes.of_spec(PRESETS[preset])


def test_pieces_concatenate_to_the_blob(tiny_path) -> None:  # type: ignore[no-untyped-def]
    from engine.model.loader import load_model

    host = load_model(tiny_path, build=False).experts
    for layer, expert in [(0, 0), (host.n_layer - 1, host.n_expert - 1)]:
        pieces = host.pieces(layer, expert)
        assert len(pieces) == 3 and all(p.base is not None for p in pieces)  # file views
        assert np.array_equal(np.concatenate(pieces), host.blob(layer, expert))


def test_a_list_upload_is_one_counted_copy() -> None:
    backend = SimBackend(1 * MiB)
    out = np.zeros(10, dtype=np.uint8)
    backend.upload([np.arange(4, dtype=np.uint8), np.arange(6, dtype=np.uint8)], out)
    assert out.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert (backend.stats.h2d_copies, backend.stats.h2d_bytes) == (1, 10)


def test_prefill_flops_by_hand() -> None:
    from engine.memory.costs import prefill_flops

    s = _shapes("qwen3-30b-a3b")
    hp = s.hp
    one = prefill_flops(s, 1)  # one token sees one key
    per_layer = (2 * hp.n_embd * (hp.q_dim + 2 * hp.kv_dim) + 2 * hp.q_dim * hp.n_embd
                 + 2 * hp.n_embd * hp.n_expert + 6 * hp.n_expert_used * hp.n_embd * hp.n_ff_exp
                 + 4 * hp.n_head * hp.head_dim)
    assert one == hp.n_layer * per_layer
    # two chunks cost what one pass does (the second chunk's queries see the first's keys)
    assert prefill_flops(s, 1000) + prefill_flops(s, 500, pos0=1000) == prefill_flops(s, 1500)


def test_a_group_never_evicts_its_own_members() -> None:
    from engine.experts.host import ArrayHostExperts
    from engine.memory.ring import StagingRing

    rng = np.random.default_rng(3)
    host = ArrayHostExperts(rng.integers(0, 256, (1, 8, 16), dtype=np.uint8))
    backend = SimBackend(1 * MiB)
    ring = StagingRing(backend, np.zeros((4, 16), dtype=np.uint8))
    for e in range(4):  # a, b, c, d fill the ring; the next slot to take is slot 0 (a's)
        ring.stage(0, e, host.pieces)
    views = ring.stage_group(0, [0, 4, 5, 6], host.pieces)  # a is a hit, then three uploads
    for e, view in zip([0, 4, 5, 6], views):
        assert np.array_equal(view, host.blob(0, e)), e  # a's slot was skipped, not reused
    assert (ring.n_uploads, ring.n_reused) == (7, 1)


class _MarkingBackend(SimBackend):
    """The sim backend plus CUDA's ordering surface: `mark()` events and batched uploads
    (`upload_many(jobs, after=)`), recording what each batch was ordered after (None: all
    compute queued) and how many copies it held."""

    def __init__(self) -> None:
        super().__init__(1 * MiB)
        self.marks = 0
        self.after: list[object] = []
        self.batches: list[int] = []

    def mark(self) -> object:
        self.marks += 1
        return f"mark{self.marks}"

    def upload_many(self, jobs, *, after=None) -> object:  # type: ignore[no-untyped-def]
        self.after.append(after)
        self.batches.append(len(jobs))
        for host, out in jobs:
            super().upload(host, out)
        return f"copies{len(self.batches)}"

    def wait(self, event: object) -> None:
        pass


def test_an_upload_into_a_released_slot_waits_only_for_its_readers() -> None:
    from engine.experts.host import ArrayHostExperts
    from engine.memory.ring import StagingRing

    host = ArrayHostExperts(np.random.default_rng(5).integers(0, 256, (2, 8, 16), dtype=np.uint8))
    backend = _MarkingBackend()
    ring = StagingRing(backend, np.zeros((3, 16), dtype=np.uint8))
    ring.stage_group(0, [0, 1], host.pieces)  # fresh slots 0, 1: after all compute, one batch
    ring.release(0, [0, 1, 7])  # 7 is not in the ring: ignored; one mark for the group
    ring.stage(0, 0, host.pieces)  # a hit re-reads slot 0: its release no longer holds
    views = ring.stage_group(1, [2, 3], host.pieces)  # slot 2 (never read), slot 0 (re-read)
    assert backend.after == [None, None] and backend.batches == [2, 2]
    assert np.array_equal(views[0], host.blob(1, 2)) and np.array_equal(views[1], host.blob(1, 3))
    ring.release(1, [2, 3])
    ring.stage_group(1, [4, 5], host.pieces, wait=False)  # slots 1 (mark1) and 2 (mark2)
    assert backend.after[-1] == ["mark1", "mark2"] and backend.batches[-1] == 2
    ring.reset()  # forgets releases with the slots
    ring.stage(0, 4, host.pieces)
    assert backend.after[-1] is None and backend.marks == 2


def test_phase_clock_sums_laps_per_phase() -> None:
    from engine.trace.phases import PhaseClock

    clock = PhaseClock(SimBackend(1 * MiB))
    clock.lap("ignored")  # no mark yet: nothing to close
    clock.start()
    for _ in range(3):
        clock.lap("attention")
        clock.lap("moe")
    totals = clock.totals()
    assert set(totals) == {"attention", "moe"} and all(v >= 0 for v in totals.values())
    assert clock.line(1.0).startswith("prefill phases: attention ")


def test_kernel_laps_mark_the_active_clock_only() -> None:
    from engine.trace import phases

    clock = phases.PhaseClock(SimBackend(1 * MiB))
    clock.start()
    phases.lap("moe gemm")  # no active clock: nothing happens
    with phases.active(clock):
        phases.lap("moe route")
        phases.lap("moe gemm")
    phases.lap("moe gemm")
    assert list(clock.totals()) == ["moe route", "moe gemm"]


def test_trace_prints_the_prefill_phases(tiny_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from engine.runtime.serve import ServeLoop

    monkeypatch.setenv("STRATA_TRACE", "1")
    lines: list[str] = []
    loop = ServeLoop.create(EngineOptions(model=str(tiny_path), ctx=1024, prefill=128),
                            on_trace=lines.append)
    prefill_request(loop.rt, list(range(5, 400)))
    phase = [ln for ln in lines if ln.startswith("prefill phases:")]
    assert len(phase) == 1 and "attention" in phase[0] and "moe" in phase[0]
    # the clock went to the prompt path with the call: the model holds no run-state
    assert not {"phase_clock", "arena_stats", "token_graph", "on_warning"} & set(
        vars(loop.rt.model.transformer))


def test_row_plan_places_every_row_once_inside_its_group() -> None:
    from engine.kernels.moe import plan_rows

    n_per = [3, 9, 1, 4, 4, 2]  # rows per used expert, sorted rows 0..22 in this order
    plan = plan_rows(n_per, group=2)
    starts = np.concatenate([[0], np.cumsum(n_per)])
    assert [sorted(g) for g in plan.groups] == [[1], [3, 4], [0, 5], [2]]  # busiest first
    assert plan.m == [9, 4, 3, 1] and plan.base == [0, 9, 17, 23] and len(plan.source) == 24
    assert sorted(plan.padded.tolist()) == sorted(set(plan.padded.tolist()))  # no row twice
    for gi, members in enumerate(plan.groups):
        base, m = plan.base[gi], plan.m[gi]
        for i, u in enumerate(members):
            mine = np.arange(starts[u], starts[u + 1])
            # the padded rows of each sorted row are where the group's GEMM computes it
            assert plan.padded[mine].tolist() == (base + i * m + np.arange(n_per[u])).tolist()
            rows = plan.source[base + i * m : base + (i + 1) * m]
            assert rows[: n_per[u]].tolist() == mine.tolist()
            assert (rows[n_per[u] :] == sum(n_per)).all()  # padding


def test_row_plan_rounds_each_groups_rows_up() -> None:
    """Rows per member rounded to a multiple of `row_align` (cuBLAS meets few shapes); every
    row still lands once, in its member's rows, the rest padding."""
    from engine.kernels.moe import plan_rows

    n_per = [3, 9, 1, 4, 4, 2]
    plan = plan_rows(n_per, group=2, row_align=8)
    assert plan.m == [16, 8, 8, 8] and len(plan.source) == 16 + 16 + 16 + 8
    starts = np.concatenate([[0], np.cumsum(n_per)])
    for gi, members in enumerate(plan.groups):
        for i, u in enumerate(members):
            rows = plan.source[plan.base[gi] + i * plan.m[gi] : plan.base[gi] + (i + 1) * plan.m[gi]]
            assert rows[: n_per[u]].tolist() == list(range(starts[u], starts[u + 1]))
            assert (rows[n_per[u] :] == sum(n_per)).all()
    assert sorted(plan.padded.tolist()) == sorted(set(plan.padded.tolist()))


def test_row_plan_counts_only_staged_experts_against_the_ring() -> None:
    from engine.kernels.moe import plan_rows

    n_per = [5, 5, 5, 5, 5, 5]
    staged = [True, False, True, False, False, True]  # 0, 2, 5 need ring slots
    plan = plan_rows(n_per, group=4, staged=staged, max_staged=1)
    assert plan.groups == [[0, 1], [2, 3, 4], [5]]  # one staged expert a group
    # without `staged`: 3 a group (padded rows stay under half of all 30 rows)
    assert plan_rows(n_per, group=4).groups == [[0, 1, 2], [3, 4, 5]]


def test_the_kernel_warm_up_is_shown_and_a_slow_one_says_why(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The CUDA warm-up's progress reaches the app as `Loading` events; one that took longer
    than SLOW_KERNELS_S (a first run compiling with NVRTC) also prints a serve line."""
    from engine.startup import runtime
    from engine.trace.events import EventBus, Loading
    from engine.trace.report import Reporter

    def shown(seconds: float) -> tuple[list[Loading], list[str]]:
        bus, lines = EventBus(), []
        events: list[Loading] = []
        bus.subscribe(lambda e: events.append(e) if isinstance(e, Loading) else None)
        clock = iter([100.0, 100.0, 100.0 + seconds, 100.0 + seconds])
        monkeypatch.setattr(runtime.time, "perf_counter", lambda: next(clock))
        progress = runtime.kernel_progress(Reporter(bus, lines.append))
        for done in range(3):
            progress(done, 2)
        return events, lines

    events, lines = shown(9.5)
    assert [(e.stage, e.done, e.total) for e in events] == [
        ("loading CUDA kernels", i, 2) for i in range(3)]
    assert lines == [("strata serve: 2 CUDA kernel modules compiled in 9.5 s (NVRTC, once per "
                     "machine: CuPy's disk cache keeps them)")]
    assert shown(0.4)[1] == []  # loaded from CuPy's disk cache: nothing to say
