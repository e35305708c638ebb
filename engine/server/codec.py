"""JSON of what the server says about the engine: events (and back, for the app's remote
link), loan flags and engine options (and a runtime change to them), the ledger and the
expert cache, the loan forecast's verdict on a message (and back). Imports neither Starlette
nor uvicorn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, fields, is_dataclass
from typing import Any, get_args, get_type_hints

from engine.backend.telemetry import GpuSnapshot
from engine.config import ENV_NAMES, EngineOptions, LoanFlags, parse_auto_int
from engine.errors import StrataError
from engine.experts.cache import EMPTY, LENT, REFILLING, RESIDENT
from engine.loan.forecast import Forecast, LoanVerdict, Workload
from engine.memory.ledger import RegionInfo
from engine.trace import events as ev

EVENT_TYPES: dict[str, type[ev.Event]] = {
    cls.__name__: cls
    for cls in vars(ev).values()
    if isinstance(cls, type) and issubclass(cls, ev.Event) and cls is not ev.Event
}
# every engine option and its JSON types (which may change while running is the guards' say)
OPTION_TYPES: dict[str, tuple[type, ...]] = {
    name: get_args(hint) or (hint,) for name, hint in get_type_hints(EngineOptions).items()
}
FLAG_NAMES = {f.name for f in fields(LoanFlags) if f.name != "warnings"}
SLOT_STATES = {"empty": EMPTY, "resident": RESIDENT, "lent": LENT, "refilling": REFILLING}


class ChangeError(StrataError):
    """A `POST /v1/flags` body that names an unknown field or gives a value of the wrong type."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# -- events ----------------------------------------------------------------------------------
def event_json(e: ev.Event) -> dict[str, Any]:
    """{"type": class name, **fields}; cache states as a string of digits (one a slot)."""
    out: dict[str, Any] = {"type": type(e).__name__}
    for f in fields(e):
        out[f.name] = _plain(getattr(e, f.name))
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):  # CacheChanged.states: small integers, one a slot
        return "".join(str(b) for b in v)
    if is_dataclass(v) and not isinstance(v, type):
        return asdict(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


_FIELD_DECODERS: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("LedgerChanged", "regions"): lambda v: tuple(RegionInfo(**r) for r in v),
    ("CacheChanged", "states"): lambda v: bytes(int(c) for c in v),
    ("CacheChanged", "blob_sizes"): lambda v: tuple(tuple(p) for p in v),
    ("GpuStats", "snapshot"): lambda v: GpuSnapshot(**v),
    ("FlagsChanged", "flags"): lambda v: tuple(tuple(p) for p in v),
}


def event_from_json(d: dict[str, Any]) -> ev.Event | None:
    """The event `event_json` wrote; None for a type this engine does not know."""
    cls = EVENT_TYPES.get(str(d.get("type")))
    if cls is None:
        return None
    kwargs = {}
    for f in fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        decode = _FIELD_DECODERS.get((cls.__name__, f.name))
        kwargs[f.name] = decode(v) if decode else tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


# -- flags and options -----------------------------------------------------------------------
def flags_json(flags: LoanFlags) -> dict[str, Any]:
    return flags.as_kwargs()


def options_json(options: EngineOptions) -> dict[str, Any]:
    return asdict(options)


def flags_from_json(d: dict[str, Any]) -> LoanFlags:
    return LoanFlags.make(**{k: v for k, v in d.items() if k in FLAG_NAMES})


def options_from_json(d: dict[str, Any]) -> EngineOptions:
    return EngineOptions(**{k: v for k, v in d.items() if k in OPTION_TYPES})


