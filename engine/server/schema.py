"""Request bodies: JSON in, a validated ChatRequest out; every refusal a RequestError naming
the field (OpenAI's error shape: message, type, param, code).

Fields a chat client commonly sends but this engine cannot honour (several choices, logprobs,
tools, penalties, JSON mode) are refused by name rather than silently ignored; fields it does
not know (`user`, `metadata`, ...) are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import FlagError, StrataError
from engine.request.sampler import SamplingParams

MAX_STOPS = 4  # OpenAI's limit on `stop`
MAX_SEED = 2**63 - 1
MAX_DIGITS = 20  # an integer longer than this fits no field (2**64 has 20 digits)
# a \uD800-\uDFFF escape: the body may hold a lone surrogate, which is no UTF-8 text
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# roles a chat template knows; OpenAI's newer "developer" is a system message
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
UNSUPPORTED = {  # field -> (value that is harmless, why it is refused otherwise)
    "logprobs": (False, "log probabilities are not returned by this server; leave it false"),
    "top_logprobs": (None, "log probabilities are not returned by this server; leave it out"),
    "frequency_penalty": (0, "penalties are not supported; leave it 0"),
    "presence_penalty": (0, "penalties are not supported; leave it 0"),
    "logit_bias": (None, "logit bias is not supported; leave it out"),
    "tools": (None, "tool calls are not supported; leave it out"),
    "functions": (None, "function calls are not supported; leave it out"),
    "audio": (None, "audio output is not supported; leave it out"),
}


class RequestError(StrataError):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.kind, self.headers = kind, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """A validated `POST /v1/chat/completions` body."""

    messages: tuple[tuple[str, str], ...]  # (role, text); the last one is the user's
    model: str | None
    max_tokens: int | None  # None: the server's --max-new, cut to what the context holds
    params: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage

    @property
    def history(self) -> tuple[tuple[str, str], ...]:
        """Every message before the last (the user's)."""
        return self.messages[:-1]

    @property
    def prompt(self) -> str:
        return self.messages[-1][1]

    @property
    def text_bytes(self) -> int:
        """The messages' text in UTF-8 bytes: what the prompt cap bounds before any work."""
        return sum(len(text.encode()) for _, text in self.messages)


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a RequestError saying where it is not: not UTF-8, not
    JSON, nested too deep, a number no field could hold (more than `MAX_DIGITS` digits, past
    a float's range, NaN or Infinity), or a string that is no text (a lone surrogate)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the request body is not UTF-8 text (byte {exc.start}); send JSON "
                           "in UTF-8") from None
    try:
        value = json.loads(text, parse_int=_json_int, parse_float=_json_float,
                           parse_constant=_json_constant)
    except json.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                           f"column {exc.colno}") from None
    except RecursionError:
        raise RequestError("the request body nests lists or objects too deeply; a request "
                           "needs a few levels") from None
    if _SURROGATE_ESCAPE.search(text):  # rare: look at every string only then
        _refuse_surrogates(value)
    if not isinstance(value, dict):
        raise RequestError(f"the request body must be a JSON object, not {_kind(value)}")
    return value


def _json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_DIGITS:
        raise RequestError(f"the request body holds an integer of {len(digits):,} digits; "
                           f"no field takes more than {MAX_DIGITS}")
    return int(digits)


def _json_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise RequestError(f"the request body holds the number {text[:40]}, past a float's "
                           "range; send a finite number")
    return v


def _json_constant(name: str) -> float:
    raise RequestError(f"the request body holds {name}, which is not JSON; send a finite number")


