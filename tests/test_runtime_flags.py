"""Runtime option changes: validated like startup flags, applied from the next request."""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineOptions, LoanFlags
from engine.conversation import Conversation
from engine.events import EventBus, FlagsRefused, PlanChosen
from engine.serve import ServeLoop


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


def test_no_token_graph_is_a_runtime_flag(demo_path: Path) -> None:
    """Accepted between requests (on CUDA it drops or captures the decode graphs; the
    simulated device decodes eagerly either way and keeps answering the same)."""
    loop = ServeLoop.create(EngineOptions(model=str(demo_path), ctx=1024))
    ids = loop.rt.model.tokenizer.encode("the river runs through the old city")
    a = loop.complete(list(ids), max_new=4).text
    assert loop.set_flags(loop.flags, loop.options.with_changes(no_token_graph=True)) == []
    assert loop.complete(list(ids), max_new=4).text == a
    assert loop.rt.options.no_token_graph and loop.rt.model.transformer.token_graph is None
    assert "token graph" not in loop.rt.summary()
