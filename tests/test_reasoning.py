"""The qwen3 reasoning parser (gateway/reasoning.py): <think>...</think> apart as reasoning_content, whole and
streamed, beside tool calls; and through a gateway started with --reasoning-parser qwen3 on the real server, whose
answer is guided to hold a think block (the embedded default does not think by itself)."""
from __future__ import annotations

import openai
import pytest

from deploy.server_process import start_gateway
from gateway.answers import chat_message
from gateway.api import chat_request
from gateway.reasoning import StreamSplitter, split

MODEL = "smollm2-135m"
THOUGHT = "<think>\nThe user asks for a city.\n</think>\n\nParis."


def test_a_whole_answer_splits_at_the_think_block():
    assert split(THOUGHT) == ("The user asks for a city.", "Paris.")
    assert split("Paris.") == (None, "Paris.")  # enable_thinking false: no block in the answer
    assert split("<think>\nstill thinking") == (None, "<think>\nstill thinking")  # cut by max_tokens: vLLM's rule


@pytest.mark.parametrize("step", [1, 2, 3, 7, 100])
def test_streamed_deltas_rebuild_the_same_parts_whatever_the_cut(step):
    splitter = StreamSplitter()
    parts = [splitter.feed(THOUGHT[i:i + step]) for i in range(0, len(THOUGHT), step)]
    parts.append(splitter.feed("", final=True))
    reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
    assert reasoning.strip("\n") == "The user asks for a city." and content == "Paris."
    plain = StreamSplitter()
    assert plain.feed("<th") == ("", "") and plain.feed("e end") == ("", "<the end")


def test_reasoning_and_tool_calls_in_one_message():
    t = chat_request({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}, MODEL, 16,
        reasoning="qwen3")
    message, reason = chat_message(t, '<think>\nA tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                                      '"arguments": {}}\n</tool_call>', "stop")
    assert reason == "tool_calls" and message["reasoning_content"] == "A tool." and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.fixture(scope="module")
def thinking(default_server):
    gateway = start_gateway(default_server.grpc_url, MODEL, 0, None, graceful_seconds=1, reasoning_parser="qwen3")
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
            yield client
    finally:
        gateway.stop(5)


def test_a_gateway_with_the_qwen3_parser_returns_reasoning_content(thinking):
    regex = r"<think>\n[a-z ]{5,30}\n</think>\n\n(Yes|No)\."
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Is Paris in France?"}], "max_tokens": 48,
               "temperature": 0, "extra_body": {"structured_outputs": {"regex": regex}}}
    whole = thinking.chat.completions.create(**request).choices[0].message
    assert whole.content in ("Yes.", "No.") and 5 <= len(whole.model_extra["reasoning_content"]) <= 30
    chunks = list(thinking.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == whole.content
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas).strip("\n") == \
        whole.model_extra["reasoning_content"]


def test_the_build_names_the_presets_parser():
    from builder.options import BuildOptions, reasoning_parser

    def parser(target, **named):
        return reasoning_parser(BuildOptions(target=target, drafter="preset", **named))

    assert parser("qwen3-8b") == "qwen3" and parser("smollm2-135m") is None
    assert parser("qwen3-8b", reasoning_parser="none") is None
    assert parser("/models/any", reasoning_parser="qwen3") == "qwen3"
