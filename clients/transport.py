"""The two ways to reach the server's front model: gRPC streaming and HTTP generate / generate_stream.

Both turn one request into an async iterator of `Response`s (one per server response) and every
failure into an exception from `errors`. The front model is decoupled, so gRPC must use the streaming
RPC even for one response, and HTTP must use the generate extension (the plain infer endpoint
refuses decoupled models); tritonclient's HTTP client has no generate call, so aiohttp (which
tritonclient's asyncio HTTP client is built on) posts it. Health checks go through tritonclient.
Each protocol's stack is imported when a transport for it is made: both are heavy (gRPC; aiohttp and
gevent through tritonclient.http), and a service uses one.

Two front models exist: `dflash_bls` (the torch runtime's repositories) and `tensorrt_llm` (a `--runtime trtllm`
build: TensorRT-LLM's LLM-API model, model_repository/trtllm). A transport finds which one its server has, once,
at its first request or health check, and talks to it in its own tensors (a `_BlsCall` or an `_LlmApiCall`). The
LLM-API model takes raw text only and returns cumulative text without token counts: a `Templater` (the gateway's
gateway.chat_template.ChatTemplate) puts conversations in the target's chat template and counts tokens; without
one, a conversation is refused, as is any parameter the LLM-API model has no input for.
"""
from __future__ import annotations

import asyncio
import json
import ssl
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Literal, Protocol as TypingProtocol

import numpy as np

from dflash_contract.guided_decoding import GUIDE_INPUT, TYPE_INPUT
from dflash_contract.protocol import (BLS_INPUTS, FINISH_REASON, FRONT_INPUTS, INCLUDE_STOP_STR, PREPROCESSING_MODEL,
                                      RENDER_CALL_PREFIX, STATISTICS, invalid_request)
from dflash_contract.server import PORTS

from .errors import (DFlashClientError, InvalidRequest, RequestCancelled, RequestTimeout, ServerError,
                     ServerUnavailable, from_server_message)
from .params import GenerationParams, penalties
from .results import Health, SpeculationStats

Protocol = Literal["grpc", "http"]
# dflash_bls: the ensemble's pipeline and tensors, and a cancelled stream frees its slot at once (an
# ensemble would decode on; see model_repository/dflash_bls)
MODEL = "dflash_bls"
# TensorRT-LLM's LLM-API model, the one front model of a `--runtime trtllm` build (used when there is no dflash_bls)
LLMAPI_MODEL = "tensorrt_llm"
FRONT_MODELS = (MODEL, LLMAPI_MODEL)  # in order of preference
HEALTH_TIMEOUT_S = 5.0
STREAM_END_TIMEOUT_S = 5.0  # for the server to end a stream after its final response
# The LLM-API model's inputs that requests use (model_repository/trtllm/tensorrt_llm/config.pbtxt), wire types.
# No batch dimension (max_batch_size 0): text_input is [1], sampling_param_stop [n], the others [1].
LLMAPI_INPUTS = {
    "text_input": "BYTES",
    "streaming": "BOOL",
    "sampling_param_max_tokens": "INT32",
    "sampling_param_temperature": "FP32",
    "sampling_param_top_k": "INT32",
    "sampling_param_top_p": "FP32",
    "sampling_param_seed": "UINT64",
    "sampling_param_stop": "BYTES",
    "sampling_param_presence_penalty": "FP32",
    "sampling_param_frequency_penalty": "FP32",
    "sampling_param_return_perf_metrics": "BOOL",  # adds the speculation statistics to each response
    "return_finish_reason": "BOOL",
}
# The model sends str(CompletionOutput.finish_reason): "None" until the end, then one of the LLM API's
# Literal['stop', 'length', 'timeout', 'cancelled'] (tensorrt_llm/executor/result.py). Ours; "timeout" is an error.
LLMAPI_FINISH_REASONS = {"None": "", "": "", "stop": "stop", "length": "length", "cancelled": "cancelled"}
LLMAPI_TIMEOUT = "timeout"


