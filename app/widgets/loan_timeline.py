"""LoanTimeline: the phases of the current request's loan transaction with their durations."""

from __future__ import annotations

from dataclasses import dataclass, replace

from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import fmt_bytes, fmt_ms
from app.widgets.request_label import RequestLabel
from engine.trace.events import (
    Event,
    LoanStep,
    PlanChosen,
    PrefillProgress,
    RequestDone,
    RequestStarted,
)

STEP_STYLES = {
    "release": "#d7875f",
    "plan": "#87afd7",
    "lend": "#ff8700",
    "prefill": "#00afaf",
    "refill": "#ffd75f",
    "restore": "#5faf5f",
    "failed": "bold red",
    "cancelled": "bold yellow",
}
LABEL_WIDTH = 10
MS_WIDTH = 10


@dataclass(frozen=True)
class Phase:
    step: str
    ms: float
    detail: str = ""
    running: bool = False


class LoanTimeline(EventView):
    """One row per phase (release, plan, lend, prefill, refill, restore), bars to scale; the
    caption names the request and whether it took a loan."""

    TITLE = "Loan timeline"

    DEFAULT_CSS = """
    LoanTimeline {
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    phases: reactive[tuple[Phase, ...]] = reactive(())  # a layout only if the height changes
    loan: reactive[bool | None] = reactive(None)
    label: reactive[RequestLabel] = reactive(RequestLabel)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._open = False
        self._prefill_t0 = 0.0

    def _begin(self) -> None:
        if not self._open:
            self._open, self.phases, self.loan = True, (), None

    def apply_event(self, event: Event) -> None:
        if isinstance(event, RequestStarted):  # never the last request's phases under its name
            self._open = False
            self._begin()
        elif isinstance(event, LoanStep):
            self._begin()
            detail = event.detail.removeprefix("strata loan: ").removeprefix("strata trace: ")
            if event.n_bytes:
                detail = (
                    f"{detail} ({fmt_bytes(event.n_bytes)})" if detail else fmt_bytes(event.n_bytes)
                )
            self._add(Phase(event.step, event.ms, detail))
        elif isinstance(event, PlanChosen):
            self._begin()
            self.loan = event.loan
            self._prefill_t0 = event.t
            chunks = "1 chunk" if event.n_chunks == 1 else f"{event.n_chunks} chunks"
            detail = f"{chunks} of {event.chunk_tokens:,}"
            self._add(Phase("prefill", 0.0, detail, running=True))
        elif isinstance(event, PrefillProgress):
            self._set_prefill(ms=(event.t - self._prefill_t0) * 1e3, running=True)
        elif isinstance(event, RequestDone):
            self._set_prefill(ms=event.prefill_s * 1e3, running=False)
            self._open = False
        self.label = self.label.after(event)

    def conversation_changed(self, why: str) -> None:
        """The user left the conversation of the request shown (ctrl+n, another opened)."""
        self.label = self.label.left(why)

    def _add(self, phase: Phase) -> None:
        """A row in the transaction's order (the lend arrives after the prefill row opens)."""
        order = list(STEP_STYLES)
        rank = lambda p: order.index(p.step) if p.step in order else len(order)
        self.phases = tuple(sorted((*self.phases, phase), key=rank))

    def _set_prefill(self, ms: float, running: bool) -> None:
        self.phases = tuple(
            replace(p, ms=ms, running=running) if p.step == "prefill" else p for p in self.phases
        )

    def watch_loan(self) -> None:
        self._caption()

    def watch_label(self) -> None:
        self._caption()

    def _caption(self) -> None:
        parts = [self.label.text(), "" if self.loan is None else
                 f"loan {'on' if self.loan else 'off'}"]
        self.caption(" · ".join(p for p in parts if p))

    def render(self) -> Text:
        if not self.phases:
            return Text("waiting for the plan…" if self.label.running else "no request yet",
                        style="dim")
        width = max(1, self.content_width() - LABEL_WIDTH - MS_WIDTH - 2)
        bar_width = max(4, width // 2)
        longest = max(p.ms for p in self.phases) or 1.0
        text = Text()
        for i, p in enumerate(self.phases):
            style = STEP_STYLES.get(p.step, "white")
            n = max(1, round(bar_width * p.ms / longest)) if p.ms > 0 else 1
            if i:
                text.append("\n")
            text.append(f"{p.step:<{LABEL_WIDTH}}", style=style)
            text.append(("█" * n).ljust(bar_width), style=style)
            ms = fmt_ms(p.ms) + ("…" if p.running else " ")
            text.append(f"{ms:>{MS_WIDTH}} ")
            text.append(p.detail, style="dim")
        return text
