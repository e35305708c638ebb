"""The MTP block's memory lent to the expert cache over plain spans (engine/loan/cache_lend.py):
the cache grows into it and fills it in profile order, everything is back before a draft and at
the end of a request, and the tokens are those of an engine that never lends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.config import EngineOptions, LoanFlags
from engine.loan.cache_lend import PREFIX
from engine.runtime.serve import ServeLoop
from engine.speculative.policy import PLAIN, DraftPolicy
from engine.tools.bench import prompt_tokens

REGIONS = ("mtp.experts", "mtp.draft_head")


def make(path: Path, lend: bool, lines: list[str] | None = None) -> ServeLoop:
    # random weights: drafts are never accepted; 40 of the 128 experts cached
    opts = EngineOptions(model=str(path), device="sim:40MiB", ctx=2048, mtp=True, spec=2,
                         draft_vocab=3000, expert_cache=40, cache_lend=lend)
    return ServeLoop.create(opts, on_trace=None if lines is None else lines.append)


def settled_plain(loop: ServeLoop, span: int = 128) -> None:
    """The policy as a request that found drafts do not pay leaves it: plain for `span`."""
    p = DraftPolicy()
    p.home = p.mode = PLAIN
    p.span = p.left = span
    loop.rt.spec.policy = p


def regions(loop: ServeLoop) -> set[str]:
    return {r.name for r in loop.rt.ledger.snapshot().regions}


def test_lend_grows_the_cache_in_profile_order_and_repay_restores(random_demo_path: Path) -> None:
    loop = make(random_demo_path, lend=True)
    rt = loop.rt
    lender, cache = rt.spec.lender, rt.cache
    assert lender is not None and cache is not None
    n0, resident0 = cache.n_slots, {cache.table.owner(s) for s in range(cache.n_slots)}
    lender.lend()
    assert not set(REGIONS) & regions(loop)  # the MTP experts and draft head are lent
    grown = cache.n_slots - n0
    assert grown == lender.grown > 0
    new = [cache.table.owner(s) for s in range(n0, cache.n_slots)]
    # the next experts of the fill order that were not resident, in that order
    assert new == [o for o in cache.order if o not in resident0][:grown]
    cache.check_integrity()
    lender.repay()
    assert cache.n_slots == n0 and set(REGIONS) <= regions(loop)
    rt.check_integrity()
    rt.spec.check_integrity()
    assert {cache.table.owner(s) for s in range(n0)} == resident0


@pytest.mark.parametrize("max_new", [6, 40])
def test_a_plain_span_lends_and_the_tokens_stay(random_demo_path: Path, max_new: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A request on a policy settled on plain steps lends at its first step and repays at its
    end; the reply is the reply of an engine that keeps the memory, with more cache hits."""
    monkeypatch.setenv("STRATA_TRACE", "1")
    lines: list[str] = []
    out = {}
    for lend in (True, False):
        loop = make(random_demo_path, lend, lines if lend else None)
        ids = prompt_tokens(loop, 300)
        settled_plain(loop)
        reply = loop.complete(ids, max_new=max_new)
        loop.rt.check_integrity()
        loop.rt.spec.check_integrity()
        assert set(REGIONS) <= regions(loop)  # resident between requests
        assert reply.timing.drafted_steps == 0
        out[lend] = reply
    assert out[True].text == out[False].text and out[True].timing.generated == max_new
    assert out[True].timing.decode_hits > out[False].timing.decode_hits
    assert any(ln.startswith("strata lend: decoding plain: lent mtp experts") for ln in lines)
    assert any(ln.startswith("strata lend: drafting again: mtp experts, draft head restored")
               for ln in lines)


