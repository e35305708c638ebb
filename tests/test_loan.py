"""The VRAM loan (seed 000, DESIGN §9 invariants 1-4) on the demo model, simulated device."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineOptions, LoanFlags
from engine.faults import Faults, InjectedFault
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.tools.bench import LOAN_ON, prompt_tokens
from engine.trace.events import EventBus, LoanStep, PrefillProgress

OPTS = {"serve": True, "vram_elastic": True, "mtp": True, "spec": 4, "prefill": "auto", "ctx": 4096}
FLAGS = LoanFlags.make(**{**LOAN_ON.as_kwargs(), "repeat_min_tokens": 256})


def make(demo_path: Path, flags: LoanFlags = FLAGS, faults: Faults | None = None,
         bus: EventBus | None = None) -> ServeLoop:
    return ServeLoop.create(EngineOptions(model=str(demo_path), **OPTS), flags, bus,  # type: ignore[arg-type]
                            faults=faults)


@dataclass(frozen=True)
class State:
    regions: tuple
    slots: bytes
    table: bytes
    resident: tuple
    startup_pending: bool
    n_messages: int


def state(loop: ServeLoop, conv: Conversation) -> State:
    rt = loop.rt
    assert rt.cache is not None
    return State(
        tuple((r.name, r.used_bytes, r.n_segments) for r in rt.ledger.snapshot().regions),
        rt.cache.states().tobytes(), rt.cache.table.slot_of.tobytes(),
        tuple((r.region, r.resident) for r in rt.resources.items),
        rt.startup_loan_pending, len(conv.messages),
    )


@pytest.fixture(scope="module")
def texts(demo_path: Path) -> list[str]:
    loop = make(demo_path, LoanFlags())
    tok = loop.rt.model.tokenizer
    return [tok.decode(prompt_tokens(loop, n, salt=s)) for n, s in ((1200, 1), (40, 2), (700, 3))]


def converse(loop: ServeLoop, texts: list[str]) -> list[str]:
    conv = Conversation()
    out = []
    for t in texts:
        out.append(loop.chat(conv, t, max_new=10).text)
        loop.rt.check_integrity()  # invariant 2, after every request
        assert loop.rt.cache is not None and loop.rt.cache.n_lent == 0
        assert loop.rt.resources.all_resident()
    return out


def test_loan_on_and_off_give_the_same_tokens(demo_path: Path, texts: list[str]) -> None:
    """Invariant 1 (and 2): a startup loan, a short message, a repeat loan."""
    bus = EventBus()
    steps: list[LoanStep] = []
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, LoanStep) else None)
    on = converse(make(demo_path, bus=bus), texts)
    off = converse(make(demo_path, LoanFlags()), texts)
    assert on == off
    restores = [s for s in steps if s.step == "restore"]
    assert len(restores) == 2  # the startup loan and the repeat loan; the 40-token one had none
    plans = [s.detail for s in steps if s.step == "plan"]
    assert "startup loan" in plans[0] and "retained startup geometry" in plans[1]
    # every request lends cache-tail slots and refills them, loan or not, in that order
    borrow = [s.step for s in steps if s.step in ("lend", "refill")]
    assert borrow == ["lend", "refill"] * len(texts)
    lends = [s for s in steps if s.step == "lend"]
    assert all("lent" in s.detail and s.n_bytes > 0 for s in lends)


def test_loan_chunk_is_larger(demo_path: Path) -> None:
    loop = make(demo_path)
    off = make(demo_path, LoanFlags())
    assert loop.rt.plan.startup_prompt.chunk_tokens >= 2 * off.rt.plan.prompt.chunk_tokens


@pytest.mark.parametrize("kind", ["startup", "repeat"])
def test_fault_at_every_step_rolls_back(demo_path: Path, texts: list[str], kind: str) -> None:
    """Invariant 3: a fault at each step leaves the state as before the request, and the
    next request's output equals a clean run's."""
    # the conversation the faulted request continues: [short, long] for a repeat loan
    clean = converse(make(demo_path), [texts[1], texts[0]] if kind == "repeat" else texts[:1])
    probe = Faults()
    loop = make(demo_path, faults=probe)
    if kind == "repeat":
        converse(loop, texts[1:2])  # the startup loan is spent on a short message
    probe.seen.clear()
    converse(loop, texts[:1])
    steps = list(dict.fromkeys(probe.seen))
    assert {"plan", "grow", "lent", "refill", "refill:slot", "shrink", "logits"} <= set(steps)
    assert any(s.startswith("release:") for s in steps) and any(s.startswith("chunk:") for s in steps)
    for step in steps:
        faults = Faults()
        loop = make(demo_path, faults=faults)
        conv = Conversation()
        if kind == "repeat":
            loop.chat(conv, texts[1], max_new=10)
        before = state(loop, conv)
        faults.arm(step)
        # a one-shot device fault on restore or on a refilled slot is retried; a failed lend
        # to the expert cache is undone (the request goes on without it)
        if step.startswith(("restore:", "cache-repay:", "cache-lend:", "refill:slot")):
            loop.chat(conv, texts[0], max_new=10)
            loop.rt.check_integrity()
            continue
        with pytest.raises(InjectedFault):
            loop.chat(conv, texts[0], max_new=10)
        assert state(loop, conv) == before, step
        loop.rt.check_integrity()
        assert loop.chat(conv, texts[0], max_new=10).text == clean[-1], step


def test_cancel_at_a_random_chunk(demo_path: Path, texts: list[str]) -> None:
    clean = converse(make(demo_path), texts[:1])
    bus = EventBus()
    loop = make(demo_path, bus=bus)
    n_chunks = -(-len(loop.rt.model.tokenizer.encode(texts[0])) // loop.rt.plan.startup_prompt.chunk_tokens)
    at = [int(np.random.default_rng(0).integers(1, n_chunks + 1))]  # after chunk 1..n

    def cancel_at(e: object) -> None:
        if isinstance(e, PrefillProgress) and e.chunk == at[0]:
            loop.cancel()

    bus.subscribe(cancel_at)
    conv = Conversation()
    before = state(loop, conv)
    reply = loop.chat(conv, texts[0], max_new=10)
    assert reply.cancelled and state(loop, conv) == before
    loop.rt.check_integrity()
    at[0] = -1  # no more cancels
    assert loop.chat(conv, texts[0], max_new=10).text == clean[0]


def test_runtime_flags_apply_from_the_next_request(demo_path: Path, texts: list[str]) -> None:
    bus = EventBus()
    steps: list[LoanStep] = []
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, LoanStep) else None)
    loop = make(demo_path, LoanFlags(), bus=bus)
    conv = Conversation()
    loop.chat(conv, texts[1], max_new=4)
    refused = loop.set_flags(LoanFlags.make(elastic_loan=True), loop.options.with_changes(serve=False))
    assert any("--serve" in v for v in refused) and loop.flags == LoanFlags()
    assert loop.set_flags(FLAGS) == []
    assert loop.rt.flags == LoanFlags()  # not yet: applied when the next request starts
    loop.chat(conv, texts[0], max_new=4)
    assert loop.rt.flags == FLAGS
    assert [s.step for s in steps if s.step in ("release", "restore")] == ["release", "restore"]


def test_cli_shows_a_loan_end_to_end(demo_path: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    for var, value in {**FLAGS.as_env(), "STRATA_TRACE": "1"}.items():
        monkeypatch.setenv(var, value)
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(str(300 + i % 5000) for i in range(1500)))
    rc = main(["run", "--model", str(demo_path), "--serve", "--vram-elastic", "--mtp",
               "--spec", "4", "--prefill", "auto", "--tokens-file", str(prompt), "--max-new", "4"])
    err = capfd.readouterr().err
    assert rc == 0, err
    order = ["strata loan: released", "strata loan: prompt plan", "strata serve: prompt plan",
             "strata trace: lent", "strata trace: refilled", "strata loan: restored",
             "strata serve: prompt 1500 tokens"]
    positions = [err.find(s) for s in order]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), err


def test_a_one_token_answer_does_not_inflate_the_next_fresh_count(demo_path: Path,
                                                                  texts: list[str]) -> None:
    """With --mtp --spec 4, a request that generated one token left the draft without the
    prompt, so the next request recomputed all of it and its fresh count crossed the repeat
    threshold: a repeat loan for a 40-token message. Now it reuses what plain decoding does."""
    bus = EventBus()
    steps: list[LoanStep] = []
    bus.subscribe(lambda e: steps.append(e) if isinstance(e, LoanStep) else None)
    loop, conv = make(demo_path, bus=bus), Conversation()
    ref, ref_conv = ServeLoop.create(EngineOptions(model=str(demo_path), ctx=4096)), Conversation()
    for text in texts[:2]:
        n = len(steps)
        got = loop.chat(conv, text, max_new=1)
        want = ref.chat(ref_conv, text, max_new=1)
        loop.rt.check_integrity()
        assert got.text == want.text
        assert (got.timing.reused_tokens, got.timing.fresh_tokens) == (
            want.timing.reused_tokens, want.timing.fresh_tokens), got.timing.line()
    assert want.timing.reused_tokens > 1000
    assert not [s for s in steps[n:] if s.step == "release"]  # 40 fresh tokens: no repeat loan


REFILL_FAILED = re.compile(r"strata trace: refill of (\d+) slots \[(\d+)\.\.(\d+)\] failed after "
                           r"(\d+) in \d+\.\d ms, (\d+) still lent \(fault injected at "
                           r"refill:slot\)")
REFILLED = re.compile(r"strata trace: refilled (\d+) slots \[(\d+)\.\.(\d+)\] in \d+\.\d ms, "
                      r"(\d+) still lent(?: \((\d+) on this attempt, (\d+) before it failed\))?")


def refill_lines(lines: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for ln in lines:
        for kind, pattern in (("failed", REFILL_FAILED), ("refilled", REFILLED)):
            m = pattern.fullmatch(ln)
            if m:
                out.append((kind, tuple(int(g) for g in m.groups() if g is not None)))
    return out


def test_a_failed_refill_attempt_says_so_and_the_retry_counts_both(
        demo_path: Path, texts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27 item 9: a refill that fails after two slots prints a trace line and a warning
    with the slots still lent; the retry's line counts the slots of both attempts, and says 0
    still lent only when every slot is back. The reply is a clean run's."""
    monkeypatch.setenv("STRATA_TRACE", "1")
    clean = converse(make(demo_path), texts[:1])
    faults, lines = Faults(), []
    loop = ServeLoop.create(EngineOptions(model=str(demo_path), **OPTS), FLAGS,  # type: ignore[arg-type]
                            faults=faults, on_trace=lines.append)
    faults.arm("refill:slot", after=2)
    assert converse(loop, texts[:1]) == clean
    (failed, (n, a, b, back, still)), (refilled, done) = refill_lines(lines)
    assert (failed, refilled, back, still) == ("failed", "refilled", 2, n - 2)
    assert n == b - a + 1 > 2
    assert done == (n, a, b, 0, n - 2, 2)  # all back: the retry's n - 2 and the first's 2
    warning = (f"strata: warning: refilling the lent expert-cache slots failed (fault injected "
               f"at refill:slot); {n - 2} of {n} still lent, retrying once")
    assert warning in lines and loop.rt.report.warnings == [warning]