def changed(flags: LoanFlags, options: EngineOptions,
            body: dict[str, Any]) -> tuple[LoanFlags, EngineOptions]:
    """`flags` and `options` with the changes of a `POST /v1/flags` body:
    `{"flags": {"elastic_loan": true, ...}, "options": {"spec": 2, ...}}` (a flag may also be
    named by its variable, `STRATA_PREFILL_ELASTIC_LOAN`). Unknown names and wrong types are a
    ChangeError; values are checked by LoanFlags and EngineOptions (FlagError)."""
    unknown = sorted(set(body) - {"flags", "options"})
    if unknown:
        raise ChangeError(f"{unknown[0]}: a flags change has 'flags' and 'options' only",
                          unknown[0])
    by_env = {var: name for name, var in ENV_NAMES.items()}
    flag_changes = {}
    for key, v in _object(body, "flags").items():
        name = by_env.get(key, key)
        if name not in FLAG_NAMES:
            raise ChangeError(f"flags.{key} is not a loan flag; one of {', '.join(ENV_NAMES)}",
                              f"flags.{key}")
        want = int if name == "repeat_min_tokens" else bool
        if isinstance(v, bool) != (want is bool) or not isinstance(v, want):
            raise ChangeError(f"flags.{key} must be {'an integer' if want is int else 'true or false'}",
                              f"flags.{key}")
        flag_changes[name] = v
    option_changes = {}
    for key, v in _object(body, "options").items():
        kinds = OPTION_TYPES.get(key)
        if kinds is None:
            raise ChangeError(f"options.{key} is not an engine option", f"options.{key}")
        if isinstance(v, bool) != (bool in kinds) or not isinstance(v, kinds):
            raise ChangeError(f"options.{key} must be {_kinds(kinds)}", f"options.{key}")
        if isinstance(v, str) and int in kinds:  # --prefill and --expert-cache: auto or N
            v = parse_auto_int(v, f"--{key.replace('_', '-')}")
        option_changes[key] = v
    return flags.with_changes(**flag_changes), options.with_changes(**option_changes)


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    v = body.get(key, {})
    if not isinstance(v, dict):
        raise ChangeError(f"{key} must be an object of name: value", key)
    return v


def _kinds(kinds: tuple[type, ...]) -> str:
    words = {bool: "true or false", int: "an integer", str: "a string", type(None): "null"}
    return " or ".join(words[k] for k in kinds)


# -- the ledger and the expert cache ---------------------------------------------------------
def vram_json(ledger: ev.LedgerChanged | None, cache: ev.CacheChanged | None) -> dict[str, Any]:
    """The ledger by region and segment, and the expert cache's slots by state."""
    out: dict[str, Any] = {"ledger": None, "expert_cache": None}
    if ledger is not None:
        d = event_json(ledger)
        del d["type"], d["t"]
        out["ledger"] = d
    if cache is not None:
        states = cache.states
        out["expert_cache"] = {
            "n_slots": len(states),
            **{name: states.count(code) for name, code in SLOT_STATES.items()},
            "lent_range": list(cache.lent_range) if cache.lent_range else None,
            "states": _plain(states),
            "state_codes": {str(code): name for name, code in SLOT_STATES.items()},
        }
    return out


# -- the loan forecast -----------------------------------------------------------------------
def verdict_json(v: LoanVerdict) -> dict[str, Any]:
    """`POST /v1/forecast`'s answer: the counts, the loan and why, both forecasts by part with
    the workload each was made for (its fitted coefficients stay on the server)."""
    def forecast(f: Forecast | None) -> dict[str, Any] | None:
        if f is None:
            return None
        return {"total_s": f.total_s, "seconds": dict(f.seconds), "workload": asdict(f.workload),
                "n_observations": f.n_observations}

    return {"prompt_tokens": v.prompt_tokens, "fresh_tokens": v.fresh_tokens, "loan": v.kind,
            "reason": v.reason, "pays": v.pays, "line": v.line(),
            "without_loan": forecast(v.without_loan), "with_loan": forecast(v.with_loan)}


def verdict_from_json(d: dict[str, Any]) -> LoanVerdict:
    """The LoanVerdict of a `verdict_json` body (KeyError or TypeError on another shape)."""
    def forecast(f: dict[str, Any] | None) -> Forecast | None:
        if f is None:
            return None
        return Forecast(Workload(**f["workload"]), dict(f["seconds"]), {},
                        int(f["n_observations"]))

    without = forecast(d["without_loan"])
    assert without is not None, "a verdict always has the forecast without a loan"
    return LoanVerdict(int(d["prompt_tokens"]), int(d["fresh_tokens"]), d["loan"],
                       str(d["reason"]), without, forecast(d["with_loan"]), d["pays"])
