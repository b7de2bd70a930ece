"""What travels between a client and the server's front models (`ensemble`, `dflash_bls`).

Names are tensorrtllm_backend's (`inflight_batcher_llm`), so existing Triton LLM clients work
unchanged; `model_repository/*/config.pbtxt` declare the same tensors (tests/test_build.py checks).

Stop strings: a stop string ends generation at the token that completes it. `dflash_bls` (and so the
clients, the OpenAI gateway) and `dflash-generate` end the text before the string, as OpenAI and vLLM do, or
after it with `include_stop_str_in_output` (dflash_runtime/stop_text.py); the `ensemble` keeps
tensorrtllm_backend's behaviour: the text keeps that whole token, stop string included.
"""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass

from . import DFlashError

# tensorrtllm_backend's optional inputs that its clients send (NVIDIA's genai-perf sends the first one to every
# model): name -> (wire type, the one value we serve, what it asks for). Declared so that such requests reach us;
# any other value asks for what the engine does not do and is refused, naming the input: never ignored.
# (The neutral values are TensorRT-LLM's: executor.h's SamplingConfig.)
FIXED_INPUTS = {
    "exclude_input_in_output": ("BOOL", True, "responses carry only the generated text"),
    "beam_width": ("INT32", 1, "no beam search"),
    "num_return_sequences": ("INT32", 1, "one sequence per request"),
    "return_context_logits": ("BOOL", False, "no logits"),
    "return_generation_logits": ("BOOL", False, "no logits"),
    "length_penalty": ("FP32", None, "beam search only"),  # None: any value, which one beam never uses
}
# Front-model inputs: name -> Triton data type (on the wire). A request carries exactly one of PROMPT_INPUTS,
# and the REQUIRED_INPUTS below.
FRONT_INPUTS = {
    "text_input": "BYTES",
    # a conversation, JSON in OpenAI's shape: [{"role": "system" | "user" | "assistant" | "tool", "content": str or
    # [{"type": "text", "text": str}, ...] (null beside an assistant's tool_calls), "name", "tool_calls",
    # "tool_call_id"}, ...], put in the target's chat template with the generation prompt
    "messages": "BYTES",
    # with messages: OpenAI's tool definitions (JSON list), and arguments of the chat template (JSON object, vLLM's
    # chat_template_kwargs: Qwen3's {"enable_thinking": false}), both passed to the target's template (chat.py)
    "tools": "BYTES",
    "chat_template_kwargs": "BYTES",
    "max_tokens": "INT32",
    # true: max_tokens is a ceiling, lowered to what the context leaves after the prompt instead of refused
    # (the OpenAI gateway's defaults, for a request that sets none, as vLLM caps its default)
    "clip_max_tokens": "BOOL",
    "min_tokens": "INT32",  # no stop (end-of-sequence ids, stop words) before this many tokens
    "min_length": "INT32",  # the older name of min_tokens (genai-perf 0.0.16 sends it)
    "stream": "BOOL",
    "temperature": "FP32",
    "top_k": "INT32",
    "top_p": "FP32",
    "seed": "UINT64",
    "random_seed": "UINT64",  # the older name of seed
    # how a sampled request verifies drafts: "exact" (its output is the same as without speculation) or "rejection"
    # (the same distribution; the sample depends on the drafter); absent: the build's (presets.SPECULATIVE_SAMPLING)
    "speculative_sampling": "BYTES",
    "end_id": "INT32",
    "pad_id": "INT32",
    "stop_words": "BYTES",
    "bad_words": "BYTES",
    "apply_chat_template": "BOOL",
    # guided decoding (structured outputs): the kind and the guide, tensorrtllm_backend's names (guided_decoding.py)
    "guided_decoding_guide_type": "BYTES",
    "guided_decoding_guide": "BYTES",
    # log-probabilities of the output tokens (LOGPROB_OUTPUTS): tensorrtllm_backend's switch, and how many of the most
    # likely tokens to add at each position (OpenAI's top_logprobs, 0-20)
    "return_log_probs": "BOOL",
    "top_logprobs": "INT32",
    # vLLM's penalties (dflash_runtime/penalties.py), under tensorrtllm_backend's names; 1, 0, 0: off
    "repetition_penalty": "FP32",
    "presence_penalty": "FP32",
    "frequency_penalty": "FP32",
    **{name: data_type for name, (data_type, _, _) in FIXED_INPUTS.items()},
}
# dflash_bls's own inputs, read where the answer's text is made with the request's state. A stop string is left
# out of the text unless this is true (OpenAI's and vLLM's rule, dflash_runtime/stop_text.py); the ensemble, whose
# postprocessing is stateless, keeps tensorrtllm_backend's rule: the text keeps the token that completes it.
INCLUDE_STOP_STR = "include_stop_str_in_output"
BLS_INPUTS = {INCLUDE_STOP_STR: "BOOL"}
# The model that turns a front model's prompt inputs into token ids (and checks every input first), and the request
# id prefix of a client's call that only asks it for them (a render): not a request of any front model, so not counted.
PREPROCESSING_MODEL = "preprocessing"
RENDER_CALL_PREFIX = "render/"
PROMPT_INPUTS = ("text_input", "messages")
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
# What the front model passes on to the `dflash` engine model unchanged (text goes through preprocessing).
ENGINE_INPUTS = ("max_tokens", "clip_max_tokens", "min_tokens", "min_length", "temperature", "top_k", "top_p", "seed",
                 "random_seed", "speculative_sampling", "end_id", "pad_id", "stop_words", "bad_words",
                 "guided_decoding_guide_type", "guided_decoding_guide", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "return_log_probs", "top_logprobs")
