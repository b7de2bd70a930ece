"""A request's tensors -> prompt ids and SamplingParams for the engine, validated before it.

Triton-free: `tensor(name)` is the model's way to read an input (numpy array, or None when absent),
so the same checks serve every model that parses a request and are tested without a server.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from dflash_contract import DFlashError
from dflash_runtime.sampling import SamplingParams

TensorGetter = Callable[[str], "np.ndarray | None"]


def parse_engine_request(tensor: TensorGetter) -> tuple[list[int], SamplingParams, bool]:
    """(prompt ids, sampling parameters, stream?) of a `dflash` model request; DFlashError on bad input."""
    ids = tensor("input_ids")
    if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
        raise DFlashError("send one prompt per request (the server batches requests itself)")
    max_tokens = scalar(tensor, "max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise DFlashError(f"max_tokens must be >= 1, got {max_tokens}")
    seed = scalar(tensor, "seed")
    legacy_seed = scalar(tensor, "random_seed")
    if seed is None:
        seed = legacy_seed
    elif legacy_seed is not None and legacy_seed != seed:
        raise DFlashError("seed and random_seed differ: send one of them")
    if strings(tensor, "bad_words"):
        raise DFlashError("bad_words is not supported by the DFlash engine")
    end_id = scalar(tensor, "end_id")
    params = SamplingParams(
        max_new_tokens=int(max_tokens),
        temperature=float(scalar(tensor, "temperature", 0.0)),
        top_k=int(scalar(tensor, "top_k", 0)),
        top_p=float(scalar(tensor, "top_p", 1.0)),
        seed=None if seed is None else int(seed),
        # end_id replaces the model's end-of-sequence ids, as in TensorRT-LLM
        stop_token_ids=(int(end_id),) if end_id is not None else (),
        ignore_eos=end_id is not None,
        stop_strings=tuple(strings(tensor, "stop_words")),
    )
    return ids[0].tolist(), params, bool(scalar(tensor, "stream", False))


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
    """The non-empty strings of a BYTES input (UTF-8)."""
    value = tensor(name)
    if value is None:
        return []
    return [w for w in (utf8(name, w) for w in value.reshape(-1)) if w]


def utf8(name: str, value) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as e:
        raise DFlashError(f"{name}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
