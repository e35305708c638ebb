"""Runtime option changes: validated like startup flags, applied from the next request."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineOptions, LoanFlags
from engine.faults import Faults, InjectedFault
from engine.loan.deferral import deferred_regions
from engine.request.conversation import Conversation
from engine.runtime import flags as runtime_flags
from engine.runtime.serve import ServeLoop
from engine.tools.bench import prompt_tokens
from engine.trace.events import EventBus, FlagsChanged, FlagsRefused, LoanStep, PlanChosen


def test_prefill_and_spec_change_between_requests(demo_path: Path) -> None:
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(seen.append)
    loop = ServeLoop.create(EngineOptions(model=str(demo_path), mtp=True, spec=4, ctx=4096,
                                          prefill=256, device="sim:80MiB", expert_cache=120),
                            LoanFlags(), bus)
    conv = Conversation()
    first = loop.chat(conv, "word " * 600, max_new=6)
    assert loop.set_flags(loop.flags, loop.options.with_changes(prefill=512, spec=2)) == []
    second = loop.chat(conv, "more " * 600, max_new=6)
    plans = [e for e in seen if isinstance(e, PlanChosen)]
    assert plans[0].chunk_tokens == 256 and plans[-1].chunk_tokens == 512
    assert loop.rt.spec.n_window == 2 and first.text and second.text


def test_changes_that_need_a_restart_are_refused(demo_path: Path) -> None:
    bus = EventBus()
    refused: list[FlagsRefused] = []
    bus.subscribe(lambda e: refused.append(e) if isinstance(e, FlagsRefused) else None)
    loop = ServeLoop.create(EngineOptions(model=str(demo_path), mtp=True, spec=2, ctx=2048),
                            LoanFlags(), bus)
    v = loop.set_flags(loop.flags, loop.options.with_changes(spec=8, ctx=4096))
    assert any("--spec 8 needs a verifier for 8 tokens" in x for x in v)
    assert any("--ctx cannot change while running" in x for x in v)
    assert refused and loop.options.spec == 2
    v = loop.set_flags(loop.flags, loop.options.with_changes(prefill=8192))
    assert v and "--prefill 8192" in v[0]
    v = loop.set_flags(loop.flags, loop.options.with_changes(dense="quant"))  # weights as loaded
    assert v == ["--dense cannot change while running; restart strata"]


def test_no_token_graph_is_a_runtime_flag(demo_path: Path) -> None:
    """Accepted between requests (on CUDA it drops or captures the decode graphs; the
    simulated device decodes eagerly either way and keeps answering the same)."""
    loop = ServeLoop.create(EngineOptions(model=str(demo_path), ctx=1024))
    ids = loop.rt.model.tokenizer.encode("the river runs through the old city")
    a = loop.complete(list(ids), max_new=4).text
    assert loop.set_flags(loop.flags, loop.options.with_changes(no_token_graph=True)) == []
    assert loop.complete(list(ids), max_new=4).text == a
    assert loop.rt.options.no_token_graph and loop.rt.session.graph is None
    assert "token graph" not in loop.rt.summary()


# -- loan flags changed at runtime (issue 15) ------------------------------------------------

LOAN_OPTS = EngineOptions(serve=True, vram_elastic=True, mtp=True, spec=4, prefill="auto",
                          ctx=4096)
NONE = LoanFlags()
MASTER = LoanFlags.make(elastic_loan=True, repeat_min_tokens=256)
ALL = LoanFlags.make(elastic_loan=True, mtp_loan=True, head_loan=True,
                     retain_startup_chunk=True, repeat_loan=True, repeat_min_tokens=256)
SUBS = ("mtp_loan", "head_loan", "retain_startup_chunk", "repeat_loan")


def _transitions() -> list[tuple[str, LoanFlags, LoanFlags]]:
    """Each of the six flags on->off and off->on, and the combinations that move several
    regions at once (the app's flags panel turning everything off is `all->none`)."""
    out = []
    for name in SUBS:  # a sub-option alone, the others staying on
        without = ALL.with_changes(**{name: False})
        out += [(f"{name} on->off", ALL, without), (f"{name} off->on", without, ALL)]
    out += [("elastic_loan on->off", MASTER, NONE), ("elastic_loan off->on", NONE, MASTER)]
    high = ALL.with_changes(repeat_min_tokens=1024)  # the 300-token message: no repeat loan
    out += [("repeat_min_tokens 256->1024", ALL, high), ("repeat_min_tokens 1024->256", high, ALL)]
    mtp_only = MASTER.with_changes(mtp_loan=True)
    head_only = MASTER.with_changes(head_loan=True)
    out += [("all->none", ALL, NONE), ("none->all", NONE, ALL), ("all->master", ALL, MASTER),
            ("master->all", MASTER, ALL), ("mtp->head", mtp_only, head_only),
            ("head->mtp", head_only, mtp_only)]
    return out


TRANSITIONS = _transitions()


@pytest.fixture(scope="module")
def two_messages(demo_path: Path) -> list[str]:
    loop = ServeLoop.create(LOAN_OPTS.with_changes(model=str(demo_path)))
    tok = loop.rt.model.tokenizer
    return [tok.decode(prompt_tokens(loop, 300, salt=s)) for s in (11, 12)]


def _make(demo_path: Path, flags: LoanFlags, bus: EventBus | None = None) -> ServeLoop:
    return ServeLoop.create(LOAN_OPTS.with_changes(model=str(demo_path)), flags, bus)


def _request(loop: ServeLoop, conv: Conversation, text: str, steps: list[LoanStep]) -> tuple:
    """One request: its text and its loan's release/restore steps; then invariant 2."""
    n = len(steps)
    reply = loop.chat(conv, text, max_new=6)
    loop.rt.check_integrity()
    assert loop.rt.cache is not None and loop.rt.cache.n_lent == 0
    assert loop.rt.resources.all_resident()
    return reply.text, [s.step for s in steps[n:] if s.step in ("release", "restore")]


_fresh: dict[LoanFlags, list[tuple]] = {}


def _fresh_run(demo_path: Path, flags: LoanFlags, texts: list[str]) -> list[tuple]:
    """Both requests on an engine started with `flags` (one run per flag set)."""
    if flags not in _fresh:
        bus = EventBus()
        steps: list[LoanStep] = []
        bus.subscribe(lambda e: steps.append(e) if isinstance(e, LoanStep) else None)
        loop, conv = _make(demo_path, flags, bus), Conversation()
        _fresh[flags] = [_request(loop, conv, t, steps) for t in texts]
    return _fresh[flags]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(("name", "old", "new"), TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_loan_flags_change_at_runtime(demo_path: Path, two_messages: list[str], name: str,
                                      old: LoanFlags, new: LoanFlags, when: str) -> None:
    """A change before or after the first request: the next request succeeds, the ledger
    holds, every region is resident after it, its loan is the one a fresh engine with the
    new flags takes, and the greedy text is that engine's."""
    bus = EventBus()
    steps: list[LoanStep] = []
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, LoanStep) else None)
    loop, conv = _make(demo_path, old, bus), Conversation()
    got = []
    if when == "after":
        got.append(_request(loop, conv, two_messages[0], steps))
    assert loop.set_flags(new) == []
    for text in two_messages[len(got):]:
        got.append(_request(loop, conv, text, steps))
    assert loop.rt.flags == new
    want = _fresh_run(demo_path, new, two_messages)
    assert [text for text, _ in got] == [text for text, _ in want], name
    changed = got if when == "before" else got[1:]  # the requests after the change
    assert [s for _, s in changed] == [s for _, s in want[-len(changed):]], name


