"""The app's settings kept between runs: one TOML file under the user config directory.

It holds the theme, whether the dashboard is shown, what a new conversation takes (a system
prompt and sampling) and the loan flags the flags panel last applied (none until it applied
some: the app's defaults). The
app reads it at start, where options given on the command line and STRATA_PREFILL_* variables
win over it (`app.config`), and writes it whole on every change, through a temporary file and
a rename. A file that cannot be used (not TOML, a wrong type, an unknown key, past the size
cap, not a regular file) is moved aside, never deleted, and the defaults apply; the app says so
once. `STRATA_CONFIG_DIR` overrides the directory.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from platformdirs import user_config_dir
from textual.theme import BUILTIN_THEMES

from engine.atomic_file import aside_path, write_text_atomic
from engine.bounded_input import InputFileError, read_capped
from engine.config import REPEAT_MIN_CEILING, REPEAT_MIN_FLOOR, LoanFlags
from engine.errors import FlagError, StrataError
from engine.request.conversation import Sampling
from engine.request.sampler import SamplingParams

CONFIG_DIR_ENV = "STRATA_CONFIG_DIR"
THEME_ENV = "TEXTUAL_THEME"  # Textual's own: set, it wins over the file as our options do
SETTINGS_NAME = "settings.toml"
# the file is under 1 KiB but for a default system prompt; past this it is refused when read,
# so it is never written
MAX_SETTINGS_BYTES = 1024 * 1024
DEFAULT_THEME = "textual-dark"
_HEADER = ("# strata chat settings, written by the app on every change. Options given on the\n"
           "# command line and STRATA_PREFILL_* variables win over these.\n")
# [conversation]'s sampling keys and the TOML types each takes
_REAL, _INTEGER = (int, float), (int,)
_SAMPLING_KEYS = {
    "temperature": _REAL,
    "top_p": _REAL,
    "top_k": _INTEGER,
    "seed": _INTEGER,
    "max_tokens": _INTEGER,
}
# SamplingParams names its values as the command line does
_OPTION_KEYS = {"--temperature": "temperature", "--top-p": "top_p", "--top-k": "top_k",
                "--seed": "seed"}
_FLAG_KEYS = tuple(f.name for f in fields(LoanFlags) if f.name != "warnings")


class SettingsError(StrataError):
    """The settings file cannot be read or written (one line naming it)."""


def config_dir() -> Path:
    """Where the app keeps its settings; STRATA_CONFIG_DIR overrides the platform default."""
    return Path(os.environ.get(CONFIG_DIR_ENV) or user_config_dir("strata"))


def settings_path() -> Path:
    return config_dir() / SETTINGS_NAME


@dataclass(frozen=True)
class Settings:
    """What the app keeps between runs: `system` and `sampling` are what a new conversation
    takes; `flags` None: the app's defaults for its options."""

    theme: str = DEFAULT_THEME
    dashboard: bool = True
    system: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    flags: LoanFlags | None = None

    def to_toml(self) -> str:
        """The settings as the file holds them (`from_toml` reads them back equal)."""
        p = self.sampling.params
        lines = [_HEADER, f"theme = {toml_string(self.theme)}",
                 f"dashboard = {_toml_bool(self.dashboard)}", "",
                 "# what a new conversation takes", "[conversation]",
                 f"system_prompt = {toml_string(self.system)}",
                 f"temperature = {p.temperature!r}", f"top_p = {p.top_p!r}",
                 f"top_k = {p.top_k}",
                 # a seed past 2**63 - 1 is written as it is: tomllib reads any integer
                 f"seed = {p.seed}", f"max_tokens = {self.sampling.max_tokens}"]
        if self.flags is not None:
            lines += ["", "# the loan flags the flags panel last applied", "[loan]"]
            for name in _FLAG_KEYS:
                value = getattr(self.flags, name)
                lines.append(f"{name} = {_toml_bool(value) if isinstance(value, bool) else value}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str) -> Settings:
        """Parse a settings file's text; SettingsError listing every problem at once (an
        unknown key, a wrong type, a value out of range). Missing keys take their defaults."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"not TOML ({exc})") from None
        problems: list[str] = []
        top = _table(data, "", {"theme", "dashboard", "conversation", "loan"}, problems)
        theme = top.get("theme", DEFAULT_THEME)
        if theme not in BUILTIN_THEMES:
            problems.append(f"theme {_shown(theme)} is not one of Textual's themes (such as "
                            f"{DEFAULT_THEME}, nord; ctrl+t in the app lists them)")
        dashboard = top.get("dashboard", True)
        if not isinstance(dashboard, bool):
            problems.append(f"dashboard {_shown(dashboard)} must be true or false")
        conversation = _table(top, "conversation", {"system_prompt", *_SAMPLING_KEYS},
                              problems)
        system = conversation.get("system_prompt", "")
        if not isinstance(system, str):
            problems.append(f"system_prompt {_shown(system)} must be a string")
        sampling = _sampling(conversation, problems)
        flags = None
        if "loan" in top:
            flags = _flags(_table(top, "loan", set(_FLAG_KEYS), problems), problems)
        if problems:
            raise SettingsError("; ".join(problems))
        assert sampling is not None
        return cls(theme, dashboard, system, sampling, flags)


def read_settings(path: Path) -> tuple[Settings, str]:
    """The settings in `path`, and "" (the defaults when there is no file); or the defaults
    and one line saying why the file could not be used and where it was moved."""
    if not os.path.lexists(path):  # False too where the directory cannot be read
        return Settings(), ""
    what = f"the settings file {path}"
    try:
        data = read_capped(path, MAX_SETTINGS_BYTES, what)
        return Settings.from_toml(data.decode("utf-8")), ""
    except UnicodeDecodeError as exc:
        why = f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start:,})"
    except InputFileError as exc:  # not a regular file, past the cap, unreadable
        why = str(exc)
    except SettingsError as exc:
        why = f"{what}: {exc}"
    try:
        moved = _move_aside(path)
    except OSError as exc:
        return Settings(), (f"{why}; it cannot be moved aside ({exc.strerror or exc}): the "
                            "defaults apply")
    return Settings(), f"{why}; it was moved to {moved.name} and the defaults apply"


def write_settings(path: Path, settings: Settings) -> None:
    """Write the whole file atomically; SettingsError (one line) when the disk refuses or the
    file would be past the size cap (a huge default system prompt)."""
    text = settings.to_toml()
    n_bytes = len(text.encode("utf-8"))
    if n_bytes > MAX_SETTINGS_BYTES:
        raise SettingsError(f"settings not saved: {n_bytes:,} bytes, more than the settings "
                            f"file's limit of {MAX_SETTINGS_BYTES:,}; shorten the default "
                            "system prompt")
    try:
        write_text_atomic(path, text)
    except (FileExistsError, NotADirectoryError):  # from making its directory
        raise SettingsError(f"settings not saved: a file is where the directory {path.parent} "
                            f"should be; move it, or set {CONFIG_DIR_ENV}") from None
    except OSError as exc:
        raise SettingsError(f"settings not saved to {path}: {exc.strerror or exc}") from None


class SettingsKeeper:
    """The settings in force and where they are kept: each change is written at once.

    `path` None keeps them in memory only (an app built without a settings file: tests,
    scenes). `sampling` is what new conversations take: the file's, unless the command line
    gave other values for this run.
    """

    def __init__(self, settings: Settings, path: Path | None, sampling: Sampling | None = None):
        self.settings, self.path = settings, path
        self.sampling = sampling or settings.sampling

    def change(self, **changes: Any) -> None:
        """Set fields of the settings and write the file (not when nothing changed);
        SettingsError when it cannot be written (the change holds for this run)."""
        new = replace(self.settings, **changes)
        if "sampling" in changes:
            self.sampling = changes["sampling"]
        if new != self.settings:
            self.settings = new
            self._write()

    @property
    def start_theme(self) -> str | None:
        """The theme to start with; None where TEXTUAL_THEME is set (Textual applied it)."""
        return None if os.environ.get(THEME_ENV) else self.settings.theme

    def reset(self) -> None:
        """Every setting back to its default, written (SettingsError when it cannot be)."""
        self.settings = Settings()
        self.sampling = self.settings.sampling
        self._write()

    def _write(self) -> None:
        if self.path is not None:
            write_settings(self.path, self.settings)


def toml_string(text: str) -> str:
    """`text` as a TOML basic string: quotes and backslashes escaped, every control character
    (DEL too, which TOML refuses raw) as \\uXXXX, and a lone surrogate (from a paste), which no
    UTF-8 file can hold, as U+FFFD (as the history stores it)."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if 0xD800 <= code <= 0xDFFF:
            out.append("\ufffd")
        elif ch in '"\\':
            out.append("\\" + ch)
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_bool(value: bool) -> str:
    return "true" if value else "false"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:24] + "..."


