"""TimingPanel: the last request's figures (the timing line, as numbers)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import fmt_bytes, fmt_ms, rate
from engine.events import Event, RequestDone


class TimingPanel(EventView):
    """PP, the prefill's forecast against what it took, TG, TTFT, drafts accepted (and how
    many steps drafted), the decode steps' expert-cache hits (and promotions) and bytes
    streamed of the last finished request."""

    TITLE = "Timing"

    done: reactive[RequestDone | None] = reactive(None)  # a layout only if the height changes

    def apply_event(self, event: Event) -> None:
        if isinstance(event, RequestDone):
            self.done = event

    def watch_done(self, done: RequestDone | None) -> None:
        self.caption("cancelled" if done is not None and done.cancelled else "")

    def render(self) -> Table | Text:
        d = self.done
        if d is None:
            return Text("no request yet", style="dim")
        # one fact a row, label and value: the pane is ~45 cells wide at 120 columns, where
        # two facts a row wrapped inside their cells
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_row("PP", f"{rate(d.fresh_tokens, d.prefill_s * 1e3)} · "
                            f"{d.fresh_tokens:,} in {fmt_ms(d.prefill_s * 1e3)}")
        if d.forecast_s and d.prefill_s:  # the loan forecast, made before the request ran
            error = 100 * (d.forecast_s / d.prefill_s - 1)
            table.add_row("forecast", f"{fmt_ms(d.forecast_s * 1e3)} · measured "
                                      f"{fmt_ms(d.prefill_s * 1e3)} ({error:+.0f}%)")
        tg = rate(d.generated, d.decode_s * 1e3) if d.decoded else "–"  # no decode step: no TG
        table.add_row("TG", f"{tg} · {d.generated:,} in {fmt_ms(d.decode_s * 1e3)}")
        table.add_row("TTFT", fmt_ms(d.ttft_s * 1e3) if d.ttft_s else "–")
        table.add_row("prompt", f"{d.prompt_tokens:,} = {d.reused_tokens:,} reused + "
                                f"{d.fresh_tokens:,} read")
        if d.drafts_offered or d.spec_steps:
            drafts = (f"{d.drafts_accepted} of {d.drafts_offered} "
                      f"({100 * d.drafts_accepted / max(1, d.drafts_offered):.0f}%)")
            if d.spec_steps:  # the drafting policy may have run plain steps
                drafts += f" · {d.drafted_steps}/{d.spec_steps} steps"
            table.add_row("drafts", drafts)
        n = d.decode_hits + d.decode_misses
        if n:  # the decode steps' expert reads: from the cache, or over the link
            promoted = f" · {d.decode_promoted:,} promoted" if d.decode_promoted else ""
            table.add_row("cache", f"{100 * d.decode_hits / n:.0f}% hits{promoted}")
        table.add_row("streamed", fmt_bytes(d.bytes_streamed))
        return table
