"""Log-probabilities (dflash_runtime/logprobs.py): the target's own at every emitted position, the same at every
block size, through both front models (tensorrtllm_backend's return_log_probs -> output_log_probs, and OpenAI's
entries) and the gateway's logprobs / top_logprobs with the official client."""
from __future__ import annotations

import json

import numpy as np
import openai
import pytest
import torch

from conftest import BLOCK, EOS, PROMPTS, load_pair
from dflash_runtime import SamplingParams, SpeculativeEngine
from test_serving import FRONT_MODELS, Stream

MODEL = "smollm2-135m"
NEW = 24


def test_logprobs_agree_at_every_block_size(tiny):
    pair = load_pair(tiny)
    params = [SamplingParams(max_new_tokens=NEW, logprobs=5), SamplingParams(max_new_tokens=NEW, logprobs=0,
                                                                             temperature=0.8, seed=3),
              SamplingParams(max_new_tokens=NEW)]
    runs = {b: SpeculativeEngine(*pair, block_size=b, max_batch_size=4).generate(PROMPTS[:3], params)
            for b in (1, BLOCK, "auto")}
    for b in (BLOCK, "auto"):
        for plain, fast in zip(runs[1], runs[b]):
            assert plain.output_ids == fast.output_ids and len(plain.logprobs) == len(fast.logprobs)
            for (lp, top), (lp2, top2) in zip(plain.logprobs, fast.logprobs):
                assert abs(lp - lp2) <= 1e-4 and [t for t, _ in top] == [t for t, _ in top2]
                assert all(abs(v - v2) <= 1e-4 for (_, v), (_, v2) in zip(top, top2))
    assert len(runs[1][0].logprobs) == len(runs[1][0].output_ids) and len(runs[1][0].logprobs[0][1]) == 5
    assert runs[1][2].logprobs == []  # not asked for


def test_logprobs_are_the_targets_log_softmax(tiny):
    """Greedy at block 16 against transformers' logits of the same tokens: the chosen token is the top one."""
    import transformers

    target_dir = tiny[0]
    seq, = SpeculativeEngine(*load_pair(tiny), block_size=BLOCK).generate([PROMPTS[0]], SamplingParams(
        max_new_tokens=NEW, logprobs=3))
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + seq.output_ids])).logits[0, len(PROMPTS[0]) - 1:-1]
    expected = torch.log_softmax(logits, -1)
    for j, (token, (lp, top)) in enumerate(zip(seq.output_ids, seq.logprobs)):
        assert abs(lp - expected[j, token].item()) <= 1e-4 and top[0][0] == token
    assert seq.output_ids[-1] == EOS or len(seq.output_ids) == NEW


@pytest.mark.parametrize("model", FRONT_MODELS)
@pytest.mark.parametrize("stream", [True, False])
def test_return_log_probs_on_both_front_models(default_server, model, stream):
    requests = Stream(default_server.grpc_url)
    try:
        requests.send(model, text_input="Name a color.", apply_chat_template=True, max_tokens=12, stream=stream,
                      return_log_probs=True, top_logprobs=np.array([[2]], dtype=np.int32))
        responses, error = requests.collect()
    finally:
        requests.close()
    assert error is None, error
    responses = [r for r in responses if r.get_response().outputs]
    floats = np.concatenate([r.as_numpy("output_log_probs").reshape(-1) for r in responses
                             if r.as_numpy("output_log_probs") is not None])
    entries = [e for r in responses if r.as_numpy("logprobs") is not None
               for e in json.loads(r.as_numpy("logprobs").item())]
    tokens = sum(1 for _ in entries)
    assert tokens == responses[-1].as_numpy("num_output_tokens").item() == len(floats)
    assert np.allclose(floats, [e["logprob"] for e in entries], atol=1e-6) and all(f <= 0 for f in floats)
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in entries)


def test_the_grpc_client_collects_every_tokens_logprobs(default_server):
    from clients import DFlashClient, GenerationParams

    with DFlashClient(default_server.grpc_url) as grpc:
        answer = grpc.generate("Name a fruit.", GenerationParams(max_tokens=10, logprobs=1))
    assert len(answer.logprobs) == answer.stats.completion_tokens
    assert all(len(e["top_logprobs"]) == 1 and e["logprob"] <= 0 for e in answer.logprobs)


@pytest.fixture(scope="module")
def client(default_server):
    with openai.OpenAI(base_url=f"{default_server.gateway.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_the_official_client_reads_logprobs_streamed_or_not(client):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
               "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert "".join(t.token for t in content) == whole.choices[0].message.content or \
        whole.choices[0].finish_reason == "stop"  # an end-of-sequence token has text the answer leaves out
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token and t.logprob <= 0 for t in content)
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]  # and the values within float tolerance: the
    assert all(abs(a.logprob - b.logprob) <= 1e-4 for a, b in zip(streamed, content))  # steps may verify other lengths
    assert client.chat.completions.create(**{**request, "logprobs": False, "top_logprobs": None}).choices[0] \
        .logprobs is None
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=2)
    legacy = completion.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 6
    assert "".join(legacy.tokens) == completion.choices[0].text and legacy.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{**request, "top_logprobs": 21})
    assert refused.value.body["param"] == "top_logprobs"
