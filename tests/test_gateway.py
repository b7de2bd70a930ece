"""The OpenAI-compatible gateway on the real tritonserver + embedded default, driven by the official `openai` client
(max_retries=0: its retries would hide a 503), compared with the project's own gRPC client."""
from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import time
import urllib.parse

import httpx
import openai
import pytest

from clients import DFlashClient, GenerationParams
from deploy.server_process import start_gateway
from dflash_contract.protocol import LIMITS
from dflash_runtime.text import encode_prompt, load_tokenizer
from test_serving import freed_promptly, metric, streamed_text, until_no_active_sequence, wait_for_metric

MODEL = "smollm2-135m"
CONVERSATION = [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}]
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?",
             "Say hello in Spanish.", "What do bees make?", "Name a large ocean.", "What color is the sky?",
             "How many legs does a spider have?"]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.fixture(scope="module")
def client(default_server):
    with openai.OpenAI(base_url=f"{default_server.gateway.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc(default_server):
    with DFlashClient(default_server.grpc_url) as c:
        yield c


def test_models_list_the_build(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_a_conversation_gives_the_grpc_clients_text_streamed_or_not(client, grpc, default_build):
    expected = grpc.generate(CONVERSATION, GenerationParams(max_tokens=24))
    whole = client.chat.completions.create(model=MODEL, messages=CONVERSATION, **GREEDY)
    assert whole.choices[0].message.content == expected.text and expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    chunks = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [expected.finish_reason]
    # usage: the server's own token counts, equal to the tokenizer's of the templated conversation
    tokenizer = load_tokenizer(default_build / "target")
    usage = whole.usage
    assert usage.prompt_tokens == len(encode_prompt(tokenizer, CONVERSATION)) == expected.stats.prompt_tokens
    assert usage.completion_tokens == expected.stats.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # the gRPC call just computed the same prompt: the prefix cache holds all of it but its last token, in blocks
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16 > 0
    # the speculation statistics (how many drafts a step verifies is chosen per step, so they vary between runs)
    details, extension = usage.completion_tokens_details, whole.model_extra["dflash"]
    assert details.accepted_prediction_tokens == extension["accepted_draft_tokens"]
    assert details.rejected_prediction_tokens == extension["draft_tokens"] - extension["accepted_draft_tokens"]
    assert extension["draft_steps"] > 0 and extension["mean_acceptance_length"] == pytest.approx(
        1 + extension["accepted_draft_tokens"] / extension["draft_steps"], abs=1e-3)
    final = [c for c in chunks if c.choices[0].finish_reason][0]
    assert set(final.model_extra["dflash"]) == set(extension)


def test_max_tokens_and_completions(client, grpc):
    chat = client.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], temperature=0,
                                          max_completion_tokens=5)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    prompt = "def fibonacci(n):"
    expected = grpc.generate(prompt, GenerationParams(max_tokens=12), chat=False)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert completion.choices[0].text == expected.text and completion.usage.completion_tokens == 12
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text


SHORT_CONTEXT = 384  # a prompt that fills it prefills in seconds on a CPU (the default build's 8,192: minutes)


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """The embedded default built with --max-context SHORT_CONTEXT and served with the gateway: an OpenAI client and
    the build."""
    from builder.build import BuildOptions, build
    from deploy.serve import start_server

    output = tmp_path_factory.mktemp("builds") / "short-context"
    build(BuildOptions(target=MODEL, drafter="preset", max_batch_size=2, max_context=SHORT_CONTEXT, sanity_tokens=0),
          output)
    log = tmp_path_factory.mktemp("short-context-server") / "tritonserver.log"
    with start_server(output / "model_repository", 0, 0, 0, log_path=log, openai_port=0) as server:
        with openai.OpenAI(base_url=f"{server.gateway.url}/v1", api_key="unused", max_retries=0) as c:
            yield c, output


