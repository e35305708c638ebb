"""The loan forecast (engine.loan.forecast): its pure parts by hand, its fit on synthetic devices,
the rates file, and on the demo model that it plans what the request then runs, learns from
every request and decides the automatic repeat loan as the runtime then acts."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineOptions, LoanFlags
from engine.errors import FlagError
from engine.experts.profile import ExpertProfile
from engine.loan.forecast import (
    AUTO_MARGIN,
    DEFAULTS,
    FEATURES,
    KEEP_PER_BUCKET,
    PARTS,
    Forecast,
    LoanVerdict,
    Observation,
    Rates,
    RatesError,
    Workload,
    coefs,
    expected_streamed,
    load_rates,
    pays,
    rates_path,
    routing_odds,
    save_rates,
    seconds_text,
    workload,
)
from engine.loan.geometry import REPLANNED, RETAINED, loan_geometry
from engine.loan.transaction import admission
from engine.memory.costs import Shapes, attention_flops, moe_flops, prefill_flops
from engine.memory.plan_types import PromptGeometry
from engine.request.conversation import Conversation, Message
from engine.request.record import reused_tokens
from engine.runtime.serve import ServeLoop
from engine.speculative.draft import MTPDraft
from engine.synth.model import PRESETS
from engine.tools.bench import LOAN_ON, prompt_tokens
from engine.trace.events import EventBus, LoanStep, PlanChosen, RequestDone

OPTS = {"serve": True, "vram_elastic": True, "mtp": True, "spec": 4, "prefill": "auto",
        "ctx": 4096}
FLAGS = LOAN_ON.with_changes(repeat_min_tokens=256)


# -- pure parts --------------------------------------------------------------------------------


def test_routing_odds_follow_the_fill_order_and_sum_to_k() -> None:
    counts = np.array([[4, 2, 3, 1], [1, 5, 2, 2]])  # [L=2, E=4]
    profile = ExpertProfile.from_counts(counts, n_tokens=6)
    odds = routing_odds(profile, 2, 4, 2)
    order = profile.order()
    pseudo = (counts + 1) / (counts + 1).sum(axis=1, keepdims=True) * 2  # one pseudo-count
    assert odds == pytest.approx([pseudo[layer, e] for layer, e in order])
    assert odds.sum() == pytest.approx(2 * 2)  # k per layer
    assert routing_odds(None, 3, 8, 2) == pytest.approx(np.full(24, 2 / 8))  # uniform
    skewed = ExpertProfile.from_counts(np.array([[99, 0, 0, 0]]))
    assert routing_odds(skewed, 1, 4, 2).max() == 1.0  # a chance, never more than every token


def test_expected_streaming_counts_the_missing_experts_each_chunk_uses() -> None:
    odds = np.full(10, 0.5)
    assert expected_streamed(odds, 10, 4, 100, 2) == 0  # everything resident
    one = 1 - 0.5**4  # a 4-token chunk uses a missing expert with this chance
    assert expected_streamed(odds, 6, 4, 8, 2) == pytest.approx(4 * one * 2)  # 2 full chunks
    assert expected_streamed(odds, 6, 4, 9, 2) == pytest.approx(4 * (2 * one + 0.5))  # + 1 token
    # a ring holding every missing expert keeps them across chunks: each uploaded once
    assert expected_streamed(odds, 6, 4, 9, 4) == pytest.approx(4 * (1 - 0.5**9))


def _shapes() -> Shapes:
    return Shapes.of_spec(PRESETS["random-demo"])


def test_a_workload_counts_chunks_flops_and_the_slots_it_lends() -> None:
    shapes = _shapes()
    hp = shapes.hp
    g = PromptGeometry(256, 8, 20, 1 << 20, 8 * shapes.blob_bytes, True)
    odds = routing_odds(None, hp.n_layer, hp.n_expert, hp.n_expert_used)
    w = workload("repeat", 1000, 24, g, shapes, n_cache_slots=100, n_lendable_slots=12,
                 odds=odds, released_bytes=5, restored_bytes=7)
    assert (w.n_chunks, w.layer_chunks) == (4, 4 * hp.n_layer)
    assert w.attn_flops == attention_flops(shapes, 1000, 24)
    assert w.moe_flops == moe_flops(shapes, 1000)
    assert w.attn_flops + w.moe_flops == prefill_flops(shapes, 1000, 24)
    # 20 slots lent, 12 of them held experts (the rest a loan grew empty): 88 stay resident
    assert w.refill_bytes == 12 * shapes.blob_bytes
    expected = expected_streamed(odds, 88, 256, 1000, 8)
    assert w.streamed_bytes == pytest.approx(expected * shapes.blob_bytes)
    assert (w.released_bytes, w.restored_bytes) == (5, 7)
    assert w.features("release").tolist() == [5, 1] and w.features("rest")[-1] == 1
    owned = replace(g, borrowed=False)
    assert workload(None, 1000, 0, owned, shapes, 100, 12, odds).refill_bytes == 0


def _truth(w: Workload, c: dict[str, np.ndarray]) -> dict[str, float]:
    return {p: float(w.features(p) @ c[p]) for p in PARTS}


def _shot(chunk: int, n: int, c: dict[str, np.ndarray], kind: str | None = None,
          noise: float = 0.0) -> Observation:
    """A request on a synthetic device whose parts are exactly linear in `c`."""
    shapes = _shapes()
    hp = shapes.hp
    g = PromptGeometry(chunk, 16, 40, 1 << 20, 16 * shapes.blob_bytes, True)
    odds = routing_odds(None, hp.n_layer, hp.n_expert, hp.n_expert_used)
    loan = 8 << 20 if kind else 0
    w = workload(kind, n, 0, g, shapes, 96, 60, odds, loan if kind == "repeat" else 0, loan)
    seconds = {p: v * (1 + noise) for p, v in _truth(w, c).items()}
    return Observation(w, seconds, sum(seconds.values()))


DEVICE = coefs(attention=(1 / 30e9, 1e-3), moe=(1 / 60e9, 2e-3, 1 / 90e6),
               rest=(3e-3, 1 / 4e9, 8e-3), release=(1 / 30e9, 1e-3), restore=(1 / 1e9, 4e-3))


def test_the_fit_recovers_a_device_from_its_requests() -> None:
    """Requests of several geometries on a device unlike the defaults: the forecast of an
    unseen one (another size, a loan) is within 2%, and the rates come back."""
    rates = Rates.fresh("sim test")
    for chunk, n, kind in [(256, 2048, None), (1280, 2048, "repeat"), (256, 4096, None),
                           (1280, 4096, "repeat"), (512, 3000, None), (1280, 300, "startup")]:
        rates = rates.observe(_shot(chunk, n, DEVICE, kind))
    target = _shot(1024, 6000, DEVICE, "repeat")
    f = rates.forecast(target.workload)
    assert f.total_s == pytest.approx(target.prefill_s, rel=0.02)
    assert f.n_observations == 6
    c = rates.fit(target.workload)
    assert c["moe"][2] == pytest.approx(DEVICE["moe"][2], rel=0.1)  # streaming s/byte
    streaming = rates.summary(c).split("expert streaming ")[1].split(" GB/s")[0]
    assert float(streaming) == pytest.approx(0.09, rel=0.1)


def test_streaming_follows_what_requests_streamed_against_their_expectation() -> None:
    """Prompts that stream 60% of what the profile's routing odds say (other text routes
    elsewhere): after two such requests a forecast expects 60% too, and its time follows."""
    rates = Rates.fresh("sim test")
    for chunk, n in [(256, 2048), (512, 4096)]:
        shot = _shot(chunk, n, DEVICE)
        w = shot.workload
        actual = replace(w, streamed_bytes=0.6 * w.streamed_bytes)
        seconds = _truth(actual, DEVICE)
        rates = rates.observe(Observation(actual, seconds, sum(seconds.values()),
                                          expected_bytes=w.streamed_bytes))
    target = _shot(512, 3000, DEVICE).workload
    f = rates.forecast(target)
    assert f.workload.streamed_bytes == pytest.approx(0.6 * target.streamed_bytes, rel=1e-6)
    truth = sum(_truth(replace(target, streamed_bytes=0.6 * target.streamed_bytes),
                       DEVICE).values())
    assert f.total_s == pytest.approx(truth, rel=0.05)
    assert Rates.fresh("sim y").streaming_factor(target) == 1.0


def test_with_no_request_the_forecast_is_the_defaults() -> None:
    rates = Rates.fresh("sim x")
    w = _shot(256, 2048, DEVICE).workload
    f = rates.forecast(w)
    truth = _truth(w, DEFAULTS["sim"])
    assert f.total_s == pytest.approx(sum(truth.values()))
    assert f.n_observations == 0 and Rates.fresh("cuda NVIDIA H200").defaults is DEFAULTS["cuda"]


def test_the_fit_leans_on_requests_of_the_same_geometry() -> None:
    """Two chunk sizes whose attention runs at different rates (as the CPU's does): each
    size's forecast follows its own requests, not the average."""
    slow = {**DEVICE, "attention": DEVICE["attention"] * np.array([1.3, 1.0])}
    rates = Rates.fresh("sim test")
    for n in (2048, 4096, 8192):
        rates = rates.observe(_shot(256, n, DEVICE))
        rates = rates.observe(_shot(1280, n, slow, "repeat"))
    for chunk, c, kind in ((256, DEVICE, None), (1280, slow, "repeat")):
        target = _shot(chunk, 6000, c, kind)
        assert rates.forecast(target.workload).total_s == pytest.approx(target.prefill_s,
                                                                         rel=0.05)


def test_observations_are_kept_per_geometry_bucket() -> None:
    """Many short messages do not push out what the long ones measured."""
    rates = Rates.fresh("sim test").observe(_shot(1280, 4096, DEVICE, "repeat"))
    for i in range(3 * KEEP_PER_BUCKET):
        rates = rates.observe(_shot(32, 32, DEVICE, noise=i / 100))
    kept = [o.workload.n_fresh for o in rates.observations]
    assert kept.count(32) == KEEP_PER_BUCKET and 4096 in kept
    newest = [o.seconds["attention"] for o in rates.observations if o.workload.n_fresh == 32]
    assert newest == sorted(newest) and newest[-1] == max(newest)  # the newest are kept


def test_rates_files_round_trip_and_keep_other_devices(tmp_path: Path) -> None:
    path = tmp_path / "m.rates.json"
    assert load_rates(path, "sim a").observations == ()  # no file yet: fresh
    a = Rates.fresh("sim a").observe(_shot(256, 2048, DEVICE))
    b = Rates.fresh("cuda b").observe(_shot(1280, 4096, DEVICE, "repeat"))
    save_rates(path, a)
    save_rates(path, b)
    assert load_rates(path, "sim a").observations == a.observations
    assert load_rates(path, "cuda b").observations == b.observations
    assert [p.name for p in tmp_path.iterdir()] == ["m.rates.json"]  # no temporary left
    path.write_text(json.dumps({"format": "strata-prefill-rates", "version": 99}))
    with pytest.raises(RatesError, match=r"m\.rates\.json is not a strata-prefill-rates file"):
        load_rates(path, "sim a")
    path.write_text("{not json")
    with pytest.raises(RatesError) as e:
        load_rates(path, "sim a")
    assert "\n" not in str(e.value) and "delete it" in str(e.value)


def test_the_rates_live_beside_an_explicit_profile_or_in_the_cache(tmp_path: Path) -> None:
    assert rates_path(tmp_path / "m.gguf", str(tmp_path / "p.json"), tmp_path / "c") == \
        tmp_path / "p.rates.json"
    cached = rates_path(tmp_path / "m.gguf", None, tmp_path / "c")
    assert cached.parent == tmp_path / "c" / "profiles" and cached.name.startswith("m-")
    assert cached == rates_path(tmp_path / "m.gguf", None, tmp_path / "c")  # stable


def _forecast(total: float, kind: str | None) -> Forecast:
    w = replace(_shot(256, 2048, DEVICE).workload, kind=kind)
    return Forecast(w, {"attention": total}, {})


def test_the_verdict_says_what_the_loan_buys() -> None:
    off, on = _forecast(5.0, None), _forecast(3.9, "repeat")
    v = LoanVerdict(5000, 4800, "repeat", "4,800 fresh >= 1,024", off, on, True)
    assert v.line() == "repeat loan: 5.0 s -> 3.9 s" and v.chosen is on
    no = LoanVerdict(400, 300, None, "300 fresh < 1,024", _forecast(0.6, None), on)
    assert no.line() == "no loan (300 fresh < 1,024): 600 ms" and no.chosen.total_s == 0.6
    assert [seconds_text(s) for s in (12.3, 4.25, 0.3204, 0.0045)] == \
        ["12 s", "4.2 s", "320 ms", "4.5 ms"]
    # the automatic decision wants the gain to beat the forecast's own error
    assert pays(_forecast(1.0, None), _forecast(0.8, "repeat"))
    assert not pays(_forecast(1.0, None), _forecast(1.0 / (1 + AUTO_MARGIN) + 1e-3, "repeat"))


def test_admission_says_why() -> None:
    assert admission(LoanFlags(), False, 5000) == (None, "loan flags off")
    on = LOAN_ON.with_changes(repeat_min_tokens=1024)
    assert admission(on, True, 10)[0] == "startup"
    assert admission(on, False, 1024) == ("repeat", "1,024 fresh >= 1,024")
    assert admission(on, False, 300) == (None, "300 fresh < 1,024")
    assert admission(on.with_changes(repeat_loan=False), False, 5000) == (None, "repeat loan off")
    auto = on.with_changes(repeat_auto=True)
    assert admission(auto, False, 300, pays=True)[0] == "repeat"  # below the threshold
    assert admission(auto, False, 5000, pays=False) == \
        (None, "auto: the forecast says the loan does not pay")
    assert admission(auto, False, 200, pays=True) == (None, "auto: 200 fresh < 256 (the floor)")
    assert admission(auto, False, 300, pays=None)[0] is None  # no forecast: the threshold


def test_the_threshold_takes_auto() -> None:
    flags = LoanFlags.from_env({"STRATA_PREFILL_REPEAT_MIN_TOKENS": " Auto "})
    assert flags.repeat_auto and flags.repeat_min_tokens == 1024
    assert flags.as_env()["STRATA_PREFILL_REPEAT_MIN_TOKENS"] == "auto"
    assert LoanFlags.from_env(flags.as_env()) == flags  # the variables round-trip
    with pytest.raises(FlagError, match="is not an integer; .* or auto"):
        LoanFlags.from_env({"STRATA_PREFILL_REPEAT_MIN_TOKENS": "sometimes"})


def test_every_part_has_a_positive_default() -> None:
    for kind in ("sim", "cuda"):
        assert set(DEFAULTS[kind]) == set(PARTS)
        for p in PARTS:
            assert DEFAULTS[kind][p].shape == (len(FEATURES[p]),) and (DEFAULTS[kind][p] > 0).all()


# -- on the demo -------------------------------------------------------------------------------


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of this test's own: its rates start empty (the demo's profile ships
    beside the model)."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    return tmp_path