# `dflash` model outputs besides the statistics: a window of token ids and how many were shown before.
TOKEN_OUTPUTS = ("output_ids", "read_offset")
FINISH_REASON = "finish_reason"  # BYTES: "" while running, then "stop", "length" or "cancelled"
# With return_log_probs, each response's new tokens' log-probabilities: tensorrtllm_backend's output_log_probs (one
# float per token), and ours, "logprobs": JSON, per token OpenAI's {"token", "bytes", "logprob", "top_logprobs":
# [{"token", "bytes", "logprob"}, ...]} (dflash_runtime/logprobs.py: the target's, after temperature)
LOGPROB_OUTPUTS = {"output_log_probs": "FP32", "logprobs": "BYTES"}


@dataclass(frozen=True)
class Statistic:
    tensor: str  # the output's name; the first three are TensorRT-LLM's (its LLM-API model returns them too)
    data_type: str
    field: str  # its name in response_statistics() and in the clients' SpeculationStats


# Per-request counts, cumulative over the request, in every response of `dflash` and the front models: the
# speculation statistics, and the prompt's and the output's tokens (usage, exact: the server's own tokens).
# The two ratios are left out of a response while they have nothing to report: mean_acceptance_length before the
# first verify step (a 1-token answer has none), acceptance_rate before the first draft; null in JSON doors.
STATISTICS = (
    Statistic("total_accepted_draft_tokens", "INT32", "accepted_draft_tokens"),
    Statistic("total_draft_tokens", "INT32", "draft_tokens"),
    Statistic("acceptance_rate", "FP32", "acceptance_rate"),  # accepted / drafted
    Statistic("draft_steps", "INT32", "draft_steps"),  # verify passes
    Statistic("mean_acceptance_length", "FP32", "mean_acceptance_length"),  # accepted drafts + 1 per pass: tau
    Statistic("num_input_tokens", "INT32", "prompt_tokens"),  # the templated prompt's tokens
    Statistic("num_cached_tokens", "INT32", "cached_tokens"),  # of those, found in the prefix cache (not computed)
    Statistic("num_output_tokens", "INT32", "completion_tokens"),  # tokens generated so far
)


def response_statistics(draft_steps: int, accepted_draft_tokens: int, draft_tokens: int, prompt_tokens: int,
                        completion_tokens: int, cached_tokens: int = 0) -> dict[str, float | int | None]:
    """The STATISTICS values of a request (by field), from the engine's counts; None: nothing to report yet."""
    return {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "completion_tokens": completion_tokens,
        "accepted_draft_tokens": accepted_draft_tokens,
        "draft_tokens": draft_tokens,
        "acceptance_rate": accepted_draft_tokens / draft_tokens if draft_tokens else None,
        "draft_steps": draft_steps,
        "mean_acceptance_length": (accepted_draft_tokens + draft_steps) / draft_steps if draft_steps else None,
    }


