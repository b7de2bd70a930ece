"""dflash_serving.requests: a `dflash` request's tensors -> prompt and SamplingParams, refused before the engine."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_contract import DFlashError
from dflash_serving.requests import is_stop_request, parse_engine_request


def tensors(**inputs):
    arrays = {name: np.asarray(value) for name, value in inputs.items()}
    return arrays.get


def test_a_full_request_becomes_sampling_params():
    ids, params, streaming = parse_engine_request(tensors(
        input_ids=[[1, 2, 3]], max_tokens=[[16]], temperature=[[0.5]], top_k=[[4]], top_p=[[0.9]],
        random_seed=[[7]], end_id=[[2]], stop_words=[[b"END", b"", "STOP".encode()]], stream=[[True]]))
    assert ids == [1, 2, 3] and streaming
    assert (params.max_new_tokens, params.temperature, params.top_k, params.seed) == (16, 0.5, 4, 7)
    assert params.top_p == pytest.approx(0.9) and params.stop_strings == ("END", "STOP")
    assert params.stop_token_ids == (2,) and params.ignore_eos  # end_id replaces the model's EOS ids


def test_defaults_are_greedy_and_not_streamed():
    ids, params, streaming = parse_engine_request(tensors(input_ids=[[5]], max_tokens=[[1]]))
    assert params.greedy and params.top_k == 0 and params.top_p == 1 and not params.stop_strings
    assert not streaming and not params.ignore_eos


@pytest.mark.parametrize("inputs, message", [
    (dict(max_tokens=[[4]]), "one prompt per request"),
    (dict(input_ids=[[1], [2]], max_tokens=[[4]]), "one prompt per request"),
    (dict(input_ids=[[1]]), "max_tokens must be >= 1, got None"),
    (dict(input_ids=[[1]], max_tokens=[[0]]), "max_tokens must be >= 1, got 0"),
    (dict(input_ids=[[1]], max_tokens=[[4]], top_p=[[0.0]]), r"top_p must be in \(0, 1\]"),
    (dict(input_ids=[[1]], max_tokens=[[4]], temperature=[[1.0, 2.0]]), "temperature must hold one value"),
    (dict(input_ids=[[1]], max_tokens=[[4]], seed=[[1]], random_seed=[[2]]), "seed and random_seed differ"),
    (dict(input_ids=[[1]], max_tokens=[[4]], bad_words=[[b"x"]]), "bad_words is not supported"),
    (dict(input_ids=[[1]], max_tokens=[[4]], stop_words=np.array([[b"\xff"]], dtype=object)),
     "stop_words: not valid UTF-8"),
])
def test_bad_requests_are_refused_with_the_field_named(inputs, message):
    with pytest.raises(DFlashError, match=message):
        parse_engine_request(tensors(**inputs))


def test_stop_requests():
    assert is_stop_request(tensors(stop=[[True]]))
    assert not is_stop_request(tensors(stop=[[False]])) and not is_stop_request(tensors(input_ids=[[1]]))
