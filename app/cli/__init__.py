"""The `strata` console script: the engine's sub-commands plus the app's (`chat`,
`screenshot`); with no arguments it opens the chat app on the demo model."""

from __future__ import annotations

import sys

APP_COMMANDS = ("app.cli.chat", "app.cli.screenshot")
DESCRIPTION = """\
strata: a Mixture-of-Experts GGUF engine that lends decode-only VRAM to prompt prefill,
with a chat app that draws the loan live and an OpenAI-compatible server.

  strata                       open the chat app on the shipped demo model
  strata --model FILE.gguf     open the chat app on a model (any `strata chat` option)
  strata COMMAND --help        the options of one command
  strata --version             the installed version"""


def version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("strata-chat")
    except PackageNotFoundError:
        from engine import __version__

        return __version__


def print_help() -> None:
    """The top-level help: what bare `strata` does first, then every command."""
    import argparse

    from engine.cli import build_parser

    parser = build_parser(APP_COMMANDS)
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("-V", "--version", action="version", help="print the version and exit")
    parser.print_help()


def main(argv: list[str] | None = None) -> int:
    from engine.cli import INTERRUPTED, end_startup, quiet_startup

    quiet_startup()  # first: Ctrl+C during the imports below is one line and exit 130
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--version"], ["-V"]):
        end_startup()
        sys.stdout.write(f"strata {version()}\n")
        return 0
    if argv[:1] in (["--help"], ["-h"]):
        print_help()
        end_startup()
        return 0
    if not argv or argv[0].startswith("--"):
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
