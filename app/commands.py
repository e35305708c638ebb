"""Command palette providers: the flags panel's actions and the chat's message actions, by
name; where the palette's Screenshot goes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, Protocol, cast

from platformdirs import user_downloads_path
from textual.command import DiscoveryHit, Hit, Hits, Provider

from app.store import data_dir
from app.widgets.flags_panel import PREFILL_CHOICES, SPEC_CHOICES, SWITCHES
from engine.config import CACHE_POLICIES, ENV_NAMES, EngineOptions, LoanFlags


class FlagsHost(Protocol):
    """What the palette needs of the app (the app provides it; this module does not import it)."""

    def flags_in_force(self) -> tuple[LoanFlags, EngineOptions] | None: ...

    def request_flags(self, flags: LoanFlags, options: EngineOptions) -> None: ...

REPEAT_THRESHOLDS = (256, 1024, 4096, 16384, 50000)
CACHE_POLICY_HELP = {
    "auto": "adaptive on CUDA, static on the simulated device",
    "adaptive": "decoding promotes the experts it misses often and lately",
    "static": "the cache keeps its profile fill",
}


class FlagCommands(Provider):
    """Toggle a loan flag, set spec T and when to draft, the prefill mode or the repeat
    threshold."""

    def commands(self) -> list[tuple[str, Callable[[], None], str]]:
        app = cast(FlagsHost, self.app)
        current = app.flags_in_force()
        if current is None:
            return []
        flags, options = current
        ask = app.request_flags
        out: list[tuple[str, Callable[[], None], str]] = []
        for name in SWITCHES:
            on = getattr(flags, name)
            out.append(
                (
                    f"Loan flag: turn {ENV_NAMES[name]} {'off' if on else 'on'}",
                    partial(ask, flags.with_changes(**{name: not on}), options),
                    f"now {'on' if on else 'off'}; applies from the next message",
                )
            )
        if not flags.repeat_auto:
            out.append(
                (
                    f"Loan flag: {ENV_NAMES['repeat_min_tokens']} = auto",
                    partial(ask, flags.with_changes(repeat_auto=True), options),
                    f"now {flags.threshold_text}; the forecast decides each repeat loan",
                )
            )
        for n in REPEAT_THRESHOLDS:
            if flags.repeat_auto or n != flags.repeat_min_tokens:
                out.append(
                    (
                        f"Loan flag: {ENV_NAMES['repeat_min_tokens']} = {n:,}",
                        partial(ask, flags.with_changes(repeat_min_tokens=n, repeat_auto=False),
                                options),
                        f"now {flags.threshold_text}",
                    )
                )

        def choices(field: str, values: Iterable[Any], label: Callable[[Any], str],
                    note: Callable[[Any], str] = lambda v: "") -> None:
            """One command per value of option `field` other than the one in force."""
            now = getattr(options, field)
            out.extend((label(v), partial(ask, flags, options.with_changes(**{field: v})),
                        f"now {now}{note(v)}") for v in values if v != now)

        choices("spec", SPEC_CHOICES,
                lambda t: f"Speculative decoding: spec T = {t}" + (" (off)" if not t else ""))
        if options.spec:
            always = options.spec_always
            out.append(
                (
                    "Speculative decoding: "
                    + ("draft only while it pays (measured)" if always else "draft on every step"),
                    partial(ask, flags, options.with_changes(spec_always=not always)),
                    (f"now {'every step' if always else 'measured'}; greedy replies only "
                     "(sampled replies always draft)"),
                )
            )
        choices("cache_policy", CACHE_POLICIES, lambda v: f"Expert cache: {v} policy",
                lambda v: f"; {CACHE_POLICY_HELP[v]}")
        choices("prefill", PREFILL_CHOICES, lambda p: f"Prefill chunk: {p}")
        return out

    async def discover(self) -> Hits:
        for name, callback, help_text in self.commands():
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, callback, help_text in self.commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)


def screenshot_dir() -> tuple[Path, str]:
    """Where the palette's Screenshot is written: the user's Downloads folder when it exists
    and is writable, else `screenshots/` in the app's data folder (created), else the working
    directory. The second item says why Downloads was passed over ("" when it was not)."""
    downloads = user_downloads_path()
    if downloads.is_dir() and os.access(downloads, os.W_OK):
        return downloads, ""
    why = f"{downloads} {'is not writable' if downloads.is_dir() else 'does not exist'}"
    folder = data_dir() / "screenshots"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder, why
    except OSError:
        pass
    return Path.cwd(), why


# (name, the app's action, what it does): the message actions, also on a focused message
CHAT_COMMANDS = (
    ("Chat: regenerate the last answer", "regenerate",
     "ctrl+r; the prompt is sent again, the KV cache reuses what came before it"),
    ("Chat: edit the last message", "edit",
     "it goes into the input; Enter sends it in its place, Esc stops editing"),
    ("Chat: copy the last answer", "copy_last",
     "to the clipboard through the terminal (OSC 52); y or c on a focused message"),
    ("Chat: copy the last code block of the last answer", "copy_last(True)",
     "b on a focused message; again for the block before it"),
    ("Chat: select a message", "focus_messages",
     "ctrl+up; then up/down between messages, Esc back to the input"),
)


class ChatCommands(Provider):
    """The chat's message actions by name: regenerate, edit, copy, select a message."""

    async def discover(self) -> Hits:
        for name, action, help_text in CHAT_COMMANDS:
            yield DiscoveryHit(name, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, action, help_text in CHAT_COMMANDS:
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), partial(self.app.run_action, action),
                          help=help_text)


# (name, the app's action, what it does)
SETTINGS_COMMANDS = (
    ("Conversation: system prompt and sampling", "chat_settings",
     "F4; this conversation's system prompt, temperature, top-p, top-k, seed, max tokens"),
    ("Settings: reset to defaults", "reset_settings",
     "theme, dashboard, sampling of new conversations and loan flags, in the settings file too"),
)


class SettingsCommands(Provider):
    """The open conversation's system prompt and sampling; the kept settings' reset."""

    async def discover(self) -> Hits:
        for name, action, help_text in SETTINGS_COMMANDS:
            yield DiscoveryHit(name, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, action, help_text in SETTINGS_COMMANDS:
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), partial(self.app.run_action, action),
                          help=help_text)
