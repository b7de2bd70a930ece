"""Faults against the real server, run as the container runs it (`dflash-serve` in its own process).

A killed engine process, a killed tritonserver, clients that vanish mid-stream, a burst past the
queue; then, without a server, a dead engine loop and dflash-serve's answer to it. The server here is
a build with 2 KV-cache slots and a queue of 2, so that a burst of a dozen requests overflows it.
The measured times are printed (pytest -s shows them).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from clients import AsyncDFlashClient, GenerationParams, RetryPolicy, ServerUnavailable
from deploy.ports import pick_ports
from deploy.serve import ready_ports, supervise
from deploy.server_process import TritonServer, _proc_stat, backend_processes
from dflash_contract.protocol import CAPACITY_MESSAGE, ENGINE_STOPPED_MESSAGE, error_class
from dflash_contract.server import (EXIT_TIMEOUT_S, FAILED_STEPS_LIMIT, FAILURE_FILE_ENV, METRICS_PATH, PORTS,
                                    READY_PATH, TEST_FAULT_ENV, UNHEALTHY_EXIT_CODE, report_engine_failure)
from test_serving import Stream, metric, wait_for_metric

REPO = Path(__file__).resolve().parent.parent
SLOTS, QUEUE = 2, 2
LONG_STORY = "Write a long story about a lighthouse keeper."
HEALTH_BOUND_S = 10  # the bound: unhealthy, and dflash-serve gone, within this after the fault


class Launched:
    """dflash-serve in a process of its own, on free ports (it picks them: its ready line names them), as a container
    entrypoint runs it."""

    def __init__(self, repository: Path, log: Path, *args: str, env: dict | None = None):
        self.repository, self.log = repository, log
        started = time.monotonic()
        with open(log, "a") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "deploy.serve", str(repository), "--ready-timeout", "300",
                 *(f"--{name}-port=0" for name in PORTS), *args],
                cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})})
        ready = self.process.stdout.readline()  # "ready: ..." once serving; "" if it exited
        assert ready.startswith("ready:"), log.read_text()[-3000:]
        self.ports = ready_ports(ready)
        self.ready_seconds = time.monotonic() - started
        # dflash-serve's children are tritonserver and the gateway; after the pids wrap the gateway may come first
        self.tritonserver = next(pid for pid in _all_pids() if _parent(pid) == self.process.pid
                                 and Path(_command(pid)[0]).name == "tritonserver")
        self.backends = backend_processes(self.tritonserver)

    grpc_url = property(lambda self: f"localhost:{self.ports['grpc']}")
    http_url = property(lambda self: f"localhost:{self.ports['http']}")
    metrics_url = property(lambda self: f"http://localhost:{self.ports['metrics']}{METRICS_PATH}")

    def backend(self, model: str):
        return next(b for b in self.backends if b.model == model)

    def ready_status(self) -> int | str:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{READY_PATH}", timeout=3) as r:  # the probe's
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError as e:
            return type(e).__name__

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(120)


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    from builder.build import BuildOptions, build

    output = tmp_path_factory.mktemp("builds") / "small-queue"
    build(BuildOptions(target="smollm2-135m", drafter="preset", max_batch_size=SLOTS, max_queue_size=QUEUE,
                       sanity_tokens=0), output)
    return output / "model_repository"


@pytest.fixture(scope="module")
def held(small_build, tmp_path_factory):
    """Holds the current dflash-serve: a test that kills it starts the next one here."""
    log = tmp_path_factory.mktemp("serve") / "dflash-serve.log"
    holder = {"server": Launched(small_build, log)}
    yield holder
    holder["server"].stop()


@pytest.fixture
def served(held):
    """The held dflash-serve, serving: a test that failed after killing it leaves the next one a new server."""
    if held["server"].process.poll() is not None:
        held["server"] = Launched(held["server"].repository, held["server"].log)
    return held


# -- clients that vanish, a burst: the server stays healthy ---------------------------------------------
def test_a_client_that_vanishes_mid_stream_frees_its_slot(served):
    server = served["server"]
    for vanish in (_kill_a_grpc_client_mid_stream, _close_an_http_stream_mid_stream):
        cancelled = metric(server, "dflash_cancelled_requests_total")
        vanish(server)
        assert wait_for_metric(server, "dflash_active_sequences", 0, timeout=5), vanish.__name__
        assert metric(server, "dflash_kv_cache_utilization") == 0
        assert metric(server, "dflash_cancelled_requests_total") == cancelled + 1


def _kill_a_grpc_client_mid_stream(server) -> None:
    # a process that dies without a word: no cancellation is sent, only its connection closes
    # a failure before it streams exits at once: its gRPC threads would keep it alive, and the readline below waiting
    client = ("import os, signal, sys\nsys.path.insert(0, sys.argv[2])\nfrom test_serving import Stream\ntry:\n"
              "    s = Stream(sys.argv[1])\n"
              f"    s.send('dflash_bls', text_input={LONG_STORY!r}, max_tokens=1000, stream=True, end_id=-1)\n"
              "    [s.responses.get(timeout=120) for _ in range(3)]\n"
              "except BaseException as e:\n    print(f'failed: {e!r}', flush=True)\n    os._exit(1)\n"
              "print('streaming', flush=True)\ninput()\nos.kill(os.getpid(), signal.SIGKILL)\n")
    child = subprocess.Popen([sys.executable, "-c", client, server.grpc_url, str(REPO / "tests")], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "streaming\n"
    assert wait_for_metric(server, "dflash_active_sequences", 1)
    child.communicate("\n", timeout=60)
    assert child.returncode == -signal.SIGKILL


def _close_an_http_stream_mid_stream(server) -> None:
    host, port = server.http_url.split(":")
    body = json.dumps({"text_input": LONG_STORY, "max_tokens": 1000, "stream": True, "end_id": -1})
    with socket.create_connection((host, int(port)), timeout=120) as connection:
        connection.sendall(f"POST /v2/models/dflash_bls/generate_stream HTTP/1.1\r\nHost: {host}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while received.count(b"data:") < 3:
            received += connection.recv(65536)
        assert wait_for_metric(server, "dflash_active_sequences", 1)


def test_a_burst_past_the_queue_is_refused_as_unavailable_and_loses_no_accepted_request(served):
    server = served["server"]
    burst = 6 * (SLOTS + QUEUE)
    params = GenerationParams(max_tokens=12)

    async def run():
        # no retries: each refusal must show, and each accepted request must come back whole
        async with AsyncDFlashClient(server.grpc_url, retry=RetryPolicy(attempts=1), timeout=600) as client:
            solo = await client.generate(LONG_STORY, params)
            answers = await asyncio.gather(*(client.generate(LONG_STORY, params) for _ in range(burst)),
                                           return_exceptions=True)
        return solo, answers

    solo, answers = asyncio.run(run())
    refused = [a for a in answers if isinstance(a, ServerUnavailable)]
    served_ = [a for a in answers if not isinstance(a, BaseException)]
    assert len(refused) + len(served_) == burst, [a for a in answers if isinstance(a, BaseException)][:3]
    assert refused and all(CAPACITY_MESSAGE in str(a) for a in refused)
    assert len(served_) >= SLOTS + QUEUE
    assert all((a.text, a.finish_reason) == (solo.text, solo.finish_reason) for a in served_)
    assert wait_for_metric(server, "dflash_kv_cache_utilization", 0)
    print(f"\nburst of {burst}: {len(served_)} served whole, {len(refused)} refused as UNAVAILABLE")


# -- a dead engine process, a dead tritonserver: dflash-serve exits so that it is restarted ---------------
def test_a_killed_engine_process_takes_the_server_down_and_a_restart_serves_again(served):
    server = served["server"]
    in_flight = {model: Stream(server.grpc_url) for model in ("dflash_bls", "ensemble")}
    for model, stream in in_flight.items():
        stream.send(model, text_input=LONG_STORY, max_tokens=1000, stream=True, end_id=-1)
        assert stream.responses.get(timeout=120)[1] is None  # it is streaming
    killed = time.monotonic()
    os.kill(server.backend("dflash").pid, signal.SIGKILL)  # as the kernel's OOM killer would
    newcomer = {}
    arrives = threading.Thread(target=lambda: newcomer.update(error=_refusal(server.grpc_url)))
    arrives.start()
    while server.ready_status() == 200 and time.monotonic() - killed < 30:
        time.sleep(0.05)
    unready = time.monotonic() - killed
    code = server.process.wait(30)
    exited = time.monotonic() - killed
    assert unready < HEALTH_BOUND_S and exited < HEALTH_BOUND_S, (unready, exited)
    errors = {model: stream.collect(timeout=30)[1] for model, stream in in_flight.items()}
    # tritonserver 2.51 sometimes aborts by itself when a stub dies (seen in CI: SIGABRT); dflash-serve
    # then exits 128 + the signal, also non-zero: the container restarts either way
    assert code == UNHEALTHY_EXIT_CODE or code == 128 + signal.SIGABRT, code
    if code == UNHEALTHY_EXIT_CODE:
        assert "backend process of model 'dflash'" in server.log.read_text()
        # in flight: dflash_bls ends its stream with the cause; the ensemble's, which Triton holds, ends
        # when the connection closes (rather than never, as without dflash-serve)
        assert ENGINE_STOPPED_MESSAGE in errors["dflash_bls"] and "model 'dflash'" in errors["dflash_bls"]
        assert error_class(errors["dflash_bls"]) == "UNAVAILABLE"
    assert all(error is not None for error in errors.values()), errors
    arrives.join(30)
    assert isinstance(newcomer["error"], ServerUnavailable), newcomer  # new requests: retry later
    for stream in in_flight.values():
        stream.close()
    _assert_nothing_left(server)

    # what the container's restart policy does next
    restarted = served["server"] = Launched(server.repository, server.log)
    answer = asyncio.run(_generate(restarted.grpc_url, "Hi", 4))
    serving = time.monotonic() - killed
    assert answer.finish_reason in ("stop", "length") and answer.text
    print(f"\nengine process killed: not ready after {unready:.2f} s, dflash-serve exited "
          f"({UNHEALTHY_EXIT_CODE}) after {exited:.2f} s; restarted and ready in {restarted.ready_seconds:.1f} s; "
          f"serving again {serving:.1f} s after the kill")


def test_a_hung_engine_step_is_detected_and_dflash_serve_exits_3_within_the_bound(small_build, tmp_path):
    """A step that never returns (DFLASH_TEST_FAULT=hang-step): the process lives and Triton stays ready, so
    only the progress watch can tell; with --hang-seconds 5 it must act within 5 s + the health bound."""
    hang_seconds = 5
    server = Launched(small_build, tmp_path / "dflash-serve.log", f"--hang-seconds={hang_seconds}",
                      env={TEST_FAULT_ENV: "hang-step"})
    try:
        stream = Stream(server.grpc_url)
        sent = time.monotonic()
        stream.send("dflash_bls", text_input="Hi", max_tokens=8, stream=True)
        code = server.process.wait(hang_seconds + HEALTH_BOUND_S + 30)
        exited = time.monotonic() - sent
        _, error = stream.collect(timeout=30)
        stream.close()
    finally:
        server.stop()
    assert code == UNHEALTHY_EXIT_CODE, (code, server.log.read_text()[-2000:])
    assert exited < hang_seconds + HEALTH_BOUND_S, exited
    assert "the engine made no progress" in server.log.read_text()
    # the stream in flight ends with the cause, as retryable elsewhere
    assert error is not None and "made no progress" in error and error_class(error) == "UNAVAILABLE", error
    _assert_nothing_left(server)
    print(f"\nhung step: dflash-serve exited ({UNHEALTHY_EXIT_CODE}) {exited:.1f} s after the request "
          f"(--hang-seconds {hang_seconds})")


def test_an_engine_step_that_always_fails_takes_the_server_down_after_the_limit(small_build, tmp_path):
    """Every step raises (DFLASH_TEST_FAULT=fail-step, as a poisoned CUDA context would): the first requests get
    INTERNAL, the FAILED_STEPS_LIMIT-th failure ends the engine like a dead one, and dflash-serve exits 3."""
    server = Launched(small_build, tmp_path / "dflash-serve.log", env={TEST_FAULT_ENV: "fail-step"})
    try:
        sent = time.monotonic()
        errors = [str(_refusal(server.grpc_url)) for _ in range(FAILED_STEPS_LIMIT)]  # one at a time
        code = server.process.wait(HEALTH_BOUND_S + 30)
        exited = time.monotonic() - sent
    finally:
        server.stop()
    log = server.log.read_text()
    assert code == UNHEALTHY_EXIT_CODE, (code, log[-2000:])
    assert all("a failing step" in e and error_class(e) == "INTERNAL" for e in errors[:-1]), errors
    assert ENGINE_STOPPED_MESSAGE in errors[-1] and error_class(errors[-1]) == "UNAVAILABLE", errors[-1]
    assert f"StepsFailing: {FAILED_STEPS_LIMIT} engine steps in a row failed" in log
    _assert_nothing_left(server)
    print(f"\nsteps failing: {FAILED_STEPS_LIMIT} requests answered, dflash-serve exited ({UNHEALTHY_EXIT_CODE}) "
          f"{exited:.1f} s after the first")


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port` (/proc/net/tcp and tcp6; an IPv4-mapped one as IPv4)."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if int(hex_port, 16) != port or state != "0A":  # 0A: TCP_LISTEN
                continue
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
            text = socket.inet_ntop(family, raw)
            found.add(text.removeprefix("::ffff:"))
    return found


def test_sigterm_after_a_dropped_http_stream_exits_promptly_on_the_address_asked_for(small_build, tmp_path):
    """--host 127.0.0.1 binds every port there; a client that drops its HTTP stream leaves nothing that holds up
    shutdown: SIGTERM ends well inside tritonserver's exit timeout, saying what it does."""
    server = Launched(small_build, tmp_path / "dflash-serve.log", "--host=127.0.0.1")
    try:
        for name, port in server.ports.items():
            assert _listening_addresses(port) == {"127.0.0.1"}, (name, _listening_addresses(port))
        _close_an_http_stream_mid_stream(server)
        assert wait_for_metric(server, "dflash_active_sequences", 0, timeout=5)
        asked = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(120)
        stopped = time.monotonic() - asked
    finally:
        server.stop()
    log = server.log.read_text()
    assert code == 0 and "Exit timeout expired" not in log, log[-3000:]
    assert stopped < EXIT_TIMEOUT_S, stopped  # tritonserver did not wait out its exit timeout
    assert "dflash-serve: draining: new requests are refused" in log and "dflash-serve: no request left after" in log
    assert "dflash-serve: stopped (tritonserver exit code 0)" in log
    _assert_nothing_left(server)
    print(f"\nSIGTERM after a dropped HTTP stream: dflash-serve exited in {stopped:.1f} s")


