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
