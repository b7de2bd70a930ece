"""A request's tensors -> what the models need, every input checked before the engine sees it.

Triton-free: `tensor(name)` is the model's way to read an input (numpy array, or None when absent),
so the same checks serve every model that parses a request and are tested without a server. The
messages name the field; the models send them as INVALID_ARG errors (dflash_contract.protocol).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from dflash_contract import DFlashError
from dflash_contract.protocol import FRONT_INPUTS, REQUIRED_INPUTS, range_error
from dflash_runtime.sampling import SamplingParams

TensorGetter = Callable[[str], "np.ndarray | None"]
NUMERIC_INPUTS = tuple(name for name, data_type in FRONT_INPUTS.items() if data_type != "BYTES")


def parse_front_request(tensor: TensorGetter) -> tuple[str, bool]:
    """(prompt text, apply the chat template?) of a front-model request, after checking all its inputs.

    The preprocessing model runs this for both front models (it is the ensemble's first step and
    dflash_bls's first call), so both refuse the same requests with the same messages.
    """
    for name in REQUIRED_INPUTS:
        if tensor(name) is None:
            raise DFlashError(f"{name} is required")
    text = utf8("text_input", scalar(tensor, "text_input"))
    if not text:
        raise DFlashError("text_input must not be empty")
    check_numbers(tensor)
    request_seed(tensor)
    check_words(tensor)
    return text, bool(scalar(tensor, "apply_chat_template", False))


def parse_engine_request(tensor: TensorGetter) -> tuple[list[int], SamplingParams, bool]:
    """(prompt ids, sampling parameters, stream?) of a `dflash` model request; DFlashError on bad input."""
    ids = tensor("input_ids")
    if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
        raise DFlashError("send one prompt per request (the server batches requests itself)")
    if tensor("max_tokens") is None:
        raise DFlashError("max_tokens is required")
    check_numbers(tensor)
    seed = request_seed(tensor)
    check_words(tensor)
    end_id = scalar(tensor, "end_id")
    params = SamplingParams(
        max_new_tokens=int(scalar(tensor, "max_tokens")),
        temperature=float(scalar(tensor, "temperature", 0.0)),
        top_k=int(scalar(tensor, "top_k", 0)),
        top_p=float(scalar(tensor, "top_p", 1.0)),
        seed=seed,
        # end_id replaces the model's end-of-sequence ids, as in TensorRT-LLM
        stop_token_ids=(int(end_id),) if end_id is not None else (),
        ignore_eos=end_id is not None,
        stop_strings=tuple(strings(tensor, "stop_words")),
    )
    return ids[0].tolist(), params, bool(scalar(tensor, "stream", False))


def check_numbers(tensor: TensorGetter) -> None:
    """Each non-text input present holds one value, within its range (dflash_contract.protocol.RANGES)."""
    for name in NUMERIC_INPUTS:
        value = scalar(tensor, name)
        error = range_error(name, value) if value is not None else None
        if error:
            raise DFlashError(error)


def request_seed(tensor: TensorGetter) -> int | None:
    """The seed, from `seed` or its older name `random_seed`; refused when the two disagree."""
    seed, legacy_seed = scalar(tensor, "seed"), scalar(tensor, "random_seed")
    if seed is not None and legacy_seed is not None and legacy_seed != seed:
        raise DFlashError("seed and random_seed differ: send one of them")
    seed = legacy_seed if seed is None else seed
    return None if seed is None else int(seed)


def check_words(tensor: TensorGetter) -> None:
    strings(tensor, "stop_words")  # valid UTF-8
    if strings(tensor, "bad_words"):
        raise DFlashError("bad_words is not supported by the DFlash engine")


def is_stop_request(tensor: TensorGetter) -> bool:
    """A `stop` request (tensorrtllm_backend's name): cancel the in-flight request with the same id."""
    stop = tensor("stop")
    return stop is not None and stop.size == 1 and bool(stop.item())


def scalar(tensor: TensorGetter, name: str, default=None):
    value = tensor(name)
    if value is None:
        return default
    if value.size != 1:
        raise DFlashError(f"{name} must hold one value per request, got shape {list(value.shape)}")
    return value.item()


def strings(tensor: TensorGetter, name: str) -> list[str]:
    """The non-empty strings of a BYTES input (UTF-8): one list per request."""
    value = tensor(name)
    if value is None:
        return []
    if value.ndim > 1 and value.shape[0] != 1:
        raise DFlashError(f"{name} must hold one list per request, got shape {list(value.shape)}")
    return [w for w in (utf8(name, w) for w in value.reshape(-1)) if w]


def utf8(name: str, value) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as e:
        raise DFlashError(f"{name}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