class Templater(TypingProtocol):
    """What the LLM-API front needs for conversations and usage (gateway.chat_template.ChatTemplate)."""

    def render(self, messages_json: str) -> str:
        """The conversation (the `messages` input's JSON) in the chat template, with the generation prompt."""

    def count(self, text: str, special_tokens: bool) -> int:
        """Tokens of `text`, with the tokenizer's added special tokens or without."""

    def token_ids(self, text: str, special_tokens: bool) -> list[int]:
        """`text`'s token ids, with the tokenizer's added special tokens or without."""

    def refuse_special_tokens(self, field: str, text: str) -> None:
        """InvalidRequest naming `field` when `text` holds a special token's text."""



@dataclass(frozen=True)
class TLS:
    """TLS for gRPC (and https for HTTP). Paths to PEM files; None = the system's trust store / no client cert."""

    root_certificates: str | None = None
    private_key: str | None = None
    certificate_chain: str | None = None

    def grpc_options(self) -> dict:
        return {"ssl": True, "root_certificates": self.root_certificates, "private_key": self.private_key,
                "certificate_chain": self.certificate_chain}

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.root_certificates)
        if self.certificate_chain:
            context.load_cert_chain(self.certificate_chain, self.private_key)
        return context


@dataclass(frozen=True)
class Request:
    prompt: dict[str, object]  # text_input and apply_chat_template, or messages (params.prompt_inputs)
    params: GenerationParams
    stream: bool  # one response per accepted group of tokens (text deltas), else one response

    def fields(self) -> dict[str, object]:
        """The front model's inputs by name; optional ones only when set."""
        p = self.params
        fields = {**self.prompt, "max_tokens": p.max_tokens, "stream": self.stream, "temperature": p.temperature,
                  "top_k": p.top_k, "top_p": p.top_p}
        if p.min_tokens:
            fields["min_tokens"] = p.min_tokens
        if p.clip_max_tokens:
            fields["clip_max_tokens"] = True
        if p.seed is not None:
            fields["seed"] = p.seed
        if p.speculative_sampling is not None:
            fields["speculative_sampling"] = p.speculative_sampling
        if p.end_id is not None:
            fields["end_id"] = p.end_id
        if p.stop:
            fields["stop_words"] = list(p.stop)
        if p.include_stop_str_in_output:  # sent only when set: the ensemble does not take it (protocol.BLS_INPUTS)
            fields[INCLUDE_STOP_STR] = True
        fields.update(penalties(p))
        if p.logprobs is not None:
            fields["return_log_probs"] = True
            if p.logprobs:
                fields["top_logprobs"] = p.logprobs
        if p.guide is not None:
            fields[TYPE_INPUT] = p.guide.type
            if p.guide.text:
                fields[GUIDE_INPUT] = p.guide.text
        return fields


@dataclass(frozen=True)
class Response:
    text: str  # the new text when streaming, else the whole text
    finish_reason: str  # "" until the last response
    stats: SpeculationStats
    final: bool  # the server sends nothing more for this request
    # where asked for (GenerationParams.logprobs): the new tokens' log-probabilities, OpenAI's per-token entries
    # (dflash_contract.protocol.LOGPROB_OUTPUTS)
    logprobs: list[dict] | None = None


class _FrontFinder:
    """Which front model the server has (FRONT_MODELS), found once: the first one ready. Until one is (server
    unreachable, models loading), requests go to dflash_bls uncached, and fail with the server's own words."""

    templater: Templater | None

    def __init__(self, templater: Templater | None):
        self.templater = templater
        self._front: str | None = None

    async def front(self) -> str:
        if self._front is None:
            for name in FRONT_MODELS:
                try:
                    ready = await self._model_ready(name)
                except Exception:  # unreachable: the request or health check says so
                    return MODEL
                if ready:
                    self._front = name
                    break
        return self._front or MODEL

    async def _model_ready(self, name: str) -> bool:
        raise NotImplementedError

    async def _call(self, request: Request) -> _BlsCall | _LlmApiCall:
        front = await self.front()
        return _BlsCall(request) if front == MODEL else _LlmApiCall(request, self.templater)


