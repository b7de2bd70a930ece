"""OpenAI's requests -> the front model's: bodies checked and translated (the answers' way back: answers.py).

Pure functions, no server: `chat_request` and `completion_request` turn a JSON body into what the front model
takes (clients.transport.Request), refusing with an `APIError` (OpenAI's error shape, the status the official
client maps to its exception classes) whatever the engine cannot honour: an unknown field, or a known one at a
value other than its neutral one. Nothing is ignored silently.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field, replace

from clients.errors import InvalidRequest
from clients.params import GenerationParams, prompt_inputs
from clients.transport import Request
from dflash_contract import DFlashError
from dflash_contract.chat import parse_template_kwargs
from dflash_contract.guided_decoding import Guide
from dflash_contract.protocol import INVALID_REQUEST_PREFIX, LIMITS, did_you_mean

from .guides import GuideError, request_guide
from .tools import ToolError, ToolPlan, tool_plan

# Fields accepted only at these values (None: absent or null): OpenAI's defaults, which the engine serves
NEUTRAL = {
    "logit_bias": (None, {}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
# Fields that change nothing the engine computes: an end-user id, request tags
INERT = ("user", "metadata", "store", "service_tier")
# The sampling fields both endpoints take; top_k, min_tokens, ignore_eos and include_stop_str_in_output are vLLM's
# (and SGLang's) extra-body names,
# speculative_sampling ours (dflash_contract.presets.SPECULATIVE_SAMPLING); response_format and vLLM's
# structured_outputs ask for guided decoding (guides.py), on both endpoints as vLLM takes them, and the penalties
# (OpenAI's presence and frequency, vLLM's repetition) are vLLM's (dflash_runtime/penalties.py)
SAMPLING = ("model", "stream", "stream_options", "temperature", "top_p", "seed", "stop", "top_k", "min_tokens",
            "ignore_eos", "speculative_sampling", "response_format", "structured_outputs", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "include_stop_str_in_output")
CHAT_FIELDS = frozenset((*SAMPLING, "messages", "max_completion_tokens", "max_tokens", "n", "logprobs", "top_logprobs",
                         "logit_bias", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                         "chat_template_kwargs", *INERT))
COMPLETION_FIELDS = frozenset((*SAMPLING, "prompt", "max_tokens", "n", "logprobs", "logit_bias", "echo", "best_of",
                               "suffix", *INERT))
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's
SEED_STEP = 0x9E3779B97F4A7C15  # choice i's seed: the request's + i steps (Translated.choice_requests)


class APIError(Exception):
    """An error answer: `body()` is OpenAI's {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


@dataclass(frozen=True)
class Translated:
    """A checked OpenAI request: what to send the front model, and how to answer."""

    request: Request
    stream: bool  # the client's choice: server-sent events, or one response
    include_usage: bool  # stream_options.include_usage: one more chunk, with the usage and no choices
    tools: ToolPlan | None = None  # a chat request's tools: its answer may be tool calls (tools.py)
    n: int = 1  # choices: one server request each (choice_requests)
    reasoning: str | None = None  # a chat answer's reasoning parser (reasoning.py), the build's
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def choice_requests(self) -> list[Request]:
        """One request per choice. Choice 0 is the request as sent; choice i samples with a seed derived from the
        request's (golden-ratio steps: reproducible, and apart from the seeds of neighbouring requests)."""
        seed = self.request.params.seed
        return [self.request if i == 0 or seed is None else
                replace(self.request, params=replace(self.request.params, seed=(seed + i * SEED_STEP) % 2 ** 64))
                for i in range(self.n)]


def chat_request(body: object, model_id: str, default_max_tokens: int, reasoning: str | None = None) -> Translated:
    body = _checked(body, CHAT_FIELDS, model_id)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of messages", "messages")
    # OpenAI's newer name of the system role
    messages = [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
                for m in messages]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        plan = tool_plan(body)
    except ToolError as e:
        raise invalid(str(e), e.param) from None
    prompt = _prompt(messages, chat=True)
    if plan is not None:
        prompt["tools"] = json.dumps(plan.tools, ensure_ascii=False)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        try:
            prompt["chat_template_kwargs"] = json.dumps(parse_template_kwargs(json.dumps(kwargs)))
        except DFlashError as e:
            raise invalid(str(e), "chat_template_kwargs") from None
    guide = _guide(body)
    if plan is not None and plan.guide() is not None:
        if guide is not None:
            raise invalid(f"tool_choice {plan.choice!r} guides the answer: send no response_format or "
                          "structured_outputs with it", "tool_choice")
        guide = plan.guide()
    t = _translated(body, prompt, limit, default_max_tokens,
                    "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens", guide,
                    _chat_logprobs(body))
    return replace(t, tools=plan, reasoning=reasoning)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (true / false) and top_logprobs (0-20) as the engine's number of top tokens, None for none."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise invalid("logprobs must be true or false", "logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise invalid(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    if top and not wanted:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: dict) -> int | None:
    """The completions API's logprobs: a number of top tokens (0-20; OpenAI's legacy limit is 5), None for none."""
    top = body.get("logprobs")
    if top is None:
        return None
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
    return top