def _table(data: dict[str, Any], name: str, keys: set[str], problems: list[str]) -> dict[str, Any]:
    """`data[name]` (or `data` itself for ""), its unknown keys reported."""
    table = data.get(name, {}) if name else data
    if not isinstance(table, dict):
        problems.append(f"{name} must be a table ([{name}])")
        return {}
    where = f"[{name}] " if name else ""
    problems += [f"unknown key {where}{_shown(k)}" for k in table if k not in keys]
    return table


def _typed(table: dict[str, Any], key: str, types: tuple[type, ...], default: Any,
           problems: list[str]) -> Any:
    value = table.get(key, default)
    # TOML's true is a Python int too: a boolean is only a boolean, a number never one
    if isinstance(value, bool) != (types == (bool,)) or not isinstance(value, types):
        kind = {(bool,): "true or false", _REAL: "a number", _INTEGER: "an integer"}[types]
        problems.append(f"{key} {_shown(value)} must be {kind}")
        return default
    return value


def _sampling(table: dict[str, Any], problems: list[str]) -> Sampling | None:
    """[sampling] as a Sampling, its values checked by SamplingParams and Sampling."""
    default = Sampling()
    defaults = {**{f.name: getattr(default.params, f.name) for f in fields(SamplingParams)},
                "max_tokens": default.max_tokens}
    values = {k: _typed(table, k, types, defaults[k], problems)
              for k, types in _SAMPLING_KEYS.items()}
    max_tokens = values.pop("max_tokens")
    params = None
    try:
        params = SamplingParams(**values)
    except FlagError as exc:  # every violation of the sampler's rules, named as here
        for line in exc.violations:
            option, _, rest = line.partition(" ")
            problems.append(f"{_OPTION_KEYS.get(option, option)} {rest}")
    try:
        sampling = Sampling(params or default.params, max_tokens)
    except FlagError as exc:
        problems += exc.violations
        return None
    return sampling if params is not None else None


def _flags(table: dict[str, Any], problems: list[str]) -> LoanFlags | None:
    """[loan] as LoanFlags; a threshold outside what STRATA_PREFILL_REPEAT_MIN_TOKENS takes
    is refused here, not clamped (the app writes only values the engine took)."""
    default = LoanFlags()
    values = {k: _typed(table, k, _INTEGER if k == "repeat_min_tokens" else (bool,),
                        getattr(default, k), problems) for k in _FLAG_KEYS}
    n = values["repeat_min_tokens"]
    if not REPEAT_MIN_FLOOR <= n <= REPEAT_MIN_CEILING:
        problems.append(f"repeat_min_tokens {n} must be in {REPEAT_MIN_FLOOR}.."
                        f"{REPEAT_MIN_CEILING}")
        return None
    return LoanFlags.make(**values)


def _move_aside(path: Path) -> Path:
    """Rename a settings file that cannot be used to `*.bad-<time>` beside it."""
    bad = aside_path(path)
    os.replace(path, bad)
    return bad
