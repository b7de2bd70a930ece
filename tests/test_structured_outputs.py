"""Structured outputs end to end on the real tritonserver + embedded default: the official `openai` client through
the gateway (response_format, vLLM's structured_outputs), and tensorrtllm_backend's guided-decoding inputs on both
front models over gRPC."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import openai
import pytest

from test_serving import FRONT_MODELS, streamed_text

MODEL = "smollm2-135m"
NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": False},
    "city": {"type": "object", "properties": {"city": NAME, "country": NAME, "capital": {"type": "boolean"}},
             "required": ["city", "country", "capital"], "additionalProperties": False},
    "colors": {"type": "object", "properties": {"colors": {"type": "array", "items": {
        "enum": ["red", "green", "blue", "yellow", "black", "white"]}, "minItems": 1, "maxItems": 4}},
        "required": ["colors"], "additionalProperties": False},
    "sentiment": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                                   "score": {"type": "number", "minimum": 0, "maximum": 1}},
                  "required": ["label", "score"], "additionalProperties": False},
    "recipe": {"type": "object", "properties": {"dish": NAME, "steps": {"type": "array", "items": NAME,
                                                                        "minItems": 1, "maxItems": 3}},
               "required": ["dish", "steps"], "additionalProperties": False},
}
PROMPTS = ["Describe it as JSON.", "Answer with JSON about Paris.", "Give me a JSON example.",
           "Reply in JSON for a happy user."]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def client(default_server):
    with openai.OpenAI(base_url=f"{default_server.gateway.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat(client, prompt: str, **fields):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_TOKENS, temperature=0, **fields)


def test_json_schema_strict_outputs_all_validate(client):
    """5 schemas x 4 prompts, 8 at a time: every answer ends (stop) and validates against its schema."""
    cases = [(name, prompt) for name in SCHEMAS for prompt in PROMPTS]

    def ask(case):
        name, prompt = case
        reply = chat(client, prompt, response_format={"type": "json_schema", "json_schema": {
            "name": name, "schema": SCHEMAS[name], "strict": True}})
        return reply.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, cases))
    for (name, _), choice in zip(cases, choices):
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_object_streamed_or_not_parses_and_the_sdks_parse_reads_it(client):
    for prompt in PROMPTS[:2]:
        whole = chat(client, prompt, response_format={"type": "json_object"}).choices[0]
        assert isinstance(json.loads(whole.message.content), dict), whole.message.content
        chunks = list(chat(client, prompt, response_format={"type": "json_object"}, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    schema = SCHEMAS["sentiment"]
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "I love it!"}],
                                           max_tokens=MAX_TOKENS, temperature=0, response_format={
                                               "type": "json_schema", "json_schema": {"name": "sentiment",
                                                                                      "schema": schema}})
    jsonschema.validate(json.loads(parsed.choices[0].message.content), schema)


def test_vllms_structured_outputs_choice_regex_and_grammar(client):
    choice = chat(client, "Is the sky blue?", extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].message.content in ("yes", "no", "maybe")
    regex = r"[A-Z][a-z]{2,12}, [0-9]{4}"
    dated = chat(client, "Name a city and a year.", extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, dated.choices[0].message.content), dated.choices[0].message.content
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    answer = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=24, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"The answer is [0-9]+\.", answer.choices[0].text), answer.choices[0].text


@pytest.mark.parametrize("model", FRONT_MODELS)
def test_guided_decoding_inputs_on_both_front_models(default_server, model):
    """tensorrtllm_backend's guided_decoding_guide_type / guided_decoding_guide: greedy and seeded sampling give
    JSON of the schema; "json" any JSON value."""
    schema = SCHEMAS["person"]
    for extra in ({}, {"temperature": 1.0, "seed": np.array([[3]], dtype=np.uint64)}):
        text, _ = streamed_text(default_server.grpc_url, "Who are you? Answer in JSON.", MAX_TOKENS, model,
                                guided_decoding_guide_type="json_schema", guided_decoding_guide=json.dumps(schema),
                                **extra)
        jsonschema.validate(json.loads(text), schema)
    text, _ = streamed_text(default_server.grpc_url, "List two numbers.", 48, model, guided_decoding_guide_type="json")
    json.loads(text)