class GrpcTransport(_FrontFinder):
    def __init__(self, url: str, tls: TLS | None = None, templater: Templater | None = None):
        import tritonclient.grpc.aio as grpcclient

        super().__init__(templater)
        self.url = url
        self._client = grpcclient.InferenceServerClient(url, **(tls.grpc_options() if tls else {}))

    async def _model_ready(self, name: str) -> bool:
        return await self._client.is_model_ready(name, client_timeout=HEALTH_TIMEOUT_S)

    async def responses(self, request: Request) -> AsyncIterator[Response]:
        import grpc

        front = await self._call(request)
        inputs = _grpc_inputs(front)  # here: a failure inside requests() would only cancel the call, unexplained
        sent_all = asyncio.Event()

        async def requests():
            yield {"model_name": front.model, "inputs": inputs, "enable_empty_final_response": True}
            # Keep our side of the stream open: half-closing it early can end the RPC before the answer.
            await sent_all.wait()

        call = self._client.stream_infer(requests())
        final = False
        try:
            async for result, error in call:
                if error is not None:
                    raise from_server_message(error.message(), self.url)
                response = _grpc_response(front, result)
                final = response.final
                yield response
                if final:
                    return
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e, self.url) from None
        finally:
            sent_all.set()  # half-closes our side: after the final response the server then ends the RPC
            if final:
                await _ended(call)
            else:
                call.cancel()  # tells the server to stop

    async def prompt_token_ids(self, request: Request) -> list[int]:
        """The token ids the server would decode `request`'s prompt into, decoding nothing: its preprocessing model,
        with every check a request gets (for TensorRT-LLM's LLM-API model, which tokenizes inside, the templater)."""
        from tritonclient.utils import InferenceServerException

        front = await self._call(request)
        if isinstance(front, _LlmApiCall):
            return front.prompt_token_ids()
        call = _PreprocessingCall(front)
        try:
            result = await self._client.infer(PREPROCESSING_MODEL, _grpc_inputs(call), request_id=call.request_id)
        except InferenceServerException as e:
            raise from_server_message(e.message(), self.url) from None
        return result.as_numpy("input_ids").reshape(-1).tolist()

    async def health(self) -> Health:
        from tritonclient.utils import InferenceServerException

        try:
            live = await self._client.is_server_live(client_timeout=HEALTH_TIMEOUT_S)
            server_ready = live and await self._client.is_server_ready(client_timeout=HEALTH_TIMEOUT_S)
            front = await self.front() if server_ready else MODEL
            model_ready = server_ready and await self._model_ready(front)
        except InferenceServerException as e:
            return Health(self.url, False, False, f"cannot reach the server at {self.url} (gRPC): {e.message()}")
        return Health(self.url, live, model_ready, _not_ready_detail(live, server_ready, model_ready, front))

    async def close(self) -> None:
        await self._client.close()


async def _ended(call) -> None:
    """Wait (briefly) for the server to end a stream whose request is complete. Cancelling it instead left
    tritonserver 2.51 unable to unload dflash_bls at shutdown once a dozen requests had been cancelled that way
    (it then waited out its exit timeout)."""
    try:
        async with asyncio.timeout(STREAM_END_TIMEOUT_S):
            async for _ in call:
                pass
    except Exception:  # the answer is whole already: a stream that does not end in time (or cleanly) is cut
        call.cancel()


