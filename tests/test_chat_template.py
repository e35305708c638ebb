"""Chat templates rendered like HuggingFace: the Qwen3 template, ChatML fallback, errors."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from engine.errors import TokenizerError
from engine.gguf.chat_template import CHATML_TEMPLATE, compile_template
from engine.gguf.template_renderer import render_chat

# Qwen3's hybrid-thinking chat template (tokenizer_config.json of Qwen3-30B-A3B), written out
# by hand: the revision that checks `message.content is string`.
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + \
reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


@pytest.fixture
def qwen3_template() -> str:
    return QWEN3_TEMPLATE


CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {
        "role": "assistant",
        "content": "<think>\nThe user greets me.\n</think>\n\nHi! How can I help?",
    },
    {"role": "user", "content": "Tell me a joke."},
]


def test_qwen3_simple_conversation(qwen3_template: str) -> None:
    assert render_chat(qwen3_template, CONVERSATION) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        # reasoning of turns before the last user query is dropped
        "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_thinking_switch_and_no_prompt(qwen3_template: str) -> None:
    out = render_chat(qwen3_template, CONVERSATION[1:2], enable_thinking=False)
    assert out == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    out = render_chat(qwen3_template, CONVERSATION[1:2], enable_thinking=True)
    assert out.endswith("<|im_start|>assistant\n")
    out = render_chat(qwen3_template, CONVERSATION[1:3], add_generation_prompt=False)
    assert out == (
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nThe user greets me.\n</think>\n\n"
        "Hi! How can I help?<|im_end|>\n"
    )


def test_qwen3_tools_and_tool_calls(qwen3_template: str) -> None:
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "str"}}}]
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "météo", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": "12 °C"},
    ]
    out = render_chat(qwen3_template, messages, tools=tools)
    assert out.startswith("<|im_start|>system\n# Tools\n")
    assert '\n{"type": "function", "function": {"name": "météo", "parameters": ' in out
    assert '<tool_call>\n{"name": "météo", "arguments": {"city": "Zürich"}}\n</tool_call>' in out
    assert out.endswith(
        "<|im_start|>user\n<tool_response>\n12 °C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template", [None, "", CHATML_TEMPLATE])
def test_chatml_fallback(template: str | None) -> None:
    out = render_chat(template, CONVERSATION[:2], add_generation_prompt=True)
    assert out == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not render_chat(template, CONVERSATION[:1], add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_hf_environment_features() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}|{% endfor %}"
        "{{ strftime_now('%Y') }}{{ eos_token }}"
    )
    messages = [{"role": "user", "content": f"ü{i}"} for i in range(4)]
    out = render_chat(template, messages, bos_token="<s>", eos_token="</s>")
    year = datetime.datetime.now().strftime("%Y")
    assert out == f'<s>"ü0"|"ü1"|{year}</s>'


def test_trim_and_lstrip_blocks() -> None:
    template = "A\n  {% if true %}\nB\n  {% endif %}\nC"
    assert render_chat(template, []) == "A\nB\nC"


def test_compiled_templates_are_cached() -> None:
    assert compile_template(QWEN3_TEMPLATE) is compile_template(QWEN3_TEMPLATE)


def one_line_error(template: str, **context: object) -> str:
    with pytest.raises(TokenizerError) as info:
        render_chat(template, [{"role": "user", "content": "x"}], **context)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_syntax_error_names_the_line() -> None:
    message = one_line_error("ok\n{% for m in messages %}\n{{ m.content }")
    assert message.startswith("chat template line 3: ")


def test_raise_exception_is_a_tokenizer_error() -> None:
    message = one_line_error(
        "{% if messages[0].role != 'system' %}"
        "{{ raise_exception('Conversation must start\nwith a system message') }}{% endif %}"
    )
    assert message == (
        "chat template refused the conversation: Conversation must start with a system message"
    )


def test_sandbox_blocks_mutation_and_private_attributes() -> None:
    message = one_line_error("{{ messages.append(1) }}")
    assert message.startswith("chat template tried an unsafe operation")
    message = one_line_error("{{ messages.__class__.__subclasses__() }}")
    assert message.startswith("chat template tried an unsafe operation")


def test_runtime_type_error() -> None:
    message = one_line_error("{{ messages[0].content + 1 }}")
    assert message.startswith("chat template failed (TypeError")


# --- real templates: llama.cpp's tree (models/templates/, llama-cpp-python 0.3.36's sdist) ----

TEMPLATES = Path(__file__).parent / "data" / "templates"
REAL_TEMPLATES = ["GLM-4.6.jinja", "GLM-4.7-Flash.jinja", "Qwen-Qwen3-0.6B.jinja"]
TOOLS = [{"type": "function", "function": {"name": "météo", "description": "weather",
                                           "parameters": {"city": "str"}}}]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "météo", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "12°C, clear"},
]


def plain_jinja(template: str, messages: list, **context: object) -> str:
    """The template through plain Jinja2 with HuggingFace's settings (the reference)."""
    import json

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: \
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(jinja2.TemplateError(m))
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token="", eos_token="", **context)


@pytest.mark.parametrize("name", REAL_TEMPLATES)
def test_real_templates_render_as_plain_jinja_does(name: str) -> None:
    """GLM-4.6, GLM-4.7-Flash and Qwen3 through our sandboxed renderer: the same text as plain
    Jinja2 for a conversation with reasoning, thinking off, tools and a tool call and result."""
    template = (TEMPLATES / name).read_text(encoding="utf-8")
    cases = [(CONVERSATION, {}), (CONVERSATION[1:2], {"enable_thinking": False}),
             (TOOL_TURNS, {"tools": TOOLS})]
    for messages, context in cases:
        assert render_chat(template, messages, **context) == plain_jinja(template, messages, **context)


def test_glm_template_renders_glms_turns() -> None:
    template = (TEMPLATES / "GLM-4.6.jinja").read_text(encoding="utf-8")
    assert render_chat(template, CONVERSATION) == (
        "[gMASK]<sop><|system|>\nYou are a helpful assistant.<|user|>\nHello!<|assistant|>\n"
        "<think></think>\nHi! How can I help?<|user|>\nTell me a joke.<|assistant|>"
    )
    assert render_chat(template, CONVERSATION[1:2], enable_thinking=False).endswith(
        "Hello!/nothink<|assistant|>\n<think></think>")
