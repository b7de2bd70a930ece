"""dflash_serving.requests: front-model and `dflash` request tensors, checked and refused before the engine."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_contract import DFlashError
from dflash_contract.protocol import LIMITS
from dflash_serving.requests import is_stop_request, parse_engine_request, parse_front_request

CONTEXT = 2048  # the engine's context limit, for parse_engine_request


def tensors(**inputs):
    arrays = {name: np.asarray(value) for name, value in inputs.items()}
    return arrays.get


def test_a_full_request_becomes_sampling_params():
    ids, params, streaming = parse_engine_request(tensors(
        input_ids=[[1, 2, 3]], max_tokens=[[16]], temperature=[[0.5]], top_k=[[4]], top_p=[[0.9]],
        random_seed=[[7]], end_id=[[2]], stop_words=[[b"END", b"", "STOP".encode()]], stream=[[True]],
        speculative_sampling=[[b"rejection"]]), CONTEXT)
    assert ids == [1, 2, 3] and streaming and params.speculative_sampling == "rejection"
    assert (params.max_new_tokens, params.temperature, params.top_k, params.seed) == (16, 0.5, 4, 7)
    assert params.top_p == pytest.approx(0.9) and params.stop_strings == ("END", "STOP")
    assert params.stop_token_ids == (2,) and params.ignore_eos  # end_id replaces the model's EOS ids


def test_clip_max_tokens_lowers_max_tokens_to_what_the_context_leaves_and_only_then():
    prompt = [[7] * 2000]
    for clip, max_tokens, expected in ((True, 512, 48), (True, 16, 16), (False, 512, 512), (None, 512, 512)):
        clipped = {} if clip is None else {"clip_max_tokens": [[clip]]}
        _, params, _ = parse_engine_request(tensors(input_ids=prompt, max_tokens=[[max_tokens]], **clipped), CONTEXT)
        assert params.max_new_tokens == expected, (clip, max_tokens)
    # a prompt that fills the context keeps a request the engine refuses by its prompt, not by max_tokens
    _, params, _ = parse_engine_request(tensors(input_ids=[[7] * CONTEXT], max_tokens=[[512]],
                                                clip_max_tokens=[[True]]), CONTEXT)
    assert params.max_new_tokens == 1


def test_defaults_are_greedy_and_not_streamed():
    ids, params, streaming = parse_engine_request(tensors(input_ids=[[5]], max_tokens=[[1]]), CONTEXT)
    assert params.greedy and params.top_k == 0 and params.top_p == 1 and not params.stop_strings
    assert not streaming and not params.ignore_eos
    assert params.speculative_sampling is None  # the engine's (the build's) method


@pytest.mark.parametrize("inputs, message", [
    (dict(max_tokens=[[4]]), "one prompt per request"),
    (dict(input_ids=[[1], [2]], max_tokens=[[4]]), "one prompt per request"),
    (dict(input_ids=[[1]]), "max_tokens is required"),
    (dict(input_ids=[[1]], max_tokens=[[0]]), "max_tokens must be >= 1, got 0"),
    (dict(input_ids=[[1]], max_tokens=[[4]], top_p=[[0.0]]), r"top_p must be in \(0, 1\]"),
    (dict(input_ids=[[1]], max_tokens=[[4]], temperature=[[1.0, 2.0]]), "temperature must hold one value"),
    (dict(input_ids=[[1]], max_tokens=[[4]], seed=[[1]], random_seed=[[2]]), "seed and random_seed differ"),
    (dict(input_ids=[[1]], max_tokens=[[4]], bad_words=[[b"x"]]), "bad_words is not supported"),
    (dict(input_ids=[[1]], max_tokens=[[4]], speculative_sampling=[[b"typical"]]),
     "speculative_sampling must be one of exact, rejection; got 'typical'"),
    (dict(input_ids=[[1]], max_tokens=[[4]], stop_words=np.array([[b"\xff"]], dtype=object)),
     "stop_words: not valid UTF-8"),
])
def test_bad_requests_are_refused_with_the_field_named(inputs, message):
    with pytest.raises(DFlashError, match=message):
        parse_engine_request(tensors(**inputs), CONTEXT)


def test_stop_requests():
    assert is_stop_request(tensors(stop=[[True]]))
    assert not is_stop_request(tensors(stop=[[False]])) and not is_stop_request(tensors(input_ids=[[1]]))


def test_a_front_request_becomes_prompt_text():
    assert parse_front_request(tensors(text_input=[[b"Hi"]], max_tokens=[[4]], apply_chat_template=[[True]],
                                       stop_words=[[b"END", b""]], seed=[[3]], random_seed=[[3]])) == ("Hi", True, {})
    assert parse_front_request(tensors(text_input=[["caf\u00e9".encode()]], max_tokens=[[1]])) == ("caf\u00e9", False, {})
    # tensorrtllm_backend's inputs at the values we serve (what genai-perf sends)
    assert parse_front_request(tensors(text_input=[[b"Hi"]], max_tokens=[[4]], exclude_input_in_output=[[True]],
                                       beam_width=[[1]], min_length=[[4]], repetition_penalty=[[1.0]],
                                       frequency_penalty=[[0.0]], return_log_probs=[[False]])) == ("Hi", False, {})


def test_a_conversation_becomes_messages_in_the_chat_template():
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
                    {"role": "user", "content": "Again"}]
    raw = json.dumps(conversation).encode()
    flat = [*conversation[:2], {"role": "assistant", "content": "Hello"}, conversation[3]]
    assert parse_front_request(tensors(messages=[[raw]], max_tokens=[[4]])) == (flat, True, {})


# every input of the front models, each way it can be wrong that reaches a model (Triton refuses the
# wrong types and per-item shapes itself); the same table runs against the real server in test_serving
@pytest.mark.parametrize("inputs, message", [
    (dict(max_tokens=[[4]], stream=[[True]]), r"text_input \(or messages\) is required"),
    (dict(text_input=[[b"Hi"]], messages=[[b'[{"role": "user", "content": "Hi"}]']], max_tokens=[[4]]),
     "send one of text_input and messages"),
    (dict(messages=[[b"Hi"]], max_tokens=[[4]]), "messages: not JSON"),
    (dict(messages=[[b"[]"]], max_tokens=[[4]]), "messages must be a non-empty JSON list"),
    (dict(messages=[[b'{"role": "user"}']], max_tokens=[[4]]), "messages must be a non-empty JSON list"),
    (dict(messages=[[b'[{"role": "robot", "content": "x"}]']], max_tokens=[[4]]),
     r"messages\[0\].role must be one of system, user, assistant, tool, got 'robot'"),
    (dict(messages=[[b'[{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}]']],
          max_tokens=[[4]]), r"messages\[1\].content\[0\]: only text parts .* got 'image_url'"),
    (dict(messages=[[b'[{"role": "assistant", "content": null}]']], max_tokens=[[4]]),
     r"messages\[0\].content must be a string or a list of text parts"),
    (dict(messages=[[b'[{"role": "user", "content": "a", "tool_calls": []}]']], max_tokens=[[4]]),
     r"messages\[0\].tool_calls: only an assistant message has tool calls"),
    (dict(messages=[[b'[{"role": "user", "content": "a", "audio": {}}]']], max_tokens=[[4]]),
     r"messages\[0\].audio is not supported \(a message has role, content, name, tool_calls, tool_call_id\)"),
    (dict(messages=[[b'[{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", '
                     b'"arguments": {"a": 1}}}]}]']], max_tokens=[[4]]),
     r"messages\[0\].tool_calls\[0\].function.arguments must be a string"),
    (dict(messages=[[b'[{"role": "user", "content": "a"}]']], tools=[[b'[{"type": "function"}]']], max_tokens=[[4]]),
     r"tools\[0\] must be \{\"type\": \"function\""),
    (dict(text_input=[[b"Hi"]], tools=[[b"[]"]], max_tokens=[[4]]), "tools needs a chat prompt"),
    (dict(messages=[[b'[{"role": "user", "content": "a"}]']], chat_template_kwargs=[[b'{"tokenize": true}']],
          max_tokens=[[4]]), "chat_template_kwargs.tokenize is set by the server"),
    (dict(messages=[[b'[{"role": "user", "content": "a"}]']], chat_template_kwargs=[[b"[1]"]], max_tokens=[[4]]),
     "chat_template_kwargs must be a JSON object"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], min_length=[[-1]]), "min_length must be >= 0, got -1"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], min_tokens=[[2]], min_length=[[3]]),
     "min_tokens and min_length differ"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], exclude_input_in_output=[[False]]),
     "exclude_input_in_output=false is not supported .responses carry only the generated text"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], beam_width=[[2]]), "beam_width=2 is not supported"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], speculative_sampling=[[b"Rejection"]]),
     "speculative_sampling must be one of exact, rejection; got 'Rejection'"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], top_logprobs=[[21]]), r"top_logprobs must be in \[0, 20\], got 21"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], return_log_probs=[[True]], beam_width=[[2]]),
     "beam_width=2 is not supported"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], presence_penalty=np.array([[2.5]], np.float32)),
     r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], repetition_penalty=np.array([[0.0]], np.float32)),
     "repetition_penalty must be > 0, got 0.0"),
    (dict(text_input=[[b"Hi"]], stream=[[True]]), "max_tokens is required"),
    (dict(text_input=[[b"a"], [b"b"]], max_tokens=[[4], [4]]),
     r"text_input must hold one value per request, got shape \[2, 1\]"),
    (dict(text_input=[[b""]], max_tokens=[[4]]), "text_input must not be empty"),
    (dict(text_input=np.array([[b"\xff"]], dtype=object), max_tokens=[[4]]), "text_input: not valid UTF-8"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[0]]), "max_tokens must be >= 1, got 0"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], temperature=[[-0.5]]), "temperature must be >= 0, got -0.5"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], temperature=np.array([[np.nan]], np.float32)),
     "temperature must be >= 0, got nan"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], top_k=[[-1]]), "top_k must be >= 0, got -1"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], top_p=[[1.5]]), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], stream=[[True, False]]), "stream must hold one value per request"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], seed=[[1]], random_seed=[[2]]), "seed and random_seed differ"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], bad_words=[[b"x"]]), "bad_words is not supported"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], stop_words=[[b"a"], [b"b"]]), "stop_words must hold one list"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], stop_words=np.array([[b"\xfe"]], dtype=object)),
     "stop_words: not valid UTF-8"),
])
def test_bad_front_requests_are_refused_with_the_field_named(inputs, message):
    with pytest.raises(DFlashError, match=message):
        parse_front_request(tensors(**inputs))


# -- request parameters (an HTTP generate body's fields that name no input) and size limits --------------------
def test_request_parameters_that_are_not_tritons_own_are_refused_naming_the_field():
    hi = tensors(text_input=[[b"Hi"]], max_tokens=[[4]])
    with pytest.raises(DFlashError, match=r"^temprature is not an input of this model \(did you mean temperature\?\)"):
        parse_front_request(hi, '{"temprature": 0.5}')
    # an input's name sent as a parameter (a generate body's "parameters" object, gRPC parameters) is not read either
    with pytest.raises(DFlashError, match=r"^temperature came as a request parameter, which this model does not read"):
        parse_front_request(hi, '{"temperature": 0.5}')
    # names only, never a value (a client may put a secret in a misspelt field)
    with pytest.raises(DFlashError, match=r"^api_keey is not an input .*\(other fields refused: x\)$") as refused:
        parse_front_request(hi, '{"api_keey": "sk-secret", "x": 1}')
    assert "sk-secret" not in str(refused.value)
    # Triton's own: the generate extension's id, its reserved names, triton_*; and none at all
    assert parse_front_request(hi, '{"id": "r1", "priority": 0, "triton_enable_empty_final_response": true}') \
        == ("Hi", False, {})
    assert parse_front_request(hi, "{}") == parse_front_request(hi) == ("Hi", False, {})


@pytest.mark.parametrize("inputs, message", [
    (dict(text_input=[[b"x" * (LIMITS.prompt_bytes + 1)]], max_tokens=[[4]]),
     r"^text_input is 1048577 bytes \(UTF-8\), over the limit of 1048576 bytes per request$"),
    (dict(text_input=[["\u00e9".encode() * (LIMITS.prompt_bytes // 2 + 1)]], max_tokens=[[4]]),  # bytes, not characters
     r"^text_input is 1048578 bytes"),
    (dict(messages=[[json.dumps([{"role": "user", "content": "x" * LIMITS.prompt_bytes}]).encode()]], max_tokens=[[4]]),
     r"^messages is 1048609 bytes \(UTF-8\), over the limit of 1048576 bytes per request$"),
    (dict(messages=[[json.dumps([{"role": "user", "content": "x"}] * (LIMITS.messages + 1)).encode()]],
          max_tokens=[[4]]), r"^messages has 2049 messages, over the limit of 2048 per request$"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], stop_words=[[b"w%d" % i for i in range(LIMITS.stop_words + 1)]]),
     r"^stop_words has 17 stop strings, over the limit of 16 per request$"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[4]], stop_words=[[b"END", b"x" * (LIMITS.stop_word_bytes + 1)]]),
     r"^stop_words\[1\] is 257 bytes \(UTF-8\), over the limit of 256 bytes per stop string$"),
    (dict(text_input=[[b"Hi"]], max_tokens=[[LIMITS.max_tokens + 1]]),
     r"^max_tokens is 262145, over the limit of 262144 tokens per request$"),
])
def test_requests_over_a_size_limit_are_refused_naming_it(inputs, message):
    with pytest.raises(DFlashError, match=message):
        parse_front_request(tensors(**inputs))


def test_requests_at_the_size_limits_are_accepted():
    at_limit = dict(max_tokens=[[LIMITS.max_tokens]],
                    stop_words=[[b"x" * LIMITS.stop_word_bytes] + [b"w%d" % i for i in range(LIMITS.stop_words - 1)]])
    text = "\u00e9" * (LIMITS.prompt_bytes // 2)  # 2 bytes each: exactly the limit
    assert parse_front_request(tensors(text_input=[[text.encode()]], **at_limit)) == (text, False, {})
    conversation = [{"role": "user", "content": "x"}] * LIMITS.messages
    assert parse_front_request(tensors(messages=[[json.dumps(conversation).encode()]], **at_limit))[0] == conversation
    # the engine model's own parser keeps the same limits
    ids, params, _ = parse_engine_request(tensors(input_ids=[[1]], **at_limit), CONTEXT)
    assert params.max_new_tokens == LIMITS.max_tokens and len(params.stop_strings) == LIMITS.stop_words
    for inputs in (dict(max_tokens=[[LIMITS.max_tokens + 1]]),
                   dict(max_tokens=[[4]], stop_words=[[b"w%d" % i for i in range(LIMITS.stop_words + 1)]])):
        with pytest.raises(DFlashError, match="over the limit of"):
            parse_engine_request(tensors(input_ids=[[1]], **inputs), CONTEXT)
