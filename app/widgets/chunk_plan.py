"""ChunkPlan: the prompt plan of the current request and its prefill progress."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.reactive import reactive
from textual.widgets import ProgressBar, Static

from app.widgets.base import EventView
from app.widgets.fmt import fmt_ms
from app.widgets.request_label import RequestLabel
from engine.trace.events import Event, PlanChosen, PrefillProgress, RequestDone, RequestStarted

MAX_REASONS = 3  # one line each; the tooltip has them all


class ChunkPlan(EventView):
    """`chunk tokens / ring slots`, loan on/off, chunks done/total, ms per chunk, a bar; the
    caption names the request (running, finished, or of a conversation the user left)."""

    TITLE = "Prompt plan"

    DEFAULT_CSS = """
    ChunkPlan {
        min-height: 0;
        & > Static { height: auto; text-wrap: nowrap; text-overflow: ellipsis; }
        & > ProgressBar { width: 1fr; }
        & Bar { width: 1fr; }
    }
    """

    plan: reactive[PlanChosen | None] = reactive(None)
    progress: reactive[PrefillProgress | None] = reactive(None)
    mean_chunk_ms: reactive[float] = reactive(0.0)
    label: reactive[RequestLabel] = reactive(RequestLabel)
    _n_lines = 0  # lines of the plan text: a layout only when that changes

    def compose(self) -> ComposeResult:
        yield Static(Text("no request yet", style="dim"), id="plan-text")
        yield ProgressBar(total=1, show_eta=False, id="prefill-bar")

    def apply_event(self, event: Event) -> None:
        self.label = self.label.after(event)  # first: the redraw below reads it
        if isinstance(event, RequestStarted):  # never the last request's plan under its name
            self.mean_chunk_ms = 0.0
            self.progress = None
            self.plan = None
        elif isinstance(event, PlanChosen):
            self.mean_chunk_ms = 0.0
            self.progress = None
            self.plan = event
        elif isinstance(event, PrefillProgress):
            self.progress = event
        elif isinstance(event, RequestDone) and self.progress is not None:
            # the queue keeps only the newest progress per tick, so average from the total
            self.mean_chunk_ms = event.prefill_s * 1e3 / max(1, self.progress.chunk)

    def conversation_changed(self, why: str) -> None:
        """The user left the conversation of the request shown (ctrl+n, another opened)."""
        self.label = self.label.left(why)

    def watch_label(self, label: RequestLabel) -> None:
        self.caption(label.text())
        self._redraw()

    def watch_plan(self) -> None:
        self._redraw()

    def watch_progress(self) -> None:
        self._redraw()

    def watch_mean_chunk_ms(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        if not self.is_mounted:
            return
        plan, prog = self.plan, self.progress
        bar = self.query_one("#prefill-bar", ProgressBar)
        if plan is None:
            if self.label.running:  # admitted, not planned yet
                self.query_one("#plan-text", Static).update(
                    Text("planning…", style="dim"), layout=self._n_lines != 1)
                self._n_lines = 1
                bar.update(total=1, progress=0)
            return
        text = Text()
        text.append(f"{plan.chunk_tokens:,} / {plan.ring_slots}", style="bold")
        text.append(" chunk tokens / ring slots · loan ")
        text.append("on" if plan.loan else "off", style="bold green" if plan.loan else "dim")
        done = prog.chunk if prog else 0
        text.append(f"\nchunk {done} of {plan.n_chunks}")
        text.append(f" · {prog.tokens_done if prog else 0:,} of {plan.fresh_tokens:,} tokens")
        if prog is not None:
            text.append(f"\nlast chunk {fmt_ms(prog.chunk_ms)}")
        if self.mean_chunk_ms:
            text.append(f" · mean {fmt_ms(self.mean_chunk_ms)} per chunk")
        for reason in plan.reasons[:MAX_REASONS]:
            text.append(f"\n· {reason}", style="dim")
        self.tooltip = "\n".join(plan.reasons) or None
        n_lines = text.plain.count("\n") + 1  # the text does not wrap (nowrap, ellipsis)
        self.query_one("#plan-text", Static).update(text, layout=n_lines != self._n_lines)
        self._n_lines = n_lines
        bar.update(total=plan.fresh_tokens, progress=prog.tokens_done if prog else 0)
