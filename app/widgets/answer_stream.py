"""Streaming an answer cheaply: finished Markdown blocks, and the open block as wrapped text.

Every layout in Textual is a reflow of the whole screen, dashboard included. A `Markdown`
fed token by token re-parsed and re-laid out its last block on every append (two layouts
each time: one more to follow the end); at 15 appends a second that took a fifth of the UI
thread's time while decoding, time the engine thread waited for under the GIL. Here the block
being written is plain text in `StreamTail`, which wraps only its open line on each append,
repaints only the lines that changed and lays out a few times a second at most; a block moves
into the Markdown once the next one begins, so the answer is formatted block by block.
"""

from __future__ import annotations

import re
import time
from itertools import pairwise
from typing import ClassVar

from markdown_it import MarkdownIt
from rich.cells import cell_len, chop_cells
from rich.segment import Segment
from rich.style import Style
from textual.containers import ScrollableContainer
from textual.errors import NoWidget
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Markdown

TAB = "    "
LAYOUT_INTERVAL_S = 0.25  # at most four layouts a second while new lines show
# ... and one in this long while the chat follows the answer, or its end is out of view: the
# layout changes nothing seen but the scroll bar, and reflows the whole screen (tens of ms)
UNSEEN_INTERVAL_S = 10.0
SCROLL_INTERVAL_S = 0.2  # while following, lines scroll up at most five times a second
SCROLL_STALL_S = 0.25  # ... on the next append; past this with none, on a timer


_WORD = re.compile(r"\s*\S+\s*")


def break_offsets(paragraph: str, width: int) -> list[int]:
    """Where greedy word wrapping at `width` cells starts each line after the first (words
    longer than a line are folded)."""
    breaks: list[int] = []
    used = 0
    for m in _WORD.finditer(paragraph):
        start, word = m.start(), m.group()
        n = cell_len(word.rstrip())
        if used + n <= width:
            used += cell_len(word)
            continue
        if used:  # the word starts the next line
            breaks.append(start)
            used = 0
        while cell_len(word.rstrip()) > width:  # fold a word wider than the line
            cut = len(chop_cells(word, width)[0]) or 1  # a character wider than the line
            if not word[cut:].strip():  # only spaces left: they trail this line
                break
            start, word = start + cut, word[cut:]
            breaks.append(start)
        used = cell_len(word)
    return breaks


def wrap_lines(text: str, width: int) -> tuple[list[str], int]:
    """Split `text` into lines of at most `width` cells (hard newlines, then words). Returns
    the lines and the offset in `text` where the last line starts: the lines before it never
    change when text is appended (greedy wrapping)."""
    lines: list[str] = []
    start = 0
    while True:
        end = text.find("\n", start)
        paragraph = text[start:] if end < 0 else text[start:end]
        cuts = [0, *break_offsets(paragraph, max(1, width)), len(paragraph)]
        lines += [paragraph[a:b].rstrip(" ") for a, b in pairwise(cuts)]
        if end < 0:
            return lines, start + cuts[-2]
        start = end + 1


def open_block_start(text: str, parser: MarkdownIt) -> int:
    """The offset in `text` where its last top-level Markdown block starts (0 when it has only
    one): everything before it is finished and can be drawn as Markdown."""
    starts = [t.map[0] for t in parser.parse(text) if t.level == 0 and t.map is not None]
    if len(starts) < 2:
        return 0
    line = starts[-1]
    offset = 0
    for _ in range(line):
        offset = text.index("\n", offset) + 1
    return offset