def test_a_refill_that_fails_twice_rolls_back_and_counts_what_is_still_lent(
        demo_path: Path, texts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Both attempts fail (after 2 slots, then 1 more): the request rolls back, each failure
    says how many are still lent (n - 2, then n - 3), and the undo path's refill brings the
    rest back (0 still lent); the next request is a clean run's."""
    monkeypatch.setenv("STRATA_TRACE", "1")
    clean = converse(make(demo_path), texts[:1])
    faults, lines = Faults(), []

    def line(text: str) -> None:
        lines.append(text)
        if text.endswith("retrying once"):  # the retry fails too, one slot further
            faults.arm("refill:slot", after=1)

    loop = ServeLoop.create(EngineOptions(model=str(demo_path), **OPTS), FLAGS,  # type: ignore[arg-type]
                            faults=faults, on_trace=line)
    conv = Conversation()
    before = state(loop, conv)
    faults.arm("refill:slot", after=2)
    with pytest.raises(InjectedFault):
        loop.chat(conv, texts[0], max_new=10)
    assert state(loop, conv) == before
    loop.rt.check_integrity()
    got = refill_lines(lines)
    n = got[0][1][0]
    assert [(kind, v[-2:] if kind == "failed" else v[3:]) for kind, v in got] == [
        ("failed", (2, n - 2)), ("failed", (3, n - 3)), ("refilled", (0, n - 3, 3))]
    assert any(ln.endswith(f"{n - 3} of {n} still lent, giving up; the request rolls back")
               for ln in lines)
    assert loop.chat(conv, texts[0], max_new=10).text == clean[0]


def test_a_requests_end_is_told_to_its_subscribers_before_its_request_done(
        demo_path: Path, texts: list[str]) -> None:
    """`ServeLoop.step`'s done stage: each `on_done` subscriber gets the request's end (its
    outcome, whether its prefill ran to the end) before RequestDone is published, for a
    reply, a failure and a cancel alike; the forecast learns only from whole prefills."""
    from engine.runtime.stages import CANCELLED, DONE, FAILED, Finished
    from engine.trace.events import RequestDone

    faults, bus = Faults(), EventBus()
    loop = make(demo_path, faults=faults, bus=bus)
    seen: list[tuple[str, bool, bool]] = []  # (outcome, prefilled, RequestDone already out)
    dones: list[RequestDone] = []
    bus.subscribe(lambda e: dones.append(e) if isinstance(e, RequestDone) else None)

    def told(f: Finished) -> None:
        seen.append((f.outcome, f.request.prefilled, len(dones) == len(seen) + 1))

    loop.on_done.append(told)
    conv = Conversation()
    loop.chat(conv, texts[1], max_new=4)
    faults.arm("logits")  # fails after the prefill's chunks, before its first token
    with pytest.raises(InjectedFault):
        loop.chat(conv, texts[0], max_new=4)
    bus.subscribe(lambda e: loop.cancel() if isinstance(e, PrefillProgress) else None)
    assert loop.chat(conv, texts[0], max_new=4).cancelled
    assert seen == [(DONE, True, False), (FAILED, False, False), (CANCELLED, False, False)]
    assert [d.cancelled for d in dones] == [False, False, True] and dones[1].error
    assert loop.learner.prefills == 1  # the failed and the cancelled prefill taught the forecast nothing
