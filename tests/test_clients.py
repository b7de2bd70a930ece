"""The clients against the real server (session fixture `default_server`), plus the rules they share with it.

Generation runs at ~10-25 tokens/s on the project's CPU machine, so requests stay short (8-24 tokens),
with prompts whose answers run past them (finish_reason "length" is then certain).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from clients import (AsyncDFlashClient, DFlashClient, GenerationParams, IncompleteResponse, InvalidRequest,
                     RequestCancelled, RequestTimeout, RetryPolicy, ServerUnavailable)
from clients import cli, loadbench
from clients.errors import ServerError, from_server_message
from clients.params import prompt_inputs
from clients.results import TextChunk, Timings
from clients.transport import address
from deploy.ports import free_ports
from dflash_contract.protocol import LIMITS

STORY = "Write a short story about a robot learning to paint."
QUESTIONS = [STORY, "Explain what a hash table is and when to use one.",
             "How does photosynthesis work? Explain it simply.", "What are three tips for staying focused?"]
FAST_RETRY = RetryPolicy(attempts=3, backoff=0.05, max_backoff=0.1)


@pytest.fixture(scope="module")
def grpc_client(default_server):
    with DFlashClient(default_server.grpc_url) as client:
        yield client


@pytest.fixture(scope="module")
def http_client(default_server):
    with DFlashClient(default_server.http_url, "http") as client:
        yield client


# -- rules shared with the server (no server needed) -------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", 1), ("temperature", -0.1), ("temperature", 0.0), ("temperature", math.nan),
    ("temperature", 2.5), ("top_k", -1), ("top_k", 0), ("top_k", 50), ("top_p", 0.0), ("top_p", 1e-6),
    ("top_p", 1.0), ("top_p", 1.01), ("top_p", math.nan), ("stop", ("",)), ("stop", ("END",)),
])
def test_parameters_follow_the_server_rules(field, value):
    from dflash_runtime.config import DFlashError
    from dflash_runtime.sampling import SamplingParams

    server_field = {"max_tokens": "max_new_tokens", "stop": "stop_strings"}.get(field, field)
    try:
        SamplingParams(**{server_field: value})
        server_accepts = True
    except DFlashError:
        server_accepts = False
    try:
        GenerationParams(**{field: value})
        client_accepts = True
    except InvalidRequest:
        client_accepts = False
    assert client_accepts == server_accepts


def test_prompt_forms():
    assert prompt_inputs("Hi", chat=True) == {"text_input": "Hi", "apply_chat_template": True}
    assert prompt_inputs("def f():", chat=False) == {"text_input": "def f():", "apply_chat_template": False}
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert json.loads(prompt_inputs(conversation, chat=False)["messages"]) == conversation  # always templated
    with pytest.raises(InvalidRequest, match="empty prompt"):
        prompt_inputs("", chat=True)
    with pytest.raises(InvalidRequest, match="empty conversation"):
        prompt_inputs([], chat=True)


def test_an_address_without_a_port_gets_the_servers_default_port(capsys):
    # grpc and HTTP libraries would pick 443 / 80 for a bare host
    assert [address(url, protocol) for url, protocol in [("localhost", "grpc"), ("localhost", "http"),
                                                         ("[::1]", "grpc"), ("dflash.ns.svc", "http")]] == \
        ["localhost:8001", "localhost:8000", "[::1]:8001", "dflash.ns.svc:8000"]
    assert address("10.0.0.1:9001", "grpc") == "10.0.0.1:9001" and address("[::1]:7000", "http") == "[::1]:7000"
    with pytest.raises(InvalidRequest, match="without a scheme"):
        address("http://localhost:8000", "http")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--help"])
    assert "8001 (gRPC), 8000 (HTTP)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("make, message", [
    (lambda: GenerationParams(max_tokens=LIMITS.max_tokens + 1),
     r"^max_tokens is 262145, over the limit of 262144 tokens per request$"),
    (lambda: GenerationParams(stop=tuple(f"w{i}" for i in range(LIMITS.stop_words + 1))),
     r"^stop has 17 stop strings, over the limit of 16 per request$"),
    (lambda: GenerationParams(stop=("END", "\u00e9" * 129)),
     r"^stop\[1\] is 258 bytes \(UTF-8\), over the limit of 256 bytes per stop string$"),
    (lambda: prompt_inputs("x" * (LIMITS.prompt_bytes + 1), chat=False),
     r"^text_input is 1048577 bytes \(UTF-8\), over the limit of 1048576 bytes per request$"),
    (lambda: prompt_inputs([{"role": "user", "content": "x" * LIMITS.prompt_bytes}], chat=True),
     r"^messages is 1048609 bytes \(UTF-8\), over the limit of 1048576 bytes per request$"),
    (lambda: prompt_inputs([{"role": "user", "content": "x"}] * (LIMITS.messages + 1), chat=True),
     r"^messages has 2049 messages, over the limit of 2048 per request$"),
])
def test_size_limits_are_the_servers_and_checked_before_sending(make, message):
    with pytest.raises(InvalidRequest, match=message):
        make()


def test_requests_at_the_size_limits_are_accepted_client_side():
    GenerationParams(max_tokens=LIMITS.max_tokens, stop=("x" * LIMITS.stop_word_bytes,) * LIMITS.stop_words)
    assert prompt_inputs("x" * LIMITS.prompt_bytes, chat=False)["text_input"]
    assert prompt_inputs([{"role": "user", "content": "x"}] * LIMITS.messages, chat=True)["messages"]
    # refused before any network: an unreachable server is never tried (it would raise ServerUnavailable)
    with DFlashClient(f"127.0.0.1:{free_ports(1)[0]}", retry=FAST_RETRY) as client:
        with pytest.raises(InvalidRequest, match="over the limit of 1048576 bytes"):
            client.generate("x" * (LIMITS.prompt_bytes + 1), GenerationParams(max_tokens=8))


@pytest.mark.parametrize("message, exception", [
    # UNAVAILABLE: capacity, shutting down, a dead engine loop, a dead engine process (Triton's words)
    ("in ensemble 'ensemble', the server is at capacity (8 running, 64 queued, queue limit 64); retry later",
     ServerUnavailable),
    ("the server is shutting down; the request was aborted", ServerUnavailable),
    ("the DFlash engine stopped (RuntimeError: boom); retry on another replica", ServerUnavailable),
    ("in ensemble 'ensemble', Stub process 'dflash_0_0' is not healthy.", ServerUnavailable),
    # INVALID_ARG: ours, and Triton's own checks at the door
    ("in ensemble 'ensemble', invalid request: top_p must be in (0, 1], got 0.0", InvalidRequest),
    ("invalid request: text_input is required", InvalidRequest),
    ("[request id: <id_unknown>] inference input 'max_tokens' data-type is 'FP32', but model 'dflash_bls' expects "
     "'INT32'", InvalidRequest),
    ("[request id: <id_unknown>] unexpected shape for input 'max_tokens' for model 'ensemble'", InvalidRequest),
    ("invalid request: temprature is not an input of this model (did you mean temperature?): a field that names no "
     "input is refused, not ignored", InvalidRequest),
    # HTTP generate: a field that names no input and is no parameter type (Triton 2.51's words)
    ("parameter 'lst' has invalid type. It should be either 'int', 'bool', or 'string'.", InvalidRequest),
    # HTTP generate bodies Triton cannot read (status 500; tritonserver 2.51's words, measured)
    ("failed to parse the request JSON buffer: Missing a comma or '}' after an object member. at 36", InvalidRequest),
    ("Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer", InvalidRequest),
    ("Unable to parse JSON bytes array: attempt to access JSON non-string as string", InvalidRequest),
    ("attempt to get members for non-object", InvalidRequest),
    ("generate expects model to produce exactly 1 response, use generate stream for model that generates various "
     "number of responses", InvalidRequest),
    ("request cancelled", RequestCancelled),
    # INTERNAL: ours, and any words the clients do not know (a server fault, never the caller's)
    ("internal error while decoding: RuntimeError: boom", ServerError),
    ("Request for unknown model: 'no_such_model' is not found", ServerError),
])
def test_server_messages_map_to_exceptions(message, exception):
    # HTTP generate answers 400 for every model's error and 500 for Triton's JSON refusals: the status must not
    # decide the class
    for status in (400, 500):
        assert type(from_server_message(message, "host:1", http_status=status)) is exception


def test_the_engine_loop_speaks_the_phrases_clients_retry_on(tiny):
    # The retryable errors are recognised by phrases (dflash_contract.protocol): the engine loop's real
    # refusals (full, then shutting down) must map to ServerUnavailable.
    import threading

    from dflash_runtime import SamplingParams, SpeculativeEngine, load_target
    from dflash_serving.engine_loop import EngineLoop, QueueFull

    target = load_target(tiny[0])
    release = threading.Event()

    class HeldStream:  # its first chunk waits, so its request keeps the engine's only slot
        def send(self, chunk):
            release.wait(60)

        def fail(self, message):
            pass

        def is_cancelled(self):
            return False

    loop = EngineLoop(lambda: SpeculativeEngine(target, None, max_batch_size=1), max_queue_size=0)
    errors = []
    try:
        loop.submit([1, 2, 3], SamplingParams(max_new_tokens=64, ignore_eos=True), HeldStream())
        for _ in range(2):
            with pytest.raises(QueueFull) as refused:
                loop.submit([1, 2, 3], SamplingParams(max_new_tokens=4), HeldStream())
            errors.append(str(refused.value))
            loop.drain(60)
    finally:
        release.set()
        loop.stop()
    assert "capacity" in errors[0] and "shutting down" in errors[1]
    assert all(isinstance(from_server_message(e, "host:1"), ServerUnavailable) for e in errors)


def test_the_library_needs_no_torch():
    # A backend service installs the client alone (clients/pyproject.toml): it must import without torch.
    code = "import sys, clients, clients.cli; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_token_latencies_share_each_gap_among_its_tokens():
    timings = Timings(0.5, 1.1, (TextChunk("ab", 0.5), TextChunk("c", 0.7), TextChunk("", 0.8),
                                 TextChunk("def", 1.1)))
    latencies = timings.token_latencies(len)  # one character = one token
    assert latencies == pytest.approx([0.0, 0.2, 0.4 / 3, 0.4 / 3, 0.4 / 3])
    assert sum(latencies) / len(latencies) == pytest.approx((timings.total - timings.ttft) / (6 - 1))


# -- against the server ----------------------------------------------------------------------------------
def test_health(default_server, grpc_client, http_client):
    assert grpc_client.ready() and http_client.ready()
    address = f"127.0.0.1:{free_ports(1)[0]}"
    with DFlashClient(address) as nobody:
        health = nobody.health()
        assert not health.ready and address in health.detail
        with pytest.raises(ServerUnavailable, match="not ready after"):
            nobody.wait_ready(0.5, interval=0.1)
    # the installed console script, as the Makefile's demo calls it
    script = Path(sys.executable).parent / "dflash-client"
    assert subprocess.run([script, "health", "--url", default_server.grpc_url, "--wait", "30"]).returncode == 0
    assert cli.main(["health", "--url", address]) == 3  # unavailable: try again later


def test_streaming_and_non_streaming_return_the_same_text(grpc_client, http_client):
    params = GenerationParams(max_tokens=16)
    whole = grpc_client.generate(STORY, params)
    with grpc_client.stream(STORY, params) as stream:
        deltas = list(stream)
    streamed = stream.result
    assert whole.text and streamed.text == "".join(deltas) == whole.text
    assert whole.finish_reason == streamed.finish_reason == "length"
    assert len(deltas) > 1 and [c.text for c in streamed.timings.chunks] == deltas
    times = [c.seconds for c in streamed.timings.chunks]
    assert times == sorted(times) and streamed.timings.ttft == times[0] <= streamed.timings.total
    stats = streamed.stats
    assert stats.draft_steps >= 1 and stats.mean_acceptance_length >= 1
    assert 0 <= stats.accepted_draft_tokens <= stats.draft_tokens
    # block size auto: how many drafts each step verifies depends on what the engine has learnt by then,
    # so two runs of one greedy request agree on the text, not on the speculation statistics
    assert whole.stats.draft_steps >= 1 and 0 <= whole.stats.accepted_draft_tokens <= whole.stats.draft_tokens
    assert http_client.generate(STORY, params).text == whole.text
    assert http_client.generate(STORY, params, stream=True).text == whole.text
    raw = grpc_client.generate("def fibonacci(n):", GenerationParams(max_tokens=12), chat=False)
    assert raw.text and raw.finish_reason == "length"


def test_stop_strings_mean_the_same_through_the_server_and_dflash_generate(grpc_client, http_client, capsys):
    # dflash_contract.protocol's rule: generation ends at the token that completes a stop string; the text ends
    # before it, or after it with include_stop_str_in_output, streamed or not. Once, the CLI cut the text before
    # the match while the server kept it.
    from dflash_tools.cli import main as generate

    question = "What is the capital of France? Answer in one sentence."
    for kept in (False, True):
        params = GenerationParams(max_tokens=24, stop=("Paris",), include_stop_str_in_output=kept)
        served = grpc_client.generate(question, params)
        assert served.finish_reason == "stop" and served.text.endswith("Paris") == kept and "Paris" not in (
            served.text[:-len("Paris")] if kept else served.text)
        assert grpc_client.generate(question, params, stream=True).text == served.text
        assert http_client.generate(question, params, stream=True).text == served.text
        flag = ["--include-stop-str-in-output"] if kept else []
        assert generate(["--prompt", question, "--max-new-tokens", "24", "--stop", "Paris", "--json", *flag]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == served.text


def test_async_client_serves_eight_concurrent_calls(default_server):
    params = GenerationParams(max_tokens=12)

    async def scenario():
        async with AsyncDFlashClient(default_server.grpc_url) as client:
            calls = [client.generate(q, params, stream=i % 2 == 0) for i, q in enumerate(QUESTIONS * 2)]
            return await asyncio.gather(*calls)

    results = asyncio.run(scenario())
    assert len(results) == 8 and all(r.text and r.finish_reason for r in results)
    # the same prompt twice (once streamed, once not) in one batch: the same greedy answer
    assert [r.text for r in results[:4]] == [r.text for r in results[4:]]


def test_cancellation_stops_the_request_promptly(grpc_client, default_server):
    with grpc_client.stream(STORY, GenerationParams(max_tokens=24)) as stream:
        next(stream)
        started = time.monotonic()
        stream.cancel()
        with pytest.raises(RequestCancelled):
            next(stream)
        assert time.monotonic() - started < 1

    async def cancel_a_task():
        async with AsyncDFlashClient(default_server.grpc_url) as client:
            task = asyncio.create_task(client.generate(STORY, GenerationParams(max_tokens=24), stream=True))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancel_a_task())


def test_cancellation_frees_the_server(grpc_client, default_server):
    with grpc_client.stream(STORY, GenerationParams(max_tokens=48)) as stream:
        next(stream)
        stream.cancel()
    deadline = time.monotonic() + 10  # a step or two to notice, a cancellation check to drop it
    while _metric(default_server.metrics_url, "dflash_active_sequences") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(default_server.metrics_url, "dflash_active_sequences") == 0
    before = _metric(default_server.metrics_url, "dflash_generated_tokens_total")
    time.sleep(1.5)
    assert _metric(default_server.metrics_url, "dflash_generated_tokens_total") == before


def test_timeouts(grpc_client, http_client):
    for client in (grpc_client, http_client):
        started = time.monotonic()
        with pytest.raises(RequestTimeout, match="within 0.2 s"):
            client.generate(STORY, GenerationParams(max_tokens=16), timeout=0.2)
        assert time.monotonic() - started < 1.5


def test_a_stream_cut_midway_raises_instead_of_returning_truncated_text(default_server):
    async def scenario(url: str, protocol: str) -> None:
        async with CuttingProxy(url) as proxy, AsyncDFlashClient(proxy.url, protocol) as client:
            seen = []
            with pytest.raises(IncompleteResponse) as error:
                async with client.stream(STORY, GenerationParams(max_tokens=16)) as stream:
                    async for delta in stream:
                        seen.append(delta)
                        proxy.cut()
            assert seen and error.value.partial_text == "".join(seen)
            with pytest.raises(RuntimeError, match="not completed"):
                stream.result

    asyncio.run(scenario(default_server.grpc_url, "grpc"))
    asyncio.run(scenario(default_server.http_url, "http"))


def test_invalid_requests_are_refused_and_never_retried(grpc_client, http_client, caplog):
    with pytest.raises(InvalidRequest, match=r"top_p must be in \(0, 1\]"):
        GenerationParams(top_p=0)
    with pytest.raises(InvalidRequest, match=r"^speculative_sampling must be one of exact, rejection; got 'typical'$"):
        GenerationParams(temperature=1.0, speculative_sampling="typical")
    caplog.set_level(logging.WARNING, logger="clients")
    too_long = GenerationParams(max_tokens=LIMITS.max_tokens)  # valid alone; the server refuses it with the prompt
    for client in (grpc_client, http_client):
        with pytest.raises(InvalidRequest, match="exceeds the context limit"):
            client.generate(STORY, too_long)
    assert not caplog.records
    assert cli.main(["generate", "--url", grpc_client.url, "--prompt", "Hi", "--top-p", "0"]) == 2


def test_an_unreachable_server_is_retried_then_named(caplog):
    caplog.set_level(logging.WARNING, logger="clients")
    for protocol in ("grpc", "http"):
        caplog.clear()
        address = f"127.0.0.1:{free_ports(1)[0]}"
        with DFlashClient(address, protocol, retry=FAST_RETRY) as client:
            with pytest.raises(ServerUnavailable, match=rf"cannot reach the server at {address}.*tried 3 times"):
                client.generate("Hi", GenerationParams(max_tokens=8))
        assert len(caplog.records) == 2  # two retries, each logged
    assert cli.main(["generate", "--url", address, "--prompt", "Hi", "--retries", "0"]) == 3


def test_cli_generate_streams_the_answer_and_prints_json(grpc_client, capsys):
    expected = grpc_client.generate(STORY, GenerationParams(max_tokens=12)).text
    assert cli.main(["generate", "--url", grpc_client.url, "--prompt", STORY, "--max-tokens", "12"]) == 0
    out = capsys.readouterr()
    assert out.out == expected + "\n" and "acceptance length" in out.err
    assert cli.main(["generate", "--url", grpc_client.url, "--prompt", STORY, "--max-tokens", "12", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["text"] == expected and answer["finish_reason"] == "length"
    assert answer["stats"]["mean_acceptance_length"] >= 1 and answer["timings"]["ttft"] > 0


def test_loadbench_reports_consistent_numbers(default_server, default_build, tmp_path):
    # The baseline is the same server here: the side-by-side path runs without a second model loaded.
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = loadbench.main(["--url", default_server.grpc_url, "--baseline-url", default_server.grpc_url,
                           "--tokenizer", str(default_build / "target"), "--prompts", "chat", "--num-prompts", "3",
                           "--concurrency", "1", "2", "--max-tokens", "12", "--warmup", "1",
                           "--in-process", str(default_build), "--json", str(out), "--plot", str(png)])
    assert code == 0 and png.stat().st_size > 0
    summary = json.loads(out.read_text())
    count = loadbench.token_counter(str(default_build / "target"))
    assert [row["level"]["value"] for row in summary["levels"]] == [1, 2]
    for row in summary["levels"]:
        for server in ("dflash", "baseline"):
            r = row[server]
            assert r["requests"] == 3 and r["failed"] == 0 and len(r["per_request"]) == 3
            assert [p["output_tokens"] for p in r["per_request"]] == [count(p["text"]) for p in r["per_request"]]
            assert r["output_tokens"] == sum(p["output_tokens"] for p in r["per_request"])
            assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"], rel=1e-3)
            assert r["requests_per_s"] == pytest.approx(3 / r["seconds"], rel=1e-3)
            assert 0 < r["ttft_s"]["p50"] <= r["latency_s"]["p50"] and r["itl_s"]["p50"] >= 0
            assert r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
            assert r["mean_acceptance_length"] >= 1
        assert row["speedup"]["identical_texts"] == "3/3"  # greedy: the same server answers alike
    overhead = summary["server_vs_in_process"]  # the build's engine in this process: the same texts
    assert overhead["identical_texts"] == "3/3" and overhead["tokens"] > 0
    rates = overhead["tokens_per_second"]
    assert overhead["ratio_server_vs_in_process"] == pytest.approx(rates["server"] / rates["in_process"], rel=0.02)


def test_loadbench_refuses_a_run_that_would_measure_less_than_it_says(capsys):
    # the newcomer trial: --num-prompts 16 --concurrency 16 on the 4 chat prompts silently ran 4, at concurrency 4
    where = ["--url", "localhost:1", "--tokenizer", "unused"]  # refused before either is used
    assert loadbench.main([*where, "--prompts", "chat", "--num-prompts", "16", "--concurrency", "16"]) == 1
    assert "--prompts chat has 4 prompts, fewer than --num-prompts 16" in capsys.readouterr().err
    assert loadbench.main([*where, "--prompts", "chat", "--num-prompts", "4", "--concurrency", "1", "8"]) == 1
    assert "--concurrency 8 is never reached with 4 prompts per level" in capsys.readouterr().err


def test_loadbench_says_when_the_gateways_figures_compare_different_work():
    def level(tau, text, ttft):
        return {"ttft_s": {"p50": ttft}, "output_tokens_per_s": 10 * tau, "mean_acceptance_length": tau,
                "per_request": [{"prompt": 0, "text": text}]}

    same = loadbench.gateway_overhead(level(1.5, "a", 0.11), level(1.5, "a", 0.10))
    assert same["ttft_p50_ms"] == pytest.approx(10) and "not_comparable" not in same
    drafted = loadbench.gateway_overhead(level(3.0, "a", 0.10), level(1.0, "a", 2.25))
    assert "tau 3.00 through the gateway, 1.00 over gRPC" in drafted["not_comparable"]
    assert "not comparable" in loadbench.table({"levels": [{"level": {"kind": "concurrency", "value": 1},
                                                            "gateway": drafted}]})


def test_loadbench_second_turns_hit_the_prefix_cache(default_server, default_build, tmp_path):
    """--turns 2: each MT-Bench conversation's second turn re-sends the first turn's answer; the server's prefix
    cache holds the history (at least the first turn's prompt), reported per level, and the texts agree."""
    out = tmp_path / "turns.json"
    code = loadbench.main(["--url", default_server.grpc_url, "--baseline-url", default_server.grpc_url,
                           "--tokenizer", str(default_build / "target"), "--prompts", "mtbench", "--turns", "2",
                           "--num-prompts", "2", "--concurrency", "1", "--max-tokens", "12", "--warmup", "0",
                           "--json", str(out)])
    assert code == 0
    row = json.loads(out.read_text())["levels"][0]
    for server in ("dflash", "baseline"):
        turn2 = row[server]["turn2"]
        firsts = [p["stats"]["prompt_tokens"] for p in row[server]["per_request"]]
        assert turn2["prompt_tokens"] > sum(firsts) and turn2["cached_tokens"] >= sum(f - 16 for f in firsts)
        assert 0 < turn2["cached_fraction"] < 1 and turn2["ttft_s"]["p50"] > 0
        assert all("--- turn 2 ---" in p["text"] for p in row[server]["per_request"])
    assert row["speedup"]["identical_texts"] == "2/2" and row["speedup"]["turn2_ttft_p50_ratio"] > 0


# -- helpers ----------------------------------------------------------------------------------------
class CuttingProxy:
    """A TCP proxy in front of the server whose connections the test can cut mid-stream."""

    def __init__(self, target: str):
        self.host, self.port = target.rsplit(":", 1)
        self._transports = []

    async def __aenter__(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.url = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.cut()
        self._server.close()

    def cut(self) -> None:
        for transport in self._transports:
            transport.abort()

    async def _connect(self, client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection(self.host, int(self.port))
        self._transports += [client_writer.transport, server_writer.transport]
        await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))


async def _pipe(reader, writer) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


def _metric(metrics_url: str, name: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))