def completion_request(body: object, model_id: str) -> Translated:
    body = _checked(body, COMPLETION_FIELDS, model_id)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise invalid("prompt must be a non-empty string (one prompt per request; token-id prompts are not "
                      "supported)", "prompt")
    return _translated(body, _prompt(prompt, chat=False), body.get("max_tokens"), COMPLETION_DEFAULT_MAX_TOKENS,
                       "max_tokens", _guide(body), _completion_logprobs(body))


def _guide(body: dict) -> Guide | None:
    try:
        return request_guide(body)
    except GuideError as e:
        raise invalid(str(e), e.param) from None


def _prompt(prompt, chat: bool) -> dict:
    """The front model's prompt inputs, within the size limits (dflash_contract.protocol.LIMITS: the prompt's bytes,
    the number of messages), refused as the server would, naming the request's field (prompt or messages)."""
    try:
        return prompt_inputs(prompt, chat=chat)
    except InvalidRequest as e:
        name = "messages" if not isinstance(prompt, str) else "prompt"
        message = str(e)
        if message.startswith("text_input"):
            message = "prompt" + message[len("text_input"):]
        raise invalid(message, name) from None


def _checked(body: object, known: frozenset[str], model_id: str) -> dict:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise invalid(f"{unknown[0]} is not supported by this server{did_you_mean(unknown[0], known)}", unknown[0])
    for name, values in NEUTRAL.items():
        if name in body and body[name] not in values:
            allowed = " or ".join("null" if v is None else repr(v) for v in values)
            raise invalid(f"{name}={body[name]!r} is not supported by this server (send {allowed})", name)
    if body.get("model") != model_id:
        if not isinstance(body.get("model"), str):
            raise invalid("model is required: the id GET /v1/models lists", "model")
        raise APIError(404, f"The model {body['model']!r} does not exist; this server serves {model_id!r}",
                       param="model", code="model_not_found")
    return body


def _translated(body: dict, prompt: dict, max_tokens: object, default_max_tokens: int,
                max_tokens_name: str, guide: Guide | None, logprobs: int | None) -> Translated:
    """max_tokens None: the default, which the server lowers to what the context leaves after the prompt (vLLM's
    rule); a number the client sent is not lowered: past the context it is refused."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop must be a string or a list of strings", "stop")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise invalid("stream_options takes include_usage only", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream must be true or false", "stream")
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "min_tokens": 0,  # OpenAI's, and off
                "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    values = {"max_tokens": default_max_tokens if max_tokens is None else max_tokens,
              **{k: default if body.get(k) is None else body[k] for k, default in defaults.items()}}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, type(None))):
            raise invalid(f"{_name(name, max_tokens_name)} must be a number", _name(name, max_tokens_name))
    ignore_eos, include_stop = body.get("ignore_eos", False), body.get("include_stop_str_in_output", False)
    for name, value in (("ignore_eos", ignore_eos), ("include_stop_str_in_output", include_stop)):
        if not isinstance(value, bool):
            raise invalid(f"{name} must be true or false", name)
    try:  # end_id -1 replaces the end-of-sequence ids by one that never comes
        params = GenerationParams(stop=tuple(s for s in stop if s), include_stop_str_in_output=include_stop,
                                  end_id=-1 if ignore_eos else None,
                                  clip_max_tokens=max_tokens is None,
                                  speculative_sampling=body.get("speculative_sampling"), guide=guide,
                                  logprobs=logprobs, **values)
    except InvalidRequest as e:  # the server's rules (ranges, limits), checked by the clients' GenerationParams
        name = next((n for n in (*values, "stop", "speculative_sampling") if str(e).startswith(n)), None)
        message = str(e) if name is None else _name(name, max_tokens_name) + str(e)[len(name):]
        raise invalid(message, name and _name(name, max_tokens_name)) from None
    # streamed from the server either way: each response is where a client's disconnect is noticed
    return Translated(Request(prompt, params, stream=True), stream,
                      include_usage=bool(options and options.get("include_usage")), n=_choices(body.get("n")))


def _choices(n) -> int:
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise invalid(f"n must be an integer >= 1, got {n!r}", "n")
    if n > LIMITS.choices:
        raise invalid(f"n is {n}, over the limit of {LIMITS.choices} choices per request", "n")
    return n


def _name(name: str, max_tokens_name: str) -> str:
    return max_tokens_name if name == "max_tokens" else name


# The front model's input names that a refusal starts with -> the request field they came from
SERVER_FIELDS = {"messages": "messages", "text_input": "prompt", "stop_words": "stop", "temperature": "temperature",
                 "top_p": "top_p", "top_k": "top_k", "seed": "seed", "min_tokens": "min_tokens",
                 "speculative_sampling": "speculative_sampling", "repetition_penalty": "repetition_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "end_id": "ignore_eos",  # end_id: what ignore_eos becomes (_translated)
                 # a guide the engine could not compile: response_format's or structured_outputs' (guides.py)
                 "guided_decoding_guide": "response_format"}


def param_of(message: str) -> str | None:
    """The request field a server refusal names ("invalid request: messages[0].role must ..." -> "messages")."""
    match = re.search(rf"{INVALID_REQUEST_PREFIX}: ([a-z_]+)", message)
    return SERVER_FIELDS.get(match.group(1)) if match else None