def test_the_default_context_is_the_targets_own(default_build):
    """SmolLM2's 8,192 positions (its config.json), not a per-place size: the KV pool that all sequences share
    (8 places of 2,048) holds one sequence of 8,192 with room to spare."""
    values = (default_build / "model_repository" / "dflash" / "config.pbtxt").read_text()
    assert 'parameters { key: "max_context" value: { string_value: "8192" } }' in values
    assert 'parameters { key: "kv_cache_tokens" value: { string_value: "16512" } }' in values


def test_a_default_max_tokens_is_lowered_to_the_context_left_and_a_sent_one_is_not(short_context):
    """Without max_tokens a long prompt gets what the context leaves (vLLM's rule): only a prompt that fills the
    context is refused. A max_tokens the client sent past the context is refused, as before."""
    client, build = short_context
    tokenizer, context = load_tokenizer(build / "target"), SHORT_CONTEXT

    def conversation(words: int) -> list[dict]:
        return [{"role": "user", "content": "Repeat after me: " + "blue sky " * words}]

    words = 1
    while len(encode_prompt(tokenizer, conversation(words + 1))) <= context - 5:
        words += 1
    messages = conversation(words)
    left = context - len(encode_prompt(tokenizer, messages))
    assert 1 <= left <= 7
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert reply.usage.prompt_tokens == context - left and reply.usage.completion_tokens <= left
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == left
    with pytest.raises(openai.BadRequestError, match=f"exceeds the context limit of {context}"):
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=left + 1)
    with pytest.raises(openai.BadRequestError, match=f"the context limit is {context}"):
        client.chat.completions.create(model=MODEL, messages=conversation(words + 10), temperature=0)


def test_an_answer_cut_inside_a_character_ends_before_it_on_every_door(client, grpc, default_server):
    """Greedy, this question is answered with emojis of 3 tokens each: max_tokens 4 and 5 stop inside the second
    one. The answer ends after the first, never in U+FFFD, streamed or not, on every door."""
    question = "Reply with three smiley emojis and nothing else."
    whole = grpc.generate(question, GenerationParams(max_tokens=3))
    assert len(whole.text) == 1 and ord(whole.text) > 0xFFFF  # one emoji, whole: 3 tokens
    for max_tokens in (4, 5):
        params = GenerationParams(max_tokens=max_tokens)
        texts = {"dflash_bls": grpc.generate(question, params).text,
                 "dflash_bls streamed": grpc.generate(question, params, stream=True).text,
                 "ensemble streamed": streamed_text(default_server.grpc_url, question, max_tokens)[0]}
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)
        texts["openai"] = reply.choices[0].message.content
        chunks = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
                                                stream=True)
        texts["openai streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert texts == dict.fromkeys(texts, whole.text), max_tokens
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == max_tokens


def test_include_usage_adds_exactly_one_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
    assert with_usage[0].usage.completion_tokens > 0 and with_usage[0].usage.prompt_tokens_details.cached_tokens > 0
    plain = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, stream=True, **GREEDY))
    assert all(c.usage is None for c in plain)


def test_a_stop_list_ends_the_text_where_the_contract_says(client, grpc):
    question = [{"role": "user", "content": QUESTIONS[1]}]
    full = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=32)
    text = full.choices[0].message.content
    word = text.split()[len(text.split()) // 2]  # a word the answer reaches midway
    stopped = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=32,
                                             stop=[word, "never appears"])
    expected = grpc.generate(question, GenerationParams(max_tokens=32, stop=(word, "never appears")))
    cut = stopped.choices[0].message.content
    # OpenAI's rule: the text ends before the stop string; vLLM's include_stop_str_in_output keeps it
    assert cut == expected.text and text.startswith(cut + word) and word not in cut
    assert stopped.choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=32,
                                          stop=[word], stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in kept if c.choices) == cut + word


