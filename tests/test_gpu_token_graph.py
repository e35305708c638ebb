"""The token graph on CUDA (gpu marker): its kernels against the eager references, and decode
steps replayed from captured graphs against eager decoding (--no-token-graph), with cache
misses read from the page-locked file, speculative windows and a loan in between."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import greedy_steps, host

from engine.config import EngineOptions, LoanFlags
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.synth.model import PRESETS, write_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mid_path(tmp_path_factory: pytest.TempPathFactory, cp) -> Path:  # type: ignore[no-untyped-def]
    """Qwen3-30B-A3B shapes, 2 blocks + MTP."""
    spec = replace(PRESETS["qwen3-30b-a3b"], n_layer=2, n_ctx=8192)
    return write_model(tmp_path_factory.mktemp("graph") / "mid.gguf", spec)


@pytest.mark.parametrize("kind", ["q4_0", "f16"])
def test_attention_and_kv_write_match_the_eager_path(cp, kind: str) -> None:  # type: ignore[no-untyped-def]
    from engine.backend.array_ops import causal_gqa
    from engine.backend.cuda import CudaBackend
    from engine.kernels.decode import attention_at, attention_workspace, kv_write_at
    from engine.kv import KVCache

    rng = np.random.default_rng(0)
    n_ctx, h, hkv, d, t, pos0 = 700, 32, 4, 128, 3, 517  # rows span a tile boundary (512)
    cuda = CudaBackend(0)
    kv = KVCache(cuda, 2, n_ctx, hkv, d, kind)
    ref = KVCache(cuda, 2, n_ctx, hkv, d, kind)
    past = cp.asarray(rng.standard_normal((2, pos0, hkv, d)), dtype=cp.float32)
    for c in (kv, ref):
        c.write(1, 0, past[0], past[1])
    k, v = (cp.asarray(rng.standard_normal((t, hkv, d)), dtype=cp.float32) for _ in range(2))
    q = cp.asarray(rng.standard_normal((t, h, d)), dtype=cp.float32)
    pos = cp.asarray([pos0], dtype=cp.int32)
    kv_write_at(kv.cells(1), k, v, pos)
    ref.write(1, pos0, k, v)
    assert bool((kv.data == ref.data).all())
    ml, acc = (cp.empty(s, dtype=cp.float32) for s in attention_workspace(t, h, d, n_ctx))
    out = attention_at(q, kv.cells(1), pos, ml, acc)
    k_all, v_all = ref.read(1, pos0 + t)
    want = causal_gqa(cp, q, k_all, v_all, pos0)
    assert float(cp.abs(out - want).max()) < 1e-4 * float(cp.abs(want).max()) + 1e-5


def test_graph_steps_match_eager_steps_with_misses(mid_path: Path) -> None:
    """A cache of 40 of the 256 experts: most routed experts are read over PCIe in place."""
    base = EngineOptions(model=str(mid_path), device="cuda", ctx=4096, vram_limit="4GiB",
                         vram_segment_mib=64, expert_cache=40, kv="q4_0")
    graph = ServeLoop.create(base)
    eager = ServeLoop.create(replace(base, no_token_graph=True))
    tg = graph.rt.session.graph
    assert tg is not None and eager.rt.session.graph is None
    ids = graph.rt.model.tokenizer.encode("the river runs through the old city " * 30)
    ta, la = greedy_steps(graph, ids, 12)
    tb, lb = greedy_steps(eager, ids, 12)
    assert ta == tb
    assert float(np.abs(la - lb).max() / np.abs(lb).max()) < 1e-3
    assert tg.n_captures == 1 and tg.n_replays == 12
    line = tg.stats_line()
    assert line is not None and line.startswith("token graph: 1 row 12 x ") and line.endswith(" ms GPU")
    assert tg.stats_line() is None  # counted since the last line
    c = graph.rt.experts.counters
    k = graph.rt.model.hp.n_expert_used
    assert c.hits > 0 and c.streamed > 0  # both paths of the job table ran
    assert graph.rt.cache.n_hits + graph.rt.cache.n_misses >= 12 * 2 * k
    graph.rt.check_integrity()


def test_a_reply_counts_the_bytes_its_decode_misses_copy(mid_path: Path) -> None:
    """`Timing.decode_bytes` (bench's "Link / token" column): every decode miss copies its
    expert's blob over the link once, with and without the token graph."""
    base = EngineOptions(model=str(mid_path), device="cuda", ctx=4096, vram_limit="4GiB",
                         vram_segment_mib=64, expert_cache=40, kv="q4_0", cache_policy="static")
    for opts in (base, replace(base, no_token_graph=True)):
        loop = ServeLoop.create(opts)
        try:
            ids = loop.rt.model.tokenizer.encode("the river runs through the old city " * 30)
            t = loop.complete(ids, max_new=8).timing
            blob = loop.rt.experts.host.layer_blob_bytes
            assert len(set(blob)) == 1 and t.decode_misses > 0
            assert t.decode_bytes == t.decode_misses * blob[0], opts.no_token_graph
        finally:
            loop.close()


def test_a_deep_model_is_captured(tmp_path: Path, cp) -> None:  # type: ignore[no-untyped-def]
    """48 narrow layers of the 30B preset's types: the step's routes of every layer are
    gathered inside the capture without a host-to-device copy (`cupy.stack` of 48 arrays
    uploads one, and the 48-layer file's graph gave up for eager steps)."""
    spec = replace(PRESETS["qwen3-30b-a3b"], n_vocab=2048, n_embd=256, n_head=4, n_head_kv=2,
                   n_expert=16, n_expert_used=4, n_ff_exp=128, n_ctx=2048)
    path = write_model(tmp_path / "deep.gguf", spec)
    loop = ServeLoop.create(EngineOptions(model=str(path), device="cuda", ctx=512, kv="q4_0"))
    try:
        tg = loop.rt.session.graph
        assert tg is not None
        ids = loop.rt.model.tokenizer.encode("the river runs " * 8)
        greedy_steps(loop, ids, 6)
        assert loop.rt.report.warnings == [] and loop.rt.session.graph is tg
        assert tg.n_captures == 1 and tg.n_replays == 6
    finally:
        loop.close()


def test_promotions_under_the_graph_change_where_experts_are_read_not_what_they_compute(
    mid_path: Path,
) -> None:
    """--cache-policy adaptive (engine/experts/policy.py) with an eager rule (no margin, no
    seed): misses move into cache slots between replays; the graph reads the device table, so
    it is not captured again, and the tokens and logits are those of the static cache."""
    base = EngineOptions(model=str(mid_path), device="cuda", ctx=4096, vram_limit="4GiB",
                         vram_segment_mib=64, expert_cache=40, kv="q4_0")
    moving = ServeLoop.create(base)
    still = ServeLoop.create(replace(base, cache_policy="static"))
    adm = moving.rt.experts.admission
    assert adm is not None and still.rt.experts.admission is None
    adm.margin, adm.score[:] = 0.0, 0.0
    ids = moving.rt.model.tokenizer.encode("the river runs through the old city " * 30)
    ta, la = greedy_steps(moving, ids, 16)
    tb, lb = greedy_steps(still, ids, 16)
    assert ta == tb
    assert float(np.abs(la - lb).max() / np.abs(lb).max()) < 1e-3
    cache = moving.rt.cache
    assert moving.rt.experts.counters.promoted > 0 and cache.n_promoted > 0
    assert moving.rt.session.graph.n_captures == 1
    assert cache.staged and np.array_equal(host(cache.table_view()), cache.table.slot_of)
    for slot in range(cache.n_slots):  # every slot holds the bytes of the expert it names
        owner = cache.table.owner(slot)
        if owner is not None:
            assert np.array_equal(host(cache.slot_view(slot)), cache.host.blob(*owner))
    moving.rt.check_integrity()


def test_speculative_decoding_and_a_loan_replay_graphs(mid_path: Path) -> None:
    """MTP drafts + 3-token windows: the same text as eager decoding, also after a repeat loan
    released and restored the output head (the graphs are captured again)."""
    loan = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                          retain_startup_chunk=True, repeat_loan=True, repeat_min_tokens=256)
    base = EngineOptions(model=str(mid_path), device="cuda", ctx=4096, serve=True,
                         vram_elastic=True, mtp=True, spec=2, vram_limit="4GiB",
                         vram_segment_mib=64, kv="q4_0")
    texts = []
    for opts in (base, replace(base, no_token_graph=True)):
        loop = ServeLoop.create(opts, loan)
        conv = Conversation()
        a = loop.chat(conv, "hello", max_new=12).text
        b = loop.chat(conv, "the river runs through the old city " * 80, max_new=12).text
        texts.append((a, b))
        loop.rt.check_integrity()
        tg = loop.rt.session.graph
        if not opts.no_token_graph:  # the graph held: it never gave up for eager steps
            assert loop.rt.report.warnings == []
            assert tg is not None and tg.n_captures >= 2 and tg.n_replays > 0
    assert texts[0] == texts[1]


