"""The prompt composer: a multi-line input whose long pastes collapse into chips.

Enter sends; ctrl+j (shift+enter or alt+enter where the terminal reports them) inserts a
newline. A bracketed paste longer than LONG_PASTE_LINES lines or LONG_PASTE_CHARS characters
is kept aside and stands in the text as a marker `[paste #N: L lines]`; a chip above the input
shows its line and token counts, and the last chip what the engine says the message will get:
the loan it would take (or why not) and the forecast ("repeat loan: 5.0 s -> 3.9 s"). The
counting and the question run in a thread worker, never on the UI thread: a huge paste does
not stop typing. Sending expands every marker into the full text.

A message that cannot fit --ctx, pasted or typed, says so under the input before Enter (the
engine's rule, asked the same way: `ServeLoop.preview`'s ContextFullError), with the numbers
and what to do, and Enter refuses it. Typed text is asked about once typing pauses for
MEASURE_DELAY_S, never on every key; Enter pressed before the answer about the text as it is
now waits for that answer, then sends or refuses.

Up on the first line and Down on the last walk the prompts sent before (`PromptHistory`); a
message put back to be edited (`edit`) is sent again in its place, Esc stops editing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import Static, TextArea
from textual.widgets.text_area import EditResult

from app.chat_actions import EditTarget
from app.draft import Draft
from app.message_text import Location, stray_markers, tidy, too_long_line, whole_markers
from app.prompt_history import PromptHistory
from engine.errors import ContextFullError, StrataError, TextTooLongError
from engine.loan.forecast import LoanVerdict

LONG_PASTE_LINES = 10
LONG_PASTE_CHARS = 1000
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")
MEASURE_DELAY_S = 0.4  # typing asks the engine again after this pause


def newlines(text: str) -> str:
    """Terminals send pasted line ends as CR (or CR LF); the engine gets LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def count_lines(text: str) -> int:
    """Lines of `text` as an editor counts them: a final newline ends a line, starts none."""
    return len(text.splitlines())


def is_long_paste(text: str) -> bool:
    return count_lines(text) > LONG_PASTE_LINES or len(text) > LONG_PASTE_CHARS


@dataclass(frozen=True)
class PastedText:
    """A collapsed paste: its full text and what the chip says about it."""

    n: int
    text: str
    n_tokens: int | None

    @property
    def n_lines(self) -> int:
        return count_lines(self.text)

    @property
    def marker(self) -> str:
        return f"[paste #{self.n}: {self.n_lines:,} lines]"


def expand(text: str, pastes: tuple[PastedText, ...]) -> str:
    for paste in pastes:
        text = text.replace(paste.marker, paste.text)
    return text


def chip_text(paste: PastedText, verdict: Text | None = None) -> Text:
    """A paste's chip: its line and token counts ('counting' until the worker has them), then
    `verdict` (the last chip carries the message's)."""
    chip = Text.assemble(
        (f" ▤ paste #{paste.n} ", "bold reverse"),
        f" {paste.n_lines:,} lines · ",
        f"{paste.n_tokens:,} tokens" if paste.n_tokens is not None
        else ("counting tokens…", "dim"),
    )
    if verdict is not None:
        chip.append(" · ")
        chip.append_text(verdict)
    return chip


def verdict_text(verdict: LoanVerdict | None, error: str = "") -> Text:
    """What the engine says the message will get: 'repeat loan: 5.0 s -> 3.9 s' (green), 'no
    loan (300 fresh < 1,024): 0.6 s' (yellow), 'loan: engine loading' or the error (dim)."""
    if error:
        return Text(f"no forecast: {error}", style="dim")
    if verdict is None:
        return Text("loan: engine loading", style="dim")
    if verdict.kind is not None and verdict.with_loan is not None:
        return Text(verdict.line(), style="bold green")
    return Text(verdict.line(), style="yellow")


