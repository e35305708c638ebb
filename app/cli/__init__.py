"""The `strata` console script: the engine's sub-commands plus the app's (`chat`,
`screenshot`); with no arguments it opens the chat app on the demo model."""

from __future__ import annotations

import sys

APP_COMMANDS = ("app.cli.chat", "app.cli.screenshot")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("--") and argv[0] not in ("--help", "-h"):
        from app.main import run_app

        return run_app(argv)  # bare `strata` (or `strata --model X ...`): the chat app
    from engine.cli import main as engine_main

    return engine_main(argv, APP_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