class StreamTail(Widget):
    """Plain text that grows at its end: lines before the open one are wrapped only once.

    The text grows first into the blank lines `reserve` keeps below it (the chat gives it the
    view below the prompt), repainting only the lines that change. Past them, a layout happens
    at most every LAYOUT_INTERVAL_S, and until it comes the new lines wait below the last one
    shown; except when the top of the widget is scrolled out of view and its bottom is in view
    (the chat follows the answer): then it draws its last lines, which is what the layout will
    show, so nothing the user sees changes when it comes and it can wait UNSEEN_INTERVAL_S;
    so can it when its bottom is out of view (the user reads above). The scroll repaints every
    line in view, so it happens at most every SCROLL_INTERVAL_S, with an append (they come
    with the frames) or a timer if none comes.
    """

    COMPONENT_CLASSES: ClassVar[set[str]] = {"stream-tail--status"}
    DEFAULT_CSS = """
    StreamTail {
        height: auto; padding: 0 1;
        & > .stream-tail--status { color: $text-muted; text-style: italic; }
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.text = ""
        self._width = 0
        self._lines: list[str] = []  # wrapped at `_width`; all but the last are final
        self._open_at = 0  # offset in `text` where the last line starts
        self._height = 0  # the lines the last layout asked for (later ones wait for the next)
        self._reserve = 0  # blank lines kept below the text, for it to grow into
        self._laid_out_at = -UNSEEN_INTERVAL_S
        self._follow = False  # draw the last lines while a layout is due
        self._unseen = False  # the lines waiting for a layout are below the view
        self._scrolled_at = -SCROLL_INTERVAL_S
        self._scrolled_to = 0  # the line count drawn by the last scroll
        self._timer: Timer | None = None
        self._timer_due = 0.0
        self._shift = 0  # lines scrolled out at the top, in this frame
        self._style = Style()
        self._status = ""  # shown in the first line until the text comes
        self._status_style = Style()

    @property
    def n_lines(self) -> int:
        return len(self._lines)

    @property
    def _shown(self) -> int:
        return max(self._height, self._reserve, 1 if self._status else 0)

    def show_status(self, status: str) -> None:
        """Say in the first line what the engine does until the text comes (a repaint of
        that line, where the view kept for the answer has room for it)."""
        if self.text:
            return
        n_before, self._status = self._shown, status
        if self._shown != n_before:
            self.refresh(layout=True)
        elif self._width:
            self.refresh(Region(0, 0, self._width, 1))

    def reserve(self, n_lines: int) -> None:
        """Take at least `n_lines` lines from the next layout on, blank below the text: the
        text grows into them with no layout."""
        self._reserve = max(0, n_lines)
        self._layout()

    def set_text(self, text: str) -> None:
        """Replace the text (lays out at once). Lines it loses leave the reserve with them
        (they moved into the Markdown above); no text, no reserve."""
        n_before = self.n_lines
        self.text, self._status = text.replace("\t", TAB), ""
        self._rewrap(self._width, from_scratch=True)
        lost = n_before - self.n_lines + 1  # and the blank line after a Markdown block
        self._reserve = max(0, self._reserve - lost) if self.text else 0
        self._layout()

    def append(self, text: str) -> None:
        """Add text at the end."""
        if not text:
            return
        self.text += text.replace("\t", TAB)
        self._status = ""  # the first text takes its line
        if not self._width:  # not laid out yet: the first layout wraps
            self._layout()
            return
        n_before, shown = self.n_lines, self._shown
        self._rewrap(self._width)
        self._look(shown)
        if not self._follow:  # repaint the lines that changed: the open one and new ones
            first, end = max(0, n_before - 1), min(self.n_lines, shown)
            if first < end:
                self.refresh(Region(0, first, self._width, end - first))
        self._update()

    def _update(self) -> None:
        """Lay out or scroll if it is time, else set a timer for when it is."""
        if self.n_lines <= self._shown:  # no line waits
            return
        now = time.monotonic()
        unseen = self._follow or self._unseen
        layout_at = self._laid_out_at + (UNSEEN_INTERVAL_S if unseen else LAYOUT_INTERVAL_S)
        if now >= layout_at:
            if not unseen:
                # The text outgrew the view below the prompt: take a view and a line, so this
                # one layout scrolls the answer's top out of view (the chat follows its end)
                # and from then on the tail follows, scrolling its own lines, instead of a
                # layout every LAYOUT_INTERVAL_S until the prompt above has scrolled away.
                self._reserve = max(self._reserve, self._view_height() + 1)
            self._layout()
            return
        due = layout_at
        if self._follow and self._scrolled_to != self.n_lines:
            scroll_at = self._scrolled_at + SCROLL_INTERVAL_S
            if now >= scroll_at:
                self._scrolled_at, self._scrolled_to = now, self.n_lines
                self.refresh()
            else:
                due = min(due, scroll_at + SCROLL_STALL_S)
        if self._timer is None or self._timer_due > due:
            if self._timer is not None:
                self._timer.stop()
            self._timer, self._timer_due = self.set_timer(due - now, self._on_timer), due

    def _on_timer(self) -> None:
        self._timer = None
        follow = self._follow
        self._look(self._shown)  # the user may have scrolled since the last append
        if follow and not self._follow:
            self.refresh()  # the top lines again, not the last ones
        self._update()

    def _look(self, shown: int) -> None:
        """Where the lines waiting for a layout (past `shown`) would be: followed (the top
        scrolled out of view, the bottom in view) or below the view."""
        waiting = self.n_lines > shown
        top_hidden, bottom_seen = self._in_view() if waiting else (False, True)
        self._follow, self._unseen = waiting and top_hidden and bottom_seen, not bottom_seen

    def _layout(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self._laid_out_at = time.monotonic()
        self._height = self._scrolled_to = self.n_lines
        self.refresh(layout=True)

    def _view_height(self) -> int:
        """The height of the view this widget scrolls in (0 outside a scrolling container)."""
        for node in self.ancestors:
            if isinstance(node, ScrollableContainer):
                return node.scrollable_content_region.height
        return 0

    def _in_view(self) -> tuple[bool, bool]:
        """Whether the top is scrolled out of view; whether the bottom is in view."""
        try:
            geometry = self.screen.find_widget(self)
        except NoWidget:
            return False, True
        region, clip = geometry.region, geometry.clip
        return region.y < clip.y, region.bottom <= clip.bottom

    def _rewrap(self, width: int, from_scratch: bool = False) -> None:
        if from_scratch or width != self._width:
            self._width, self._lines, self._open_at = width, [], 0
        if not width or not self.text:
            return
        lines, last = wrap_lines(self.text[self._open_at :], width)
        self._lines[-1:] = lines  # the old open line is the first one of the new wrap
        self._open_at += last

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return container.width

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if width != self._width:  # a new width: wrapped again, every line shows at once
            self._rewrap(width)
            self._height = self.n_lines
        return self._shown

    def render_lines(self, crop: Region) -> list[Strip]:
        # once per frame: the rich style is costly to look up, and the size is now current
        self._style = self.rich_style
        if self._status:
            muted = self.get_component_rich_style("stream-tail--status")  # alpha blended
            self._status_style = muted + Style(bgcolor=self._style.bgcolor)
        self._shift = max(0, self.n_lines - self.content_size.height) if self._follow else 0
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        index = y + self._shift
        style = self._style
        if index >= len(self._lines):
            if index == 0 and self._status:
                status = self._status
                if cell_len(status) > self._width:
                    status = chop_cells(status, max(1, self._width - 1))[0] + "…"
                return self._strip(status, self._status_style)
            return Strip.blank(self._width, style)
        return self._strip(self._lines[index], style)

    def _strip(self, line: str, style: Style) -> Strip:
        return Strip([Segment(line, style)], cell_len(line)).extend_cell_length(
            self._width, self._style
        )


# a fence's opening line (CommonMark: up to 3 spaces, 3+ backticks or tildes, an info string
# with no backtick after backticks) and a closing line of the same character, at least as long
_FENCE_OPEN = re.compile(r" {0,3}(`{3,}|~{3,})([^\n]*)\n")


def _fence_close(fence: str) -> re.Pattern[str]:
    return re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", re.MULTILINE)


class BlockCutter:
    """Where the finished Markdown blocks end as text streams in: the offset of the block still
    being written. Parses only the open block, and only when a line began since the last
    write; inside a fenced code block only the new lines are searched for the closing fence
    (a long code block parsed whole on every frame would cost more with each line)."""

    def __init__(self) -> None:
        self._parser = MarkdownIt("gfm-like")
        self._new_line = True  # the last line written is still blank
        self._close: re.Pattern[str] | None = None  # the open block is an open fence: its end
        self._looked = False  # whether the open block's first line was looked at for a fence
        self.parses = 0  # the open block parsed, for tests

    def cut(self, tail: str, text: str) -> int:
        """The offset in `tail + text` where its last block starts (0: `tail`, the open
        block so far, goes on with `text`)."""
        pending = tail + text
        # a block can only begin on a new line: parse when one began since the last write
        began = "\n" in text or self._new_line
        self._new_line = not pending[pending.rfind("\n") + 1 :].strip()
        if not began:
            return 0
        first_look = not self._looked and "\n" in pending  # its first line is whole
        if first_look:
            self._looked = True
            opened = _FENCE_OPEN.match(pending)
            if opened is not None and not (opened[1][0] == "`" and "`" in opened[2]):
                self._close = _fence_close(opened[1])
        if self._close is not None:
            # after the opening line; then from the line the new text joins: while no line
            # closes the fence, it is the whole of `pending`
            start = pending.index("\n") + 1
            if not first_look:
                start = max(start, pending.rfind("\n", 0, len(tail)) + 1)
            if self._close.search(pending, start) is None:
                return 0
            self._close = None  # closed: from now on the parse says where the next block starts
        self.parses += 1
        cut = open_block_start(pending, self._parser)
        if cut:  # a new open block: its first line is looked at
            self._looked = False
        return cut


class AnswerStream:
    """Writes generated text into a Markdown (finished blocks) and a StreamTail (the open block).

    The same calls as Textual's MarkdownStream (`write`, `stop`); after `stop` the Markdown
    holds everything written and the tail is empty. Finished blocks are appended to the
    Markdown, never parsed again (`blocks_appended` counts the appends).
    """

    def __init__(self, markdown: Markdown, tail: StreamTail) -> None:
        self.markdown, self.tail = markdown, tail
        self.cutter = BlockCutter()
        self.blocks_appended = 0

    async def write(self, text: str) -> None:
        """Append generated text."""
        if not text:
            return
        cut = self.cutter.cut(self.tail.text, text)
        if cut:
            pending = self.tail.text + text
            await self.markdown.append(pending[:cut])
            self.blocks_appended += 1
            self.tail.set_text(pending[cut:])
        else:
            self.tail.append(text)

    async def stop(self) -> None:
        """Move the open block into the Markdown."""
        if self.tail.text:
            await self.markdown.append(self.tail.text)
            self.blocks_appended += 1
            self.tail.set_text("")