class HttpTransport(_FrontFinder):
    def __init__(self, url: str, tls: TLS | None = None, templater: Templater | None = None):
        import aiohttp
        import tritonclient.http.aio as httpclient

        super().__init__(templater)
        self.url = url
        context = tls.ssl_context() if tls else None
        self._base = f"{'https' if tls else 'http'}://{url}/v2/models"
        # limit=0: as many connections as requests in flight (a benchmark may hold hundreds).
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=context or True))
        self._health = httpclient.InferenceServerClient(url, conn_timeout=HEALTH_TIMEOUT_S, ssl=tls is not None,
                                                        ssl_context=context)

    async def _model_ready(self, name: str) -> bool:
        return await self._health.is_model_ready(name)

    async def responses(self, request: Request) -> AsyncIterator[Response]:
        import aiohttp

        # Always streamed, and joined by the client when one answer was asked for: Triton notices that an HTTP client
        # went away (its timeout, a dropped connection) only when it writes to it, so a request answered in one
        # response at the end decoded to the end after its client gave up (measured: the slot busy 10 s later)
        try:
            call = await self._call(replace(request, stream=True))
            async with self._session.post(f"{self._base}/{call.model}/generate_stream", json=call.json()) as reply:
                if reply.content_type != "text/event-stream":  # one JSON body: the answer or an error
                    yield self._response(call, await reply.json(content_type=None), reply.status, final=True)
                    return
                async for line in reply.content:  # server-sent events: "data: {...}" lines
                    if line.startswith(b"data:"):
                        response = self._response(call, json.loads(line[5:]), reply.status, final=False)
                        yield response
                        if response.final:
                            return
        except aiohttp.ClientConnectorError as e:
            raise ServerUnavailable(f"cannot reach the server at {self.url} (HTTP): {e.os_error}", self.url) from None
        except (aiohttp.ClientError, json.JSONDecodeError) as e:
            raise ServerUnavailable(f"the connection to {self.url} broke: {type(e).__name__}: {e}", self.url) from None

    def _response(self, call: _BlsCall | _LlmApiCall, body: dict, status: int, final: bool) -> Response:
        if "error" in body:  # also inside a 200 event stream
            raise from_server_message(str(body["error"]), self.url, status)
        response = call.response(body.get, final)
        return replace(response, final=True) if response.finish_reason else response  # events carry no flags

    async def health(self) -> Health:
        from tritonclient.utils import InferenceServerException

        try:
            live = await self._health.is_server_live()
            server_ready = live and await self._health.is_server_ready()
            front = await self.front() if server_ready else MODEL
            model_ready = server_ready and await self._model_ready(front)
        except (InferenceServerException, OSError, asyncio.TimeoutError) as e:
            return Health(self.url, False, False, f"cannot reach the server at {self.url} (HTTP): {e}")
        return Health(self.url, live, model_ready, _not_ready_detail(live, server_ready, model_ready, front))

    async def close(self) -> None:
        await self._session.close()
        await self._health.close()


def address(url: str, protocol: Protocol) -> str:
    """HOST:PORT; a bare HOST gets the server's default port for the protocol (8001 gRPC, 8000 HTTP), not the
    transport libraries' 443 / 80."""
    if "://" in url:
        raise InvalidRequest(f"give the address as HOST:PORT, without a scheme (got {url!r}); TLS is an option")
    has_port = url.rpartition(":")[2].isdigit() and not url.endswith("]")  # [::1] is a host alone
    return url if has_port or protocol not in PORTS else f"{url}:{PORTS[protocol]}"


def open_transport(url: str, protocol: Protocol, tls: TLS | None,
                   templater: Templater | None = None) -> GrpcTransport | HttpTransport:
    if protocol == "grpc":
        return GrpcTransport(url, tls, templater)
    if protocol == "http":
        return HttpTransport(url, tls, templater)
    raise InvalidRequest(f"unknown protocol {protocol!r} (grpc, http)")


class _BlsCall:
    """One request to dflash_bls: the ensemble's tensors, batch dimension [1, n]; text deltas, counts and all."""

    model, types, batched = MODEL, {**FRONT_INPUTS, **BLS_INPUTS}, True

    def __init__(self, request: Request):
        self.fields = request.fields()

    def json(self) -> dict:
        return self.fields

    def response(self, get: Callable[[str], object], final: bool) -> Response:
        entries = get("logprobs")
        return Response(_str(get("text_output")), _str(get(FINISH_REASON)), _stats(get), final,
                        None if entries is None else json.loads(_str(entries)))


