"""Chat templates rendered in a child process bounded in time and memory (`render_chat`), and
the probe a model's template must pass at load (`check_chat_template`).

Jinja's sandbox cannot bound one C-level operation: `'{:>999999999}'.format(1)`,
`'x' * 10**9` or a `join` of a huge range allocates in a single call. So one persistent child
per process (started on first use, shared under a lock) renders every template: it limits its
own address space (RLIMIT_AS: `TemplateLimits.memory_mib`) and, per render, its CPU time
(RLIMIT_CPU, a backstop should this process die mid-render), while this side waits for the
reply with a wall-clock deadline and kills the child on a timeout or a crash; the next render
starts a fresh one. The two speak JSON lines over pipes:
`{"template", "variables", "limits", "max_chars"}` -> `{"text"}` or `{"error", "refused"}`.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from functools import cache
from pathlib import Path
from typing import Any

from engine.errors import TokenizerError
from engine.gguf.chat_template import (
    MiB,
    TemplateLimits,
    TemplateRefusal,
    memory_message,
    render_in_sandbox,
    time_message,
)

# The conversation every model's template must render at load: each role, the turn to answer.
PROBE_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
)
PROBE_NAME = "a probe conversation (system, user, assistant, user)"

START_S = 60.0  # a loaded 2-core machine can take seconds to start Python
READY = b'{"ready": true}\n'
_ROOT = Path(__file__).resolve().parents[2]  # holds the `engine` package the child imports


@cache
def default_limits() -> TemplateLimits:
    """The limits from the STRATA_TEMPLATE_* variables, read once per process."""
    return TemplateLimits.from_env()


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    limits: TemplateLimits | None = None,
    **context: Any,
) -> str:
    """Render `messages` (dicts with 'role' and 'content') into a prompt string.

    `template` None or empty means ChatML. Extra keyword arguments (`tools`,
    `enable_thinking`, ...) become template variables; all must be JSON data. Template errors,
    sandbox violations and every limit (`limits`, default `default_limits()`) raise a one-line
    `TokenizerError` (`TemplateRefusal` when the template called raise_exception).
    """
    variables = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                 "bos_token": bos_token, "eos_token": eos_token, **context}
    return _RENDERER.render(template, variables, limits or default_limits())


def check_chat_template(template: str | None, bos_token: str = "", eos_token: str = "",
                        limits: TemplateLimits | None = None) -> None:
    """Refuse, in one line, a template that cannot render PROBE_MESSAGES with the generation
    prompt, or renders nothing. A template that refuses a system message (raise_exception) is
    asked again without it, as models without a system role are."""
    try:
        try:
            text = render_chat(template, list(PROBE_MESSAGES), True, bos_token, eos_token, limits)
        except TemplateRefusal:
            text = render_chat(template, list(PROBE_MESSAGES[1:]), True, bos_token, eos_token,
                               limits)
    except TokenizerError as exc:
        raise TokenizerError(f"{exc} (rendering {PROBE_NAME} at load)") from None
    if not text.strip():
        raise TokenizerError(f"chat template renders an empty prompt for {PROBE_NAME}; fix "
                             "tokenizer.chat_template in the model file")


class _Died(Exception):
    """The child exited or closed its pipe."""


class TemplateRenderer:
    """The persistent renderer child of this process; `render` is thread-safe (one render at
    a time) and starts, restarts or replaces (another memory limit) the child as needed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = 0  # the pid that started it: a forked copy of this process starts its own
        self._memory_mib = 0
        self._last_stderr = b""  # what the last child wrote before it ended (our bugs)

    def render(self, template: str | None, variables: dict[str, Any],
               limits: TemplateLimits) -> str:
        """`render_in_sandbox` of `template` and `variables` in the child, within `limits`."""
        try:
            payload = json.dumps(variables)
        except (TypeError, ValueError) as exc:
            raise TokenizerError(f"the conversation is not JSON data ({exc}); pass strings, "
                                 "numbers, lists and objects") from None
        max_chars = limits.max_output_chars(len(payload))
        request = (f'{{"template": {json.dumps(template)}, "limits": '
                   f'{json.dumps(asdict(limits))}, "max_chars": {max_chars}, '
                   f'"variables": {payload}}}\n').encode()
        with self._lock:
            reply = self._exchange(request, limits, max_chars)
        if "text" in reply:
            return reply["text"]
        raise (TemplateRefusal if reply.get("refused") else TokenizerError)(reply["error"])

    def close(self) -> None:
        """End the child (it exits at the end of its input), killing it if it does not."""
        with self._lock:
            self._stop(kill=False)

    def _exchange(self, request: bytes, limits: TemplateLimits, max_chars: int) -> dict:
        deadline = time.monotonic() + limits.time_s
        try:
            proc = self._child(limits.memory_mib)
            assert proc.stdin is not None
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
            except BrokenPipeError:  # it died since its last reply (killed from outside)
                self._stop(kill=True)
                raise TokenizerError(self._died_message(proc, limits)) from None
            # JSON escapes make a reply up to 6 characters per output character
            line = self._read_line(proc, deadline, 6 * max_chars + 4096, limits)
        except BaseException:
            # a limit, Ctrl+C or our bug between request and reply: the child may still
            # answer, and no later render may read that answer as its own
            self._stop(kill=True)
            raise
        try:
            return json.loads(line)
        except ValueError:
            self._stop(kill=True)
            raise AssertionError(f"renderer reply is not JSON: {line[:200]!r}") from None

    def _read_line(self, proc: subprocess.Popen[bytes], deadline: float, max_bytes: int,
                   limits: TemplateLimits) -> bytes:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = bytearray()
        while not buf.endswith(b"\n"):  # a reply is one line: JSON escapes its newlines
            left = deadline - time.monotonic()
            if left <= 0:
                self._stop(kill=True)
                raise TokenizerError(time_message(limits))
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self._stop(kill=True)
                raise TokenizerError(self._died_message(proc, limits))
            buf += chunk
            assert len(buf) <= max_bytes, f"renderer reply past {max_bytes:,} bytes"
        return bytes(buf)

    def _child(self, memory_mib: int) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._owner != os.getpid():
            self._proc = None  # the parent's child: leave it to the parent
        if self._proc is not None and (self._memory_mib != memory_mib
                                       or self._proc.poll() is not None):
            self._stop(kill=True)
        if self._proc is None:
            env = {**os.environ,
                   "PYTHONPATH": os.pathsep.join(filter(None, (str(_ROOT),
                                                               os.environ.get("PYTHONPATH"))))}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "engine.gguf.template_renderer", str(memory_mib)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=_ROOT, env=env,
            )
            self._owner, self._memory_mib = os.getpid(), memory_mib
            # its start (imports) is not the first render's time
            line = self._read_line(self._proc, time.monotonic() + START_S, 4096,
                                   TemplateLimits(time_s=START_S, memory_mib=memory_mib))
            assert line == READY, f"renderer said {line[:200]!r} at start"
        return self._proc

    def _stop(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None or self._owner != os.getpid():
            return
        if kill:
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:  # a broken pipe's unflushed bytes
                pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._last_stderr = proc.stderr.read()[-4096:] if proc.stderr is not None else b""
        if proc.stderr is not None:
            proc.stderr.close()

    def _died_message(self, proc: subprocess.Popen[bytes], limits: TemplateLimits) -> str:
        code = proc.returncode
        last = self._last_stderr.decode(errors="replace").split()
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit status {code}")
        said = f": {' '.join(last[-12:])}" if last else ""
        return (f"the chat template renderer died while rendering ({how}{said}); "
                f"{memory_message(limits)}")


_RENDERER = TemplateRenderer()
atexit.register(_RENDERER.close)


# --- the child ----------------------------------------------------------------------------------


def _limit_self(memory_mib: int) -> None:
    """Bound this child: address space, no core files, no files written."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    want = memory_mib * MiB
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_AS, (want, hard))


def _limit_cpu(time_s: float) -> None:
    """Allow this render `time_s` (rounded up) more seconds of CPU: SIGXCPU ends the child if
    the parent, which kills it at its deadline, is gone."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used) + math.ceil(time_s) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _answer(line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except RecursionError:
        return {"error": "the conversation is nested too deep to render; flatten it"}
    except MemoryError:
        return {"error": "the conversation is too large to render"}
    limits = TemplateLimits(**request["limits"])
    _limit_cpu(limits.time_s)
    try:
        return {"text": render_in_sandbox(request["template"], request["variables"], limits,
                                          request["max_chars"])}
    except TemplateRefusal as exc:
        return {"error": str(exc), "refused": True}
    except TokenizerError as exc:
        return {"error": str(exc)}


def main() -> None:
    """The child: JSON lines in, JSON lines out, until its input ends."""
    import signal
    import warnings

    warnings.simplefilter("ignore")  # its stderr is read only once it has ended
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the parent's (it kills mid-render)
    _limit_self(int(sys.argv[1]))
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    for line in sys.stdin.buffer:
        reply = _answer(line)
        try:
            out = json.dumps(reply).encode() + b"\n"
        except MemoryError:
            del reply
            out = json.dumps({"error": "the chat template's output is too large to send "
                                       "back"}).encode() + b"\n"
        sys.stdout.buffer.write(out)
        sys.stdout.buffer.flush()


if __name__ == "__main__":
    main()