class PromptInput(TextArea):
    """TextArea where Enter sends and long pastes are handed to the composer."""

    @dataclass
    class Submitted(Message):
        text: str

    @dataclass
    class LongPaste(Message):
        text: str

    @dataclass
    class Recall(Message):
        """Up on the first line (older) or Down on the last (newer): a history step."""

        older: bool

    def show_hint(self, description: str) -> None:
        """Show the model's own suggestion of what to try (the 'Try: ...' part of its
        description) while the input is empty; nothing when it has none."""
        at = description.find("Try:")
        self.placeholder = description[at:].strip() if at >= 0 else ""

    def action_cursor_up(self, select: bool = False) -> None:
        first = self.navigator.is_first_wrapped_line(self.cursor_location)
        super().action_cursor_up(select)
        if first and not select:
            self.post_message(self.Recall(older=True))

    def action_cursor_down(self, select: bool = False) -> None:
        last = self.navigator.is_last_wrapped_line(self.cursor_location)
        super().action_cursor_down(select)
        if last and not select:
            self.post_message(self.Recall(older=False))

    # A keyboard edit never cuts into a paste's marker: it takes the whole marker (as its own
    # undo step, so one ctrl+z brings the chip back), or types beside it.
    def _delete_via_keyboard(self, start: Location, end: Location) -> EditResult | None:
        return self._replace_via_keyboard("", start, end)

    def _replace_via_keyboard(self, insert: str, start: Location,
                              end: Location) -> EditResult | None:
        whole = whole_markers(self.document.get_line, start, end)
        takes_marker = whole[0] != whole[1] and whole != tuple(sorted((start, end)))
        if takes_marker:
            self.history.checkpoint()
        result = super()._replace_via_keyboard(insert, *whole)
        if takes_marker:
            self.history.checkpoint()
        return result

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        # short pastes fall through to TextArea's own handler (Textual calls it after this one)
        text = newlines(event.text)
        if not self.read_only and is_long_paste(text):
            event.stop()
            event.prevent_default()
            self.post_message(self.LongPaste(text))

    def paste(self, text: str) -> None:
        """Paste `text` as a bracketed paste would (the app's pastes made elsewhere)."""
        text = newlines(text)
        if is_long_paste(text):
            self.post_message(self.LongPaste(text))
        else:
            self.insert(text)


