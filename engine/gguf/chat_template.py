"""Render a conversation with a model's Jinja chat template, the way HuggingFace does.

Same environment as `transformers`' `apply_chat_template`: a jinja2 immutable sandbox with
`trim_blocks`/`lstrip_blocks`, loop controls, the `{% generation %}` tag, a `tojson` filter
that keeps non-ASCII text, and the `raise_exception` / `strftime_now` globals.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import TokenizerError

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class _TemplateRaised(jinja2.TemplateError):
    """The template called raise_exception(message)."""


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
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile (once per distinct text) a chat template, or raise `TokenizerError`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"chat template line {exc.lineno}: {_one_line(exc.message)}; fix the template"
        ) from None


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **context: Any,
) -> str:
    """Render `messages` (dicts with 'role' and 'content') into a prompt string.

    `template` None or empty means ChatML. Extra keyword arguments (`tools`,
    `enable_thinking`, ...) become template variables. Template errors and sandbox violations
    raise a one-line `TokenizerError`.
    """
    compiled = compile_template(template or CHATML_TEMPLATE)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except _TemplateRaised as exc:
        raise TokenizerError(
            f"chat template refused the conversation: {_one_line(str(exc))}"
        ) from None
    except jinja2.exceptions.SecurityError as exc:
        raise TokenizerError(
            f"chat template tried an unsafe operation ({_one_line(str(exc))}); "
            "use a trusted template"
        ) from None
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise TokenizerError(
            f"chat template failed ({type(exc).__name__}: {_one_line(str(exc))}); "
            "check the messages or the template"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