def _refuse_surrogates(value: Any) -> None:
    """A RequestError naming the first string (or key) that holds a lone surrogate."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                _text(k, f"{where}.{k!r}" if where else repr(k))
                stack.append((item, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(v))
        elif isinstance(v, str):
            _text(v, where)


def _text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{where or 'the body'} holds a lone surrogate (\\u{ord(s[exc.start]):x} "
                           f"at character {exc.start}), which is not text; send valid UTF-16 "
                           "pairs or UTF-8", where or None) from None


def parse_chat(body: bytes, defaults: SamplingParams) -> ChatRequest:
    """Validate a chat completion request; fields left out take `defaults` (the server's)."""
    d = {k: v for k, v in parse_json(body).items() if v is not None}  # null: left out
    for name, (harmless, why) in UNSUPPORTED.items():
        if name in d and d[name] != harmless and d[name] != []:
            raise RequestError(f"{name}: {why}", name, code="unsupported_parameter")
    n = _int(d, "n", 1)
    if n is not None and n != 1:
        raise RequestError(f"n {n}: one choice per request is supported; leave it 1", "n",
                           code="unsupported_parameter")
    fmt = d.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("response_format: only {\"type\": \"text\"} is supported",
                           "response_format", code="unsupported_parameter")
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, not {_kind(model)}", "model")
    max_tokens = _int(d, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(d, "max_tokens", 1)
    changes = {
        "temperature": _number(d, "temperature", 0.0, 2.0, defaults.temperature),
        "top_p": _number(d, "top_p", 0.0, 1.0, defaults.top_p, low_open=True),
        "top_k": _int(d, "top_k", 0) if "top_k" in d else defaults.top_k,  # llama.cpp's
        "seed": _int(d, "seed", 0, MAX_SEED) if "seed" in d else defaults.seed,
    }
    try:
        params = replace(defaults, **changes)
    except FlagError as exc:  # the sampler's own rule (it names its CLI option)
        field = next((k for k in changes if k in str(exc) or k.replace("_", "-") in str(exc)),
                     None)
        raise RequestError(f"{field or 'sampling'}: {exc}", field) from None
    stream = _bool(d, "stream")
    options = d.get("stream_options", {})
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, not {_kind(options)}",
                           "stream_options")
    return ChatRequest(_messages(d), model, max_tokens, params, _stops(d), stream,
                       stream and _bool(options, "include_usage", "stream_options."))


def _messages(d: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    if "messages" not in d:
        raise RequestError("messages is required: a list of {role, content} objects",
                           "messages")
    items = d["messages"]
    if not isinstance(items, list) or not items:
        raise RequestError("messages must be a non-empty list of {role, content} objects",
                           "messages")
    out = []
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with role and content, not "
                               f"{_kind(m)}", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            shown = repr(role) if isinstance(role, str) else _kind(role)
            raise RequestError(f"{where}.role {shown[:60]} is not one of "
                               f"{', '.join(ROLES)}", f"{where}.role")
        out.append((ROLES[role], _content(m.get("content"), f"{where}.content")))
    if out[-1][0] != "user":
        raise RequestError(f"messages[{len(out) - 1}] is a {items[-1]['role']} message; the "
                           "last message must be the user's (role 'user')", "messages")
    return tuple(out)


def _content(value: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (what the openai client may send)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str
            ):
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise RequestError(f"{where}[{j}] is a {kind!s} part; only text parts "
                                   "({type: text, text}) are supported", f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts, not "
                       f"{_kind(value)}", where)


def _stops(d: dict[str, Any]) -> tuple[str, ...]:
    stop = d.get("stop", [])
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOPS}", "stop")
    if "" in stops:
        raise RequestError("stop holds an empty string; every stop string needs text", "stop")
    return tuple(stops)


def _int(d: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    if name not in d:
        return None
    v = d[name]
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"{name} must be an integer, not {_kind(v)}", name)
    if v < low or (high is not None and v > high):
        bound = f"at least {low}" if high is None else f"in {low}..{high}"
        raise RequestError(f"{name} {str(v)[:24]} must be {bound}", name)
    return v


def _number(d: dict[str, Any], name: str, low: float, high: float, default: float,
            low_open: bool = False) -> float:
    if name not in d:
        return default
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"{name} must be a number, not {_kind(v)}", name)
    try:
        v = float(v)
    except OverflowError:  # an integer past a float's range
        raise RequestError(f"{name} {str(v)[:24]}... must be in [{low:g}, {high:g}]",
                           name) from None
    if not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number, not {v}", name)
    if v > high or v < low or (low_open and v == low):
        bound = f"in ({low:g}, {high:g}]" if low_open else f"in [{low:g}, {high:g}]"
        raise RequestError(f"{name} {v:g} must be {bound}", name)
    return float(v)


def _bool(d: dict[str, Any], name: str, prefix: str = "") -> bool:
    v = d.get(name, False)
    if not isinstance(v, bool):
        raise RequestError(f"{prefix}{name} must be true or false, not {_kind(v)}",
                           prefix + name)
    return v


def _kind(v: Any) -> str:
    """What a JSON value is, in words (with the value when it is short)."""
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number",
             list: "a list", dict: "an object", type(None): "null"}
    shown = json.dumps(v) if isinstance(v, (str, int, float, bool)) else ""
    return f"{names.get(type(v), type(v).__name__)}" + (f" ({shown[:40]})" if shown else "")
