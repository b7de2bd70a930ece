"""Tools and template arguments in the chat template, tool-call parsing, and tool calls through the gateway.

The template with tools is a Qwen3-style one written here (tools in the system prompt, Hermes <tool_call> blocks,
<tool_response> user turns, the enable_thinking switch), on the embedded default's tokenizer: templating is checked
against transformers' own apply_chat_template of the same template."""
from __future__ import annotations

import copy
import json

import openai
import pytest

from dflash_contract.chat import HERMES_SYSTEM, hermes_messages
from dflash_runtime.checkpoint import resolve_target
from dflash_runtime.text import encode_prompt, load_tokenizer
from gateway.tools import ToolError, ToolPlan, tool_plan

QWEN3_STYLE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}{%- for m in messages %}{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for call in m.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
                                             "additionalProperties": False}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_target(MODEL)[0])


@pytest.fixture
def qwen3_style(tokenizer):
    qwen = copy.copy(tokenizer)
    qwen.chat_template = QWEN3_STYLE
    return qwen


def test_tools_and_template_arguments_render_as_transformers_renders_them(qwen3_style):
    for kwargs in ({}, {"enable_thinking": False}):
        for tools in (None, [WEATHER, TIME]):
            args = {**kwargs, **({"tools": tools} if tools else {})}
            expected = qwen3_style.apply_chat_template(TOOL_TURNS, tools=tools, tokenize=False,
                                                       add_generation_prompt=True, **kwargs)
            assert encode_prompt(qwen3_style, TOOL_TURNS, template_args=args) == \
                qwen3_style.encode(expected, add_special_tokens=False)
    off = qwen3_style.decode(encode_prompt(qwen3_style, TOOL_TURNS[:1], template_args={"enable_thinking": False}))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_template_without_tools_gets_them_in_the_hermes_format(tokenizer):
    """SmolLM2's template has no tools: the definitions join the system prompt, calls and results the turns."""
    text = tokenizer.decode(encode_prompt(tokenizer, TOOL_TURNS, template_args={"tools": [WEATHER]}))
    assert HERMES_SYSTEM.split("{tools}")[0] in text and json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    plain = [{"role": "user", "content": "Hi"}]
    assert hermes_messages(plain, []) == plain  # nothing changes for a conversation without tools
    assert encode_prompt(tokenizer, plain) == tokenizer.encode(tokenizer.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def test_auto_parses_hermes_tool_calls_and_keeps_the_text_before_them():
    plan = tool_plan({"tools": [WEATHER, TIME]})
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = plan.calls(text)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"} and calls[0]["id"].startswith("call_")
    assert len(tool_plan({"tools": [WEATHER, TIME], "parallel_tool_calls": False}).calls(text)[1]) == 1
    assert plan.calls("Just text.") == ("Just text.", [])
    assert plan.calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert tool_plan({"tools": [WEATHER], "tool_choice": "none"}).calls(text) == (text, [])


def test_required_and_named_choices_guide_the_answer_and_read_it():
    required = tool_plan({"tools": [WEATHER, TIME], "tool_choice": "required"})
    schema = json.loads(required.guide().text)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    _, calls = required.calls('[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    single = tool_plan({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    assert json.loads(single.guide().text)["maxItems"] == 1
    named = tool_plan({"tools": [WEATHER, TIME], "tool_choice": {"type": "function",
                                                                  "function": {"name": "get_weather"}}})
    assert json.loads(named.guide().text) == WEATHER["function"]["parameters"]
    assert named.calls('{"city": "Oslo"}')[1][0]["function"] == {"name": "get_weather",
                                                                 "arguments": '{"city": "Oslo"}'}
    assert tool_plan({"tools": [WEATHER], "tool_choice": "auto"}).guide() is None
    assert tool_plan({}) is None and tool_plan({"tools": []}) is None


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "function"}]}, "tools", "tools[0] must be"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools have the same name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be true or false"),
])
def test_bad_tools_fields_are_refused_naming_them(body, param, words):
    with pytest.raises(ToolError, match=words.replace("[", r"\[").replace("]", r"\]")) as refused:
        tool_plan(body)
    assert refused.value.param == param


@pytest.fixture(scope="module")
def client(default_server):
    with openai.OpenAI(base_url=f"{default_server.gateway.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def ask(client, **fields):
    return client.chat.completions.create(model=MODEL, max_tokens=96, temperature=0, **{
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], **fields})


def test_forced_and_required_tool_calls_parse_and_name_the_tool(client):
    named = ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    required = ask(client, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    assert {c.function.name for c in required.message.tool_calls} <= {"get_weather", "get_time"}
    chunks = list(ask(client, tools=[WEATHER, TIME], tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in required.message.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_two_turn_tool_conversation_and_auto(client):
    """The follow-up turn (an assistant's tool_calls with null content, the tool's result, a named message) is
    templated and answered; "auto" on SmolLM2 (which has no tool training) answers text or parsed calls."""
    messages = [{"role": "user", "content": "Weather in Paris?", "name": "ann"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    reply = ask(client, messages=messages, tools=[WEATHER]).choices[0]
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    assert reply.message.content or reply.message.tool_calls
    free = ask(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert free.message.tool_calls is None and free.message.content


def test_chat_template_kwargs_reach_the_template(client):
    """SmolLM2's template reads no arguments: the same answer with or without one; a reserved one is refused."""
    plain = ask(client).choices[0].message.content
    assert ask(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message.content \
        == plain
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert refused.value.body["param"] == "chat_template_kwargs"
