"""`strata` entry point: sub-commands, one-line errors, exit code 2 on bad input."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from engine.errors import StrataError

COMMANDS = tuple(
    f"engine.cli.{name}"
    for name in (
        "run", "logits", "info", "make_model", "strip_mtp", "plan", "profile", "bench",
        "bench_spec", "bench_sampler", "gpu_probe", "serve", "bench_serve",
    )
)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as one line (no usage dump) and exits with 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"strata: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def build_parser(extra: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The parser of every sub-command module in COMMANDS plus `extra` (the app adds its own:
    the engine never imports the app)."""
    from importlib import import_module

    parser = OneLineParser(prog="strata", description=__doc__)
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    for module in COMMANDS + extra:
        import_module(module).add_parser(sub)
    return parser


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def _exit_interrupted(signum: int, frame: object) -> None:
    os.write(2, b"strata: interrupted\n")  # no Python I/O: it may be mid-write
    os._exit(INTERRUPTED)


def quiet_startup() -> None:
    """Ctrl+C while the sub-commands import (seconds: numpy, the engine) exits 130 with one
    line instead of a KeyboardInterrupt traceback from deep inside an import; nothing has
    started yet, so there is nothing to undo. `end_startup` gives Ctrl+C back to the command.
    The console entry point calls this first; an inherited 'ignore' (`nohup`, `cmd &` in a
    script) is kept."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):  # not ignored
        signal.signal(signal.SIGINT, _exit_interrupted)


def end_startup() -> None:
    """Ctrl+C raises KeyboardInterrupt again (the commands undo their work on it)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is _exit_interrupted):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None, extra: tuple[str, ...] = ()) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(extra)
        args = parser.parse_args(argv)
    finally:  # argparse exits from inside parse_args on a bad argument
        end_startup()
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except StrataError as exc:
        sys.stderr.write(f"strata: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("strata: interrupted\n")
        return INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