def make(demo_path: Path, flags: LoanFlags = FLAGS, bus: EventBus | None = None,
         **options: object) -> ServeLoop:
    return ServeLoop.create(EngineOptions(model=str(demo_path), **{**OPTS, **options}),  # type: ignore[arg-type]
                            flags, bus)


def test_the_forecast_plans_what_the_request_runs(demo_path: Path, fresh_cache: Path) -> None:
    """Startup loan, no loan, repeat loan (the retained startup geometry), and a repeat loan
    that re-plans (retain off): the verdict made before each request names the loan the
    runtime takes and the prompt plan it runs."""
    bus = EventBus()
    plans: list[PlanChosen] = []
    bus.subscribe(lambda e: plans.append(e) if isinstance(e, PlanChosen) else None)
    loop = make(demo_path, bus=bus)
    for i, (n, flags) in enumerate([(600, FLAGS), (700, LoanFlags()), (900, FLAGS),
                                    (800, FLAGS.with_changes(retain_startup_chunk=False)),
                                    (100, FLAGS)]):
        assert not loop.set_flags(flags)
        reply = loop.complete(prompt_tokens(loop, n, salt=i), max_new=2)
        v, p = reply.verdict, plans[-1]
        assert v is not None
        w = v.chosen.workload
        assert (w.kind is not None, w.chunk_tokens, w.ring_slots) == (p.loan, p.chunk_tokens,
                                                                      p.ring_slots), i
        assert v.kind == ("startup", None, "repeat", "repeat", None)[i]
        assert w.n_chunks == p.n_chunks and w.n_fresh == p.fresh_tokens
        assert reply.timing.forecast_s == pytest.approx(v.chosen.total_s)