def test_the_same_seed_gives_the_same_sample(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], temperature=0.9, top_p=0.95,
                                              seed=seed, max_tokens=16).choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))
    # vLLM's and SGLang's extra-body top_k reaches the engine
    top1 = client.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], temperature=0.9, seed=3,
                                          max_tokens=8, extra_body={"top_k": 1})
    greedy = client.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], temperature=0, max_tokens=8)
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    # speculative_sampling (extra body): "exact" is the build's default; rejection sampling's sample is its own (it
    # depends on the drafts and, under this build's adaptive verify length, on the lengths verified: not repeatable)
    def with_method(seed, method):
        return client.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], temperature=0.9, top_p=0.95,
                                              seed=seed, max_tokens=16,
                                              extra_body={"speculative_sampling": method}).choices[0].message.content

    assert with_method(7, "exact") == first
    assert any(with_method(seed, "rejection") != with_method(seed, "exact") for seed in (7, 8, 9))


def test_n_choices_streamed_or_not_are_the_seeded_requests_they_derive_from(client):
    """n=3 sampled: choice i is the request with seed + i steps (api.SEED_STEP), streamed chunks rebuild each choice
    by index, usage counts the prompt once and every completion; greedy choices are alike, as OpenAI's are."""
    from gateway.api import SEED_STEP

    request = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 16, "temperature": 1.0}
    whole = client.chat.completions.create(**request, n=3, seed=11)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(**request, seed=(11 + i * SEED_STEP) % 2 ** 64) for i in range(3)]
    assert [c.message.content for c in whole.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in whole.choices}) > 1
    assert whole.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    chunks = list(client.chat.completions.create(**request, n=3, seed=11, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    greedy = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, n=2,
                                       temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_penalties_reach_the_engine_as_the_grpc_clients_do(client, grpc):
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}
    expected = grpc.generate(CONVERSATION, GenerationParams(max_tokens=24, **penalties))
    reply = client.chat.completions.create(model=MODEL, messages=CONVERSATION, **GREEDY, presence_penalty=1.5,
                                           frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3})
    assert reply.choices[0].message.content == expected.text
    assert expected.text != grpc.generate(CONVERSATION, GenerationParams(max_tokens=24)).text


BAD_REQUESTS = {  # request fields -> (exception class, param the error names)
    "unknown role": (dict(messages=[{"role": "robot", "content": "Hi"}]), openai.BadRequestError, "messages"),
    "image content": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                      openai.BadRequestError, "messages"),
    "empty messages": (dict(messages=[]), openai.BadRequestError, "messages"),
    "n over the limit": (dict(n=LIMITS.choices + 1), openai.BadRequestError, "n"),
    "n = 0": (dict(n=0), openai.BadRequestError, "n"),
    "tool parameters not a schema": (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
                                     openai.BadRequestError, "tools"),
    "logprobs not a bool": (dict(extra_body={"logprobs": "yes"}), openai.BadRequestError, "logprobs"),
    "presence penalty over 2": (dict(presence_penalty=2.5), openai.BadRequestError, "presence_penalty"),
    "repetition penalty 0": (dict(extra_body={"repetition_penalty": 0}), openai.BadRequestError, "repetition_penalty"),
    "schema that does not compile": (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}), openai.BadRequestError, "response_format"),
    "two constraints": (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {
        "regex": "a+"}}), openai.BadRequestError, "structured_outputs"),
    "structural tag": (dict(extra_body={"structured_outputs": {"structural_tag": "{}"}}), openai.BadRequestError,
                       "structured_outputs"),
    "logit bias": (dict(logit_bias={"1": 5}), openai.BadRequestError, "logit_bias"),
    "unknown speculative sampling": (dict(temperature=1, extra_body={"speculative_sampling": "typical"}),
                                     openai.BadRequestError, "speculative_sampling"),
    "max tokens 0": (dict(max_completion_tokens=0), openai.BadRequestError, "max_completion_tokens"),
    "negative temperature": (dict(temperature=-1), openai.BadRequestError, "temperature"),
    "top_p 2": (dict(top_p=2), openai.BadRequestError, "top_p"),
    "text temperature": (dict(extra_body={"temperature": "hot"}), openai.BadRequestError, "temperature"),
    "unknown field": (dict(extra_body={"best_of_n": 3}), openai.BadRequestError, "best_of_n"),
    "too long": (dict(max_tokens=100000), openai.BadRequestError, None),
    "unknown model": (dict(model="gpt-4o"), openai.NotFoundError, "model"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_raise_the_clients_matching_exception(client, case):
    fields, exception, param = BAD_REQUESTS[case]
    request = {"model": MODEL, "messages": CONVERSATION[1:2], "max_tokens": 8, **fields}
    for stream in (False, True):
        with pytest.raises(exception) as raised:
            list(client.chat.completions.create(**request, stream=stream)) if stream else \
                client.chat.completions.create(**request)
        error = raised.value.body
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert client.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], max_tokens=2).choices  # serving


