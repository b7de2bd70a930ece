"""What a request asks for: the prompt (raw text or chat messages) and the sampling parameters.

The ranges are the server's: dflash_contract.protocol.RANGES, which the front models check too, so a
request refused here would be refused there with the same words (tests/test_clients.py also checks
them against the engine's SamplingParams); so are the size limits (protocol.LIMITS: prompt bytes, messages,
stop strings, max_tokens). Stop strings follow dflash_contract.protocol's rule.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from dflash_contract.guided_decoding import Guide
from dflash_contract.presets import speculative_sampling_error
from dflash_contract.protocol import messages_count_error, prompt_size_error, range_error, stop_words_error

from .errors import InvalidRequest

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1

# A chat message as in the OpenAI / Hugging Face chat formats: {"role": "user", "content": "..."}.
Message = Mapping[str, object]
Prompt = Union[str, Sequence[Message]]


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # same seed, same output (with or without the drafter)
    # stop strings: generation ends at the token completing one; the text ends before the string (OpenAI's rule), or
    # after it with include_stop_str_in_output
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    end_id: int | None = None  # replaces the model's end-of-sequence ids (TensorRT-LLM semantics)
    min_tokens: int = 0  # no stop (end of sequence, stop string) before this many tokens
    # True: max_tokens is a ceiling the server lowers to what its context leaves after the prompt, rather than
    # refusing prompt + max_tokens over the context (the OpenAI gateway's defaults)
    clip_max_tokens: bool = False
    # how a sampled request verifies drafts: "exact" (the same output as without speculation) or "rejection" (the
    # same distribution, another sample); None: the server's build decides
    speculative_sampling: str | None = None
    guide: Guide | None = None  # guided decoding: the output matches it (dflash_contract.guided_decoding)
    repetition_penalty: float = 1.0  # vLLM's penalties: PENALTIES_OFF's values are off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # each token's log-probability (the target's, after temperature) and this many most likely ones (0-20) in every
    # Response; None: none
    logprobs: int | None = None

    def __post_init__(self):
        # The tensor types bound what fits (INT32, UINT64); within them, the server's ranges.
        for name in ("max_tokens", "top_k", "min_tokens"):
            value = getattr(self, name)
            _check(_is_int(value) and value <= INT32_MAX, f"{name} must be a 32-bit integer, got {value!r}")
        for name in ("max_tokens", "temperature", "top_k", "top_p", "min_tokens", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            error = range_error(name, getattr(self, name))
            _check(error is None, error)
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= UINT64_MAX),
               f"seed must be in [0, 2**64), got {self.seed}")
        _check(self.end_id is None or (_is_int(self.end_id) and -2**31 <= self.end_id <= INT32_MAX),
               f"end_id must be a 32-bit integer, got {self.end_id}")
        _check(not isinstance(self.stop, str), "stop must be a sequence of strings, not one string")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must not be empty")
        error = stop_words_error("stop", self.stop)
        _check(error is None, error)
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be None or a number of top tokens in [0, 20], got {self.logprobs!r}")
        error = None if self.speculative_sampling is None else speculative_sampling_error(self.speculative_sampling)
        _check(error is None, error)


PENALTIES_OFF = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def penalties(params: GenerationParams) -> dict[str, float]:
    """The penalties a request sets (the others are off): what goes on the wire."""
    return {name: getattr(params, name) for name, off in PENALTIES_OFF.items() if getattr(params, name) != off}


def prompt_inputs(prompt: Prompt, chat: bool) -> dict[str, object]:
    """The front model's prompt inputs: text_input (with apply_chat_template), or a conversation as `messages`.

    A str with chat becomes one user message in the model's chat template, on the server; a conversation
    ([{"role": "system" | "user" | "assistant", "content": ...}, ...]) is always templated there. The server
    checks every message and names the one it refuses.
    """
    if isinstance(prompt, str):
        _check(bool(prompt), "empty prompt")
        _check_size("text_input", prompt)
        return {"text_input": prompt, "apply_chat_template": chat}
    messages = list(prompt)
    _check(bool(messages), "empty conversation")
    error = messages_count_error(len(messages))
    _check(error is None, error)
    text = json.dumps(messages, ensure_ascii=False)
    _check_size("messages", text)  # what the server measures: the input's bytes
    return {"messages": text}


def _check_size(name: str, text: str) -> None:
    error = prompt_size_error(name, len(text.encode("utf-8", "surrogatepass")))
    _check(error is None, error)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)
