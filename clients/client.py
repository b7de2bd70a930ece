"""The asyncio client: one request = one stream of server responses, retried while nothing has arrived.

`AsyncDFlashClient` is the core; `DFlashClient` (clients/sync.py) runs it on a private event loop,
so both have the same retries, timeouts and completeness checks.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from .errors import IncompleteResponse, RequestCancelled, RequestTimeout, ServerUnavailable
from .params import GenerationParams, Prompt, prompt_inputs
from .results import Generation, Health, TextChunk, Timings
from .transport import TLS, Protocol, Request, Response, Templater, address, open_transport

log = logging.getLogger("clients")


@dataclass(frozen=True)
class RetryPolicy:
    """Retries on ServerUnavailable only (unreachable, at capacity, shutting down), and only before the
    first response: after that, a retry could repeat text the caller has already seen."""

    attempts: int = 3  # tries in all; 1 = no retry
    backoff: float = 0.25  # seconds before the first retry, then times `multiplier` up to `max_backoff`
    multiplier: float = 2.0
    max_backoff: float = 4.0

    def __post_init__(self):
        if self.attempts < 1 or self.backoff < 0 or self.multiplier < 1 or self.max_backoff < 0:
            raise ValueError(f"invalid retry policy {self}: attempts >= 1, backoffs >= 0, multiplier >= 1")

    def delay(self, retry: int) -> float:
        """Seconds before retry number `retry` (1-based); jittered so that rejected clients spread out."""
        ceiling = min(self.max_backoff, self.backoff * self.multiplier ** (retry - 1))
        return random.uniform(ceiling / 2, ceiling)


class AsyncDFlashClient:
    """Generate text with a DFlash Triton server (its `dflash_bls` model, or a trtllm build's `tensorrt_llm`).

    url: HOST:PORT of the server's gRPC (default) or HTTP endpoint. timeout: the default per-request
    limit in seconds (None = none), for the whole request including retries. templater: the target's chat
    template and tokenizer (gateway.chat_template.ChatTemplate) for a `--runtime trtllm` server, whose model
    takes raw text only; without one, only raw text (chat=False) goes to such a server.
    """

    def __init__(self, url: str, protocol: Protocol = "grpc", *, tls: TLS | None = None,
                 retry: RetryPolicy = RetryPolicy(), timeout: float | None = None, templater: Templater | None = None):
        self.url, self.protocol, self.retry, self.timeout = address(url, protocol), protocol, retry, timeout
        self._transport = open_transport(self.url, protocol, tls, templater)

    def stream(self, prompt: Prompt, params: GenerationParams | None = None, *, chat: bool = True,
               timeout: float | None = None) -> AsyncTextStream:
        """Text deltas as the server accepts them: `async with client.stream(...) as s: async for delta in s`.

        chat: a str prompt is wrapped as a user message in the model's chat template (False: raw text).
        """
        return AsyncTextStream(self, _request(prompt, params, chat, stream=True), self._timeout(timeout))

    async def generate(self, prompt: Prompt, params: GenerationParams | None = None, *, chat: bool = True,
                       stream: bool = False, timeout: float | None = None) -> Generation:
        """The whole answer. stream=True receives it in deltas (for a real time to first token)."""
        async with AsyncTextStream(self, _request(prompt, params, chat, stream), self._timeout(timeout)) as s:
            async for _ in s:
                pass
        return s.result

    async def health(self) -> Health:
        return await self._transport.health()

    async def ready(self) -> bool:
        return (await self.health()).ready

    async def wait_ready(self, timeout: float, interval: float = 1.0) -> Health:
        """Poll until the server and the model are ready; ServerUnavailable (with the reason) after `timeout` s."""
        return await wait_until_ready(self.health, self.url, timeout, interval)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncDFlashClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


async def wait_until_ready(health: Callable[[], Awaitable[Health]], url: str, timeout: float,
                           interval: float = 1.0) -> Health:
    """Poll `health` until it says ready; ServerUnavailable (with the reason) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (state := await health()).ready:
        if time.monotonic() + interval > deadline:
            raise ServerUnavailable(f"{url} not ready after {timeout:g} s: {state.detail}", url)
        await asyncio.sleep(interval)
    return state


class AsyncTextStream:
    """One request's text deltas (an async iterator); `result` holds the Generation once it completed.

    Raises instead of ending quietly when the server's final response never came, so a truncated text
    is never mistaken for a complete one. Cancel with `aclose()` or by cancelling the awaiting task.
    """

    def __init__(self, client: AsyncDFlashClient, request: Request, timeout: float | None):
        self._client, self._request, self._timeout = client, request, timeout
        self._deltas = self._run()
        self._deadline: float | None = None
        self._result: Generation | None = None

    @property
    def result(self) -> Generation:
        if self._result is None:
            raise RuntimeError("the stream has not completed: iterate it to the end first")
        return self._result

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        loop = asyncio.get_running_loop()
        if self._deadline is None:  # the clock starts when the request is sent
            self._deadline = loop.time() + self._timeout if self._timeout is not None else None
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._deltas.__anext__()
        except TimeoutError:
            # closing the stream cancels the request on the server, which frees its slot: a client that gives up
            # must not leave it decoding to the end
            await self.aclose()
            raise RequestTimeout(f"no complete answer from {self._client.url} within {self._timeout:g} s",
                                 self._client.url) from None

    async def aclose(self) -> None:
        await self._deltas.aclose()

    async def __aenter__(self) -> AsyncTextStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _run(self) -> AsyncIterator[str]:
        url = self._client.url
        start = time.perf_counter()
        responses, attempts = await self._open()
        chunks: list[TextChunk] = []
        logprobs: list[dict] = []
        try:
            while True:
                try:
                    response = await responses.__anext__()
                except StopAsyncIteration:
                    raise IncompleteResponse(f"the server at {url} closed the stream before the final response",
                                             url, _joined(chunks)) from None
                except ServerUnavailable as e:  # the connection broke mid-way: never retried, never "complete"
                    raise IncompleteResponse(f"the connection to {url} broke before the final response ({e})",
                                             url, _joined(chunks)) from None
                logprobs += response.logprobs or []
                if response.text:
                    chunks.append(TextChunk(response.text, time.perf_counter() - start))
                    yield response.text
                if response.finish_reason or response.final:
                    break
        finally:
            await responses.aclose()
        total = time.perf_counter() - start
        if response.finish_reason == "cancelled":
            raise RequestCancelled(f"the server at {url} cancelled the request", url)
        if not response.finish_reason:
            raise IncompleteResponse(f"the server at {url} ended the request without a finish reason",
                                     url, _joined(chunks))
        timings = Timings(chunks[0].seconds if chunks else total, total, tuple(chunks))
        self._result = Generation(_joined(chunks), response.finish_reason, response.stats, timings, attempts,
                                  tuple(logprobs))

    async def _open(self) -> tuple[AsyncIterator[Response], int]:
        """The response iterator with its first response waiting in front, and how many tries it took."""
        retry, loop = self._client.retry, asyncio.get_running_loop()
        attempt = 0
        while True:
            attempt += 1
            responses = self._client._transport.responses(self._request)
            try:
                first = await responses.__anext__()
            except StopAsyncIteration:
                raise IncompleteResponse(f"the server at {self._client.url} sent no response",
                                         self._client.url) from None
            except ServerUnavailable as e:
                await responses.aclose()
                delay = retry.delay(attempt)
                out_of_time = self._deadline is not None and loop.time() + delay >= self._deadline
                if attempt >= retry.attempts or out_of_time:
                    raise ServerUnavailable(f"{e} (tried {attempt} time{'s' * (attempt > 1)})", e.url) from None
                log.warning("%s; retry %d of %d in %.2f s", e, attempt, retry.attempts - 1, delay)
                await asyncio.sleep(delay)
                continue
            return _prepend(first, responses), attempt


async def _prepend(first: Response, rest: AsyncIterator[Response]) -> AsyncIterator[Response]:
    try:
        yield first
        async for response in rest:
            yield response
    finally:
        await rest.aclose()  # cancels the server request when the caller stops early


def _request(prompt: Prompt, params: GenerationParams | None, chat: bool, stream: bool) -> Request:
    return Request(prompt_inputs(prompt, chat), params or GenerationParams(), stream)


def _joined(chunks: list[TextChunk]) -> str:
    return "".join(c.text for c in chunks)
