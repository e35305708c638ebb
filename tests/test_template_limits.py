"""Hostile chat templates end bounded in time, memory, output and recursion, in one line.

Each failure of issue 27 item 1 renders through the real renderer child with the limits
lowered (1 s, 256 MiB, 1 MiB of output, depth 16), and must end within a few seconds with a
one-line TokenizerError naming the limit; this process's memory does not grow. The probe at
load refuses such a template in `strata info` / `strata plan` (exit 2, one line), and a template
that renders an empty prompt for one conversation is a one-line error in `strata run` and a 400
from the server, never a ZeroDivisionError.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import EngineOptions, LoanFlags
from engine.errors import FlagError, StrataError, TokenizerError
from engine.gguf.chat_template import CHATML_TEMPLATE, MAX_RANGE, TemplateLimits
from engine.gguf.template_renderer import _RENDERER, check_chat_template, render_chat
from engine.request.conversation import Conversation
from engine.runtime.serve import ServeLoop
from engine.synth.model import PRESETS, make_tensor, synth_tensors, write_gguf
from engine.synth.vocab import build_vocab
from tests.servers import running

LOW = TemplateLimits(time_s=1.0, output_mib=1.0, memory_mib=256, depth=16)
USER = [{"role": "user", "content": "hi"}]

# name -> (template, words the one line must hold); every case from the issue, and the C-level
# blow-ups no in-process check sees (format width, center, replace, doubling with `~`)
HOSTILE = {
    "join of a huge range": ("{{ range(100000)|join('x' * 1000) }}", "output passed"),
    "x times 10**9": ("{{ 'x' * 10**9 }}", "from '*'"),
    "nested range loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "more than 1 s"),
    "strftime_now of a 2 MB format": ("{{ strftime_now('%Y' * 10**6) }}", "from '*'"),
    "strftime_now of a long format": ("{{ strftime_now('%Y' * 1000) }}", "strftime_now format"),
    "range(10**9)": ("{{ range(10**9)|length }}", f"more than {MAX_RANGE:,} items"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                        "deeper than 16"),
    "recursive loop": ("{% for m in messages recursive %}{{ loop([m]) }}{% endfor %}",
                       "deeper than 16"),
    "1/0": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "attr('format_map')": ("{{ ('{x}'|attr('format_map'))({}) }}", "KeyError"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "more than 256 MiB"),
    "center": ("{{ 'a'|center(999999999) }}", "more than 256 MiB"),
    "replace": ("{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}", "more than 256 MiB"),
    "doubling with ~": (("{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"),
                        "more than 256 MiB"),
}


def refusal(template: str, limits: TemplateLimits = LOW,
            messages: list[dict] | None = None) -> str:
    with pytest.raises(TokenizerError) as info:
        render_chat(template, messages or USER, limits=limits)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_template_ends_bounded_in_one_line(case: str) -> None:
    template, words = HOSTILE[case]
    # the memory cases test the memory bound: time enough for a loaded machine to reach it
    limits = replace(LOW, time_s=10) if "MiB" in words else LOW
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    message = refusal(template, limits)
    assert time.monotonic() - t0 < limits.time_s + 3, case
    assert words in message, message
    assert message.startswith("chat template "), message
    # the work ran in the child: this process did not grow (ru_maxrss is in KiB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024
    assert render_chat(None, USER, limits=LOW).endswith("<|im_start|>assistant\n")  # still up


def test_each_refusal_names_how_to_raise_its_limit() -> None:
    assert "STRATA_TEMPLATE_TIME_S" in refusal(HOSTILE["nested range loops"][0])
    assert "STRATA_TEMPLATE_OUTPUT_MIB" in refusal(HOSTILE["join of a huge range"][0])
    assert "STRATA_TEMPLATE_MEMORY_MIB" in refusal(HOSTILE["center"][0])
    assert "STRATA_TEMPLATE_DEPTH" in refusal(HOSTILE["recursive macro"][0])


def test_raised_limits_let_the_same_template_render() -> None:
    deep = "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{% else %}end{% endif %}{% endmacro %}"
    assert "deeper than 16" in refusal(deep + "{{ f(20) }}")
    assert render_chat(deep + "{{ f(20) }}", USER, limits=replace(LOW, depth=32)) == "end"
    big = "{{ 'x' * 2000000 }}"
    assert "from '*'" in refusal(big)
    assert len(render_chat(big, USER, limits=replace(LOW, output_mib=4))) == 2_000_000


def test_python_recursion_past_the_depth_limit_is_one_line() -> None:
    message = refusal(HOSTILE["recursive macro"][0], replace(LOW, depth=10_000))
    assert "recursion limit" in message or "more than 256 MiB" in message, message


def test_the_output_bound_grows_with_the_conversation() -> None:
    long = [{"role": "user", "content": "y" * 3_000_000}]  # past 1 MiB on its own
    out = render_chat(CHATML_TEMPLATE, long, limits=LOW)
    assert len(out) > 3_000_000
    assert "output passed" in refusal("{% for i in range(5) %}{{ messages[0].content }}"
                                      "{% endfor %}", messages=long)


def test_a_killed_renderer_is_restarted() -> None:
    assert render_chat(None, USER, limits=LOW)
    proc = _RENDERER._proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert render_chat(None, USER, limits=LOW).endswith("assistant\n")
    assert _RENDERER._proc is not proc


def test_a_renderer_killed_mid_render_is_one_line() -> None:
    render_chat(None, USER, limits=LOW)
    proc = _RENDERER._proc
    assert proc is not None
    threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL)).start()
    message = refusal(HOSTILE["nested range loops"][0], replace(LOW, time_s=5))
    assert "renderer died while rendering (killed by signal 9)" in message, message


def test_renders_from_many_threads_share_the_child() -> None:
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = render_chat(None, [{"role": "user", "content": str(i)}], limits=LOW)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == f"<|im_start|>user\n{i}<|im_end|>\n<|im_start|>assistant\n"
               for i in range(8))


def test_odd_text_passes_through_the_pipe() -> None:
    text = "é\u2028\ud800 \x00 {{ }}\n"  # a lone surrogate, a NUL, template syntax as text
    assert render_chat("{{ messages[0].content }}", [{"role": "user", "content": text}],
                       limits=LOW) == text


@pytest.mark.parametrize("value", ["", "abc", "-1", "0", "1e3", "\u0663", "99999999"])
def test_limit_variables_are_checked(value: str) -> None:
    with pytest.raises(FlagError, match="STRATA_TEMPLATE_TIME_S"):
        TemplateLimits.from_env({"STRATA_TEMPLATE_TIME_S": value})


def test_limit_variables_set_the_limits() -> None:
    limits = TemplateLimits.from_env({"STRATA_TEMPLATE_TIME_S": "0.5",
                                      "STRATA_TEMPLATE_OUTPUT_MIB": "16",
                                      "STRATA_TEMPLATE_MEMORY_MIB": "2048",
                                      "STRATA_TEMPLATE_DEPTH": "200"})
    assert limits == TemplateLimits(time_s=0.5, output_mib=16, memory_mib=2048, depth=200)
    assert TemplateLimits.from_env({}) == TemplateLimits()


# --- the probe at load ------------------------------------------------------------------------

SYSTEMLESS = ("{% if messages[0].role == 'system' %}"
              "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML_TEMPLATE)
ONLY_LONG = "{% if messages|length > 1 %}" + CHATML_TEMPLATE + "{% endif %}"


def test_the_probe_passes_real_templates_and_ones_without_a_system_role() -> None:
    check_chat_template(None, limits=LOW)
    check_chat_template(SYSTEMLESS, limits=LOW)
    check_chat_template(ONLY_LONG, limits=LOW)  # empty only for one message: found per request


@pytest.mark.parametrize("template, words", [
    ("{{ '' }}", "renders an empty prompt for a probe conversation"),
    ("{{ raise_exception('never') }}", "refused the conversation: never"),
    (HOSTILE["nested range loops"][0], "more than 1 s"),
])
def test_the_probe_refuses_in_one_line(template: str, words: str) -> None:
    with pytest.raises(TokenizerError) as info:
        check_chat_template(template, limits=LOW)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


# --- files with such templates: the CLI, the engine, the server ------------------------------


def write_with_template(path: Path, template: str) -> Path:
    """The tiny preset written by the project's GGUF writer with `template` as its
    tokenizer.chat_template."""
    spec = PRESETS["tiny"]
    vocab = replace(build_vocab(spec.n_vocab, seed=spec.seed), chat_template=template)
    tensors = synth_tensors(spec)
    data = (make_tensor(name, shape, qtype, spec) for name, (shape, qtype) in tensors.items())
    return write_gguf(path, spec, vocab, tensors, data, "hostile template")


def strata(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STRATA_TEMPLATE_TIME_S": "1"}
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], check=False, env=env,
                          capture_output=True, text=True, timeout=120)


def one_error_line(r: subprocess.CompletedProcess[str], words: str) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("strata: error: ") and words in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["info", "plan"])
@pytest.mark.parametrize("case, words", [("nested range loops", "more than 1 s"),
                                         ("x times 10**9", "from '*'")])
def test_info_and_plan_refuse_a_hostile_template(tmp_path: Path, command: str, case: str,
                                                 words: str) -> None:
    path = write_with_template(tmp_path / "hostile.gguf", HOSTILE[case][0])
    args = [str(path)] if command == "info" else ["--model", str(path), "--device", "sim"]
    r = strata(command, *args)
    one_error_line(r, words)
    assert r.stderr.startswith("strata: error: hostile.gguf: chat template "), r.stderr
    assert "probe conversation" in r.stderr and r.stdout == "", r.stderr


@pytest.fixture(scope="module")
def only_long_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_with_template(tmp_path_factory.mktemp("tpl") / "only-long.gguf", ONLY_LONG)


def test_run_refuses_an_empty_prompt_in_one_line(only_long_path: Path) -> None:
    r = strata("run", "--model", str(only_long_path), "--device", "sim", "--prompt", "hi",
               "--max-new", "1")
    one_error_line(r, "renders an empty prompt for this conversation")


def test_the_engine_keeps_the_conversation_on_an_empty_prompt(only_long_path: Path) -> None:
    loop = ServeLoop.create(EngineOptions(model=str(only_long_path), device="sim", ctx=256))
    try:
        conv = Conversation()
        with pytest.raises(TokenizerError, match="empty prompt"):
            loop.chat(conv, "hi", max_new=1)
        assert conv.as_dicts() == []
        with pytest.raises(StrataError, match="the prompt is empty"):
            loop.complete([], max_new=1)
        conv.add("user", "hello")  # a second message: the template renders it
        assert loop.chat(conv, "again", max_new=2).text is not None
    finally:
        loop.close()


def test_the_server_answers_400_for_an_empty_prompt(only_long_path: Path) -> None:
    options = {"device": "sim", "ctx": 256}
    with running(str(only_long_path), options, LoanFlags()) as server, server.client() as c:
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert "empty prompt" in r.json()["error"]["message"]
        body["messages"].insert(0, {"role": "system", "content": "be brief"})
        assert c.post("/v1/chat/completions", json=body).status_code == 200
