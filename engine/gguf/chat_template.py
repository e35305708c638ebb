"""Render a conversation with a model's Jinja chat template, the way HuggingFace does, with
cheap guards that name what a hostile template did.

Same environment as `transformers`' `apply_chat_template`: a jinja2 immutable sandbox with
`trim_blocks`/`lstrip_blocks`, loop controls, the `{% generation %}` tag, a `tojson` filter
that keeps non-ASCII text, and the `raise_exception` / `strftime_now` globals.

The guards here turn the usual blow-ups into one line that names the limit: a `range` past
`MAX_RANGE`, a `*`, `+` or `**` whose result would pass the output bound, a long
`strftime_now` format, macro calls (or recursive loops) nested past `TemplateLimits.depth`,
Python's recursion limit, and output past the bound (streamed through `generate()`). They
cannot bound one C-level operation (`'{:>999999999}'.format(1)` allocates a gigabyte in a
single call), so the engine renders through `engine.gguf.template_renderer`, which runs
`render_in_sandbox` in a child process with an address-space and CPU limit and a deadline.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Context, LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import FlagError, TokenizerError

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MAX_RANGE = 100_000  # jinja2's own sandbox bound; no chat template needs more
MAX_STRFTIME_FORMAT = 256  # characters; real templates pass a dozen ("%d %b %Y")
MiB = 1 << 20

ENV_TIME = "STRATA_TEMPLATE_TIME_S"
ENV_OUTPUT = "STRATA_TEMPLATE_OUTPUT_MIB"
ENV_MEMORY = "STRATA_TEMPLATE_MEMORY_MIB"
ENV_DEPTH = "STRATA_TEMPLATE_DEPTH"


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one render. Output: `output_mib` plus `output_per_input` times the
    conversation's own size (a template repeats what it is given, it does not multiply it);
    memory: the renderer process's address space; depth: macro calls nested in each other."""

    time_s: float = 5.0
    output_mib: float = 4.0
    output_per_input: int = 4
    memory_mib: int = 1024
    depth: int = 64

    def __post_init__(self) -> None:
        assert self.time_s > 0 and self.output_mib > 0 and self.output_per_input >= 0, self
        assert self.memory_mib >= 64 and self.depth >= 1, self

    def max_output_chars(self, n_input_chars: int) -> int:
        """The output bound of a render whose variables are `n_input_chars` long."""
        return int(self.output_mib * MiB) + self.output_per_input * n_input_chars

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TemplateLimits:
        """The defaults, each raised (or lowered) by its STRATA_TEMPLATE_* variable; a value
        that is not a number in range is a FlagError naming the variable."""
        env = os.environ if env is None else env
        d = cls()
        return cls(
            time_s=_env_number(env, ENV_TIME, d.time_s, 0.01, 3600.0, "seconds"),
            output_mib=_env_number(env, ENV_OUTPUT, d.output_mib, 0.01, 65536.0, "MiB"),
            memory_mib=int(_env_number(env, ENV_MEMORY, d.memory_mib, 128, 1 << 20, "MiB",
                                       whole=True)),
            depth=int(_env_number(env, ENV_DEPTH, d.depth, 1, 10_000, "levels", whole=True)),
        )


_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")  # ASCII digits only: int() takes other scripts'
_WHOLE = re.compile(r"[0-9]+")


def _env_number(env: Mapping[str, str], name: str, default: float, low: float, high: float,
                unit: str, whole: bool = False) -> float:
    raw = env.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not (_WHOLE if whole else _NUMBER).fullmatch(text) or not low <= float(text) <= high:
        kind = "a whole number" if whole else "a number"
        raise FlagError(f"{name}={raw[:40]!r} is not {kind} of {unit} in {low:g}..{high:g}; "
                        f"unset it for the default ({default:g})")
    return float(text)


# --- one-line messages, each naming the limit and how to raise it -----------------------------


def time_message(limits: TemplateLimits) -> str:
    return (f"chat template took more than {limits.time_s:g} s to render (a loop without end?); "
            f"fix the template, or raise {ENV_TIME} if it is trusted")


def memory_message(limits: TemplateLimits) -> str:
    return (f"chat template needed more than {limits.memory_mib:,} MiB of memory to render; "
            f"fix the template, or raise {ENV_MEMORY} if it is trusted")


def output_message(limits: TemplateLimits, max_chars: int, what: str = "output") -> str:
    return (f"chat template {what} passed the bound of {max_chars:,} characters "
            f"({limits.output_mib:g} MiB "
            f"plus {limits.output_per_input} x the conversation's size); fix the template, or "
            f"raise {ENV_OUTPUT} if it is trusted")


def depth_message(limits: TemplateLimits) -> str:
    return (f"chat template nested macro calls (or recursive loops) deeper than "
            f"{limits.depth} (a macro calling itself without end?); fix the template, or raise {ENV_DEPTH} if it is trusted")