def test_drafts_get_the_memory_back_before_they_run(random_demo_path: Path) -> None:
    """A short plain span (a probe) lends nothing; after a long one, the draft probe finds the
    MTP regions resident (the draft model runs on them) and the reply is unchanged."""
    loop = make(random_demo_path, lend=True)
    ids = prompt_tokens(loop, 300)
    settled_plain(loop, span=LEND_SPAN)
    reply = loop.complete(ids, max_new=LEND_SPAN + 6)
    # the probe after the span drafted on the restored MTP regions (a released one fails the
    # draft), lost again, and the next plain span lent again
    assert reply.timing.drafted_steps > 0
    assert loop.rt.spec.lender.n_lends == 2
    plain = make(random_demo_path, lend=False)
    settled_plain(plain, span=LEND_SPAN)
    assert plain.complete(ids, max_new=LEND_SPAN + 6).text == reply.text
    short = make(random_demo_path, lend=True)
    settled_plain(short, span=8)  # below the lend threshold
    short.complete(ids, max_new=9)  # inside the span (what follows its probe depends on timing)
    assert short.rt.spec.lender.n_lends == 0


LEND_SPAN = 40


def test_a_failed_lend_is_undone_and_decoding_goes_on(random_demo_path: Path) -> None:
    """A fault while lending (the draft head's release, after the experts'): the experts come
    back, a warning says so, no more lends; the request completes with the same tokens."""
    from engine.faults import Faults

    faults = Faults()
    faults.arm("cache-lend:mtp.draft_head")
    warnings: list[str] = []
    opts = make(random_demo_path, lend=True).options
    loop = ServeLoop.create(opts, on_trace=warnings.append, faults=faults)
    ids = prompt_tokens(loop, 300)
    settled_plain(loop)
    reply = loop.complete(ids, max_new=20)
    assert any("lending the MTP regions to the expert cache failed" in w for w in warnings)
    lender = loop.rt.spec.lender
    assert lender.off and lender.n_lends == 0 and set(REGIONS) <= regions(loop)
    loop.rt.check_integrity()
    plain = make(random_demo_path, lend=False)
    settled_plain(plain)
    assert plain.complete(ids, max_new=20).text == reply.text