def test_every_request_is_measured_kept_and_saved(demo_path: Path, fresh_cache: Path) -> None:
    bus = EventBus()
    done: list[RequestDone] = []
    bus.subscribe(lambda e: done.append(e) if isinstance(e, RequestDone) else None)
    loop = make(demo_path, bus=bus)
    assert loop.rates.observations == () and loop.rates.device.startswith("sim ")
    loop.complete(prompt_tokens(loop, 600, salt=1), max_new=2)  # the startup loan
    assert loop.rates.observations == () and loop.learner.last_observation is None  # once-only costs
    assert not loop.set_flags(LoanFlags())
    loop.complete(prompt_tokens(loop, 500, salt=3), max_new=2)  # no loan
    assert not loop.set_flags(FLAGS)
    loop.complete(prompt_tokens(loop, 700, salt=2), max_new=2)  # a repeat loan
    first, second = loop.rates.observations
    assert loop.learner.last_observation is second and second.workload.kind == "repeat"
    for o in (first, second):
        assert sum(o.seconds.values()) == pytest.approx(o.prefill_s)
        assert o.seconds["attention"] > 0 and o.seconds["moe"] > 0
    assert first.workload.kind is None and first.seconds["restore"] == 0
    assert first.workload.released_bytes == first.workload.restored_bytes == 0
    assert second.workload.released_bytes == second.workload.restored_bytes > 0
    assert second.workload.streamed_bytes == done[-1].bytes_streamed
    assert done[-1].forecast_s > 0
    again = make(demo_path)  # another process on the same model finds them
    assert again.rates.observations == loop.rates.observations
    assert again.learner.rates_file == loop.learner.rates_file and loop.learner.rates_file.is_relative_to(fresh_cache)


