"""CompactStrip: the dashboard in two lines, above the chat when the dashboard is not shown
(below 100 columns it shares the screen with the chat, so F2 never hides the input)."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import fmt_bytes, fmt_ms, rate, region_color
from app.widgets.vram_bar import BLOCK, OUTSIDE, bar_cells, held_bytes, limit_bytes
from engine.trace.events import (
    CacheChanged,
    Event,
    LedgerChanged,
    PlanChosen,
    PrefillProgress,
    RequestDone,
    RequestStarted,
)

BAR_CELLS = 16  # the VRAM bar: wide enough to show the loan's regions grow and shrink


class CompactStrip(EventView):
    """Line 1: a VRAM bar with held / limit, the expert cache's lent slots, the prompt plan.
    Line 2: the running request's prefill progress, else the last request's PP and TG (and,
    when it was cancelled or failed in the prefill, how much of the prompt it read)."""

    DEFAULT_CSS = """
    CompactStrip {
        height: 2;
        min-height: 2;
        border: none;
        padding: 0 1;
        background: $boost;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    # each repaints two lines; the height never changes, so no layout
    ledger: reactive[LedgerChanged | None] = reactive(None)
    cache: reactive[CacheChanged | None] = reactive(None)
    plan: reactive[PlanChosen | None] = reactive(None)
    progress: reactive[PrefillProgress | None] = reactive(None)
    done: reactive[RequestDone | None] = reactive(None)
    running: reactive[bool] = reactive(False)

    def apply_event(self, event: Event) -> None:
        if isinstance(event, LedgerChanged):
            self.ledger = event
        elif isinstance(event, CacheChanged):
            self.cache = event
        elif isinstance(event, RequestStarted):
            self.running, self.progress = True, None
        elif isinstance(event, PlanChosen):
            self.plan, self.progress = event, None
        elif isinstance(event, PrefillProgress):
            self.progress = event
        elif isinstance(event, RequestDone):
            self.running, self.done = False, event

    def render(self) -> Text:
        text = self.memory_line()
        text.append("\n")
        text.append_text(self.request_line())
        return text

    def memory_line(self) -> Text:
        """'VRAM ████░░ 3.4 MiB / 4 MiB · lent 0 of 16 slots · plan 256 / 8, loan off'."""
        text = Text("VRAM ", style="bold")
        ledger = self.ledger
        if ledger is None:
            return text.append("waiting for the memory ledger…", style="dim")
        held, limit = held_bytes(ledger), limit_bytes(ledger)
        parts = [(r.name, r.mapped_bytes) for r in ledger.regions]
        parts += [(OUTSIDE, ledger.unaccounted_bytes or 0), ("free", max(0, limit - held))]
        for name, n in bar_cells(parts, max(limit, held), BAR_CELLS):
            text.append(BLOCK * n, style=region_color(name))
        text.append(f" {fmt_bytes(held)} / {fmt_bytes(limit)}")
        cache = self.cache
        if cache is not None:
            style = "bold #ff8700" if cache.n_lent else ""
            text.append(" · ")
            text.append(f"lent {cache.n_lent} of {len(cache.states):,} slots", style=style)
        plan = self.plan
        if plan is not None:
            text.append(f" · plan {plan.chunk_tokens:,} / {plan.ring_slots}, loan ")
            text.append("on" if plan.loan else "off", style="bold green" if plan.loan else "dim")
        return text

    def request_line(self) -> Text:
        """The prefill's progress while a request reads its prompt, else the last figures."""
        prog, done = self.progress, self.done
        if self.running:
            if prog is None:
                return Text("request running: planning the prompt…", style="dim")
            return Text.assemble(
                ("prefill ", "bold"),
                f"chunk {prog.chunk} of {prog.n_chunks} · {prog.tokens_done:,} of "
                f"{prog.tokens_total:,} tokens · last chunk {fmt_ms(prog.chunk_ms)}",
            )
        if done is None:
            return Text("no request yet · F2 shows the dashboard", style="dim")
        tg = rate(done.generated, done.decode_s * 1e3) if done.decoded else "–"
        text = Text.assemble(
            ("last request ", "dim"),
            ("PP ", "bold"), rate(done.n_read, done.prefill_s * 1e3),
            " · ", ("TG ", "bold"), tg,
        )
        word = "failed" if done.failed else "cancelled" if done.cancelled else ""
        if word:
            # a stopped prefill: how much of the prompt it read (the PP above is of those)
            read = (f": {done.n_read:,} of {done.fresh_tokens:,} read"
                    if done.read_tokens is not None else "")
            text.append(f" · {word}{read}", style="red" if done.failed else "yellow")
        return text
