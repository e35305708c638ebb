"""`strata chat` / `python -m app` start-up errors and `strata screenshot`."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from app.app import StrataApp
from app.cli.screenshot import screenshot
from app.config import ChatConfig
from app.main import run_app
from app.scenes import wait_until
from app.store import Store
from engine.config import EngineOptions, LoanFlags


def test_a_bad_flag_value_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STRATA_PREFILL_ELASTIC_LOAN", "maybe")
    assert run_app(["--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("strata: error: STRATA_PREFILL_ELASTIC_LOAN='maybe' is not a boolean")


def test_a_missing_model_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_app(["--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.gguf: no such file" in err


def test_a_bad_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run_app(["--model", "tiny", "--kv", "f64"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_refused_combination_at_start_exits_2_with_every_reason(tmp_path: Path) -> None:
    # the flags need --serve and --vram-elastic, which are missing: refused once loaded
    config = ChatConfig(EngineOptions(model="tiny"), LoanFlags(elastic_loan=True))
    app = StrataApp(config, store=Store.open(tmp_path / "db.sqlite3"))

    async def run() -> None:
        async with app.run_test() as pilot:
            await wait_until(pilot, lambda: bool(app.error_line))

    asyncio.run(run())
    assert app.return_code == 2
    assert "needs --serve" in app.error_line and "needs --vram-elastic" in app.error_line


def test_screenshot_writes_svg_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(scenes=["refused-flag"], out=str(tmp_path), model="tiny")
    assert screenshot(args) == 0
    svg = (tmp_path / "refused-flag.svg").read_text()
    assert svg.startswith("<svg") and "STRATA_PREFILL_ELASTIC_LOAN=1" in svg
    written = capsys.readouterr().out.split()
    assert str(tmp_path / "refused-flag.svg") in written
    png = tmp_path / "refused-flag.png"
    try:
        import cairosvg  # noqa: F401
    except (ImportError, OSError):
        assert not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(png) in written