def test_expected_streaming_is_close_to_what_the_prefill_streams(demo_path: Path,
                                                                fresh_cache: Path) -> None:
    """The routing odds of the profile the cache was filled from, against the bytes a 2,048-
    token prompt streamed with the loan and without."""
    loop = make(demo_path)
    for i, flags in enumerate((FLAGS, LoanFlags(), FLAGS)):
        assert not loop.set_flags(flags)
        reply = loop.complete(prompt_tokens(loop, 2048, salt=i), max_new=2)
        assert reply.verdict is not None
        forecast = reply.verdict.chosen.workload.streamed_bytes
        assert forecast == pytest.approx(reply.timing.bytes_streamed, rel=0.15), i


def test_the_automatic_decision_is_the_forecast_s(demo_path: Path, fresh_cache: Path) -> None:
    """With STRATA_PREFILL_REPEAT_MIN_TOKENS=auto: rates where a restore costs a second keep
    a 2,048-token message off the loan; the defaults (a 5x larger chunk) take it; the runtime
    does what the verdict says."""
    auto = LOAN_ON.with_changes(repeat_auto=True)
    bus = EventBus()
    plans: list[PlanChosen] = []
    bus.subscribe(lambda e: plans.append(e) if isinstance(e, PlanChosen) else None)
    loop = make(demo_path, auto, bus)
    loop.complete(prompt_tokens(loop, 64, salt=9), max_new=1)  # the startup loan
    loop.rates = replace(Rates.fresh(loop.rates.device),
                         defaults={**DEFAULTS["sim"], "restore": np.array([1 / 2e9, 1.0])})
    costly = loop.complete(prompt_tokens(loop, 2048, salt=1), max_new=1)
    assert costly.verdict is not None and costly.verdict.kind is None
    assert costly.verdict.reason == "auto: the forecast says the loan does not pay"
    assert not plans[-1].loan
    loop.rates = Rates.fresh(loop.rates.device)
    cheap = loop.complete(prompt_tokens(loop, 2048, salt=2), max_new=1)
    assert cheap.verdict is not None and cheap.verdict.kind == "repeat" and plans[-1].loan
    assert cheap.verdict.pays and cheap.verdict.with_loan is not None
    assert cheap.verdict.with_loan.total_s * (1 + AUTO_MARGIN) < cheap.verdict.without_loan.total_s


