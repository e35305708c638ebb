"""Entry points: `run_app(argv)` (bare `strata`, `python -m app`) and `launch(config)`."""

from __future__ import annotations

import sys

from app.config import ChatConfig, add_chat_args, chat_config
from app.store import Store
from engine.cli import OneLineParser
from engine.errors import StrataError


def run_app(argv: list[str] | None = None) -> int:
    """Parse `strata chat` options from argv (default: sys.argv[1:]) and run the app."""
    parser = OneLineParser(prog="strata chat", description="the strata chat app")
    add_chat_args(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = chat_config(args)
    except StrataError as exc:
        sys.stderr.write(f"strata: error: {exc}\n")
        return 2
    return launch(config)


def launch(config: ChatConfig) -> int:
    """Run the app until it quits; an engine or a store that cannot start: one line, exit 2."""
    from app.app import StrataApp

    try:
        store = Store.open()  # before the screen changes: a refusal is a plain line
    except StrataError as exc:
        sys.stderr.write(f"strata: error: {exc}\n")
        return 2
    app = StrataApp(config, store=store)
    app.run()
    if app.error_line:
        sys.stderr.write(f"strata: error: {app.error_line}\n")
    return app.return_code or 0