def test_a_misspelt_field_is_refused_with_the_field_it_was_meant_to_be():
    from gateway.api import APIError, chat_request

    body = {"model": MODEL, "messages": CONVERSATION[1:2], "temprature": 0.5}
    with pytest.raises(APIError, match=r"^temprature is not supported by this server \(did you mean temperature\?\)$"):
        chat_request(body, MODEL, 16)
    with pytest.raises(APIError, match=r"^best_of_n is not supported by this server$"):  # nothing close
        chat_request({"model": MODEL, "messages": CONVERSATION[1:2], "best_of_n": 2}, MODEL, 16)


def test_render_gives_the_token_ids_a_request_is_decoded_from_and_checks_it_as_one(client, default_server,
                                                                                    default_build):
    """vLLM's render endpoints: the server's own preprocessing tokenizes, so the ids are those the engine gets (the
    chat template for a conversation, raw text for a completion), as many as a real answer's usage counts; a bad
    request is refused with the words a generate request gets, and nothing is decoded."""
    url, tokenizer = default_server.gateway.url, load_tokenizer(default_build / "target")
    chat = httpx.post(f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": CONVERSATION},
                      timeout=60)
    assert chat.status_code == 200, chat.text
    rendered = chat.json()
    assert rendered["model"] == MODEL and rendered["request_id"].startswith("chatcmpl-")
    assert rendered["token_ids"] == encode_prompt(tokenizer, CONVERSATION)
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, **GREEDY)
    assert answer.usage.prompt_tokens == len(rendered["token_ids"])
    prompt = "The capital of France is"
    (completion,) = httpx.post(f"{url}/v1/completions/render", json={"model": MODEL, "prompt": prompt},
                               timeout=60).json()
    assert completion["token_ids"] == encode_prompt(tokenizer, prompt, chat=False)
    assert completion["request_id"].endswith("-0")
    def ensemble_refusals():  # what preprocessing counts when it refuses a request of the ensemble's
        lines = httpx.get(default_server.metrics_url, timeout=10).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("dflash_requests_total{")
                   and 'model="ensemble"' in line and 'outcome="refused"' in line)

    refusals = ensemble_refusals()  # a render is nobody's request: its refusal is not counted
    for body, status, words in [({"model": MODEL, "prompt": prompt, "top_p": 2}, 400, "top_p"),
                                ({"model": "nope", "prompt": prompt}, 404, "does not exist"),
                                ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role")]:
        path = "/v1/chat/completions/render" if "messages" in body else "/v1/completions/render"
        refused = httpx.post(url + path, json=body, timeout=60)
        assert refused.status_code == status and words in refused.json()["error"]["message"], refused.text
    # over the engine's context: the words generate answers with, from the engine's own limit
    over = {"model": MODEL, "prompt": prompt, "max_tokens": 100000}
    generated, refused = (httpx.post(f"{url}{path}", json=over, timeout=60)
                          for path in ("/v1/completions", "/v1/completions/render"))
    assert generated.status_code == refused.status_code == 400
    assert refused.json()["error"] == generated.json()["error"]
    assert "exceeds the context limit" in refused.json()["error"]["message"]
    time.sleep(1)  # metrics are recorded off the request's thread
    assert ensemble_refusals() == refusals


def test_raw_http_errors_have_openais_shape(default_server):
    url = default_server.gateway.url
    for path, body, status in [("/v1/chat/completions", b"{not json", 400), ("/v1/nothing", b"{}", 404),
                               ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * (5 << 20)}).encode(),
                                413)]:
        reply = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert reply.status_code == status and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health", timeout=10).json() == {"ready": True, "detail": ""}


