"""The OpenAI-compatible HTTP server: FastAPI routes over one gRPC connection to the front model.

Each request becomes one streaming gRPC request (clients.transport, the clients' own code), whether or not the
client asked for a stream: a response per engine step is where a client that went away is noticed, and the
gRPC call is then cancelled, which frees the sequence's KV-cache slot at the engine's next step. A refusal
that comes before any text (a malformed conversation, a full server) is an HTTP error status; a failure
after it is an `error` event, then `[DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response as HTTPResponse, StreamingResponse
from starlette.exceptions import HTTPException

from clients.errors import (DFlashClientError, IncompleteResponse, InvalidRequest, RequestCancelled,
                            ServerUnavailable)
from clients.params import GenerationParams
from clients.transport import GrpcTransport, Response
from dflash_contract.engine_counts import EngineCounts, engine_counts
from dflash_contract.protocol import LIMITS, clipped_max_tokens, context_error, invalid_request
from dflash_contract.server import GATEWAY_HEALTH_PATH, GATEWAY_METRICS_PATH

from . import answers, api
from .chat_template import ChatTemplate
from .metrics import (CHAT_PATH, CHAT_RENDER_PATH, COMPLETIONS_PATH, COMPLETIONS_RENDER_PATH, CONTENT_TYPE, FirstText,
                      GatewayMetrics, MetricsMiddleware)
from .protocol_metrics import protocol_metrics
from .reasoning import StreamSplitter

DISCONNECT_CHECK_SECONDS = 0.25  # how often a non-streamed request looks for its client
RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class Settings:
    triton_url: str  # HOST:PORT of tritonserver's gRPC endpoint
    model_id: str  # what /v1/models lists and requests name
    api_key: str | None = None  # None: no authentication
    default_max_tokens: int = 512  # for a chat request without max_completion_tokens / max_tokens
    # 4 x the prompt's limit (protocol.LIMITS.prompt_bytes, which api refuses with 400 naming it): a prompt at
    # that limit fits however JSON escapes it (\uXXXX: 2x a CJK character's UTF-8 bytes, 3x an emoji's), with the
    # rest of the body; a larger body is refused unread (413)
    max_body_bytes: int = 4 * LIMITS.prompt_bytes
    # the build's target checkpoint: its chat template and tokenizer, for a front model that takes raw text only
    # (a --runtime trtllm build's tensorrt_llm); None: conversations go to the server, which templates them
    target_dir: str | None = None
    reasoning_parser: str | None = None  # REASONING_PARSERS: the build's; None: answers are all content


def create_app(settings: Settings) -> FastAPI:
    transport: dict[str, GrpcTransport] = {}  # made on the server's event loop, at start-up
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_):
        templater = ChatTemplate.from_target_dir(settings.target_dir) if settings.target_dir else None
        transport["grpc"] = GrpcTransport(settings.triton_url, templater=templater)
        yield
        await transport["grpc"].close()

    app = FastAPI(title="DFlash OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    metrics, counts = GatewayMetrics(settings.model_id), engine_counts()
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    _answer_errors_as_openai(app)

    @app.get(GATEWAY_HEALTH_PATH)
    async def health():  # no API key: probes send none
        state = await transport["grpc"].health()
        return JSONResponse({"ready": state.ready, "detail": state.detail}, status_code=200 if state.ready else 503)

    @app.get(GATEWAY_METRICS_PATH)
    async def prometheus_metrics():  # no API key: Prometheus (and a router's endpoint picker) send none
        protocol = protocol_metrics(counts.read() if counts else None, settings.model_id)
        return HTTPResponse(metrics.render() + protocol, media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        _authorize(request, settings.api_key)
        return {"object": "list", "data": [_model(settings.model_id, started)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        _authorize(request, settings.api_key)
        if model_id != settings.model_id:
            raise api.APIError(404, f"The model {model_id!r} does not exist", param="model", code="model_not_found")
        return _model(settings.model_id, started)

    @app.post(CHAT_PATH)
    async def chat(request: Request):
        started = time.monotonic()
        _authorize(request, settings.api_key)
        t = _translated(settings, await _json_body(request, settings.max_body_bytes), chat=True)
        return await _answer(request, transport["grpc"], t, settings.model_id, chat=True,
                             first_text=FirstText(metrics, CHAT_PATH, started))

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request):
        started = time.monotonic()
        _authorize(request, settings.api_key)
        t = _translated(settings, await _json_body(request, settings.max_body_bytes), chat=False)
        return await _answer(request, transport["grpc"], t, settings.model_id, chat=False,
                             first_text=FirstText(metrics, COMPLETIONS_PATH, started))

    _add_render_endpoints(app, settings, transport, counts)
    return app


def _translated(settings: Settings, body: object, chat: bool) -> api.Translated:
    """A chat or completion request's body, checked and translated with this server's settings."""
    if chat:
        return api.chat_request(body, settings.model_id, settings.default_max_tokens, settings.reasoning_parser)
    return api.completion_request(body, settings.model_id)


def _add_render_endpoints(app: FastAPI, settings: Settings, transport: dict[str, GrpcTransport],
                          counts: EngineCounts | None) -> None:
    """vLLM's render endpoints: the prompt token ids a request would be decoded from, so that a router computes the
    prefix-cache blocks a replica holds without a tokenizer of its own. A request is checked as it would be to
    generate, by the gateway, by the server's preprocessing, which tokenizes it, and against the engine's context
    (its counts: none for a gateway that dflash-serve did not start); nothing is decoded."""
    async def render(request: Request, chat: bool):
        _authorize(request, settings.api_key)
        t = _translated(settings, await _json_body(request, settings.max_body_bytes), chat)
        try:
            token_ids = await transport["grpc"].prompt_token_ids(t.request)
        except DFlashClientError as e:
            raise _api_error(e) from None
        engine = counts.read() if counts else None
        if engine is not None:
            _check_context(len(token_ids), t.request.params, engine.max_context)
        return answers.rendered(t, settings.model_id, token_ids, chat)

    @app.post(CHAT_RENDER_PATH)
    async def chat_render(request: Request):
        return await render(request, chat=True)

    @app.post(COMPLETIONS_RENDER_PATH)
    async def completions_render(request: Request):
        return await render(request, chat=False)


def _check_context(prompt_tokens: int, params: GenerationParams, limit: int) -> None:
    """The engine's refusal of a prompt and max_tokens over its context, as generate answers it."""
    max_tokens = params.max_tokens
    if params.clip_max_tokens:  # as the dflash model lowers it (dflash_serving.requests)
        max_tokens = clipped_max_tokens(max_tokens, prompt_tokens, limit)
    detail = context_error(prompt_tokens, max_tokens, limit)
    if detail:
        raise api.invalid(invalid_request(detail), api.param_of(invalid_request(detail)))


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error in OpenAI's shape: ours, FastAPI's (unknown paths, wrong methods), and any other as a 500."""
    @app.exception_handler(api.APIError)
    async def api_error(_, e: api.APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return JSONResponse(api.APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        return JSONResponse(api.APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)


def _model(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "dflash"}


def _authorize(request: Request, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise api.APIError(401, "Incorrect API key provided" if given else "Missing API key: send "
                           "'Authorization: Bearer <key>'", code="invalid_api_key")


async def _json_body(request: Request, limit: int) -> object:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _too_large(limit)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise api.invalid(f"the request body is not valid JSON ({e})") from None


def _too_large(limit: int) -> api.APIError:
    return api.APIError(413, f"the request body is larger than this server's limit of {limit} bytes")


def _api_error(e: DFlashClientError) -> api.APIError:
    """The HTTP error for a failure the front model reported (or the connection to it)."""
    message = str(e)
    if isinstance(e, InvalidRequest):
        return api.invalid(message, api.param_of(message))
    if isinstance(e, (ServerUnavailable, RequestCancelled)):
        return api.APIError(503, message, code="service_unavailable",
                            headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return api.APIError(500, message)


async def _answer(request: Request, transport: GrpcTransport, t: api.Translated, model_id: str, chat: bool,
                  first_text: Callable[[], None]):
    """One JSON response, or a stream of events (first_text() is called after each event with text)."""
    streams = await _open(transport, t)
    if t.stream:
        return StreamingResponse(_events(t, model_id, chat, streams, first_text),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect_all():
        return await asyncio.gather(*(_collect(first, responses) for first, responses in streams))

    collecting = asyncio.create_task(collect_all())
    while not collecting.done():  # a client that went away cancels its requests (and frees their slots)
        await asyncio.wait({collecting}, timeout=DISCONNECT_CHECK_SECONDS)
        if not collecting.done() and await request.is_disconnected():
            collecting.cancel()
    try:
        results = collecting.result()
    except asyncio.CancelledError:
        raise api.APIError(499, "the client closed the connection") from None
    except DFlashClientError as e:
        raise _api_error(e) from None
    build = answers.chat_response if chat else answers.completion_response
    return build(t, model_id, [(text, last.finish_reason, last.stats, entries) for text, last, entries in results])


async def _open(transport: GrpcTransport, t: api.Translated) -> list[tuple[Response, AsyncIterator[Response]]]:
    """(first response, the rest) of each choice's request. A refusal comes first, before any text: an HTTP status.
    The other choices start once choice 0 has answered: its prompt is in the prefix cache by then, so they find it
    there instead of prefilling it again."""
    requests = t.choice_requests()
    opened = [await _first(transport, requests[0])]
    others = await asyncio.gather(*(_first(transport, r) for r in requests[1:]), return_exceptions=True)
    opened += [o for o in others if not isinstance(o, BaseException)]
    failed = [o for o in others if isinstance(o, BaseException)]
    if failed:
        for _, responses in opened:
            await responses.aclose()
        raise failed[0]
    return opened


async def _first(transport: GrpcTransport, request) -> tuple[Response, AsyncIterator[Response]]:
    responses = transport.responses(request)
    try:
        first = await anext(responses, None)
    except DFlashClientError as e:
        await responses.aclose()
        raise _api_error(e) from None
    if first is None:
        await responses.aclose()
        raise api.APIError(500, "the server ended the request without an answer")
    return first, responses


async def _collect(first: Response, responses: AsyncIterator[Response]) -> tuple[str, Response, list]:
    """(the whole text, the last response, every token's logprobs entries) of one choice."""
    texts, entries, response = [first.text], list(first.logprobs or []), first
    async with contextlib.aclosing(responses):
        while not _finished(response):
            response = await _next(responses)
            texts.append(response.text)
            entries += response.logprobs or []
    return "".join(texts), response, entries


def _finished(response: Response) -> bool:
    """Whether this is the request's last response; an error if the request did not complete."""
    if response.finish_reason == "cancelled":
        raise RequestCancelled("the server cancelled the request")
    if response.final and not response.finish_reason:
        raise IncompleteResponse("the server ended the request without a finish reason")
    return bool(response.finish_reason)


async def _next(responses: AsyncIterator[Response]) -> Response:
    try:
        return await anext(responses)
    except StopAsyncIteration:
        raise IncompleteResponse("the stream from the server ended before its final response") from None
    except ServerUnavailable as e:  # the connection broke midway: the answer is incomplete, not retryable
        raise IncompleteResponse(f"the connection to the server broke before the final response ({e})") from None


async def _events(t: api.Translated, model_id: str, chat: bool, streams: list[tuple[Response, AsyncIterator]],
                  first_text: Callable[[], None]) -> AsyncIterator[str]:
    """Server-sent events: per choice the role, the text deltas, the one chunk with finish_reason; the usage chunk
    if asked for (all choices together), then [DONE]; a failure midway is an error event before [DONE]. Several
    choices' chunks interleave as they come. Cancelled (the client went away): the gRPC requests are cancelled on
    the way out."""
    lasts: dict[int, Response] = {}
    chunks = [_choice_chunks(t, model_id, chat, i, first, responses, lasts)
              for i, (first, responses) in enumerate(streams)]
    try:
        async for body, has_text in _merged(chunks):
            yield _event(body)
            if has_text:
                first_text()
        if t.include_usage:
            stats = answers.combined([lasts[i].stats for i in range(len(streams))])
            yield _event((answers.chat_chunk if chat else answers.completion_chunk)(t, model_id, None, stats=stats))
    except DFlashClientError as e:
        yield _event(_api_error(e).body())
    yield "data: [DONE]\n\n"


async def _merged(generators: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async generators as they come (one: as it is); each closed on the way out."""
    if len(generators) == 1:
        async with contextlib.aclosing(generators[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(generator):
        try:
            async with contextlib.aclosing(generator):
                async for item in generator:
                    await queue.put(item)
            await queue.put(done)
        except Exception as e:  # the reader raises it
            await queue.put(e)

    tasks = [asyncio.create_task(pump(g)) for g in generators]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _choice_chunks(t: api.Translated, model_id: str, chat: bool, index: int, first: Response,
                         responses: AsyncIterator[Response], lasts: dict) -> AsyncIterator[tuple[dict, bool]]:
    """(chunk, has text?) of one choice: its role chunk, text deltas and finish chunk; its last response in
    lasts[index]."""
    def chunk(text: str, reason: str | None = None, stats=None, entries=None) -> dict:
        if not chat:
            return answers.completion_chunk(t, model_id, text, reason, stats, index, entries)
        delta = {"content": text} if text or reason is None else {}  # the finish chunk's is empty without text
        return answers.chat_chunk(t, model_id, delta, reason, stats, index, entries)

    held = chat and t.tools is not None and t.tools.parses  # the whole answer is needed to find its tool calls
    thoughts = StreamSplitter() if chat and t.reasoning and not held else None
    texts, entries = [], []  # entries: logprobs of tokens whose text has not gone out yet
    async with contextlib.aclosing(responses):
        if chat:
            yield answers.chat_chunk(t, model_id, {"role": "assistant", "content": ""}, index=index), False
        response = first
        while not _finished(response):
            entries += response.logprobs or []
            if response.text and held:
                texts.append(response.text)
            elif response.text and thoughts is not None:
                thought, text = thoughts.feed(response.text)
                if thought:
                    yield answers.chat_chunk(t, model_id, {"reasoning_content": thought}, index=index), True
                if text:
                    yield chunk(text), True
            elif response.text:
                yield chunk(response.text, entries=entries), True
                entries = []
            response = await _next(responses)
        lasts[index] = response
        if held:
            for body in _tool_chunks(t, model_id, "".join(texts) + response.text, response, index):
                yield body, True
        elif thoughts is not None:
            thought, text = thoughts.feed(response.text, final=True)
            if thought:
                yield answers.chat_chunk(t, model_id, {"reasoning_content": thought}, index=index), True
            yield chunk(text, response.finish_reason, response.stats), bool(text)
        else:
            yield chunk(response.text, response.finish_reason, response.stats, entries + (response.logprobs or [])), \
                bool(response.text)


def _tool_chunks(t: api.Translated, model_id: str, text: str, last: Response, index: int) -> list[dict]:
    """The end of a held stream: its content, its tool calls (one delta, each call whole, as OpenAI's chunks carry
    them: index, id, type, function name and arguments), then the finish chunk."""
    message, reason = answers.chat_message(t, text, last.finish_reason)
    chunks = [answers.chat_chunk(t, model_id, {name: message[name]}, index=index)
              for name in ("reasoning_content", "content") if message.get(name)]
    if "tool_calls" in message:
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        chunks.append(answers.chat_chunk(t, model_id, {"tool_calls": calls}, index=index))
    chunks.append(answers.chat_chunk(t, model_id, {}, reason, last.stats, index))
    return chunks


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
