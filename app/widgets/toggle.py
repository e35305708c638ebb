"""Toggle: a one-line switch that reads as text ('[ on]' / '[off]'), so a column of them
stays five separate controls, and shows the focus (reversed)."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.widgets import Switch

ON, OFF = "[ on]", "[off]"


class Toggle(Switch):
    """A `Switch` (same messages, keys and clicks) drawn as '[ on]' or '[off]'; the arrows
    move the focus up and down a column of them."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("down", "app.focus_next", "Next", show=False),
        Binding("up", "app.focus_previous", "Previous", show=False),
    ]

    DEFAULT_CSS = """
    Toggle {
        border: none;
        padding: 0;
        height: 1;
        width: 5;
        background: transparent;
        color: $text-muted;
        &.-on { color: $text-success; text-style: bold; }
        &:hover { text-style: underline; }
        &:focus { border: none; background-tint: transparent; text-style: reverse bold; }
    }
    """

    def render(self) -> Text:
        return Text(ON if self.value else OFF)

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return len(OFF)
