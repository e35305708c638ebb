"""The screen's frame, fitted to its width: a header whose subtitle drops its least important
parts before the title is cut, and a footer that keeps Help in sight at 80 columns."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.content import Content
from textual.widgets import Footer, Header
from textual.widgets._footer import FooterKey
from textual.widgets._header import HeaderTitle

SEPARATOR = " · "  # between the subtitle's parts, most important first
HEADER_SIDES = 16  # the header's icon (8 cells) and as much on the right, to stay centred
PINNED_ACTIONS = ("help",)  # keys the footer shows first (at its left edge), never cut


def fit_subtitle(title: str, sub_title: str, room: int) -> str:
    """`sub_title` without its last ' · ' parts until 'title — sub_title' fits `room` cells
    (its first part is kept: the header cuts that one with an ellipsis)."""
    parts = sub_title.split(SEPARATOR)
    while len(parts) > 1 and len(title) + 3 + len(SEPARATOR.join(parts)) > room:
        parts.pop()
    return SEPARATOR.join(parts)


class StrataHeader(Header):
    """A one-line header: the title, then as much of the subtitle as fits the width."""

    DEFAULT_CSS = """
    StrataHeader HeaderClockSpace { width: 8; }
    """

    def format_title(self) -> Content:
        title, sub_title = self.screen_title, self.screen_sub_title
        if self.size.width:
            sub_title = fit_subtitle(title, sub_title, self.size.width - HEADER_SIDES)
        return self.app.format_title(title, sub_title)

    def on_resize(self, event: events.Resize) -> None:
        self.query_one(HeaderTitle).update(self.format_title())


class StrataFooter(Footer):
    """The key bindings; Help is pinned to the left edge (as in htop), so the keys that do
    not fit are cut after it, whoever adds bindings. Compact at every width: toggling it on
    a resize restyled every key."""

    DEFAULT_CSS = """
    StrataFooter FooterKey.-pinned { dock: left; border-right: vkey $foreground 20%; }
    """

    def compose(self) -> ComposeResult:
        for widget in super().compose():
            if isinstance(widget, FooterKey) and widget.action in PINNED_ACTIONS:
                widget.add_class("-pinned")
            yield widget

    def __init__(self) -> None:
        super().__init__(compact=True)