def test_preview_counts_fresh_tokens_against_the_kv(demo_path: Path, fresh_cache: Path) -> None:
    loop = make(demo_path)
    conv = Conversation()
    loop.chat(conv, "What is a cat?", max_new=4)
    text = "tell me about the river " * 60
    v = loop.preview(conv, text)
    ahead = Conversation(messages=[*conv.messages])
    ahead.add("user", text)
    ids = loop.prompt_ids(ahead)
    reused = reused_tokens(loop.rt.session, loop.rt.spec, ids)
    assert v.prompt_tokens == len(ids) and v.fresh_tokens == len(ids) - reused
    assert 0 < v.fresh_tokens < v.prompt_tokens
    other = loop.preview(Conversation(), text)  # another conversation: its KV starts empty
    assert other.fresh_tokens == other.prompt_tokens
    assert len(conv.messages) == 2  # a question: nothing added


def test_preview_keeps_what_the_request_keeps_under_mtp(random_demo_path: Path,
                                                        fresh_cache: Path) -> None:
    """--mtp: the draft continues from a cell only while the token after it matches too, so a
    prompt that parts from the KV inside it keeps one token fewer than the KV's common prefix.
    The preview asks the request's own rule (engine.request.record.reused_tokens), and asking
    allocates nothing: the MTP draft's KV is made by the first request's begin step."""
    loop = make(random_demo_path, LoanFlags())
    rt = loop.rt
    assert rt.spec is not None
    draft = rt.spec.draft
    assert isinstance(draft, MTPDraft) and draft.kv is None

    def held() -> tuple[object, int]:  # the ledger and what the KV region has carved
        return rt.ledger.snapshot(), rt.ledger.region("kv").carved_bytes

    ledger = held()
    ids = loop.prompt_ids(Conversation(messages=[Message("user", "hello there")]))
    assert reused_tokens(rt.session, rt.spec, ids) == 0
    assert draft.kv is None and held() == ledger
    conv = Conversation()
    loop.chat(conv, "hello there", max_new=8)
    assert draft.kv is not None  # the request bound it
    # the answer the next prompt re-reads is not the one in the KV: they part inside the KV
    conv.messages[-1] = replace(conv.messages[-1], content="Something else entirely.")
    text = "and then?"
    ahead = Conversation(id=conv.id, messages=[*conv.messages])
    ahead.add("user", text)
    ids = loop.prompt_ids(ahead)
    n_kv = rt.session.reusable(ids)  # the KV's part of the rule alone
    assert 0 < n_kv < len(rt.session.tokens)
    ledger, cells = held(), (draft.n_cells, list(draft.seq))
    v = loop.preview(conv, text)
    assert held() == ledger
    assert (draft.n_cells, draft.seq) == cells  # a question: the draft as it was
    reply = loop.chat(conv, text, max_new=4)
    assert reply.timing.reused_tokens == n_kv - 1  # the draft's part decided
    assert (v.prompt_tokens, v.fresh_tokens) == (reply.timing.prompt_tokens,
                                                 reply.timing.fresh_tokens)