def test_no_token_graph_toggles_at_runtime(mid_path: Path) -> None:
    """--no-token-graph from the app's flag panel takes effect from the next request."""
    opts = EngineOptions(model=str(mid_path), device="cuda", ctx=2048, vram_limit="4GiB",
                         vram_segment_mib=64, kv="q4_0")
    loop = ServeLoop.create(opts)
    session = loop.rt.session
    assert session.graph is not None and loop.rt.summary().endswith(", token graph")
    ids = loop.rt.model.tokenizer.encode("the river runs through the old city " * 10)
    a = loop.complete(list(ids), max_new=6).text
    assert loop.set_flags(loop.rt.flags, replace(opts, no_token_graph=True)) == []
    b = loop.complete(list(ids), max_new=6).text
    assert session.graph is None and a == b
    assert loop.set_flags(loop.rt.flags, opts) == []
    c = loop.complete(list(ids), max_new=6).text
    assert session.graph is not None and session.graph.n_replays > 0 and c == a


def test_step_profile_times_every_part_and_leaves_the_session_intact(mid_path: Path) -> None:
    from engine.tools.graph_profile import profile_step

    opts = EngineOptions(model=str(mid_path), device="cuda", ctx=2048, vram_limit="4GiB",
                         vram_segment_mib=64, kv="q4_0")
    loop = ServeLoop.create(opts)
    ids = loop.rt.model.tokenizer.encode("the river runs through the old city " * 10)
    a = loop.complete(list(ids), max_new=6).text
    tg = loop.rt.session.graph
    n_tokens, counts = tg.kv.n_tokens, tg.counts.get()
    rows = dict(profile_step(tg, list(ids[-1:]), pos=1500, repeat=3))
    assert all(ms > 0 for ms in rows.values()) and "whole step (replay)" in rows
    assert rows["sum of the parts"] == pytest.approx(sum(
        ms for k, ms in rows.items() if k not in ("sum of the parts", "whole step (replay)")))
    assert tg.kv.n_tokens == n_tokens and (tg.counts.get() == counts).all()
    assert loop.complete(list(ids), max_new=6).text == a