RECURSION_MESSAGE = ("chat template recursed past Python's recursion limit (a macro or a "
                     "recursive loop without end, or data nested too deep); fix the template")


class TemplateRefusal(TokenizerError):
    """The template called `raise_exception`: it refuses this conversation."""


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(message)."""


@dataclass
class _Budget:
    """One render's bounds (what the guards check) and its macro depth so far."""

    limits: TemplateLimits
    max_chars: int
    depth: int = 0


# The render in progress on this thread (None: compiling, or a template used outside a render).
_BUDGET: ContextVar[_Budget | None] = ContextVar("template_budget", default=None)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant spans with it; we render
    the body unchanged (no assistant-token mask is needed for inference)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """The HF sandbox plus the guards: sized `*`, `+` and `**`, counted macro depth.
    Intercepted operators are also never folded at compile time (jinja2 skips them)."""

    intercepted_binops: ClassVar[frozenset[str]] = frozenset(("*", "+", "**"))  # type: ignore[misc]

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            n = _binop_size(operator, left, right)
            if n > budget.max_chars:
                what = f"value of {n:,} items (from {operator!r})"
                raise TokenizerError(output_message(budget.limits, budget.max_chars, what))
        return super().call_binop(context, operator, left, right)

    def call(self, context: Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is None or not isinstance(obj, (Macro, LoopContext)):
            return super().call(context, obj, *args, **kwargs)
        if budget.depth >= budget.limits.depth:
            raise TokenizerError(depth_message(budget.limits))
        budget.depth += 1
        try:
            return super().call(context, obj, *args, **kwargs)
        finally:
            budget.depth -= 1


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """Items (characters, list entries, or for `**` decimal digits) the result would hold;
    0 where it cannot blow up."""
    if operator == "*":
        if isinstance(left, int) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if isinstance(left, (str, list, tuple)) and isinstance(right, int):
            return len(left) * max(right, 0)
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            return len(left) + len(right)
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return abs(left).bit_length() * right * 3 // 10  # log10(2) ~ 0.3
    return 0


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    if len(fmt) > MAX_STRFTIME_FORMAT:
        raise TokenizerError(f"chat template passed a strftime_now format of {len(fmt):,} "
                             f"characters, more than {MAX_STRFTIME_FORMAT}; fix the template")
    return datetime.now().strftime(fmt)


def _range(*args: int) -> range:
    items = range(*args)
    try:
        n = len(items)
    except OverflowError:  # past sys.maxsize items
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        shown = ", ".join(_show(a) for a in args)
        raise TokenizerError(f"chat template asked for range({shown}), more than "
                             f"{MAX_RANGE:,} items; fix the template")
    return items


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile (once per distinct text) a chat template, or raise `TokenizerError`."""
    env = _ChatEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _range
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"chat template line {exc.lineno}: {_one_line(exc.message)}; fix the template"
        ) from None
    except RecursionError:
        raise TokenizerError(RECURSION_MESSAGE) from None


def render_in_sandbox(template: str | None, variables: dict[str, Any], limits: TemplateLimits,
                      max_chars: int) -> str:
    """Render `template` (None or empty: ChatML) with `variables` in this process, under the
    in-process guards: output and values up to `max_chars` characters, macro depth up to
    `limits.depth`. Every failure is a one-line `TokenizerError` (`TemplateRefusal` when the
    template called raise_exception). Time and memory are bounded only by the caller: run it
    in the renderer process (engine.gguf.template_renderer)."""
    token = _BUDGET.set(_Budget(limits, max_chars))
    try:
        # compiled inside the budget too: jinja2 folds constant filter calls while compiling
        compiled = compile_template(template or CHATML_TEMPLATE)
        pieces: list[str] = []
        n_chars = 0
        for piece in compiled.generate(**variables):
            n_chars += len(piece)
            if n_chars > max_chars:
                raise TokenizerError(output_message(limits, max_chars))
            pieces.append(piece)
        return "".join(pieces)
    except TokenizerError:
        raise
    except _TemplateRaised as exc:
        raise TemplateRefusal(
            f"chat template refused the conversation: {_one_line(_short(str(exc)))}"
        ) from None
    except jinja2.exceptions.SecurityError as exc:
        raise TokenizerError(
            f"chat template tried an unsafe operation ({_one_line(_short(str(exc)))}); "
            "use a trusted template"
        ) from None
    except MemoryError:
        raise TokenizerError(memory_message(limits)) from None
    except RecursionError:
        raise TokenizerError(RECURSION_MESSAGE) from None
    except Exception as exc:  # noqa: BLE001 - whatever a template's code raises is the template's
        raise TokenizerError(
            f"chat template failed ({type(exc).__name__}: {_one_line(_short(str(exc)))}); "
            "check the messages or the template"
        ) from None
    finally:
        _BUDGET.reset(token)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text):,} characters)"


def _show(value: Any) -> str:
    """A range argument as the template wrote it; an int too long to print by its size."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length():,} bits>"
    return _short(repr(value), 40)