def test_a_retained_geometry_that_does_not_fit_is_re_planned_by_both(
        random_demo_path: Path, fresh_cache: Path) -> None:
    """The retained startup geometry was planned with every deferred region's bytes; a repeat
    loan that releases fewer (the head loan turned off) cannot lend its slots. The transaction
    re-plans, and the forecast made before the request names the same geometry: both ask
    engine.loan.geometry.loan_geometry."""
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(lambda e: seen.append(e) if isinstance(e, (PlanChosen, LoanStep)) else None)
    loop = make(random_demo_path, bus=bus)
    loop.complete(prompt_tokens(loop, 600, salt=1), max_new=2)  # the startup loan
    rt = loop.rt
    retained = rt.retained_geometry
    assert retained is not None and retained.borrowed
    args = (rt.plan, rt.plan.free_bytes, rt.costs, rt.plan_options)
    assert loan_geometry(*args, "repeat", retained, retained.n_lent_slots, 0) == (retained,
                                                                                  RETAINED)
    assert loan_geometry(*args, "repeat", retained, retained.n_lent_slots - 1, 0)[1] == REPLANNED
    assert loan_geometry(*args, "startup", retained, retained.n_lent_slots, 0)[1] == REPLANNED
    assert not loop.set_flags(FLAGS.with_changes(head_loan=False))
    seen.clear()
    reply = loop.complete(prompt_tokens(loop, 900, salt=2), max_new=2)
    (plan,) = [e for e in seen if isinstance(e, PlanChosen)]
    steps = [e.detail for e in seen if isinstance(e, LoanStep) and e.step == "plan"]
    assert len(steps) == 1 and "(re-planned, repeat loan)" in steps[0]
    assert plan.ring_slots != retained.ring_slots  # another geometry than the retained one
    assert reply.verdict is not None
    w = reply.verdict.chosen.workload
    assert (w.kind, w.chunk_tokens, w.ring_slots) == ("repeat", plan.chunk_tokens,
                                                      plan.ring_slots)


