"""`strata chat`: the Textual chat app on one engine (options here, flags from the environment).

The app itself lives in `app/`; this module only registers the command, turns the command line
into a `ChatConfig` (`app.config`) and launches it. Bad options or STRATA_PREFILL_* values are
one line and exit code 2.
"""

from __future__ import annotations

import argparse

from app.config import add_chat_args, chat_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="the chat app: streams answers and draws the VRAM loan")
    add_chat_args(p)
    p.set_defaults(func=chat)


def chat(args: argparse.Namespace) -> int:
    config = chat_config(args)
    from app.main import launch  # the app (Textual) loads only for this command

    return launch(config)