class _PreprocessingCall:
    """A render: dflash_bls's request, its front-model inputs only, to the preprocessing model, which takes those."""

    types, batched = FRONT_INPUTS, True

    def __init__(self, call: _BlsCall):
        self.fields = {name: value for name, value in call.fields.items() if name in FRONT_INPUTS}
        self.request_id = RENDER_CALL_PREFIX + uuid.uuid4().hex


class _LlmApiCall:
    """One request to TensorRT-LLM's LLM-API model: its tensors (no batch dimension); its cumulative text turned
    into deltas, its finish reasons into ours; the token counts from the templater, when there is one."""

    model, types, batched = LLMAPI_MODEL, LLMAPI_INPUTS, False

    def __init__(self, request: Request, templater: Templater | None):
        prompt, templated = _llmapi_prompt(request.prompt, templater)
        self.fields = _llmapi_fields(request, prompt)
        self._templater, self._prompt, self._templated = templater, prompt, templated
        self._prompt_tokens = templater.count(prompt, special_tokens=not templated) if templater else 0
        self._text = ""  # all the text so far
        self._stats = SpeculationStats()

    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids as TensorRT-LLM encodes it (the templater's tokenizer: the target's)."""
        return _templater(self._templater, "render").token_ids(self._prompt, special_tokens=not self._templated)

    def json(self) -> dict:  # HTTP generate: one value per input ([1] tensors), lists as they are
        return {name: value[0] if name == "text_input" else value for name, value in self.fields.items()}

    def response(self, get: Callable[[str], object], final: bool) -> Response:
        text = get("text_output")  # absent from an empty final response
        cumulative = self._text if text is None else _str(text)
        if not cumulative.startswith(self._text):
            raise ServerError(f"{LLMAPI_MODEL}'s text_output is not cumulative: {cumulative!r} after {self._text!r}")
        delta, self._text = cumulative[len(self._text):], cumulative
        reason = _llmapi_finish_reason(_str(get(FINISH_REASON)))
        stats = _stats(get)
        if stats != SpeculationStats():  # the statistics come with the text, not in an empty final response
            self._stats = stats
        if self._templater is not None:
            self._stats = replace(self._stats, prompt_tokens=self._prompt_tokens,
                                  completion_tokens=self._templater.count(self._text, special_tokens=False)
                                  if reason or final else self._stats.completion_tokens)
        return Response(delta, reason, self._stats, final)


def _llmapi_prompt(prompt: dict[str, object], templater: Templater | None) -> tuple[str, bool]:
    """(the prompt's text, templated?): the LLM-API model takes raw text only, so the chat template is ours."""
    for name in ("tools", "chat_template_kwargs"):
        if name in prompt:
            raise InvalidRequest(invalid_request(f"{name} is not available with TensorRT-LLM's LLM-API model "
                                                 f"({LLMAPI_MODEL}) yet: its prompts are templated without them"))
    if "messages" in prompt:
        return _templater(templater, "messages").render(prompt["messages"]), True
    text = prompt["text_input"]
    if prompt.get("apply_chat_template"):
        message = json.dumps([{"role": "user", "content": text}], ensure_ascii=False)
        return _templater(templater, "apply_chat_template").render(message), True
    if templater is not None:  # raw text is the user's too: TensorRT-LLM would read its special tokens' text as them
        templater.refuse_special_tokens("text_input", text)
    return text, False


def _templater(templater: Templater | None, name: str) -> Templater:
    if templater is None:
        raise InvalidRequest(invalid_request(
            f"{name}: the server's model ({LLMAPI_MODEL}, TensorRT-LLM's LLM API) takes raw text only, and this "
            "client has no chat template: send raw text (chat=False), or a conversation through the OpenAI "
            "gateway (dflash-gateway --target-dir), which templates it"))
    return templater


def _llmapi_fields(request: Request, prompt: str) -> dict[str, object]:
    p = request.params
    unavailable = {"min_tokens": p.min_tokens or None, "end_id": p.end_id,  # no such LLM-API inputs
                   "speculative_sampling": p.speculative_sampling, TYPE_INPUT: p.guide and p.guide.type,
                   "repetition_penalty": penalties(p).get("repetition_penalty"),
                   "logprobs": p.logprobs, INCLUDE_STOP_STR: p.include_stop_str_in_output or None}
    for name, value in unavailable.items():
        if value is not None:
            raise InvalidRequest(invalid_request(
                f"{name} is not available with TensorRT-LLM's LLM-API model ({LLMAPI_MODEL}): it has no such input"
                + (" (the end-of-sequence ids come from the tokenizer)" if name == "end_id" else "")))
    # clip_max_tokens needs no input: TensorRT-LLM lowers every max_tokens past max_seq_len to what the prompt leaves
    # (executor/base_worker.py, _deduce_max_tokens)
    fields = {"text_input": [prompt], "streaming": request.stream, "sampling_param_max_tokens": p.max_tokens,
              "sampling_param_temperature": p.temperature, "sampling_param_top_k": p.top_k,
              "sampling_param_top_p": p.top_p, "sampling_param_return_perf_metrics": True,
              "return_finish_reason": True}
    if p.seed is not None:
        fields["sampling_param_seed"] = p.seed
    if p.stop:
        fields["sampling_param_stop"] = list(p.stop)
    for name, value in penalties(p).items():  # TensorRT-LLM's SamplingParams fields of the same names
        if name != "repetition_penalty":  # refused above: its model has no such input
            fields[f"sampling_param_{name}"] = value
    return fields


def _llmapi_finish_reason(reason: str) -> str:
    if reason == LLMAPI_TIMEOUT:
        raise RequestTimeout(f"{LLMAPI_MODEL} ended the request: its time limit passed")
    if reason not in LLMAPI_FINISH_REASONS:
        raise ServerError(f"{LLMAPI_MODEL} sent an unknown finish_reason {reason!r}")
    return LLMAPI_FINISH_REASONS[reason]


def _grpc_inputs(call: _BlsCall | _LlmApiCall) -> list:
    from tritonclient.grpc import InferInput
    from tritonclient.utils import triton_to_np_dtype

    inputs = []
    for name, value in call.fields.items():
        data_type = call.types[name]
        values = value if isinstance(value, list) else [value]
        if data_type == "BYTES":
            values = [v.encode("utf-8") for v in values]
        array = np.array([values] if call.batched else values, dtype=triton_to_np_dtype(data_type))
        tensor = InferInput(name, list(array.shape), data_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _grpc_response(call: _BlsCall | _LlmApiCall, result) -> Response:
    def scalar(name):
        value = result.as_numpy(name)
        return None if value is None else value.reshape(-1)[0]

    return call.response(scalar, result.get_response().parameters["triton_final_response"].bool_param)


def _str(value) -> str:
    """A BYTES output's value (bytes over gRPC, str in HTTP's JSON), "" when absent."""
    return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else "" if value is None else str(value)


def _stats(get) -> SpeculationStats:
    """SpeculationStats from get(output name) -> value or None (a flags-only final response has no outputs).
    An FP32 value becomes the shortest decimal of that float32 (2/3 is 0.6666667, not the float64 of the
    float32, 0.6666666865348816)."""
    values = {s: get(s.tensor) for s in STATISTICS}
    return SpeculationStats(**{s.field: float(str(np.float32(value))) if s.data_type == "FP32" else int(value)
                               for s, value in values.items() if value is not None})


def _rpc_error(error, url: str) -> DFlashClientError:
    import grpc

    code, details = error.code(), error.details()
    if code == grpc.StatusCode.UNAVAILABLE:
        return ServerUnavailable(f"cannot reach the server at {url} (gRPC): {details}", url)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeout(f"{url}: {details}", url)
    if code == grpc.StatusCode.CANCELLED:
        return RequestCancelled(f"{url}: {details}", url)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details, url)
    return ServerError(f"{url}: gRPC {code.name}: {details}", url)


def _not_ready_detail(live: bool, server_ready: bool, model_ready: bool, model: str) -> str:
    if not live:
        return "the server is not live"
    if not server_ready:
        return "the server is live but not ready (models loading?)"
    return "" if model_ready else f"the server is ready but model {model!r} is not"
