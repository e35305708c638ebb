"""Snapshot tests of the app's scenes (pytest-textual-snapshot), on the tiny preset.

Fixed terminal size; the scenes show no clock and no timings (idle has no request yet, the
refused flag happens before any), and the prompt cursor does not blink. Update with
`pytest tests/test_app_snapshots.py --snapshot-update` after a deliberate change, and look at
the report it writes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.scenes import SCENES, SIZE
from app.store import Store


@pytest.mark.parametrize("name", ["idle", "refused-flag"])
def test_scene_snapshot(name: str, snap_compare, tmp_path: Path) -> None:
    scene = SCENES[name]
    app = scene.app("tiny", store=Store.open(tmp_path / "conversations.sqlite3"))
    assert snap_compare(app, terminal_size=SIZE, run_before=scene.run)


def test_a_paste_that_cannot_fit_at_80x24(snap_compare, tmp_path: Path) -> None:
    """The chip and the line under it say the message cannot fit --ctx, with the numbers,
    before Enter (issue 28 item 5)."""
    from textual.events import Paste

    from app.app import StrataApp
    from app.config import ChatConfig
    from app.scenes import sample_paste, wait_ready, wait_until
    from engine.config import EngineOptions, LoanFlags

    config = ChatConfig(EngineOptions(model="tiny", ctx=256), LoanFlags(), max_new=8)
    app = StrataApp(config, store=Store.open(tmp_path / "conversations.sqlite3"),
                    export_dir=tmp_path / "exports")

    async def run_before(pilot) -> None:  # type: ignore[no-untyped-def]
        await wait_ready(pilot)
        pilot.app.post_message(Paste(sample_paste(12)))
        await wait_until(pilot, lambda: pilot.app.query_one("#too-long").display)
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
