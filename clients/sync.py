"""The blocking client: AsyncDFlashClient on a private event-loop thread.

One loop thread per client multiplexes every request on one connection, so a single DFlashClient
can be shared by many threads (tritonclient's blocking gRPC client allows one stream per client).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Coroutine, Iterator, TypeVar

from .client import AsyncDFlashClient, AsyncTextStream, RetryPolicy
from .errors import RequestCancelled
from .params import GenerationParams, Prompt
from .results import Generation, Health
from .transport import TLS, Protocol

T = TypeVar("T")


class DFlashClient:
    """Blocking twin of AsyncDFlashClient (same arguments, same methods). Thread-safe."""

    def __init__(self, url: str, protocol: Protocol = "grpc", *, tls: TLS | None = None,
                 retry: RetryPolicy = RetryPolicy(), timeout: float | None = None):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"dflash-client {url}", daemon=True)
        self._thread.start()

        async def connect() -> AsyncDFlashClient:  # channels bind to the loop they are made on
            return AsyncDFlashClient(url, protocol, tls=tls, retry=retry, timeout=timeout)

        try:
            self._client = self._run(connect())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def url(self) -> str:
        return self._client.url

    def generate(self, prompt: Prompt, params: GenerationParams | None = None, *, chat: bool = True,
                 stream: bool = False, timeout: float | None = None) -> Generation:
        return self._run(self._client.generate(prompt, params, chat=chat, stream=stream, timeout=timeout))

    def stream(self, prompt: Prompt, params: GenerationParams | None = None, *, chat: bool = True,
               timeout: float | None = None) -> TextStream:
        """Text deltas as they arrive: `with client.stream(...) as s: for delta in s: ...`; `s.cancel()` stops it."""
        return TextStream(self, self._client.stream(prompt, params, chat=chat, timeout=timeout))

    def health(self) -> Health:
        return self._run(self._client.health())

    def ready(self) -> bool:
        return self.health().ready

    def wait_ready(self, timeout: float, interval: float = 1.0) -> Health:
        return self._run(self._client.wait_ready(timeout, interval))

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._stop_loop()

    def __enter__(self) -> DFlashClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, coroutine: Coroutine[object, object, T]) -> T:
        """Run a coroutine on the client's loop and wait; Ctrl-C (or any exception here) cancels it."""
        return _wait(self._submit(coroutine))

    def _submit(self, coroutine: Coroutine[object, object, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class TextStream:
    """Blocking iterator over one request's text deltas; `result` once it completed. See AsyncTextStream."""

    def __init__(self, client: DFlashClient, stream: AsyncTextStream):
        self._client, self._stream = client, stream
        self._lock = threading.Lock()  # orders cancel() against the step in flight
        self._step: concurrent.futures.Future[str] | None = None
        self._cancelled = False

    @property
    def result(self) -> Generation:
        return self._stream.result

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        with self._lock:
            if self._cancelled:
                raise RequestCancelled("cancelled by the caller", self._client.url)
            self._step = step = self._client._submit(self._stream.__anext__())
        try:
            return _wait(step)
        except StopAsyncIteration:
            raise StopIteration from None
        except concurrent.futures.CancelledError:
            raise RequestCancelled("cancelled by the caller", self._client.url) from None

    def cancel(self) -> None:
        """Stop the request, from any thread: the iteration raises RequestCancelled."""
        with self._lock:
            self._cancelled = True
            if self._step is not None:
                self._step.cancel()
        self.close()

    def close(self) -> None:
        """Release the request (cancels it on the server if it has not completed)."""
        self._client._submit(_quietly(self._stream.aclose()))

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait(future: concurrent.futures.Future[T]) -> T:
    try:
        return future.result()
    except BaseException:
        future.cancel()  # KeyboardInterrupt in the waiting thread: stop the request too (no-op when done)
        raise


async def _quietly(coroutine: Coroutine) -> None:
    # aclose() while a cancelled step is still unwinding raises "already running": that step closes it.
    try:
        await coroutine
    except RuntimeError:
        pass
