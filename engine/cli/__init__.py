"""`strata` entry point: sub-commands, one-line errors, exit code 2 on bad input."""

from __future__ import annotations

import argparse
import sys

from engine.errors import StrataError

COMMANDS = tuple(
    f"engine.cli.{name}"
    for name in (
        "run", "logits", "info", "make_model", "strip_mtp", "plan", "profile", "bench",
        "bench_spec", "gpu_probe", "serve", "bench_serve",
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


def main(argv: list[str] | None = None, extra: tuple[str, ...] = ()) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(extra)
    args = parser.parse_args(argv)
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
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
