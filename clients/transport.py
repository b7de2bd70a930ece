"""The two ways to reach the server's front model: gRPC streaming and HTTP generate / generate_stream.

Both turn one request into an async iterator of `Response`s (one per server response) and every
failure into an exception from `errors`. The front model is decoupled, so gRPC must use the streaming
RPC even for one response, and HTTP must use the generate extension (the plain infer endpoint
refuses decoupled models); tritonclient's HTTP client has no generate call, so aiohttp (which
tritonclient's asyncio HTTP client is built on) posts it. Health checks go through tritonclient.
Each protocol's stack is imported when a transport for it is made: both are heavy (gRPC; aiohttp and
gevent through tritonclient.http), and a service uses one.
"""
from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from typing import AsyncIterator, Literal

import numpy as np

from dflash_contract.protocol import FINISH_REASON, FRONT_INPUTS, STATISTICS

from .errors import (DFlashClientError, InvalidRequest, RequestCancelled, RequestTimeout, ServerError,
                     ServerUnavailable, from_server_message)
from .params import GenerationParams
from .results import Health, SpeculationStats

Protocol = Literal["grpc", "http"]
# dflash_bls: the ensemble's pipeline and tensors, and a cancelled stream frees its slot at once (an
# ensemble would decode on; see model_repository/dflash_bls)
MODEL = "dflash_bls"
HEALTH_TIMEOUT_S = 5.0



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
        if p.seed is not None:
            fields["seed"] = p.seed
        if p.end_id is not None:
            fields["end_id"] = p.end_id
        if p.stop:
            fields["stop_words"] = list(p.stop)
        return fields


@dataclass(frozen=True)
class Response:
    text: str  # the new text when streaming, else the whole text
    finish_reason: str  # "" until the last response
    stats: SpeculationStats
    final: bool  # the server sends nothing more for this request


class GrpcTransport:
    def __init__(self, url: str, tls: TLS | None = None):
        import tritonclient.grpc.aio as grpcclient

        self.url = url
        self._client = grpcclient.InferenceServerClient(url, **(tls.grpc_options() if tls else {}))

    async def responses(self, request: Request) -> AsyncIterator[Response]:
        import grpc

        sent_all = asyncio.Event()

        async def requests():
            yield {"model_name": MODEL, "inputs": _grpc_inputs(request), "enable_empty_final_response": True}
            # Keep our side of the stream open: half-closing it early can end the RPC before the answer.
            await sent_all.wait()

        call = self._client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    raise from_server_message(error.message(), self.url)
                response = _grpc_response(result)
                yield response
                if response.final:
                    return
        except grpc.aio.AioRpcError as e:
            raise _rpc_error(e, self.url) from None
        finally:
            sent_all.set()
            call.cancel()  # no-op after the final response; otherwise tells the server to stop

    async def health(self) -> Health:
        from tritonclient.utils import InferenceServerException

        try:
            live = await self._client.is_server_live(client_timeout=HEALTH_TIMEOUT_S)
            server_ready = live and await self._client.is_server_ready(client_timeout=HEALTH_TIMEOUT_S)
            model_ready = server_ready and await self._client.is_model_ready(MODEL, client_timeout=HEALTH_TIMEOUT_S)
        except InferenceServerException as e:
            return Health(self.url, False, False, f"cannot reach the server at {self.url} (gRPC): {e.message()}")
        return Health(self.url, live, model_ready, _not_ready_detail(live, server_ready, model_ready))

    async def close(self) -> None:
        await self._client.close()


