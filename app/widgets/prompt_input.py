"""The prompt composer: a multi-line input whose long pastes collapse into chips.

Enter sends; ctrl+j (shift+enter or alt+enter where the terminal reports them) inserts a
newline. A bracketed paste longer than LONG_PASTE_LINES lines or LONG_PASTE_CHARS characters
is kept aside and stands in the text as a marker `[paste #N: L lines]`; a chip above the input
shows its line and token counts and whether it crosses the repeat-loan threshold. Sending
expands every marker into the full text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Static, TextArea

from app.draft import Draft

LONG_PASTE_LINES = 10
LONG_PASTE_CHARS = 1000
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


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


def chip_text(paste: PastedText, repeat_threshold: int | None) -> Text:
    chip = Text()
    chip.append_text(
        Text.assemble(
            (f" ▤ paste #{paste.n} ", "bold reverse"),
            f" {paste.n_lines:,} lines · ",
            f"{paste.n_tokens:,} tokens"
            if paste.n_tokens is not None
            else "tokens: engine loading",
            " · ",
        )
    )
    if repeat_threshold is None:
        chip.append("repeat loan off", style="dim")
    elif paste.n_tokens is not None and paste.n_tokens >= repeat_threshold:
        chip.append(f"≥ {repeat_threshold:,}: repeat loan", style="bold green")
    else:
        chip.append(f"< {repeat_threshold:,}: no repeat loan", style="yellow")
    return chip


class PromptInput(TextArea):
    """TextArea where Enter sends and long pastes are handed to the composer."""

    @dataclass
    class Submitted(Message):
        text: str

    @dataclass
    class LongPaste(Message):
        text: str

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
    }
    """

    @dataclass
    class Send(Message):
        """The user pressed Enter: the expanded prompt and the draft to put back on cancel."""

        prompt: str
        draft: Draft

    pastes: reactive[tuple[PastedText, ...]] = reactive((), layout=True)
    repeat_threshold: reactive[int | None] = reactive(None)

    def __init__(self, count_tokens: Callable[[str], int | None], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.count_tokens = count_tokens
        self._next_n = 1

    def compose(self) -> ComposeResult:
        yield Static(id="chips")
        yield PromptInput(id="prompt", soft_wrap=True, show_line_numbers=False)

    @property
    def input(self) -> PromptInput:
        return self.query_one(PromptInput)

    def watch_pastes(self) -> None:
        self._draw_chips()

    def watch_repeat_threshold(self) -> None:
        self._draw_chips()

    def _draw_chips(self) -> None:
        chips = self.query_one("#chips", Static)
        chips.display = bool(self.pastes)
        chips.update(Text("\n").join(chip_text(p, self.repeat_threshold) for p in self.pastes))

    def on_prompt_input_long_paste(self, message: PromptInput.LongPaste) -> None:
        message.stop()
        paste = PastedText(self._next_n, message.text, self.count_tokens(message.text))
        self._next_n += 1
        self.pastes = (*self.pastes, paste)
        self.input.insert(paste.marker)

    def on_text_area_changed(self, message: TextArea.Changed) -> None:
        # a marker the user deleted takes its chip with it
        text = message.text_area.text
        kept = tuple(p for p in self.pastes if p.marker in text)
        if kept != self.pastes:
            self.pastes = kept

    def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        message.stop()
        prompt = expand(message.text, self.pastes)
        if not prompt.strip():
            return
        draft = Draft(message.text, tuple((p.n, p.text) for p in self.pastes))
        self.post_message(self.Send(prompt, draft))

    def clear(self) -> None:
        self.input.clear()
        self.pastes = ()

    def restore(self, draft: Draft) -> None:
        """Put a sent prompt back, chips included (after a cancel or a failure); anything
        typed meanwhile stays after it."""
        typed = self.input.text
        restored = tuple(PastedText(n, text, self.count_tokens(text)) for n, text in draft.pastes)
        self.pastes = (*restored, *(p for p in self.pastes if p.marker in typed))
        self._next_n = max([self._next_n, *(n + 1 for n, _ in draft.pastes)])
        self.input.load_text(draft.text + (f"\n{typed}" if typed.strip() else ""))
        self.input.move_cursor(self.input.document.end)
        self.input.focus()

    def recount(self) -> None:
        """Count tokens of pastes made before the engine was loaded."""
        self.pastes = tuple(
            p if p.n_tokens is not None else PastedText(p.n, p.text, self.count_tokens(p.text))
            for p in self.pastes
        )
