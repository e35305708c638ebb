"""TimingPanel: the last finished request's figures (the timing line, as numbers), named; while
a request runs, its own progress instead."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive

from app.widgets.base import EventView
from app.widgets.fmt import fmt_bytes, fmt_ms, rate
from app.widgets.request_label import RequestLabel
from engine.trace.events import Event, PrefillProgress, RequestDone, RequestStarted


class TimingPanel(EventView):
    """PP, the prefill's forecast against what it took, TG, TTFT, drafts accepted (and how
    many steps drafted), the decode steps' expert-cache hits (and promotions) and bytes
    streamed of the last finished request. The caption names the request ('request 12 ·
    prompt 5,570 tokens', 'new conversation: last request 11'); while one runs ('request 13 ·
    running') the panel shows its prompt and prefill progress, never the last one's figures
    as if they were its own."""

    TITLE = "Timing"

    done: reactive[RequestDone | None] = reactive(None)  # a layout only if the height changes
    label: reactive[RequestLabel] = reactive(RequestLabel)
    started: reactive[RequestStarted | None] = reactive(None)  # the running request
    progress: reactive[PrefillProgress | None] = reactive(None)
    _done_id = 0  # the request whose figures `done` holds (0: unknown)

    def apply_event(self, event: Event) -> None:
        if isinstance(event, RequestStarted):
            self.progress = None
            self.started = event
        elif isinstance(event, PrefillProgress):
            self.progress = event
        elif isinstance(event, RequestDone):
            self.started, self.progress = None, None
            self.done = event
        self.label = self.label.after(event)
        if isinstance(event, RequestDone):
            self._done_id = self.label.request_id

    def conversation_changed(self, why: str) -> None:
        """The user left the conversation of the request shown (ctrl+n, another opened)."""
        self.label = self.label.left(why)

    def watch_label(self, label: RequestLabel) -> None:
        self.caption(label.text())

    def render(self) -> Table | Text:
        if self.started is not None:
            return self._in_progress(self.started)
        d = self.done
        if d is None:
            return Text("no request yet", style="dim")
        # one fact a row, label and value: the pane is ~45 cells wide at 120 columns, where
        # two facts a row wrapped inside their cells
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        if d.failed:
            table.add_row(Text("failed", style="bold red"), Text(d.error, style="red"))
        # a stopped prefill: what it read (whole chunks) in the time it ran, of its fresh tokens
        stopped = d.read_tokens is not None
        read = f"{d.n_read:,} of {d.fresh_tokens:,}" if stopped else f"{d.fresh_tokens:,}"
        pp = rate(d.n_read, d.prefill_s * 1e3) if d.n_read else "–"
        table.add_row("PP", f"{pp} · {read} in {fmt_ms(d.prefill_s * 1e3)}")
        if d.forecast_s and d.prefill_s and not stopped:  # the forecast made before it ran
            error = 100 * (d.forecast_s / d.prefill_s - 1)
            table.add_row("forecast", f"{fmt_ms(d.forecast_s * 1e3)} · measured "
                                      f"{fmt_ms(d.prefill_s * 1e3)} ({error:+.0f}%)")
        tg = rate(d.generated, d.decode_s * 1e3) if d.decoded else "–"  # no decode step: no TG
        table.add_row("TG", f"{tg} · {d.generated:,} in {fmt_ms(d.decode_s * 1e3)}"
                      if d.generated else "– · nothing generated")
        table.add_row("TTFT", fmt_ms(d.ttft_s * 1e3) if d.ttft_s else "–")
        fresh = (f"{d.fresh_tokens:,} fresh, {d.n_read:,} read" if stopped
                 else f"{d.fresh_tokens:,} read")
        table.add_row("prompt", f"{d.prompt_tokens:,} = {d.reused_tokens:,} reused + {fresh}")
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

    def _in_progress(self, s: RequestStarted) -> Table:
        """The running request: its prompt, how far the prefill is; the last one's PP and TG
        on a dim line named as the last one's."""
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_row("prompt", f"{s.prompt_tokens:,} = {s.prompt_tokens - s.fresh_tokens:,} "
                                f"reused + {s.fresh_tokens:,} to read")
        p = self.progress
        if p is None:
            table.add_row("prefill", "starting")
        elif p.tokens_done < p.tokens_total:
            table.add_row("prefill", f"{p.tokens_done:,} of {p.tokens_total:,} tokens · "
                                     f"chunk {p.chunk} of {p.n_chunks}")
        else:
            chunks = "1 chunk" if p.n_chunks == 1 else f"{p.n_chunks} chunks"
            table.add_row("prefill", f"done ({chunks}) · generating")
        d = self.done
        if d is not None:
            tg = rate(d.generated, d.decode_s * 1e3) if d.decoded else "–"
            whose = f"request {self._done_id}" if self._done_id else "the last request"
            table.add_row(Text("before", style="dim"),
                          Text(f"PP {rate(d.n_read, d.prefill_s * 1e3)} · TG {tg} "
                               f"({whose})", style="dim"))
        return table