def test_a_killed_tritonserver_makes_dflash_serve_exit_non_zero_and_leaves_no_process(served):
    server = served["server"]
    killed = time.monotonic()
    os.kill(server.tritonserver, signal.SIGKILL)
    assert server.process.wait(30) == 128 + signal.SIGKILL
    assert time.monotonic() - killed < HEALTH_BOUND_S
    assert "tritonserver ended on its own (killed by signal 9)" in server.log.read_text()
    _assert_nothing_left(server)


async def _generate(url: str, prompt: str, max_tokens: int, attempts: int = 3):
    async with AsyncDFlashClient(url, retry=RetryPolicy(attempts=attempts), timeout=120) as client:
        return await client.generate(prompt, GenerationParams(max_tokens=max_tokens))


def _refusal(url: str) -> Exception | None:
    """What a request gets from a failing server, without retries (None: it was answered)."""
    try:
        asyncio.run(_generate(url, "Hi", 4, attempts=1))
    except Exception as e:
        return e
    return None


def _assert_nothing_left(server: Launched) -> None:
    """No live process of tritonserver's group (its backends included), no shared memory of theirs."""
    deadline = time.monotonic() + 10
    while _live_group(server.tritonserver) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _live_group(server.tritonserver)
    assert not [b.shm_region for b in server.backends if (Path("/dev/shm") / b.shm_region).exists()]


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _command(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return [""]


def _parent(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return int(stat[1]) if stat else None


def _live_group(pgid: int) -> list[int]:
    """Processes of a process group that still run (zombies wait for their new parent to reap them)."""
    return [pid for pid in _all_pids() if (stat := _proc_stat(pid)) and int(stat[2]) == pgid and stat[0] != "Z"]


# -- a dead engine loop (no server) -----------------------------------------------------------------------
class Fatal(BaseException):
    """A fault the loop does not handle (its steps catch Exception): the loop thread ends."""


class Recorder:
    def __init__(self, fatal: bool = False):
        self.fatal, self.error, self.done = fatal, None, threading.Event()

    def send(self, chunk):
        if self.fatal:
            raise Fatal("the stream blew up")

    def fail(self, message):
        self.error = message
        self.done.set()

    def is_cancelled(self):
        return False


def test_a_dead_engine_loop_fails_its_requests_refuses_new_ones_and_reports_why(tmp_path):
    from conftest import make_target
    from dflash_runtime import SamplingParams, SpeculativeEngine, load_target
    from dflash_serving.engine_loop import EngineLoop, EngineStopped

    target = load_target(make_target(tmp_path / "target", "qwen3"))
    causes = []
    loop = EngineLoop(lambda: SpeculativeEngine(target, None, max_batch_size=2), on_failure=causes.append)
    waiting = Recorder()
    try:
        loop.submit([1, 2, 3], SamplingParams(max_new_tokens=500, ignore_eos=True), waiting)
        loop.submit([4, 5], SamplingParams(max_new_tokens=4), Recorder(fatal=True))
        assert waiting.done.wait(60)
        assert not loop.alive and causes == ["Fatal: the stream blew up"] == [loop.failure]
        assert ENGINE_STOPPED_MESSAGE in waiting.error and error_class(waiting.error) == "UNAVAILABLE"
        with pytest.raises(EngineStopped, match="Fatal: the stream blew up") as refused:
            loop.submit([1], SamplingParams(max_new_tokens=1), Recorder())
        assert error_class(str(refused.value)) == "UNAVAILABLE"
    finally:
        loop.stop()


def test_dflash_serve_stops_a_server_whose_engine_reported_its_death(tmp_path, monkeypatch, capsys):
    # the report travels by file from the dflash model to dflash-serve; here a plain process stands for
    # tritonserver, since only whether and how it is stopped matters
    process = subprocess.Popen(["sleep", "120"], start_new_session=True)
    server = TritonServer(process, pick_ports(dict.fromkeys(PORTS, 0)), None, tmp_path / "runtime")
    server.runtime_dir.mkdir()
    monkeypatch.setenv(FAILURE_FILE_ENV, str(server.failure_file))
    assert server.health_problem() is None
    report_engine_failure("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert supervise(server, threading.Thread(target=lambda: None)) == UNHEALTHY_EXIT_CODE
    assert process.returncode == -signal.SIGTERM and not server.runtime_dir.exists()
    assert "the dflash engine stopped (RuntimeError: CUDA error" in capsys.readouterr().err