def test_an_idle_connection_outlives_the_clients_own_keep_alive(default_server):
    """httpx (and so the openai client) drops an idle connection after 5 s; the gateway must keep it longer, or a
    request sent as the gateway closes it fails with "Server disconnected without sending a response"."""
    url = urllib.parse.urlsplit(default_server.gateway.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.connect()
    connection.auto_open = 0  # one socket: a closed one raises instead of being opened again
    try:
        for _ in range(2):
            connection.request("GET", "/health")
            reply = connection.getresponse()
            assert reply.status == 200 and json.loads(reply.read())["ready"]
            time.sleep(6)  # idle past uvicorn's default keep-alive of 5 s: the next request then finds it closed
    finally:
        connection.close()


def test_the_served_model_name_and_default_length_are_the_operators(default_server):
    gateway = start_gateway(default_server.grpc_url, "support-bot", 0, None, graceful_seconds=1, default_max_tokens=3)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="-", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["support-bot"]
            reply = client.chat.completions.create(model="support-bot", messages=CONVERSATION[1:2], temperature=0)
            assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
            with pytest.raises(openai.NotFoundError, match="this server serves 'support-bot'"):
                client.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], max_tokens=2)
    finally:
        gateway.stop(5)
    from deploy.serve import main as serve

    with pytest.raises(SystemExit):  # refused before anything starts
        serve(["builds/none", "--default-max-tokens", "0"])


def test_an_api_key_is_required_once_set(default_server):
    gateway = start_gateway(default_server.grpc_url, MODEL, 0, "s3cret", graceful_seconds=1)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
            with pytest.raises(openai.AuthenticationError):
                wrong.chat.completions.create(model=MODEL, messages=CONVERSATION[1:2], max_tokens=2)
        assert httpx.get(gateway.url + "/v1/models", timeout=10).status_code == 401  # no key at all
        assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200  # probes send none
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="s3cret", max_retries=0) as right:
            assert [m.id for m in right.models.list()] == [MODEL]
        # dflash-serve's watch sees a dead gateway (and then stops the server, exit status 3)
        watched = dataclasses.replace(default_server, gateway=gateway)
        assert watched.health_problem() is None
        gateway.process.kill()
        gateway.process.wait()
        assert "the OpenAI gateway exited" in watched.health_problem()
    finally:
        gateway.stop(5)


def test_a_client_that_goes_away_frees_its_slot_within_a_second(default_server):
    cancelled = metric(default_server, "dflash_cancelled_requests_total")
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
               "max_tokens": 1000, "min_tokens": 1000}
    with httpx.stream("POST", f"{default_server.gateway.url}/v1/chat/completions", json={**request, "stream": True},
                      timeout=120) as reply:
        lines = reply.iter_lines()
        for _ in range(4):  # the role, then text: it is decoding
            assert next(line for line in lines if line.startswith("data: "))
        assert wait_for_metric(default_server, "dflash_active_sequences", 1)
    streamed = until_no_active_sequence(default_server)
    # a non-streamed request whose client times out (the gateway looks for its client every 0.25 s)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{default_server.gateway.url}/v1/chat/completions", json=request, timeout=3)
    whole = until_no_active_sequence(default_server)
    assert freed_promptly(*streamed) and freed_promptly(whole[0] - 0.25, whole[1]), (streamed, whole)
    assert metric(default_server, "dflash_cancelled_requests_total") == cancelled + 2