def test_what_if_is_refused_as_the_flags_would_be(demo_path: Path, fresh_cache: Path) -> None:
    loop = make(demo_path, LoanFlags(), serve=False)
    with pytest.raises(FlagError, match="needs --serve"):
        loop.what_if(FLAGS, loop.options, 4096)
    v = loop.what_if(LoanFlags(), loop.options, 4096)
    assert v.kind is None and v.with_loan is None and v.fresh_tokens == 4096
    assert v.reason == "loan flags off" and math.isfinite(v.without_loan.total_s)


# -- the commands ------------------------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from engine.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_prints_the_forecast_loan_off_and_on(demo_path: Path, fresh_cache: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`strata plan --prompt-tokens N`: loan off, startup and repeat loan side by side, from
    the rates of earlier requests once there are some; the loan columns follow the geometry
    an engine would run."""
    args = ("plan", "--model", str(demo_path), "--serve", "--vram-elastic", "--mtp", "--spec",
            "4", "--ctx", str(OPTS["ctx"]), "--prompt-tokens", "2048")  # the engine `make` runs
    rc, out, _ = _run(capsys, *args)
    assert rc == 0 and "forecast of a 2,048-token prompt" in out
    assert "defaults (no request measured yet)" in out
    header = next(line for line in out.splitlines() if "loan off" in line)
    assert "startup loan" in header and "repeat loan" in header
    plan_row = next(line for line in out.splitlines() if line.startswith("| prompt plan"))
    loop = make(demo_path)
    reply = loop.complete(prompt_tokens(loop, 2048, salt=3), max_new=2)  # the startup loan
    assert reply.verdict is not None
    w = reply.verdict.chosen.workload
    assert f"{w.chunk_tokens:,} / {w.ring_slots:,}" in plan_row.split("|")[3]
    loop.complete(prompt_tokens(loop, 2048, salt=4), max_new=2)  # kept: not the first
    rc, out, _ = _run(capsys, *args)
    assert rc == 0 and "1 earlier request (" in out and "routing odds: the calibration" in out


def test_plan_says_why_the_loan_is_refused(demo_path: Path, fresh_cache: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, "plan", "--model", str(demo_path), "--prompt-tokens", "4096")
    header = next(line for line in out.splitlines() if "loan off" in line)
    assert rc == 0 and [c.strip() for c in header.strip("|").split("|")] == ["", "loan off", "loan"]
    assert "- the loan is refused: STRATA_PREFILL_ELASTIC_LOAN=1 needs --serve" in out
    rc, out, err = _run(capsys, "plan", "--model", str(demo_path), "--prompt-tokens", "0")
    assert rc == 2 and not out and err.strip().count("\n") == 0 and "--prompt-tokens 0" in err


def test_bench_forecast_prints_forecast_against_measured(tiny_path: Path, fresh_cache: Path,
                                                          tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    out_json = tmp_path / "shots.json"
    rc, out, _ = _run(capsys, "bench", "--model", str(tiny_path), "--forecast",
                      "--prompt-tokens", "300,600", "--runs", "1", "--max-new", "2",
                      "--fresh-rates", "--json", str(out_json))
    assert rc == 0
    rows = [line for line in out.splitlines() if line.startswith(("| 300 |", "| 600 |"))]
    # two sizes x three configurations; the parts table lacks each engine's first prefill
    assert len(rows) == 2 * 3 + 2 * 2
    assert "Median absolute error of the measured runs:" in out
    shots = json.loads(out_json.read_text())
    assert [s["config"] for s in shots[:5]] == ["startup loan", "loan off", "repeat loan",
                                                "loan off", "repeat loan"]
    assert [s["first"] for s in shots[:5]] == [True, True, True, False, False]
    assert all(s["forecast_s"] > 0 and s["measured_s"] > 0 for s in shots)


def test_soak_auto_checks_every_decision_against_its_twin(tiny_path: Path, fresh_cache: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    rc, out, _ = _run(capsys, "bench", "--model", str(tiny_path), "--soak", "4", "--auto",
                      "--prompt-tokens", "600,300", "--short-tokens", "16", "--max-new", "2")
    assert rc == 0 and "STRATA_PREFILL_REPEAT_MIN_TOKENS=auto" in out
    head, _, row = out.strip().splitlines()[-3:]
    assert "Loans slower than without" in head and "Declined" in head
    cells = [c.strip() for c in row.strip("|").split("|")]
    loans, declined = int(cells[1]), int(cells[7])
    assert loans + declined == 2  # the two long messages were decided; the short never loan


@pytest.mark.parametrize("value", ["abc", "0", "100,-3"])
def test_bench_token_lists_are_checked(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _run(capsys, "bench", "--prompt-tokens", value)
    assert e.value.code == 2 and "--prompt-tokens" in capsys.readouterr().err


def test_a_question_during_a_loan_sees_the_engine_between_requests(demo_path: Path,
                                                                    fresh_cache: Path) -> None:
    """Asked from another thread while a repeat loan holds its slots and its released
    regions, the verdict is the one asked before the request started (the loan's grown cache,
    lent slots and released regions are not the engine's resting state)."""
    import threading

    from engine.trace.events import PrefillProgress

    bus = EventBus()
    reached, release = threading.Event(), threading.Event()

    def hold(e: object) -> None:
        if isinstance(e, PrefillProgress) and not reached.is_set():
            reached.set()
            release.wait(30)

    loop = make(demo_path, FLAGS.with_changes(retain_startup_chunk=False), bus)
    loop.complete(prompt_tokens(loop, 300, salt=1), max_new=1)  # the startup loan
    before = [loop.verdict(n, 0) for n in (300, 2048)]
    bus.subscribe(hold)
    worker = threading.Thread(target=loop.complete, args=(prompt_tokens(loop, 2048, salt=2),),
                              kwargs={"max_new": 1})
    worker.start()
    try:
        assert reached.wait(30) and loop.busy and loop.rt.cache is not None
        assert loop.rt.cache.n_lent > 0  # the loan is in flight
        during = [loop.verdict(n, 0) for n in (300, 2048)]
    finally:
        release.set()
        worker.join(30)
    for a, b in zip(before, during):
        assert (a.kind, a.line()) == (b.kind, b.line())
        assert a.with_loan is not None and b.with_loan is not None
        assert a.with_loan.workload == b.with_loan.workload
        assert a.without_loan.workload == b.without_loan.workload