@dataclass(frozen=True)
class RequestLimits:
    """The largest request accepted, the same at every door: the front models (dflash_serving.requests), the
    OpenAI gateway (gateway.api, before it calls the server) and the clients' own checks (clients.params).
    Beyond a limit a request is refused as INVALID_ARG naming it (the messages below), never cut to fit. The
    prompt's tokens have no limit here: the build's context does (the dflash model refuses prompt + max_tokens
    over it, naming the context limit), which only the engine knows."""

    # the prompt's UTF-8 bytes: text_input, or the `messages` input's JSON. About 250k tokens of prose or code
    # (~4 bytes a token, also for CJK text: ~3 bytes a character, ~1.4 characters a token), above the context
    # of every target DFlash drafters exist for (32k-128k): a real prompt meets the context limit first. It bounds
    # what one request makes the server decode, JSON-parse and tokenize before that check.
    prompt_bytes: int = 1 << 20
    # messages in a conversation (each one's size is bounded by prompt_bytes): 2048, what OpenAI's chat API is
    # known to allow; long multi-turn conversations stay far below it.
    messages: int = 2048
    # stop strings per request, and each one's UTF-8 bytes: OpenAI allows 4 (vLLM and TensorRT-LLM set no
    # number); stop strings are end markers ("</answer>", "\nUser:"), and the engine matches every one
    # against the text's tail after every step, so their number and length are what each step pays for.
    stop_words: int = 16
    stop_word_bytes: int = 256
    # max_tokens: 2**18, above the largest output any hosted API offers today (OpenAI's: 128k) and as large
    # as the largest contexts of open models; the build's context limit refuses what it cannot hold anyway.
    max_tokens: int = 1 << 18
    # choices per request (OpenAI's n): each is a sequence of its own in the batch, so a request of n takes n of the
    # engine's places; 16 covers best-of and self-consistency sampling (vLLM sets no limit)
    choices: int = 16


LIMITS = RequestLimits()


def prompt_size_error(name: str, size: int) -> str | None:
    """The message for a prompt (text_input or messages, `size` UTF-8 bytes) over LIMITS.prompt_bytes, or None."""
    if size <= LIMITS.prompt_bytes:
        return None
    return f"{name} is {size} bytes (UTF-8), over the limit of {LIMITS.prompt_bytes} bytes per request"


def clipped_max_tokens(max_tokens: int, prompt_tokens: int, limit: int) -> int:
    """A default max_tokens lowered to what a context of `limit` tokens leaves after the prompt, one at least (a
    prompt that leaves none is refused by context_error)."""
    return max(1, min(max_tokens, limit - prompt_tokens))


def context_error(prompt_tokens: int, max_tokens: int, limit: int) -> str | None:
    """The message for a prompt and max_tokens that do not fit the engine's context of `limit` tokens, or None: what
    a generate request is refused with (the engine says more of a prompt that leaves no room), and a render request."""
    if prompt_tokens >= limit:
        return (f"prompt has {prompt_tokens} tokens; the context limit is {limit} (including at least one generated "
                "token)")
    if prompt_tokens + max_tokens > limit:
        return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the context limit of {limit} "
                "tokens")
    return None


def messages_count_error(count: int) -> str | None:
    if count <= LIMITS.messages:
        return None
    return f"messages has {count} messages, over the limit of {LIMITS.messages} per request"


def stop_words_error(name: str, words) -> str | None:
    """The message for stop strings (str) over LIMITS' number or length, or None; `name` is the field's."""
    words = list(words)
    if len(words) > LIMITS.stop_words:
        return f"{name} has {len(words)} stop strings, over the limit of {LIMITS.stop_words} per request"
    for i, word in enumerate(words):
        size = len(word.encode("utf-8", "surrogatepass"))
        if size > LIMITS.stop_word_bytes:
            return (f"{name}[{i}] is {size} bytes (UTF-8), over the limit of {LIMITS.stop_word_bytes} bytes per "
                    "stop string")
    return None


