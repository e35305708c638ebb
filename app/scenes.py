"""Scenes for screenshots and snapshot tests: the app driven by a pilot to a known state.

`capture(name, out_dir)` runs a scene headless and writes `<name>.svg` (and `<name>.png` when
cairosvg is installed). Scenes use a throw-away conversation store, so no user data shows.
"""

from __future__ import annotations

import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import Input, TextArea

from app.app import StrataApp
from app.config import APP_DEFAULTS, APP_FLAGS, ChatConfig
from app.store import Store
from app.widgets.prompt_input import Composer, PromptInput
from engine.config import EngineOptions, LoanFlags
from engine.trace.events import PrefillProgress

SIZE = (120, 40)
PNG_FONT = "DejaVu Sans Mono"  # Debian: fonts-dejavu-core
WORDS = [
    "the",
    "expert",
    "cache",
    "lends",
    "its",
    "tail",
    "to",
    "the",
    "prompt",
    "path",
    "while",
    "the",
    "verifier",
    "and",
    "the",
    "native",
    "head",
    "step",
    "aside;",
    "every",
    "lent",
    "slot",
    "is",
    "refilled",
    "into",
    "the",
    "same",
    "slot",
    "before",
    "the",
    "first",
    "token",
]


def sample_paste(n_lines: int, width: int = 12) -> str:
    """A deterministic multi-line text (a stand-in for a pasted log or document)."""
    lines = []
    for i in range(n_lines):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(width)]
        lines.append(f"{i + 1:04d} " + " ".join(words))
    return "\n".join(lines)


