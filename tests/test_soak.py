"""A soak against the real server: many short requests at concurrency 8 through the client library.

Nothing may be lost (every request completes) or differ (greedy answers equal each prompt's solo
answer, whatever batch they ran in); afterwards the server's memory is where it was, the KV cache
is empty again and the server stops without waiting out its exit timeout. The test suite runs a short
soak; `make soak` runs 1,000 requests (DFLASH_SOAK_REQUESTS) and prints the figures.
"""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from clients import AsyncDFlashClient, GenerationParams, RetryPolicy
from test_serving import metric, wait_for_metric

REQUESTS = int(os.environ.get("DFLASH_SOAK_REQUESTS", "32"))
CONCURRENCY = 8
MAX_TOKENS = 4
# Short raw-text prompts: on 2 CPU cores a batch of 8 chat-template prompts costs seconds to prefill,
# and the soak is about the server, not the model.
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet of the solar system is",
           "Once upon a time", "def add(a, b):", "The color of the sky is", "One, two, three,", "Bees make"]
# Requests before the baseline: the allocators settle once the largest batch has run.
WARM_UP = CONCURRENCY
RSS_DRIFT_LIMIT = 0.02


@pytest.fixture(scope="module")
def soak_server(default_build, tmp_path_factory):
    """A server of its own: the baseline is a fresh server's, whatever the tests before did to theirs."""
    from deploy.serve import start_server

    log = tmp_path_factory.mktemp("soak-server") / "tritonserver.log"
    with start_server(default_build / "model_repository", 0, 0, 0, log_path=log) as server:
        yield server


@pytest.mark.soak
def test_soak_loses_nothing_changes_nothing_and_leaks_nothing(soak_server):
    params = GenerationParams(max_tokens=MAX_TOKENS)
    solo = asyncio.run(_answers(soak_server.grpc_url, PROMPTS, params, concurrency=1))
    assert not [a for a in solo if isinstance(a, BaseException)], solo
    expected = {p: (a.text, a.finish_reason) for p, a in zip(PROMPTS, solo)}
    asyncio.run(_answers(soak_server.grpc_url, _prompts(WARM_UP), params, CONCURRENCY))
    assert wait_for_metric(soak_server, "dflash_active_sequences", 0)
    kv_before = metric(soak_server, "dflash_kv_cache_utilization")
    rss_before = server_rss(soak_server.process.pid)

    prompts = _prompts(REQUESTS)
    started = time.monotonic()
    answers = asyncio.run(_answers(soak_server.grpc_url, prompts, params, CONCURRENCY))
    seconds = time.monotonic() - started
    lost = [a for a in answers if isinstance(a, BaseException)]
    mismatched = [(p, a.text) for p, a in zip(prompts, answers)
                  if not isinstance(a, BaseException) and (a.text, a.finish_reason) != expected[p]]
    assert wait_for_metric(soak_server, "dflash_active_sequences", 0)
    kv_after = metric(soak_server, "dflash_kv_cache_utilization")
    rss_after = server_rss(soak_server.process.pid)
    drift = (rss_after - rss_before) / rss_before
    print(f"\nsoak: {REQUESTS} requests at concurrency {CONCURRENCY} ({MAX_TOKENS} tokens each) in {seconds:.1f} s "
          f"({REQUESTS / seconds:.1f} requests/s); lost {len(lost)}, mismatched {len(mismatched)}; "
          f"server RSS {rss_before / 2**20:.1f} -> {rss_after / 2**20:.1f} MiB (drift {100 * drift:+.2f} %); "
          f"KV-cache utilization {kv_before:g} -> {kv_after:g}")
    assert not lost, lost[:3]
    assert not mismatched, mismatched[:3]
    assert kv_after == kv_before
    assert drift < RSS_DRIFT_LIMIT
    # and it stops cleanly: while the clients cancelled each stream after its final response (rather than closing
    # their side), a dozen requests left tritonserver 2.51 unable to unload dflash_bls, and it waited out its exit
    # timeout (15 s) at every shutdown
    stopping = time.monotonic()
    code = soak_server.stop()
    print(f"soak: stopped in {time.monotonic() - stopping:.1f} s (exit code {code})")
    assert code == 0 and "Exit timeout expired" not in soak_server.log(), soak_server.log()[-3000:]


def _prompts(count: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(count)]


async def _answers(url: str, prompts: list[str], params: GenerationParams, concurrency: int):
    """The answers (or the exceptions) to `prompts`, `concurrency` requests in flight at a time."""
    slots = asyncio.Semaphore(concurrency)
    # no retry: a request that needed one would count as served while the server had refused it
    async with AsyncDFlashClient(url, retry=RetryPolicy(attempts=1), timeout=300) as client:
        async def one(prompt):
            async with slots:
                return await client.generate(prompt, params, chat=False)

        return await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)


def server_rss(pgid: int) -> int:
    """Resident bytes of a server's process group: tritonserver and its model processes."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                status = (stat.parent / "status").read_text()
                total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        except (OSError, StopIteration, IndexError):
            continue  # gone meanwhile, or a zombie (no VmRSS)
    return total * 1024