def parse_messages(raw: str) -> list[dict]:
    """A conversation in OpenAI's shape (the `messages` input) as [{"role", "content": str, and where given "name",
    "tool_calls", "tool_call_id"}]; DFlashError naming the message and field for anything else. The front models'
    check, and the gateway's where it templates."""
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as e:
        raise DFlashError(f"messages: not JSON ({e})") from None
    if not isinstance(messages, list) or not messages:
        raise DFlashError("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
    error = messages_count_error(len(messages))
    if error:
        raise DFlashError(error)
    return [_message(i, m) for i, m in enumerate(messages)]


MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")


def _message(i: int, message) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise DFlashError(f"{where} must be an object with role and content")
    unknown = sorted(set(message) - set(MESSAGE_FIELDS))
    if unknown:
        raise DFlashError(f"{where}.{unknown[0]} is not supported (a message has {', '.join(MESSAGE_FIELDS)})")
    role, content = message.get("role"), message.get("content")
    if role not in MESSAGE_ROLES:
        raise DFlashError(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DFlashError(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  f"are supported, got {kind!r}")
        content = "".join(part["text"] for part in content)
    result = {"role": role}
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise DFlashError(f"{where}.{name} must be a string")
            result[name] = message[name]
    if message.get("tool_calls") is not None:
        if role != "assistant":
            raise DFlashError(f"{where}.tool_calls: only an assistant message has tool calls")
        result["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", call)
                                for j, call in enumerate(_list(f"{where}.tool_calls", message["tool_calls"]))]
    if content is None and "tool_calls" in result:
        content = ""  # OpenAI's null content beside an assistant's tool calls
    if not isinstance(content, str):
        raise DFlashError(f"{where}.content must be a string or a list of text parts")
    result["content"] = content
    return result


def _list(where: str, value) -> list:
    if not isinstance(value, list):
        raise DFlashError(f"{where} must be a list")
    return value


def _tool_call(where: str, call) -> dict:
    """An assistant's tool call as the templates read it: {"id", "type": "function", "function": {"name",
    "arguments": the JSON text}} (Qwen3's template writes a string as it is, and an object as JSON)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DFlashError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise DFlashError(f"{where}.function.arguments must be a string (JSON text)")
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def config_type(data_type: str) -> str:
    """A wire data type ("BYTES", "INT32", ...) as config.pbtxt and the Python backend spell it."""
    return "TYPE_STRING" if data_type == "BYTES" else f"TYPE_{data_type}"


# Front-model inputs every request must carry (and one of PROMPT_INPUTS). The configs mark them optional on purpose:
# Triton only counts a request's inputs, so a request without text_input but with two other inputs passed its check
# and an ensemble then skipped its steps and answered an empty success. Checked by the models instead.
REQUIRED_INPUTS = ("max_tokens",)
# The numeric inputs' ranges: name -> (test, the rule in words). NaN fails every comparison, so it is
# refused too. Values a tensor type cannot hold (INT32, UINT64) never reach a model: Triton refuses them.
RANGES = {
    "max_tokens": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: v >= 0, ">= 0"),
    "top_k": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "min_tokens": (lambda v: v >= 0, ">= 0"),
    "min_length": (lambda v: v >= 0, ">= 0"),
    "repetition_penalty": (lambda v: v > 0, "> 0"),
    "top_logprobs": (lambda v: 0 <= v <= 20, "in [0, 20]"),
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
}
# Inputs under two names (tensorrtllm_backend renamed them in 2025.05): current name -> older name
ALIASES = {"seed": "random_seed", "min_tokens": "min_length"}


def range_error(name: str, value) -> str | None:
    """The message for a value outside its input's range (RANGES, and LIMITS.max_tokens), or None."""
    rule = RANGES.get(name)
    if rule is not None and not rule[0](value):
        return f"{name} must be {rule[1]}, got {value}"
    if name == "max_tokens" and value > LIMITS.max_tokens:
        return f"{name} is {value}, over the limit of {LIMITS.max_tokens} tokens per request"
    return None


# Request parameters that are Triton's own: its parameters extension's reserved names (docs/protocol/
# extension_parameters.md: never custom parameters), and the generate extension's "id" (the request id, which
# Triton 2.51 also passes on as a parameter: measured). Over HTTP generate / generate_stream, every body field
# that names no input reaches the model as a request parameter (so do a "parameters" object's members, but for
# those that name an input, which become that input: measured); gRPC requests carry parameters as well. The
# front models read none, so any other parameter would be ignored: it is refused instead (parameters_error),
# over both protocols. A normal request, from our clients or tritonclient, arrives with none (measured: Triton
# strips "triton_enable_empty_final_response").
TRITON_PARAMETERS = frozenset(("id", "sequence_id", "priority", "timeout", "sequence_start", "sequence_end",
                               "headers"))
TRITON_PARAMETER_PREFIX = "triton_"
_NAME_SHOWN = 64  # characters of a field name a message shows


def parameters_error(parameters_json: str) -> str | None:
    """The message for request parameters a front model would ignore (a misspelt HTTP generate field, ...), or
    None. `parameters_json` is the Python backend's request.parameters(). Names only: values are never shown."""
    try:
        parameters = json.loads(parameters_json or "{}")
    except json.JSONDecodeError:
        return None  # Triton's own JSON: cannot happen; nothing of the client's to name
    unknown = sorted(name for name in parameters if name not in TRITON_PARAMETERS
                     and not name.startswith(TRITON_PARAMETER_PREFIX))
    if not unknown:
        return None
    first, shown = unknown[0], [_shown(name) for name in unknown]
    if first in FRONT_INPUTS or first in BLS_INPUTS:
        message = (f"{first} came as a request parameter, which this model does not read: send it as an input (a "
                   "top-level field of an HTTP generate body, a tensor over gRPC)")
    else:
        hint = did_you_mean(first, {**FRONT_INPUTS, **BLS_INPUTS})
        message = f"{shown[0]} is not an input of this model{hint}: a field that names no input is refused, not ignored"
    if len(shown) > 1:
        message += f" (other fields refused: {', '.join(shown[1:])})"
    return message


def did_you_mean(name: str, choices) -> str:
    """" (did you mean X?)" where `name` is a near miss of one of `choices` (a misspelt field), else ""."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.8)
    return f" (did you mean {close[0]}?)" if close else ""


def _shown(name: str) -> str:
    return name if len(name) <= _NAME_SHOWN else name[:_NAME_SHOWN] + "..."


# Error classes: what a client can do about a failed request. Triton's error codes do not survive every
# path (a gRPC stream carries an error as a bare message; HTTP generate answers 400 for every model's error
# and 500 for a body Triton cannot read; an ensemble puts "in ensemble '...', " in front), so each class is
# recognisable by its words, defined here for the server's messages and the clients' matching (error_class):
#   INVALID_ARG  a malformed request: fix it, do not retry. Ours read "invalid request: <field> ...";
#                Triton's own door checks (types, shapes, input counts) have TRITON_REFUSAL_PHRASES.
#   UNAVAILABLE  at capacity, shutting down, or the engine is dead: retry later or on another replica.
#   CANCELLED    the client (or a stop request) cancelled it.
#   INTERNAL     anything else: a fault while serving a valid request. Retrying it would not help.
INVALID_REQUEST_PREFIX = "invalid request"
CAPACITY_MESSAGE = "the server is at capacity"
SHUTTING_DOWN_MESSAGE = "the server is shutting down"
ENGINE_STOPPED_MESSAGE = "the DFlash engine stopped"
STUB_UNHEALTHY_PHRASE = "is not healthy"  # Triton's words for a model whose backend process died
UNAVAILABLE_PHRASES = (CAPACITY_MESSAGE, SHUTTING_DOWN_MESSAGE, ENGINE_STOPPED_MESSAGE, STUB_UNHEALTHY_PHRASE)
CANCELLED_MESSAGE = "request cancelled"
INTERNAL_ERROR_PREFIX = "internal error"
# Triton's refusals of a request before any model runs (tritonserver 2.51 to 26.x wording)
TRITON_REFUSAL_PHRASES = ("expected number of inputs between", "inputs but got", "unexpected inference input",
                          "unexpected shape for input", "data-type is", "batch-size must be",
                          "input byte size mismatch", "string elements for inference input",
                          "has no shape but model requires batch dimension", "request has 0 inputs",
                          "has invalid type. It should be either",  # an HTTP generate field (list, object,
                                                                     # null) that names no input
                          # HTTP generate / generate_stream bodies Triton cannot read (status 500, measured on
                          # 2.51): not JSON or not an object, a value of the wrong JSON type for its input
                          # ("32" for an integer, messages as a list), and "stream": true on generate
                          "failed to parse the request JSON buffer", "attempt to get members for non-object",
                          "Unable to parse 'data'", "Unable to parse JSON bytes array",
                          "generate expects model to produce exactly 1 response")


def invalid_request(detail: str) -> str:
    """The message of an INVALID_ARG error: detail names the field and the rule."""
    return f"{INVALID_REQUEST_PREFIX}: {detail}"


def error_class(message: str) -> str:
    """INVALID_ARG, UNAVAILABLE, CANCELLED or INTERNAL: the class of an error message (see above)."""
    if any(phrase in message for phrase in UNAVAILABLE_PHRASES):
        return "UNAVAILABLE"
    if CANCELLED_MESSAGE in message:
        return "CANCELLED"
    if f"{INVALID_REQUEST_PREFIX}: " in message or any(p in message for p in TRITON_REFUSAL_PHRASES):
        return "INVALID_ARG"
    return "INTERNAL"
