"""`strata screenshot SCENE --out DIR`: SVG (and PNG with cairosvg) of an app scene."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SCENE_NAMES = ("answer", "idle", "paste-loan", "refused-flag")  # app.scenes.SCENES (not imported to parse)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("screenshot", help="write SVG/PNG screenshots of the app's scenes")
    p.add_argument(
        "scenes",
        nargs="+",
        choices=(*SCENE_NAMES, "all"),
        metavar="SCENE",
        help=f"one or more of {', '.join(SCENE_NAMES)}, or all",
    )
    p.add_argument("--out", default="screenshots", help="output directory (default screenshots/)")
    p.add_argument("--model", default="demo", help="model preset or .gguf path (default demo)")
    p.set_defaults(func=screenshot)


def screenshot(args: argparse.Namespace) -> int:
    from app.scenes import capture  # the app (Textual) loads only for this command

    names = SCENE_NAMES if "all" in args.scenes else tuple(dict.fromkeys(args.scenes))
    for name in names:
        for path in capture(name, Path(args.out), args.model):
            sys.stdout.write(f"{path}\n")
    return 0