def test_eight_concurrent_streams_give_the_texts_of_eight_solo_runs(client, default_server):
    def request(question):
        return {"model": MODEL, "messages": [{"role": "user", "content": question}], **GREEDY}

    solo = {q: client.chat.completions.create(**request(q)).choices[0].message.content for q in QUESTIONS}

    async def together():
        async with openai.AsyncOpenAI(base_url=f"{default_server.gateway.url}/v1", api_key="x", max_retries=0) as c:
            async def one(question):
                stream = await c.chat.completions.create(**request(question), stream=True)
                return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])

            return await asyncio.gather(*(one(q) for q in QUESTIONS))

    assert dict(zip(QUESTIONS, asyncio.run(together()))) == solo


# -- size limits (dflash_contract.protocol.LIMITS), refused by the gateway itself: no server behind it -------------
@pytest.fixture(scope="module")
def serverless():
    """The gateway's app on a tritonserver address where none listens: whatever reaches the server fails as 503."""
    from fastapi.testclient import TestClient

    from deploy.ports import free_ports
    from gateway.app import Settings, create_app

    with TestClient(create_app(Settings(f"127.0.0.1:{free_ports(1)[0]}", MODEL))) as c:
        yield c


LIMITED = {  # path, body fields -> (param, message)
    "prompt bytes": ("/v1/completions", dict(prompt="x" * (LIMITS.prompt_bytes + 1)), "prompt",
                     "prompt is 1048577 bytes (UTF-8), over the limit of 1048576 bytes per request"),
    "messages bytes": ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x" * LIMITS.prompt_bytes}]),
                       "messages", "messages is 1048609 bytes (UTF-8), over the limit of 1048576 bytes per request"),
    "messages": ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}] * (LIMITS.messages + 1)),
                 "messages", "messages has 2049 messages, over the limit of 2048 per request"),
    "stop words": ("/v1/chat/completions", dict(stop=[f"w{i}" for i in range(LIMITS.stop_words + 1)]), "stop",
                   "stop has 17 stop strings, over the limit of 16 per request"),
    "stop word bytes": ("/v1/completions", dict(stop=["x" * (LIMITS.stop_word_bytes + 1)]), "stop",
                        "stop[0] is 257 bytes (UTF-8), over the limit of 256 bytes per stop string"),
    "max_completion_tokens": ("/v1/chat/completions", dict(max_completion_tokens=LIMITS.max_tokens + 1),
                              "max_completion_tokens",
                              "max_completion_tokens is 262145, over the limit of 262144 tokens per request"),
    "max_tokens": ("/v1/completions", dict(max_tokens=LIMITS.max_tokens + 1), "max_tokens",
                   "max_tokens is 262145, over the limit of 262144 tokens per request"),
}


@pytest.mark.parametrize("case", LIMITED, ids=list(LIMITED))
def test_size_limits_are_refused_by_the_gateway_naming_the_field(serverless, case):
    path, fields, param, message = LIMITED[case]
    prompt = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": CONVERSATION[1:2]}
    reply = serverless.post(path, json={"model": MODEL, **prompt, **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                     "code": "invalid_value"}


def test_requests_at_the_size_limits_pass_the_gateways_checks(serverless):
    # the largest prompt, JSON-escaped as the OpenAI SDK sends it (\uXXXX: 6 bytes a 3-byte character), fits the body
    # limit (413) and passes the checks: it reaches the (absent) server, hence 503
    prompt = "\u65e5" * (LIMITS.prompt_bytes // 3)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": LIMITS.max_tokens,
                       "stop": ["x" * LIMITS.stop_word_bytes] * LIMITS.stop_words})
    assert len(body) > 2 * LIMITS.prompt_bytes
    assert serverless.post("/v1/completions", content=body).status_code == 503
    over = serverless.post("/v1/completions", json={"model": MODEL, "prompt": prompt + "xx"})  # 2 bytes more
    assert over.status_code == 400 and over.json()["error"]["message"].startswith("prompt is 1048577 bytes")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * LIMITS.messages}
    assert serverless.post("/v1/chat/completions", json=chat).status_code == 503
    # over the body limit: refused unread
    assert serverless.post("/v1/completions", content=b" " * (4 * LIMITS.prompt_bytes + 1)).status_code == 413
