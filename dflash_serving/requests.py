"""A request's tensors -> what the models need, every input checked before the engine sees it.

Triton-free: `tensor(name)` is the model's way to read an input (numpy array, or None when absent),
so the same checks serve every model that parses a request and are tested without a server. The
messages name the field; the models send them as INVALID_ARG errors (dflash_contract.protocol).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from dflash_contract import DFlashError
from dflash_contract.chat import parse_template_kwargs, parse_tools
from dflash_contract.guided_decoding import GUIDE_INPUT, TYPE_INPUT, Guide, guide_of
from dflash_contract.presets import check_speculative_sampling
from dflash_contract.protocol import (ALIASES, FIXED_INPUTS, FRONT_INPUTS, PROMPT_INPUTS, REQUIRED_INPUTS,
                                      clipped_max_tokens, parameters_error, parse_messages, prompt_size_error,
                                      range_error, stop_words_error)
from dflash_runtime.sampling import SamplingParams

TensorGetter = Callable[[str], "np.ndarray | None"]
NUMERIC_INPUTS = tuple(name for name, data_type in FRONT_INPUTS.items() if data_type != "BYTES")


def parse_front_request(tensor: TensorGetter, parameters: str = "{}") -> tuple[str | list[dict], bool, dict]:
    """(prompt, apply the chat template?, the template's other arguments) of a front-model request, after checking
    all its inputs and its request parameters (request.parameters(): JSON): the prompt is text_input's text, or the
    conversation in `messages` (always templated), as [{"role", "content": str, ...}]; the arguments: `tools` and
    chat_template_kwargs (dflash_contract.chat).

    The preprocessing model runs this for both front models (it is the ensemble's first step and
    dflash_bls's first call), so both refuse the same requests with the same messages. (dflash_bls checks its
    own request's parameters first, by the same rule, protocol.parameters_error: a BLS call passes none on.)
    """
    check_parameters(parameters)
    given = [name for name in PROMPT_INPUTS if tensor(name) is not None]
    if len(given) != 1:
        raise DFlashError("send one of text_input and messages" if given else "text_input (or messages) is required")
    for name in REQUIRED_INPUTS:
        if tensor(name) is None:
            raise DFlashError(f"{name} is required")
    raw = scalar(tensor, given[0])
    error = prompt_size_error(given[0], len(raw) if isinstance(raw, bytes) else len(str(raw).encode("utf-8")))
    if error:
        raise DFlashError(error)
    text = utf8(given[0], raw)
    check_numbers(tensor)
    check_fixed(tensor)
    aliased(tensor, "seed")
    aliased(tensor, "min_tokens")
    speculative_sampling(tensor)
    check_words(tensor)
    guide(tensor)
    chat = given == ["messages"] or bool(scalar(tensor, "apply_chat_template", False))
    template = template_args(tensor, chat)
    if given == ["messages"]:
        return parse_messages(text), True, template
    if not text:
        raise DFlashError("text_input must not be empty")
    return text, chat, template


def template_args(tensor: TensorGetter, chat: bool) -> dict:
    """`tools` and chat_template_kwargs, for the chat template: only where there is one to apply."""
    raw = {name: scalar(tensor, name) for name in ("tools", "chat_template_kwargs")}
    given = [name for name, value in raw.items() if value is not None]
    if given and not chat:
        raise DFlashError(f"{given[0]} needs a chat prompt: messages, or text_input with apply_chat_template")
    args = {}
    if raw["chat_template_kwargs"] is not None:
        args.update(parse_template_kwargs(utf8("chat_template_kwargs", raw["chat_template_kwargs"])))
    if raw["tools"] is not None:
        args["tools"] = parse_tools(utf8("tools", raw["tools"]))
    return args


def parse_engine_request(tensor: TensorGetter, max_context: int) -> tuple[list[int], SamplingParams, bool]:
    """(prompt ids, sampling parameters, stream?) of a `dflash` model request; DFlashError on bad input. With
    clip_max_tokens, max_tokens is lowered to what `max_context` leaves after the prompt (a prompt that leaves no
    room is still the engine's to refuse)."""
    ids = tensor("input_ids")
    if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
        raise DFlashError("send one prompt per request (the server batches requests itself)")
    if tensor("max_tokens") is None:
        raise DFlashError("max_tokens is required")
    check_numbers(tensor)
    check_words(tensor)
    end_id = scalar(tensor, "end_id")
    max_tokens = int(scalar(tensor, "max_tokens"))
    if scalar(tensor, "clip_max_tokens", False):
        max_tokens = clipped_max_tokens(max_tokens, ids.shape[1], max_context)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=aliased(tensor, "min_tokens") or 0,
        temperature=float(scalar(tensor, "temperature", 0.0)),
        top_k=int(scalar(tensor, "top_k", 0)),
        top_p=float(scalar(tensor, "top_p", 1.0)),
        seed=aliased(tensor, "seed"),
        speculative_sampling=speculative_sampling(tensor),
        # end_id replaces the model's end-of-sequence ids, as in TensorRT-LLM
        stop_token_ids=(int(end_id),) if end_id is not None else (),
        ignore_eos=end_id is not None,
        stop_strings=tuple(strings(tensor, "stop_words")),
        guide=guide(tensor),
        repetition_penalty=float(scalar(tensor, "repetition_penalty", 1.0)),
        presence_penalty=float(scalar(tensor, "presence_penalty", 0.0)),
        frequency_penalty=float(scalar(tensor, "frequency_penalty", 0.0)),
        logprobs=logprobs(tensor),
    )
    return ids[0].tolist(), params, bool(scalar(tensor, "stream", False))


def check_parameters(parameters: str) -> None:
    """No request parameter that is not Triton's own (dflash_contract.protocol.parameters_error): over HTTP
    generate, a misspelt field ("temprature") arrives as one, and would otherwise be ignored."""
    error = parameters_error(parameters)
    if error:
        raise DFlashError(error)


def check_fixed(tensor: TensorGetter) -> None:
    """tensorrtllm_backend's inputs we serve at one value only (dflash_contract.protocol.FIXED_INPUTS)."""
    for name, (_, value, meaning) in FIXED_INPUTS.items():
        given = scalar(tensor, name)
        if given is not None and value is not None and given != value:
            raise DFlashError(f"{name}={_literal(given)} is not supported ({meaning}; send {_literal(value)} or "
                              "leave it out)")


def _literal(value) -> str:
    return str(value).lower() if isinstance(value, (bool, np.bool_)) else f"{value:g}"


def check_numbers(tensor: TensorGetter) -> None:
    """Each non-text input present holds one value, within its range (dflash_contract.protocol.RANGES)."""
    for name in NUMERIC_INPUTS:
        value = scalar(tensor, name)
        error = range_error(name, value) if value is not None else None
        if error:
            raise DFlashError(error)


def aliased(tensor: TensorGetter, name: str) -> int | None:
    """An input sent under its name or its older one (protocol.ALIASES); refused when the two disagree."""
    value, older = scalar(tensor, name), scalar(tensor, ALIASES[name])
    if value is not None and older is not None and older != value:
        raise DFlashError(f"{name} and {ALIASES[name]} differ: send one of them")
    value = older if value is None else value
    return None if value is None else int(value)


def check_words(tensor: TensorGetter) -> None:
    error = stop_words_error("stop_words", strings(tensor, "stop_words"))  # valid UTF-8, within LIMITS
    if error:
        raise DFlashError(error)
    if strings(tensor, "bad_words"):
        raise DFlashError("bad_words is not supported by the DFlash engine")


def guide(tensor: TensorGetter) -> Guide | None:
    """The request's guided decoding (dflash_contract.guided_decoding), None for none; its grammar is the engine's
    to compile."""
    texts = {name: scalar(tensor, name) for name in (TYPE_INPUT, GUIDE_INPUT)}
    return guide_of(*(None if value is None else utf8(name, value) for name, value in texts.items()))


def logprobs(tensor: TensorGetter) -> int | None:
    """The top log-probabilities a request asks for with each token (None: no log-probabilities)."""
    top = scalar(tensor, "top_logprobs")
    if not scalar(tensor, "return_log_probs", False):
        if top:
            raise DFlashError("top_logprobs needs return_log_probs=true")
        return None
    return int(top or 0)


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


def speculative_sampling(tensor: TensorGetter) -> str | None:
    """The method a request names (presets.SPECULATIVE_SAMPLING), None for the build's; an unknown one is refused."""
    value = scalar(tensor, "speculative_sampling")
    return None if value is None else check_speculative_sampling(utf8("speculative_sampling", value))


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
