"""EventView: the mixin of every widget that draws engine events."""

from __future__ import annotations

from typing import ClassVar

from textual.geometry import Size
from textual.widget import Widget

from app.engine_link import EngineLink
from engine.trace.events import Event


class EventView(Widget):
    """Receives `EngineLink.Events` batches (posted by the app) and applies each event.

    Subclasses implement `apply_event`, setting reactives; their `watch_`/`render` draw. The
    reactives only repaint: after a batch the view asks for a layout if its height changed.
    While an answer streams a view does not get shorter (it keeps the blank lines it had until
    the answer ends), so a picture that goes back and forth between two heights (the slot map
    while the MTP experts are lent and restored during a decode) lays the screen out once, not
    on every change: a layout reflows the whole screen, chat included, time the engine thread
    waits for under the GIL.
    """

    TITLE: ClassVar[str] = ""

    # every dashboard picture: a titled rule on top, its drawing below
    DEFAULT_CSS = """
    EventView {
        height: auto;
        min-height: 2;
        border: none;
        border-top: solid $primary 40%;
        border-title-color: $text-primary;
        padding: 0 1;
    }
    """

    _fitted = (0, 0)  # (width, content height) when the last layout was asked for
    _measuring = 0  # the width a layout measures the picture for, while it does
    _held = (0, 0)  # while an answer streams: (width, the most lines drawn at that width)

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def caption(self, detail: str) -> None:
        """Show `detail` after the title on the top border."""
        self.border_title = f"{self.TITLE} · {detail}" if detail else self.TITLE

    def content_width(self) -> int:
        """The width to draw at: the one a layout measures the picture for (its height comes
        from a drawing at that width), else the laid-out size's. Not `content_size`: that
        goes through the screen region, and for a widget scrolled out of the dashboard's
        view that arranges the whole screen again (the chat included: seconds with a long
        history)."""
        return max(1, self._measuring or self.outer_size.width - self.styles.gutter.width)

    def on_engine_link_events(self, message: EngineLink.Events) -> None:
        for event in message.events:
            self.apply_event(event)
        if not message.streaming:
            self._held = (0, 0)
        elif not self._held[0]:
            self._held = self._fitted
        self._fit()

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        """The picture's height; while an answer streams, the most it had at this width."""
        self._measuring = width  # a new width (the dashboard's scrollbar came): drawn at it
        try:
            height = super().get_content_height(container, viewport, width)
        finally:
            self._measuring = 0
        if self._held[0] == width:
            height = max(height, self._held[1])
            self._held = (width, height)
        return height

    def _fit(self) -> None:
        # A layout reflows the whole screen (chat included); the reactives only repaint, so
        # ask for one when the picture's height changed, which during a loan is rarely.
        width = self.outer_size.width - self.styles.gutter.width
        if width <= 0 or not self.display:  # hidden (the GPU panel off CUDA), or not laid out
            return
        fitted = (width, self.get_content_height(self.container_size, self.app.size, width))
        if fitted != self._fitted:
            self._fitted = fitted
            self.refresh(layout=True)

    def apply_event(self, event: Event) -> None:
        raise NotImplementedError