async def wait_until(pilot: Pilot, predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Pause the pilot until `predicate()` holds; raises TimeoutError after `timeout_s`."""
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await pilot.pause(0.05)
    raise TimeoutError(f"scene condition not reached in {timeout_s:.0f} s")


def steady_cursor(field: Input | TextArea) -> None:
    """`field` draws its cursor without blinking, repainted now. A TextArea keys its cached
    lines on the cursor only while it blinks, so a line drawn in a blink phase without the
    cursor would otherwise stay as it was (the picture lost its cursor one run in four)."""
    field.cursor_blink = False
    field.notify_style_update()  # drops the TextArea's cached lines
    field.refresh()


async def wait_ready(pilot: Pilot) -> None:
    app = pilot.app
    assert isinstance(app, StrataApp)
    await wait_until(pilot, lambda: app.link.loop is not None and app.screen is app.default_screen)
    steady_cursor(app.query_one(PromptInput))  # a still picture: no blink phase in it
    await pilot.pause(0.2)


@dataclass(frozen=True)
class Scene:
    """A named app state: how to configure the app and how to drive it there."""

    name: str
    run: Callable[[Pilot], Awaitable[None]]
    options: Callable[[str], EngineOptions]
    flags: LoanFlags = field(default_factory=LoanFlags)

    def app(self, model: str = "demo", store: Store | None = None) -> StrataApp:
        config = ChatConfig(self.options(model), self.flags, max_new=64)
        if store is None:
            store = Store.open(Path(tempfile.mkdtemp(prefix="strata-scene-")) / "scene.sqlite3")
        return StrataApp(config, store=store)


async def idle(pilot: Pilot) -> None:
    await wait_ready(pilot)


async def refused_flag(pilot: Pilot) -> None:
    """Turn the master loan switch on without --serve/--vram-elastic: the engine refuses."""
    await wait_ready(pilot)
    await pilot.click("#elastic_loan")
    app = pilot.app
    await wait_until(pilot, lambda: "refused" in str(app.query_one("#flags-status").render()))
    await pilot.pause(0.3)


async def paste_loan(pilot: Pilot) -> None:
    """A short first message (it takes the startup loan), then a long paste: the repeat loan
    releases the decode-only regions; stop while its prefill runs."""
    await wait_ready(pilot)
    app = pilot.app
    assert isinstance(app, StrataApp)
    composer = app.query_one(Composer)
    await pilot.press(*"hello")
    await pilot.press("enter")
    await wait_until(pilot, lambda: app.link.loop is not None and not app.link.loop.busy
                     and len(app.conv.messages) >= 2)
    app.post_message(_paste(sample_paste(300)))  # about 6,300 tokens: it fits --ctx 8,192
    await wait_until(pilot, lambda: bool(composer.pastes))
    await pilot.press("enter")
    await wait_until(pilot, lambda: _prefill_chunk(app) >= 3)
    app.post_message(_paste(sample_paste(60)))  # the next message: its chip and forecast
    await wait_until(pilot, lambda: bool(composer.pastes))
    await pilot.pause(0.2)


async def answer(pilot: Pilot) -> None:
    """Two dictionary questions answered with MTP drafts on every step (`--spec-always`: on
    the CPU the drafting policy would soon decode plain, drafted steps cost 2.5x here)."""
    await wait_ready(pilot)
    app = pilot.app
    assert isinstance(app, StrataApp)
    for n, message in enumerate(("What does 'water' mean?", "What is a cat?"), start=1):
        await pilot.press(*message)
        await pilot.press("enter")
        await wait_until(pilot, lambda n=n: app.link.loop is not None and not app.link.loop.busy
                         and len(app.conv.messages) >= 2 * n and not app.running)
    await pilot.pause(0.5)


def _paste(text: str):
    from textual.events import Paste

    return Paste(text)


def _prefill_chunk(app: StrataApp) -> int:
    from app.widgets.chunk_plan import ChunkPlan

    progress: PrefillProgress | None = app.query_one(ChunkPlan).progress
    return progress.chunk if progress is not None else 0


def loan_ready(model: str) -> EngineOptions:
    """The app's own defaults (app.config.APP_DEFAULTS): loan-ready, MTP drafts checked by the
    verifier, their memory lent to the expert cache over plain spans."""
    return EngineOptions(model=model, **APP_DEFAULTS)  # type: ignore[arg-type]


def drafting_always(model: str) -> EngineOptions:
    """The app's defaults, drafting on every step (`--spec-always`)."""
    return loan_ready(model).with_changes(spec_always=True)


# idle is the first screen a user sees with the app's defaults (loan-ready, every flag on);
# refused-flag needs a plain set-up (no --serve/--vram-elastic) for the guards to refuse
SCENES = {
    "idle": Scene("idle", idle, loan_ready, APP_FLAGS),
    "answer": Scene("answer", answer, drafting_always, APP_FLAGS),
    "paste-loan": Scene("paste-loan", paste_loan, loan_ready, APP_FLAGS),
    "refused-flag": Scene("refused-flag", refused_flag, lambda model: EngineOptions(model=model)),
}


def screenshot(scene: Scene, model: str = "demo", size: tuple[int, int] = SIZE) -> str:
    """Run `scene` headless and return the SVG of the screen it ends on."""
    app = scene.app(model)

    async def pilot_run(pilot: Pilot) -> None:
        await scene.run(pilot)
        await pilot.wait_for_scheduled_animations()
        await pilot.pause()
        svg = app.export_screenshot(title=f"strata chat — {scene.name}")
        app.link.cancel()
        app.exit(svg)

    svg = app.run(headless=True, size=size, auto_pilot=pilot_run)
    if app.error_line:
        raise RuntimeError(f"scene {scene.name}: the engine did not start: {app.error_line}")
    assert isinstance(svg, str), f"scene {scene.name} ended without a screenshot"
    return svg


def capture(name: str, out_dir: Path, model: str = "demo") -> list[Path]:
    """Write `<name>.svg` and, when cairosvg is importable, `<name>.png`; returns the paths."""
    svg = screenshot(SCENES[name], model)
    out_dir.mkdir(parents=True, exist_ok=True)
    svg_path = out_dir / f"{name}.svg"
    svg_path.write_text(svg, encoding="utf-8")
    written = [svg_path]
    png = svg_to_png(svg)
    if png is not None:
        png_path = out_dir / f"{name}.png"
        png_path.write_bytes(png)
        written.append(png_path)
    return written


def svg_to_png(svg: str) -> bytes | None:
    """PNG bytes via cairosvg (needs the system cairo library); None when unavailable."""
    try:
        import cairosvg
    except (ImportError, OSError):
        return None
    # the SVG asks for Fira Code (a web font cairo cannot fetch): name a local monospace font
    svg = svg.replace("font-family: Fira Code, monospace;", f"font-family: {PNG_FONT}, monospace;")
    return cairosvg.svg2png(bytestring=svg.encode("utf-8"), scale=1.5)
