"""EngineOptions (command-line options) and LoanFlags (the six STRATA_PREFILL_* variables).

Both are frozen dataclasses, validated on construction for values; combinations are the
guards' job (`engine.loan.guards.validate`).
"""

from __future__ import annotations

import difflib
import operator
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from engine.errors import FlagError

REPEAT_MIN_DEFAULT = 1024
REPEAT_MIN_FLOOR = 256
# Above a C int no prompt can reach the threshold: a typo, refused rather than kept
REPEAT_MIN_CEILING = 2**31 - 1
AUTO = "auto"  # STRATA_PREFILL_REPEAT_MIN_TOKENS=auto: the forecast decides the repeat loan

# The rows of a decode step at most: one token, or a `--spec` window (the verifier's forward),
# so `--spec` is bounded by it. The decode paths key on it (the host reads a step's routing, one
# launch of the stacked QKV, the MoE decode kernels, the steps the token graph captures) and
# the GEMV kernel takes that many vectors; a longer forward is a prompt chunk.
DECODE_ROWS = 8
SPEC_MIN = 2  # a window of one token is plain decoding

ENV_NAMES = {
    "elastic_loan": "STRATA_PREFILL_ELASTIC_LOAN",
    "mtp_loan": "STRATA_PREFILL_MTP_LOAN",
    "head_loan": "STRATA_PREFILL_HEAD_LOAN",
    "retain_startup_chunk": "STRATA_PREFILL_RETAIN_STARTUP_CHUNK",
    "repeat_loan": "STRATA_PREFILL_REPEAT_LOAN",
    "repeat_min_tokens": "STRATA_PREFILL_REPEAT_MIN_TOKENS",
}
ENV_PREFIX = "STRATA_PREFILL_"
# the master switch's (elastic_loan's) sub-options: each needs it on (the guards)
SUB_OPTIONS = ("mtp_loan", "head_loan", "retain_startup_chunk", "repeat_loan")
# Spellings of a boolean, in any case and with surrounding spaces ignored; empty is off.
TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off", "")
BOOLEAN_SPELLINGS = "1, true, yes, on or 0, false, no, off (any case; empty is off)"
_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: int() would also take '1_000', '١٢'