class Composer(Vertical):
    """PromptInput plus the chips of its collapsed pastes; posts `Composer.Send`."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop_editing", "Stop editing"),
    ]

    DEFAULT_CSS = """
    Composer {
        height: auto;
        max-height: 50%;
        & > #chips {
            height: auto; padding: 0 1; color: $text-accent;
            text-wrap: nowrap; text-overflow: ellipsis;
        }
        & > PromptInput {
            height: auto; min-height: 3; max-height: 12; border: round $accent 50%; padding: 0 1;
        }
        & > PromptInput:focus { border: round $accent; }
        & > #editing { display: none; height: auto; padding: 0 1; color: $text-warning; }
        & > #editing.-shown { display: block; }
        & > #too-long { display: none; height: auto; padding: 0 1; color: $text-error; }
        & > #too-long.-shown { display: block; }
        & > PromptInput.-too-long, & > PromptInput.-too-long:focus { border: round $error; }
    }
    """

    @dataclass
    class Send(Message):
        """The user pressed Enter: the expanded prompt and the draft to put back on cancel;
        `edit`: the message it is sent again in place of (None: a new message)."""

        prompt: str
        draft: Draft
        edit: EditTarget | None = None

    @dataclass
    class Measured(Message):
        """A worker's counts (paste number -> tokens) and the engine's verdict on the message."""

        generation: int
        counts: dict[int, int | None]
        verdict: LoanVerdict | None
        error: str = ""
        message: str = ""  # the text measured
        too_long: str = ""  # it cannot fit the context: the line that says so (too_long_line)

    pastes: reactive[tuple[PastedText, ...]] = reactive((), layout=True)
    verdict: reactive[LoanVerdict | None] = reactive(None)
    editing: reactive[EditTarget | None] = reactive(None)

    def __init__(self, count_tokens: Callable[[str], int | None],
                 ask: Callable[[str], LoanVerdict | None], **kwargs: object) -> None:
        """`count_tokens(text)` and `ask(message)` (the engine's verdict on sending it) run in
        a worker thread; either returns None while the engine is loading."""
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.count_tokens, self.ask = count_tokens, ask
        self._next_n = 1
        self._generation = 0  # measurements started; an older one's answer is dropped
        self._error = ""
        self._pending: Timer | None = None
        self.history = PromptHistory()  # the app gives it the store's prompts
        self._before_edit: Draft | None = None  # the input before `edit`, back after it
        self._too_long: tuple[str, str] | None = None  # (message, why) when it cannot fit
        self._send_when_measured = False  # Enter waits for the answer about the text as it is
        self._removed: dict[str, PastedText] = {}  # chips an edit took (by marker): ctrl+z

    def compose(self) -> ComposeResult:
        yield Static(id="editing")
        yield Static(id="chips")
        yield Static(id="too-long")
        yield PromptInput(id="prompt", soft_wrap=True, show_line_numbers=False)

    @property
    def input(self) -> PromptInput:
        return self.query_one(PromptInput)

    def watch_pastes(self) -> None:
        self._draw_chips()

    def watch_verdict(self) -> None:
        self._draw_chips()

    def _draw_chips(self) -> None:
        chips = self.query_one("#chips", Static)
        chips.display = bool(self.pastes)
        last = len(self.pastes) - 1
        too_long = self._too_long[1] if self._too_long is not None else ""
        verdict = (Text("cannot fit --ctx: not sent", style="bold red") if too_long
                   else verdict_text(self.verdict, self._error))
        line = self.query_one("#too-long", Static)
        line.set_class(bool(too_long), "-shown")
        line.update(Text(too_long))
        self.input.set_class(bool(too_long), "-too-long")
        chips.update(Text("\n").join(chip_text(p, verdict if i == last else None)
                                     for i, p in enumerate(self.pastes)))

    # -- asking the engine (in a worker) ---------------------------------------------------
    def measure(self) -> None:
        """Count the pastes' tokens and ask the engine what the message would get (whether it
        fits --ctx, typed or pasted), in a thread worker; the answer comes back as `Measured`
        (a newer measurement supersedes it)."""
        if self._pending is not None:
            self._pending.stop()
            self._pending = None
        self._generation += 1
        generation, pastes = self._generation, self.pastes
        message = tidy(expand(self.input.text, pastes))
        if not message:
            self.verdict, self._too_long, self._error = None, None, ""
            self._draw_chips()
            self._answer_enter()
            return

        def work() -> None:
            counts: dict[int, int | None] = {}
            try:
                for p in pastes:
                    counts[p.n] = (p.n_tokens if p.n_tokens is not None
                                   else self.count_tokens(p.text))
                answer = self.Measured(generation, counts, self.ask(message), message=message)
            except (ContextFullError, TextTooLongError) as e:  # said before Enter, with numbers
                answer = self.Measured(generation, counts, None, message=message,
                                       too_long=too_long_line(e))
            except StrataError as e:  # e.g. the message would not fit the context
                answer = self.Measured(generation, counts, None, str(e))
            self.post_message(answer)

        self.run_worker(work, thread=True, exclusive=True, group="composer-measure")

    def on_composer_measured(self, message: Measured) -> None:
        message.stop()
        if message.generation != self._generation:
            return
        self._error = message.error
        self._too_long = (message.message, message.too_long) if message.too_long else None
        self.pastes = tuple(
            p if p.n_tokens is not None else replace(p, n_tokens=message.counts.get(p.n))
            for p in self.pastes
        )
        self.verdict = message.verdict if self.pastes else None  # shown on the last chip
        self._draw_chips()  # the error alone changes no reactive
        self._answer_enter()

    def _answer_enter(self) -> None:
        """Enter waited for this measurement: send now, or refuse (the line says why)."""
        if self._send_when_measured:
            self._send_when_measured = False
            self._submit(self.input.text)

    def _measure_soon(self) -> None:
        if self._pending is not None:
            self._pending.stop()
        self._pending = self.set_timer(MEASURE_DELAY_S, self.measure)

    # -- user actions ----------------------------------------------------------------------
    def on_prompt_input_long_paste(self, message: PromptInput.LongPaste) -> None:
        message.stop()
        paste = PastedText(self._next_n, message.text, None)
        self._next_n += 1
        self.pastes = (*self.pastes, paste)
        self.input.insert(paste.marker)
        self.measure()

    def on_text_area_changed(self, message: TextArea.Changed) -> None:
        # a marker the user deleted takes its chip with it (ctrl+z, the marker back, brings
        # the chip back); typing beside chips asks again
        text = message.text_area.text
        kept = tuple(p for p in self.pastes if p.marker in text)
        shown = {p.marker for p in self.pastes}
        back = tuple(p for m, p in self._removed.items() if m in text and m not in shown)
        for p in self.pastes:
            if p not in kept:
                self._removed[p.marker] = p
                self.notify(f"paste #{p.n} ({p.n_lines:,} lines) removed; ctrl+z brings it "
                            "back", timeout=4)
        for p in back:
            del self._removed[p.marker]
            self.notify(f"paste #{p.n} is back", timeout=2)
        self._send_when_measured = False  # Enter was for the text before this edit
        if kept != self.pastes or back:
            self.pastes = tuple(sorted((*kept, *back), key=lambda p: p.n))
            self.measure()
        elif self.pastes or text.strip() or self._too_long is not None:
            self._measure_soon()  # typing: asked once it pauses, not on every key

    def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        message.stop()
        self._submit(message.text)

    def _submit(self, text: str) -> None:
        """Enter on `text`: post `Send`, or say why not."""
        stray = stray_markers(text, {p.marker for p in self.pastes})
        if stray:  # sent as it is, it would be those characters in place of a paste
            self.notify(f"{stray[0]} names no paste any more: ctrl+z brings the paste back, "
                        "or delete the marker. Not sent.", severity="warning", timeout=8)
            return
        prompt = tidy(expand(text, self.pastes))
        if not prompt:
            if text:
                self.notify("Nothing to send: the message is only spaces and blank lines.",
                            severity="warning", timeout=4)
            return
        if self._too_long is not None:
            if self._too_long[0] == prompt:
                self.notify(self._too_long[1], title="Not sent", severity="error", timeout=10)
                return
            # it could not fit before the last edit: asked now, sent when the engine says it fits
            self._send_when_measured = True
            self.measure()
            return
        draft = Draft(text, tuple((p.n, p.text) for p in self.pastes))
        self.history.sent(prompt)
        self.post_message(self.Send(prompt, draft, self.editing))

    def clear(self) -> None:
        """Empty the input after a send (an edit sent: what the input held before it)."""
        before, self._before_edit = self._before_edit, None
        self.editing = None
        self._load(before or Draft(""))
        self.measure()

    # -- history and editing ---------------------------------------------------------------
    def _draft(self) -> Draft:
        return Draft(self.input.text, tuple((p.n, p.text) for p in self.pastes))

    def _draft_of(self, text: str) -> Draft:
        """A prompt as the input shows it: a long one as a chip, as a paste of it would be."""
        if not is_long_paste(text):
            return Draft(text)
        paste = PastedText(self._next_n, text, None)
        return Draft(paste.marker, ((paste.n, text),))

    def _load(self, draft: Draft, at_start: bool = False) -> None:
        """Replace the input with `draft` (its chips too); the cursor at its end, or at the
        end of its first line (`at_start`: Up again goes on to the older entry)."""
        self.pastes = tuple(PastedText(n, text, None) for n, text in draft.pastes)
        self._next_n = max([self._next_n, *(n + 1 for n, _ in draft.pastes)])
        self.input.load_text(draft.text)
        document = self.input.document
        self.input.move_cursor((0, len(document.get_line(0))) if at_start else document.end)

    def on_prompt_input_recall(self, message: PromptInput.Recall) -> None:
        message.stop()
        current = self._draft()
        shown = self.history.older(current) if message.older else self.history.newer(current)
        if shown is None:
            return
        self._load(shown if isinstance(shown, Draft) else self._draft_of(shown),
                   at_start=message.older)
        self.measure()

    def edit(self, target: EditTarget, text: str) -> None:
        """Put `text` (the message `target`) into the input to be edited; sending it sends
        it in the message's place. What the input held comes back after (or on Esc)."""
        if self._before_edit is None:
            self._before_edit = self._draft()
        self.history.reset()
        self.editing = target
        self._load(self._draft_of(text))
        self.input.focus()
        self.measure()

    def action_stop_editing(self) -> None:
        """Esc while editing: the message stays as it was, the input as before the edit."""
        before, self._before_edit = self._before_edit, None
        self.editing = None
        self._load(before or Draft(""))
        self.measure()
        self.notify("Stopped editing; the conversation is unchanged.", timeout=3)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop_editing":
            return self.editing is not None
        return True

    def watch_editing(self, target: EditTarget | None) -> None:
        line = self.query_one("#editing", Static)
        line.set_class(target is not None, "-shown")
        if target is not None:
            after = (f"; the {target.n_after:,} message(s) after it are dropped"
                     if target.n_after else "")
            line.update(f"✎ editing message {target.index + 1}: Enter sends it in its "
                        f"place{after} · Esc stops editing")
        self.refresh_bindings()

    def restore(self, draft: Draft) -> None:
        """Put a sent prompt back, chips included (after a cancel or a failure); anything
        typed meanwhile stays after it."""
        typed = self.input.text
        restored = tuple(PastedText(n, text, None) for n, text in draft.pastes)
        self.pastes = (*restored, *(p for p in self.pastes if p.marker in typed))
        self._next_n = max([self._next_n, *(n + 1 for n, _ in draft.pastes)])
        self.history.reset()
        self.input.load_text(draft.text + (f"\n{typed}" if typed.strip() else ""))
        self.input.move_cursor(self.input.document.end)
        self.input.focus()
        self.measure()