class HttpTransport:
    def __init__(self, url: str, tls: TLS | None = None):
        import aiohttp
        import tritonclient.http.aio as httpclient

        self.url = url
        context = tls.ssl_context() if tls else None
        self._base = f"{'https' if tls else 'http'}://{url}/v2/models/{MODEL}"
        # limit=0: as many connections as requests in flight (a benchmark may hold hundreds).
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ssl=context or True))
        self._health = httpclient.InferenceServerClient(url, conn_timeout=HEALTH_TIMEOUT_S, ssl=tls is not None,
                                                        ssl_context=context)

    async def responses(self, request: Request) -> AsyncIterator[Response]:
        import aiohttp

        endpoint = "generate_stream" if request.stream else "generate"
        try:
            async with self._session.post(f"{self._base}/{endpoint}", json=request.fields()) as reply:
                if reply.content_type != "text/event-stream":  # one JSON body: the answer or an error
                    yield self._response(await reply.json(content_type=None), reply.status, final=True)
                    return
                async for line in reply.content:  # server-sent events: "data: {...}" lines
                    if line.startswith(b"data:"):
                        body = json.loads(line[5:])
                        response = self._response(body, reply.status, final=bool(body.get(FINISH_REASON)))
                        yield response
                        if response.final:
                            return
        except aiohttp.ClientConnectorError as e:
            raise ServerUnavailable(f"cannot reach the server at {self.url} (HTTP): {e.os_error}", self.url) from None
        except (aiohttp.ClientError, json.JSONDecodeError) as e:
            raise ServerUnavailable(f"the connection to {self.url} broke: {type(e).__name__}: {e}", self.url) from None

    def _response(self, body: dict, status: int, final: bool) -> Response:
        if "error" in body:  # also inside a 200 event stream
            raise from_server_message(str(body["error"]), self.url, status)
        return Response(body.get("text_output", ""), body.get(FINISH_REASON) or "", _stats(body.get), final)

    async def health(self) -> Health:
        from tritonclient.utils import InferenceServerException

        try:
            live = await self._health.is_server_live()
            server_ready = live and await self._health.is_server_ready()
            model_ready = server_ready and await self._health.is_model_ready(MODEL)
        except (InferenceServerException, OSError, asyncio.TimeoutError) as e:
            return Health(self.url, False, False, f"cannot reach the server at {self.url} (HTTP): {e}")
        return Health(self.url, live, model_ready, _not_ready_detail(live, server_ready, model_ready))

    async def close(self) -> None:
        await self._session.close()
        await self._health.close()


def open_transport(url: str, protocol: Protocol, tls: TLS | None) -> GrpcTransport | HttpTransport:
    if "://" in url:
        raise InvalidRequest(f"give the address as HOST:PORT, without a scheme (got {url!r}); TLS is an option")
    if protocol == "grpc":
        return GrpcTransport(url, tls)
    if protocol == "http":
        return HttpTransport(url, tls)
    raise InvalidRequest(f"unknown protocol {protocol!r} (grpc, http)")


def _grpc_inputs(request: Request) -> list:
    from tritonclient.grpc import InferInput
    from tritonclient.utils import triton_to_np_dtype

    inputs = []
    for name, value in request.fields().items():
        data_type = FRONT_INPUTS[name]
        values = value if isinstance(value, list) else [value]
        if data_type == "BYTES":
            values = [v.encode("utf-8") for v in values]
        array = np.array([values], dtype=triton_to_np_dtype(data_type))  # [1, n]: the batch dimension
        tensor = InferInput(name, list(array.shape), data_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _grpc_response(result) -> Response:
    def scalar(name):
        value = result.as_numpy(name)
        return None if value is None else value.reshape(-1)[0]

    text, reason = scalar("text_output"), scalar(FINISH_REASON)
    final = result.get_response().parameters["triton_final_response"].bool_param
    return Response((text or b"").decode("utf-8"), (reason or b"").decode("utf-8"), _stats(scalar), final)


def _stats(get) -> SpeculationStats:
    """SpeculationStats from get(output name) -> value or None (a flags-only final response has no outputs)."""
    values = {s: get(s.tensor) for s in STATISTICS}
    return SpeculationStats(**{s.field: (float if s.data_type == "FP32" else int)(value)
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


def _not_ready_detail(live: bool, server_ready: bool, model_ready: bool) -> str:
    if not live:
        return "the server is not live"
    if not server_ready:
        return "the server is live but not ready (models loading?)"
    return "" if model_ready else f"the server is ready but model {MODEL!r} is not"