@dataclass(frozen=True)
class LoanFlags:
    """The seed's six flags. `elastic_loan` is the master switch; the rest are sub-options."""

    elastic_loan: bool = False
    mtp_loan: bool = False
    head_loan: bool = False
    retain_startup_chunk: bool = False
    repeat_loan: bool = False
    repeat_min_tokens: int = REPEAT_MIN_DEFAULT
    # STRATA_PREFILL_REPEAT_MIN_TOKENS=auto: a repeat loan is taken when the forecast says it
    # pays (engine.loan.forecast.pays), not by the threshold (kept for when auto is turned off)
    repeat_auto: bool = False
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        # values from users come through `make` (clamped, or refused); this is our own check
        assert REPEAT_MIN_FLOOR <= self.repeat_min_tokens <= REPEAT_MIN_CEILING, (
            f"LoanFlags(repeat_min_tokens={self.repeat_min_tokens}): use LoanFlags.make")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LoanFlags:
        """Read the STRATA_PREFILL_* variables; every bad value is reported at once.

        A STRATA_PREFILL_* name that is none of the six is not an error, but each one gets a
        warning (in `warnings`) naming the closest real name.
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        errors: list[str] = []
        for name, var in ENV_NAMES.items():
            raw = env.get(var)
            if raw is None:
                continue
            if name == "repeat_min_tokens":
                try:
                    threshold = parse_threshold(raw)
                except FlagError as e:
                    errors += e.violations
                    continue
                if threshold == AUTO:
                    values["repeat_auto"] = True
                elif threshold is not None:  # empty is unset, as an empty boolean is off
                    values[name] = threshold
                continue
            value = raw.strip().lower()
            if value in TRUE_SPELLINGS:
                values[name] = True
            elif value in FALSE_SPELLINGS:
                values[name] = False
            else:
                errors.append(f"{var}={raw!r} is not a boolean; use {BOOLEAN_SPELLINGS}")
        if errors:
            raise FlagError(errors)
        flags = cls.make(**values)  # type: ignore[arg-type]
        unknown = tuple(unknown_env_warning(var) for var in sorted(env)
                        if var.startswith(ENV_PREFIX) and var not in ENV_NAMES.values())
        return replace(flags, warnings=unknown + flags.warnings) if unknown else flags

    @classmethod
    def make(cls, **values: object) -> LoanFlags:
        """Construct with the repeat threshold clamped to >= 256, a negative one included
        (seed 000; the warning is in `warnings`); one above 2**31 - 1 is a FlagError."""
        n = operator.index(
            values.get("repeat_min_tokens", REPEAT_MIN_DEFAULT))  # type: ignore[arg-type]
        if n > REPEAT_MIN_CEILING:
            raise FlagError(_too_large(n))
        warnings: tuple[str, ...] = ()
        if n < REPEAT_MIN_FLOOR:
            var = ENV_NAMES["repeat_min_tokens"]
            line = (f"{var}={_shown(n)} is below the minimum of {REPEAT_MIN_FLOOR} tokens; "
                    f"clamped to {REPEAT_MIN_FLOOR}")
            warnings = (line,)
            n = REPEAT_MIN_FLOOR
        values = {**values, "repeat_min_tokens": n}
        return cls(**values, warnings=warnings)  # type: ignore[arg-type]

    def with_changes(self, **changes: object) -> LoanFlags:
        """These flags with `changes` (a runtime change), checked as `make` checks; the new
        flags' `warnings` are those of the change alone.

        Off is one step: turning the master switch off turns off with it every sub-option the
        change does not name (seed 000: they are its sub-options; one alone stays refused)."""
        if changes.get("elastic_loan") is False:
            changes = {**{n: False for n in SUB_OPTIONS}, **changes}
        return LoanFlags.make(**{**self.as_kwargs(), **changes})

    def sub_options_on(self) -> tuple[str, ...]:
        """The master switch's sub-options that are on (their field names)."""
        return tuple(n for n in SUB_OPTIONS if getattr(self, n))

    def warnings_for(self, options: EngineOptions) -> tuple[str, ...]:
        """`warnings`, and what these flags mean for an engine with `options`: a repeat
        threshold above the context, which no message can reach."""
        out = self.warnings
        if (self.elastic_loan and self.repeat_loan and not self.repeat_auto
                and self.repeat_min_tokens > options.ctx):
            var = ENV_NAMES["repeat_min_tokens"]
            line = (f"{var}={self.repeat_min_tokens} is above the context (--ctx "
                    f"{options.ctx}): no message reaches it, so no repeat loan runs; lower it, "
                    "or raise --ctx")
            out += (line,)
        return out

    def as_kwargs(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "warnings"}

    def as_env(self) -> dict[str, str]:
        return {
            var: str(int(getattr(self, name))) if name != "repeat_min_tokens"
            else self.threshold_text
            for name, var in ENV_NAMES.items()
        }

    @property
    def threshold_text(self) -> str:
        """STRATA_PREFILL_REPEAT_MIN_TOKENS as written: 'auto' or the count."""
        return AUTO if self.repeat_auto else str(self.repeat_min_tokens)


DENSE_FORMATS = ("auto", "quant", "float")
CACHE_POLICIES = ("auto", "adaptive", "static")  # engine/experts/policy.py; devices: auto


