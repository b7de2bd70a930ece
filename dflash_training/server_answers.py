"""The target's answers from an OpenAI-compatible server, for dflash-drafter-data --server.

Any server with /v1/chat/completions serves: ours (dflash-serve's gateway), trtllm-serve, vLLM, SGLang. Each
prompt goes as one user message, non-streamed, with OpenAI's standard fields only (model, messages, max_tokens,
temperature, and seed when sampling), a bounded number in flight; 429, 502, 503 and 504 and a broken connection
are retried with exponential backoff (never sooner than the server's Retry-After), anything else ends the run
with the server's message (the answers written so far stay: the next run resumes after them).

The server answers text, so the answer's token ids are the target tokenizer's encoding of that text, plus the
target's first end-of-sequence id when the answer stopped on its own. They can differ from the ids the server
sampled where the model sampled a split of the text that its tokenizer would not make (BPE encodes a text one
way; a model may emit "hel" + "lo"), and where the server dropped special tokens from the text; the records
keep the server's own count (server_completion_tokens) so that a difference shows.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random
from dataclasses import dataclass
from typing import Iterator

from dflash_runtime.config import DFlashError

RETRIED_STATUSES = (429, 502, 503, 504)  # overload and a restarting server: worth waiting for
MAX_BACKOFF_SECONDS = 30.0


@dataclass(frozen=True)
class Server:
    url: str  # the API's base URL as the openai client takes it: http://host:9000/v1
    model: str | None  # None: the first id in /models
    api_key: str | None
    concurrency: int  # requests in flight at most
    retries: int  # per request, after the first try
    timeout: float  # seconds per request


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str  # OpenAI's: "stop" (an end of sequence) or "length"
    prompt_tokens: int | None  # usage, as the server counted
    completion_tokens: int | None


async def ask(session, server: Server, model: str, text: str, max_tokens: int, temperature: float,
              seed: int | None) -> Answer:
    """One chat completion, retried while the server is busy or restarting."""
    import aiohttp

    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": temperature, **({"seed": seed} if seed is not None else {})}
    for attempt in itertools.count():  # the last try returns or raises
        last = attempt == server.retries
        try:
            async with session.post(f"{server.url}/chat/completions", json=body) as reply:
                if reply.status == 200:
                    return parse_answer(await reply.json(), server.url)
                detail = error_message(await reply.text())
                if reply.status not in RETRIED_STATUSES or last:
                    raise DFlashError(f"{server.url} answered HTTP {reply.status}: {detail}")
                delay = retry_after(reply.headers.get("Retry-After"), attempt)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            if last:
                raise DFlashError(f"{server.url}: no answer after {server.retries + 1} tries ({e or type(e).__name__})")
            delay = retry_after(None, attempt)
        await asyncio.sleep(delay)


def retry_after(header: str | None, attempt: int) -> float:
    """Exponential backoff from half a second, at least the server's Retry-After (seconds) when it sent one, with
    jitter: requests refused together do not all come back together."""
    backoff = 0.5 * 2 ** attempt
    try:
        backoff = max(backoff, float(header))
    except (TypeError, ValueError):
        pass
    return min(MAX_BACKOFF_SECONDS, backoff) * random.uniform(1.0, 1.5)


def error_message(body: str) -> str:
    """OpenAI's {"error": {"message"}} if the body is that, else the body (cut short)."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:300]


def parse_answer(payload: dict, url: str) -> Answer:
    try:
        choice, usage = payload["choices"][0], payload.get("usage") or {}
        text, reason = choice["message"]["content"] or "", choice["finish_reason"]
    except (KeyError, IndexError, TypeError):
        raise DFlashError(f"{url} answered something that is not a chat completion: {str(payload)[:300]}") from None
    if reason not in ("stop", "length"):
        raise DFlashError(f"{url} ended an answer with finish_reason {reason!r}: only 'stop' and 'length' are "
                          "the target's own answers")
    return Answer(text, reason, usage.get("prompt_tokens"), usage.get("completion_tokens"))


async def served_model(session, server: Server) -> str:
    """--model, or the first model the server lists."""
    if server.model:
        return server.model
    async with session.get(f"{server.url}/models") as reply:
        if reply.status != 200:
            hint = "" if server.url.rstrip("/").endswith("/v1") else " (the URL is the API's base, ending in /v1)"
            raise DFlashError(f"{server.url}/models answered HTTP {reply.status}{hint}: "
                              f"{error_message(await reply.text())}")
        models = (await reply.json()).get("data") or []
    if not models:
        raise DFlashError(f"{server.url} serves no model")
    return models[0]["id"]


async def answers(server: Server, prompts: Iterator[tuple[object, str, int | None]], max_tokens: int,
                  temperature: float):
    """(item, Answer) as each finishes, for (item, text, seed) from prompts, drawn as room frees up."""
    import aiohttp

    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    timeout = aiohttp.ClientTimeout(total=server.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=server.concurrency)) as session:
        try:
            model = await served_model(session, server)
        except aiohttp.ClientError as e:
            raise DFlashError(f"cannot reach {server.url}: {e}") from None
        in_flight: dict[asyncio.Task, object] = {}
        try:
            while True:
                while len(in_flight) < server.concurrency:
                    prompt = next(prompts, None)
                    if prompt is None:
                        break
                    item, text, seed = prompt
                    in_flight[asyncio.ensure_future(ask(session, server, model, text, max_tokens, temperature,
                                                        seed))] = item
                if not in_flight:
                    return
                done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    yield in_flight.pop(task), task.result()
        finally:
            for task in in_flight:
                task.cancel()
