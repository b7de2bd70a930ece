"""The OpenAI-compatible gateway as a load-benchmark target: the asyncio client's generate(), over HTTP + SSE.

dflash-loadbench measures the gateway beside direct gRPC with the same prompts and the same timings (time to
the first text, every text chunk), so the gateway's overhead is a difference measured in one run. aiohttp (a
dependency of the clients already) rather than the `openai` package, which the client library does not need.
"""
from __future__ import annotations

import asyncio
import json
import time

from dflash_contract.server import GATEWAY_HEALTH_PATH

from .client import wait_until_ready
from .errors import DFlashClientError, InvalidRequest, ServerError, ServerUnavailable
from .params import GenerationParams, Prompt
from .results import Generation, Health, SpeculationStats, TextChunk, Timings


class OpenAIHttpClient:
    """generate() through /v1/chat/completions (or /v1/completions for raw text), streamed; url is HOST:PORT."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float | None = None):
        import aiohttp

        self.url, self.timeout = url, timeout
        self._base = f"http://{url}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0))
        self._model: str | None = None

    async def generate(self, prompt: Prompt, params: GenerationParams, *, chat: bool = True,
                       stream: bool = True) -> Generation:
        import aiohttp

        body = {"model": await self._model_id(), "max_tokens": params.max_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "stream": True, "stream_options": {"include_usage": True},
                **({"seed": params.seed} if params.seed is not None else {}),
                **({"stop": list(params.stop)} if params.stop else {}),
                **({"min_tokens": params.min_tokens} if params.min_tokens else {}),
                **({"ignore_eos": True} if params.end_id == -1 else {}),
                **({"speculative_sampling": params.speculative_sampling} if params.speculative_sampling else {})}
        if chat or not isinstance(prompt, str):
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        else:
            path, body["prompt"] = "/v1/completions", prompt
        start = time.perf_counter()
        chunks, reason, stats, usage = [], None, None, None
        try:
            async with asyncio.timeout(self.timeout), self._session.post(self._base + path, json=body) as reply:
                if reply.status != 200:
                    raise _error(reply.status, await reply.text(), self.url)
                async for line in reply.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise ServerError(event["error"]["message"], self.url)
                    for choice in event["choices"]:
                        text = choice.get("delta", {}).get("content") if chat else choice.get("text")
                        if text:
                            chunks.append(TextChunk(text, time.perf_counter() - start))
                        reason = choice.get("finish_reason") or reason
                    if event.get("dflash"):
                        stats = event["dflash"]
                    if event.get("usage"):
                        usage = event["usage"]
        except aiohttp.ClientError as e:
            raise ServerUnavailable(f"the connection to {self.url} broke: {e}", self.url) from None
        if reason is None or stats is None or usage is None:
            raise ServerError(f"{self.url} ended the stream without a finish reason", self.url)
        total = time.perf_counter() - start
        return Generation("".join(c.text for c in chunks), reason,
                          SpeculationStats(**stats, prompt_tokens=usage["prompt_tokens"],
                                           cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
                                           completion_tokens=usage["completion_tokens"]),
                          Timings(chunks[0].seconds if chunks else total, total, tuple(chunks)))

    async def _model_id(self) -> str:
        if self._model is None:
            async with self._session.get(self._base + "/v1/models") as reply:
                if reply.status != 200:
                    raise _error(reply.status, await reply.text(), self.url)
                self._model = (await reply.json())["data"][0]["id"]
        return self._model

    async def health(self) -> Health:
        import aiohttp

        try:
            async with self._session.get(self._base + GATEWAY_HEALTH_PATH) as reply:
                detail = (await reply.json()).get("detail", "")
                return Health(self.url, True, reply.status == 200, detail)
        except (aiohttp.ClientError, OSError) as e:
            return Health(self.url, False, False, f"cannot reach the gateway at {self.url}: {e}")

    async def wait_ready(self, timeout: float, interval: float = 1.0) -> Health:
        return await wait_until_ready(self.health, self.url, timeout, interval)

    async def close(self) -> None:
        await self._session.close()


def _error(status: int, body: str, url: str) -> DFlashClientError:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body
    if status == 503:
        return ServerUnavailable(message, url)
    return (InvalidRequest if 400 <= status < 500 else ServerError)(f"HTTP {status}: {message}", url)