@dataclass(frozen=True)
class EngineOptions:
    """Command-line options of the engine (`strata run/chat/bench/plan`)."""

    model: str = "demo"
    device: str = "auto"
    ctx: int = 8192
    kv: str = "f16"
    prefill: int | str = "auto"
    expert_cache: int | str = "auto"
    expert_profile: str | None = None
    vram_segment_mib: int | None = None  # None: the backend's default
    vram_reserve_mib: int = 0
    vram_elastic: bool = False
    vram_limit: str | None = None
    serve: bool = False
    mtp: bool = False
    spec: int = 0
    spec_always: bool = False  # draft every step (else only while drafting is measured faster)
    draft_vocab: int = 0  # 0: every row of the head
    mtp_experts: int | str = "auto"  # nextn experts kept on the device (auto: all that fit)
    no_token_graph: bool = False
    dense: str = "auto"  # dense linear weights: quant, float, or auto (quant on CUDA)
    no_borrow: bool = False
    # lend the MTP regions to the expert cache over plain spans (engine/loan/cache_lend.py);
    # off unless asked, so an engine without it runs the default path unchanged
    cache_lend: bool = False
    cache_policy: str = "auto"  # adaptive: decode steps promote misses; static; auto: by device
    batch_slots: int = 1
    prefill_head_alias: bool = False

    def __post_init__(self) -> None:
        errors = []
        if self.ctx < 16:
            errors.append(f"--ctx {self.ctx} must be at least 16")
        if isinstance(self.prefill, int) and self.prefill < 1:
            errors.append(f"--prefill {self.prefill} must be 'auto' or a positive token count")
        if isinstance(self.expert_cache, int) and self.expert_cache < 0:
            errors.append(f"--expert-cache {self.expert_cache} must be 'auto' or >= 0")
        if self.spec and not SPEC_MIN <= self.spec <= DECODE_ROWS:
            errors.append(f"--spec {self.spec} must be 0 (off) or {SPEC_MIN}..{DECODE_ROWS}")
        if self.dense not in DENSE_FORMATS:
            errors.append(f"--dense {self.dense} must be one of {', '.join(DENSE_FORMATS)}")
        if self.cache_policy not in CACHE_POLICIES:
            errors.append(f"--cache-policy {self.cache_policy} must be one of "
                          f"{', '.join(CACHE_POLICIES)}")
        if isinstance(self.mtp_experts, int) and self.mtp_experts < 1:
            errors.append(f"--mtp-experts {self.mtp_experts} must be 'auto' or >= 1")
        if self.draft_vocab < 0:
            errors.append(f"--draft-vocab {self.draft_vocab} must be >= 0")
        if self.batch_slots < 1:
            errors.append(f"--batch-slots {self.batch_slots} must be >= 1")
        if self.vram_segment_mib is not None and self.vram_segment_mib < 1:
            errors.append(f"--vram-segment-mib {self.vram_segment_mib} must be >= 1")
        if self.vram_reserve_mib < 0:
            errors.append(f"--vram-reserve-mib {self.vram_reserve_mib} must be >= 0")
        if errors:
            raise FlagError(errors)

    def with_changes(self, **changes: object) -> EngineOptions:
        return replace(self, **changes)  # type: ignore[arg-type]


def parse_threshold(raw: str) -> int | str | None:
    """STRATA_PREFILL_REPEAT_MIN_TOKENS as written (the variable, the app's flags panel): None
    when empty (as if unset), AUTO, or a count in ASCII digits, not yet clamped (`make` does
    that). FlagError, naming the value, for anything else or a count above 2**31 - 1."""
    text = raw.strip()
    if not text:
        return None
    if text.lower() == AUTO:
        return AUTO
    if not _INTEGER.fullmatch(text):
        raise FlagError(f"{ENV_NAMES['repeat_min_tokens']}={raw!r} is not an integer; give a "
                        "token count such as 1024, or auto (the forecast decides)")
    digits = text.lstrip("+-").lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS:  # int() refuses past 4,300 digits; the sign is what matters
        n = (-1 if text[0] == "-" else 1) * 10**_MAX_DIGITS
    else:
        n = int(text)
    if n > REPEAT_MIN_CEILING:
        raise FlagError(_too_large(n))
    return n


_MAX_DIGITS = 4000


def _shown(n: int) -> str:
    """A count as a message shows it: cut short when long, so the message stays one line."""
    if abs(n) >= 10**_MAX_DIGITS:  # parse_threshold's stand-in for a longer number
        return f"{'-' if n < 0 else ''}<more than {_MAX_DIGITS:,} digits>"
    text = str(n)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"


def _too_large(n: int) -> str:
    return (
        f"{ENV_NAMES['repeat_min_tokens']}={_shown(n)} is larger than any prompt; give a token "
        f"count up to {REPEAT_MIN_CEILING:,} (such as 1024), or auto"
    )


def unknown_env_warning(var: str) -> str:
    """The warning for a STRATA_PREFILL_* name that is not one of the six flags."""
    real = list(ENV_NAMES.values())
    cut = [name for name in real if name.startswith(var) or var.startswith(name)]  # ..._MIN
    close = cut or difflib.get_close_matches(var, real, n=1, cutoff=0.0)
    return f"{var} is not one of the six loan flags and is ignored; did you mean {close[0]}?"


def parse_auto_int(text: str, flag: str) -> int | str:
    """'auto' or a positive integer, for --prefill, --expert-cache and --mtp-experts."""
    if text == "auto":
        return "auto"
    if not _INTEGER.fullmatch(text) or len(text) > 20:  # int() takes '1_0', ' 7', '١٢' too
        raise FlagError(f"{flag} {text[:40]!r} must be 'auto' or an integer (ASCII digits)")
    return int(text)