def test_a_new_engine_goes_on_from_the_last_policy(random_demo_path: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The drafting policy of a greedy request is kept beside the rates: the next engine on the
    same model and device starts where it stopped (plain, lending at its first step)."""
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    first = make(random_demo_path, lend=True)
    ids = prompt_tokens(first, 300)
    settled_plain(first)
    first.complete(ids, max_new=8)
    assert first.keeper.policy_file.exists()
    second = make(random_demo_path, lend=True)
    policy = second.rt.spec.policy
    assert policy.home == PLAIN and policy.plain_ahead() >= 32
    reply = second.complete(ids, max_new=8)
    assert reply.timing.drafted_steps == 0 and second.rt.spec.lender.n_lends == 1
    other = tmp_path / "x.policy.json"
    other.write_text("not json")
    from engine.speculative import policy as draft_policy

    assert draft_policy.load(other, "cpu") is None  # an unreadable file: measured from scratch


def test_the_policy_round_trips_through_json() -> None:
    p = DraftPolicy()
    for seconds, tokens in ((0.03, 1), (0.02, 1), (0.014, 1), (0.015, 1), (0.013, 1)):
        p.measured(seconds, tokens)
    p.caught_up(0.64, 32_000)
    p.plain_s = 1.5
    q = DraftPolicy.from_json(p.as_json())
    assert q.as_json() == p.as_json() and q.drafting() == p.drafting()
    assert (q.row_s, q.plain_s) == (p.row_s, 1.5)
    old = {k: v for k, v in p.as_json().items() if k not in ("row_s", "plain_s")}
    assert DraftPolicy.from_json(old).row_s is None  # a file from before: measured again
    with pytest.raises(ValueError):
        DraftPolicy.from_json({**p.as_json(), "home": "sometimes"})


def test_a_probe_whose_catch_up_costs_too_much_waits(random_demo_path: Path) -> None:
    """The decoder tells the policy how many rows a probe would catch the draft model up on
    (here the deferred 300-token prompt and the plain steps since): at a measured 1 s a row no
    probe fits the plain time of a 64-token reply; before any measurement it probes."""
    replies = {}
    for row_s in (None, 1.0):
        loop = make(random_demo_path, lend=True)
        ids = prompt_tokens(loop, 300)
        settled_plain(loop, span=LEND_SPAN)  # long enough to defer the prompt's pass
        loop.rt.spec.policy.row_s = row_s
        replies[row_s] = loop.complete(ids, max_new=LEND_SPAN + 24)
        loop.rt.check_integrity()
    assert replies[None].timing.drafted_steps > 0  # the probe after the span (it measures)
    assert replies[1.0].timing.drafted_steps == 0
    assert replies[1.0].text == replies[None].text


# -- an explicit option, off by default, its lines named apart (issue 27 item 10) -------------

def test_off_by_default_the_mtp_regions_stay_resident(random_demo_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With no STRATA_PREFILL_* variable and no --cache-lend, the default path is unchanged: a
    long plain span lends nothing, the MTP regions never leave the ledger, and no line says
    'strata loan:' or 'strata lend:'."""
    from engine.trace.events import EventBus, LedgerChanged

    for var in [v for v in os.environ if v.startswith("STRATA_PREFILL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("STRATA_TRACE", "1")
    assert EngineOptions().cache_lend is False
    bus, lines = EventBus(), []
    seen: list[set[str]] = []
    bus.subscribe(lambda e: seen.append({r.name for r in e.regions})
                  if isinstance(e, LedgerChanged) else None)
    opts = EngineOptions(model=str(random_demo_path), device="sim:40MiB", ctx=2048, mtp=True,
                         spec=2, draft_vocab=3000, expert_cache=40)
    loop = ServeLoop.create(opts, LoanFlags.from_env(), bus, on_trace=lines.append)
    assert loop.rt.spec.lender is None and not loop.flags.elastic_loan
    settled_plain(loop)
    n0 = loop.rt.cache.n_slots
    seen.clear()  # from here on: the request
    reply = loop.complete(prompt_tokens(loop, 300), max_new=40)
    assert reply.timing.drafted_steps == 0 and loop.rt.cache.n_slots == n0
    assert all(set(REGIONS) <= names for names in seen) and set(REGIONS) <= regions(loop)
    assert not [ln for ln in lines if ln.startswith(("strata loan:", "strata lend:"))]


def test_its_trace_lines_say_lend_not_loan(random_demo_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--cache-lend on, the prefill loan off: the lend's lines begin 'strata lend:' and no
    line claims a prefill loan."""
    monkeypatch.setenv("STRATA_TRACE", "1")
    lines: list[str] = []
    loop = make(random_demo_path, lend=True, lines=lines)
    settled_plain(loop)
    loop.complete(prompt_tokens(loop, 300), max_new=40)
    lend = [ln for ln in lines if "decoding plain" in ln or "drafting again" in ln]
    assert lend and all(ln.startswith(PREFIX) for ln in lend), lend
    assert not [ln for ln in lines if ln.startswith("strata loan:")]


def test_the_option_on_the_command_line_and_in_the_app() -> None:
    """`--cache-lend` (documented in its help) asks for it; the chat app turns it on with its
    loan defaults, `--plain` leaves it off."""
    from app.config import add_chat_args, chat_config
    from engine.cli import OneLineParser
    from engine.cli.options import add_engine_args, engine_options, options_argv

    p = OneLineParser(prog="t")
    add_engine_args(p)
    assert not engine_options(p.parse_args([])).cache_lend
    on = engine_options(p.parse_args(["--mtp", "--spec", "2", "--cache-lend"]))
    assert on.cache_lend and options_argv(on) == ["--mtp", "--spec", "2", "--cache-lend"]
    text = " ".join(p.format_help().split())  # as wrapped for the terminal
    assert "--cache-lend with --mtp --spec: lend the MTP experts" in text
    assert "'strata lend:'; default: off" in text
    app = OneLineParser(prog="chat")
    add_chat_args(app)
    assert chat_config(app.parse_args([])).options.cache_lend
    assert not chat_config(app.parse_args(["--plain"])).options.cache_lend