@pytest.mark.parametrize(("name", "old", "new"), TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_flags_before_the_first_request_hold_regions_as_a_fresh_engine(
        demo_path: Path, name: str, old: LoanFlags, new: LoanFlags) -> None:
    """Applied before any request, the new flags leave the decode-only regions, the startup
    loan and the startup plan as an engine started with them has them."""
    rt = _make(demo_path, old).rt
    runtime_flags.apply(rt, rt.options, new)
    fresh = _make(demo_path, new).rt
    deferred = deferred_regions(new, rt.options)
    for r in rt.resources.items:
        assert r.resident == (r.region not in deferred), (name, r.region)
    assert [(r.region, r.resident) for r in rt.resources.items] == [
        (r.region, r.resident) for r in fresh.resources.items]
    assert rt.startup_loan_pending == fresh.startup_loan_pending == new.elastic_loan
    assert rt.plan_options == fresh.plan_options
    assert sorted(rt.plan.deferred, key=str) == sorted(fresh.plan.deferred, key=str)
    assert (rt.plan.regions, rt.plan.startup_prompt) == (fresh.plan.regions,
                                                         fresh.plan.startup_prompt)
    rt.check_integrity()
    assert rt.ledger.snapshot().regions == fresh.ledger.snapshot().regions


def test_a_failed_restore_keeps_the_old_flags(demo_path: Path,
                                              two_messages: list[str]) -> None:
    """A device fault while restoring what the new flags no longer defer: the request fails
    with one typed error, the engine is as before, and the next request applies the flags."""
    faults = Faults()
    loop = ServeLoop.create(LOAN_OPTS.with_changes(model=str(demo_path)), ALL, faults=faults)
    before = [(r.region, r.resident) for r in loop.rt.resources.items]
    assert loop.set_flags(NONE) == []
    faults.arm("flags:restore:head.native")
    conv = Conversation()
    with pytest.raises(InjectedFault):
        loop.chat(conv, two_messages[0], max_new=6)
    assert [(r.region, r.resident) for r in loop.rt.resources.items] == before
    assert loop.rt.flags == ALL and loop.rt.startup_loan_pending and not conv.messages
    loop.rt.check_integrity()
    text = loop.chat(conv, two_messages[0], max_new=6).text
    assert loop.rt.flags == NONE and loop.rt.resources.all_resident()
    assert text == _fresh_run(demo_path, NONE, two_messages)[0][0]


# -- the repeat threshold changed at runtime: the seed's clamp, said (issue 27 item 9) -------

def test_a_clamped_threshold_says_so_in_the_log_and_the_event(demo_path: Path) -> None:
    """Seed 000's clamp at runtime: 100 (or -5) is taken as 256 and the warning is a printed
    line, kept by the reporter, and on the FlagsChanged event (the app's event log)."""
    bus = EventBus()
    changed: list[FlagsChanged] = []
    bus.subscribe(lambda e: changed.append(e) if isinstance(e, FlagsChanged) else None)
    lines: list[str] = []
    loop = ServeLoop.create(LOAN_OPTS.with_changes(model=str(demo_path)), ALL, bus,
                            on_trace=lines.append)
    for asked in (100, -5):
        assert loop.set_flags(loop.flags.with_changes(repeat_min_tokens=asked)) == []
        assert loop.flags.repeat_min_tokens == 256
        want = (f"STRATA_PREFILL_REPEAT_MIN_TOKENS={asked} is below the minimum of 256 tokens; "
                "clamped to 256")
        assert changed[-1].warnings == (want,)
        assert lines[-1] == loop.rt.report.warnings[-1] == f"strata: warning: {want}"
        assert "\n" not in lines[-1]
    assert loop.set_flags(loop.flags.with_changes(repeat_min_tokens=2048)) == []
    assert changed[-1].warnings == () and loop.flags.repeat_min_tokens == 2048
    far = loop.flags.with_changes(repeat_min_tokens=50_000)  # above --ctx 4096: never taken
    assert loop.set_flags(far) == []
    assert "is above the context (--ctx 4096)" in changed[-1].warnings[0]
    assert runtime_flags.warnings(loop.options, far) == list(changed[-1].warnings)
    loop.close()


def test_post_flags_returns_the_clamp_warning(demo_path: Path) -> None:
    """POST /v1/flags: a clamped threshold answers 200 with the warning in `warnings`; one past
    any prompt is refused naming the value; the event carries the warning too."""
    from servers import running

    with running(str(demo_path)) as srv:  # every loan flag on, --ctx 1024
        changed: list[FlagsChanged] = []
        srv.bus.subscribe(lambda e: changed.append(e) if isinstance(e, FlagsChanged) else None)
        with srv.client() as c:
            r = c.post("/v1/flags", json={"flags": {"repeat_min_tokens": 100}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["flags"]["repeat_min_tokens"] == 256
            want = ("STRATA_PREFILL_REPEAT_MIN_TOKENS=100 is below the minimum of 256 tokens; "
                    "clamped to 256")
            assert body["warnings"] == [want] and changed[-1].warnings == (want,)
            assert srv.loop.rt.report.warnings[-1] == f"strata: warning: {want}"
            r = c.post("/v1/flags", json={"flags": {"repeat_min_tokens": 2**31}})
            assert r.status_code == 422 and "larger than any prompt" in r.json()["error"]["message"]
            r = c.post("/v1/flags", json={"flags": {"repeat_min_tokens": 10**30}})
            assert r.status_code in (400, 422)  # the body's parser may refuse it first
            assert srv.loop.flags.repeat_min_tokens == 256
            r = c.post("/v1/flags", json={"flags": {"repeat_min_tokens": 512}})
            assert r.status_code == 200 and r.json()["warnings"] == []
            assert c.get("/v1/flags").json()["warnings"] == []
