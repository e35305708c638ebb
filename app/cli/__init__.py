"""The `strata` console script: the engine's sub-commands plus the app's (`chat`,
`screenshot`); with no arguments it opens the chat app on the demo model."""

from __future__ import annotations

import sys

APP_COMMANDS = ("app.cli.chat", "app.cli.screenshot")


def main(argv: list[str] | None = None) -> int:
    from engine.cli import INTERRUPTED, end_startup, quiet_startup

    quiet_startup()  # first: Ctrl+C during the imports below is one line and exit 130
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("--") and argv[0] not in ("--help", "-h"):
        from app.main import run_app

        end_startup()
        try:
            return run_app(argv)  # bare `strata` (or `strata --model X ...`): the chat app
        except KeyboardInterrupt:  # before the app holds the terminal (it takes Ctrl+C then)
            sys.stderr.write("strata: interrupted\n")
            return INTERRUPTED
    from engine.cli import main as engine_main

    return engine_main(argv, APP_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
