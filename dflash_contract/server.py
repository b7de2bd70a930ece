"""How `dflash-serve` is reached, watched and stopped: ports, probe paths, health watch, drain protocol.

The launcher (deploy/serve.py), the `dflash` Triton model, the clients' defaults and the Kubernetes
manifests all read these.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
import time
from pathlib import Path

# openai: the OpenAI-compatible gateway (dflash_gateway) beside tritonserver; 9000 is Triton's own OpenAI frontend's
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
GATEWAY_HEALTH_PATH = "/health"  # 200 only while tritonserver is ready
GATEWAY_METRICS_PATH = "/metrics"  # the gateway's own metrics, on its port (tritonserver's are on the metrics port)
OPENAI_API_KEY_ENV = "DFLASH_OPENAI_API_KEY"  # the gateway's API key, when one is required
READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
METRICS_PATH = "/metrics"
# Request latency buckets (seconds), of the server's metrics and the gateway's. A token costs ~1-5 ms on a GPU
# (several per DFlash step) and tens of ms on a CPU; the first one adds the prefill and the wait for a slot (the
# queue timeout is 60 s by default); answers run to minutes.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)

# The drain protocol: on SIGTERM dflash-serve creates the drain file before it signals tritonserver.
# Triton tells a Python model nothing until it unloads it, which happens only after in-flight
# requests end; the dflash model watches the file, refuses new requests, fails the ones still running
# after DRAIN_SECONDS (so every client gets a final response), then creates `acknowledged_path` to say no
# request is left, and the launcher stops tritonserver, which waits at most EXIT_TIMEOUT_S for models
# to unload.
DRAIN_FILE_ENV = "DFLASH_DRAIN_FILE"
DRAIN_SECONDS_ENV = "DFLASH_DRAIN_SECONDS"
DRAIN_SECONDS = 30
EXIT_TIMEOUT_S = 15
DRAIN_SLACK_S = 5  # beyond DRAIN_SECONDS, for the model to end the last requests and say so
FLUSH_SECONDS = 1.5  # for the last responses to leave before tritonserver closes the connections
# the most a clean shutdown takes, in whole seconds (Kubernetes' grace period is an integer)
SHUTDOWN_SECONDS = math.ceil(DRAIN_SECONDS + DRAIN_SLACK_S + FLUSH_SECONDS + EXIT_TIMEOUT_S)


# The health watch. tritonserver 2.51 (the CPU server) keeps answering "live" and "ready" after a
# Python backend process dies (measured: every request then fails, and in-flight streams hang
# forever); from 26.01 its readiness sees a dead backend process, and from 26.03 it asks the model
# (`is_ready`), but it never restarts one. So dflash-serve watches every HEALTH_CHECK_SECONDS: the
# backend processes, the engine's failure file (the dflash model writes the cause there when its
# engine loop dies) and Triton's readiness. On a failure it writes the cause to that file (dflash_bls
# ends its streams with it, then creates `acknowledged_path`), waits for that, at most
# STREAMS_END_SECONDS, and allows FLUSH_SECONDS for those errors to leave, stops tritonserver
# (SIGKILL after ABORT_SECONDS: a server with a dead backend does not finish its graceful exit) and
# exits with UNHEALTHY_EXIT_CODE, so that the container (or its supervisor) restarts it.
FAILURE_FILE_ENV = "DFLASH_FAILURE_FILE"
HEALTH_CHECK_SECONDS = 1.0
NOT_READY_CHECKS = 2  # consecutive "not ready" answers from tritonserver that count as a failure
ABORT_SECONDS = 3
# A response send blocks until tritonserver takes it (python_backend's ResponseSender::Send): once
# dflash_bls says its streams ended, their errors are Triton's (rather than a guess at a pause).
STREAMS_END_SECONDS = 3
UNHEALTHY_EXIT_CODE = 3


# The progress watch. An engine loop that is alive but does not advance (a step that never returns: a GPU
# hang, a deadlock, a blocked device copy) leaves its process alive and Triton ready while every request
# waits. So the loop records, in a small file dflash-serve creates (PROGRESS_FILE_ENV), when its running step
# began and what its steps usually take (StepProgress); the health watch counts a step running longer than
# max(HANG_STEP_MULTIPLE x the usual step, the hang floor) as a failure, with a dead engine's consequences.
# The usual step is a moving average of the loop's own steps, prefills included: the multiple leaves room
# for a long prefill among decode steps (a 4k-token prefill costs tens of decode steps), and the floor
# (dflash-serve --hang-seconds) for the first steps, whose kernels compile and caches warm, and for slow
# CPUs. Nothing is judged while the loop waits for work: an idle server is not a hung one.
PROGRESS_FILE_ENV = "DFLASH_PROGRESS_FILE"
HANG_STEP_MULTIPLE = 50
HANG_FLOOR_SECONDS = 60.0
# A fault that every step raises (a CUDA error after an illegal access poisons the context for good) costs
# an INTERNAL error per step forever: after this many consecutive failed steps the loop stops as if its
# thread had died, and the server is restarted.
FAILED_STEPS_LIMIT = 3
# The longest a request waits for a KV-cache slot before it is refused as UNAVAILABLE (retry later or
# elsewhere): a client waits for its first token at most about this long on a saturated server, rather
# than for as long as every request before it takes. dflash-serve --queue-timeout sets it (0: no bound).
QUEUE_TIMEOUT_ENV = "DFLASH_QUEUE_TIMEOUT_SECONDS"
QUEUE_TIMEOUT_SECONDS = 60.0
# The prefix cache's changes for a router (dflash_serving/kv_events.py), when dflash-serve --kv-events-port is set:
# the ZMQ endpoints the dflash model binds (PUB; ROUTER for replays, optional) and the messages' topic.
KV_EVENTS_ENDPOINT_ENV = "DFLASH_KV_EVENTS_ENDPOINT"
KV_EVENTS_REPLAY_ENV = "DFLASH_KV_EVENTS_REPLAY_ENDPOINT"
KV_EVENTS_TOPIC_ENV = "DFLASH_KV_EVENTS_TOPIC"
# The port the chart publishes them on: llm-d's picker dials every pod of its pool there (its kv-events
# podDiscoveryConfig.socketPort, 5557 by default) and names the pod <ip>:<the pool's target port> in the topic.
KV_EVENTS_PORT = 5557
# Tests only: "hang-step" makes the engine loop's next step block forever, "fail-step" makes every step raise.
TEST_FAULT_ENV = "DFLASH_TEST_FAULT"


class StepProgress:
    """The engine loop's progress record, written by the loop and read by dflash-serve: a 16-byte mapped file
    holding when the running step began (CLOCK_MONOTONIC, one clock for every process of the machine; 0 when
    no step runs) and the loop's usual step seconds. A mapping: the loop writes it twice a step, with no
    system call."""

    FORMAT = "<dd"

    def __init__(self, path: Path):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), struct.calcsize(self.FORMAT))

    @classmethod
    def create(cls, path: Path) -> "StepProgress":
        path.write_bytes(bytes(struct.calcsize(cls.FORMAT)))
        return cls(path)

    def started(self, usual_seconds: float) -> None:
        self._map[:] = struct.pack(self.FORMAT, time.monotonic(), usual_seconds)

    def finished(self, usual_seconds: float) -> None:
        self._map[:] = struct.pack(self.FORMAT, 0.0, usual_seconds)

    def hung(self, floor_seconds: float) -> str | None:
        """Why the running step counts as hung, or None."""
        since, usual = struct.unpack(self.FORMAT, self._map[:])
        if not since:
            return None
        running, limit = time.monotonic() - since, max(HANG_STEP_MULTIPLE * usual, floor_seconds)
        if running <= limit:
            return None
        return (f"the engine made no progress: a step has run for {running:.1f} s (the limit is {limit:.1f} s: "
                f"{HANG_STEP_MULTIPLE} x the usual {usual:.3f} s, at least {floor_seconds:g} s)")


def queue_timeout() -> float | None:
    """Seconds a request may wait for a slot, as dflash-serve set it (QUEUE_TIMEOUT_SECONDS by default); None:
    no bound."""
    seconds = float(os.environ.get(QUEUE_TIMEOUT_ENV, QUEUE_TIMEOUT_SECONDS))
    return seconds if seconds > 0 else None


def progress_signal() -> StepProgress | None:
    """Where the engine loop records its progress, when launched by dflash-serve."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    return StepProgress(Path(path)) if path else None


def report_engine_failure(cause: str) -> None:
    """Tell dflash-serve (when it launched this server) that the engine died, and why."""
    path = os.environ.get(FAILURE_FILE_ENV)
    if path:
        Path(path).write_text(cause)


def failure_signal() -> Path | None:
    """The file whose appearance means "this server is failing" (its text: why), when launched by
    dflash-serve, which also writes it when a backend process dies: the front models then end their
    streams with an error that says so, before the server stops."""
    path = os.environ.get(FAILURE_FILE_ENV)
    return Path(path) if path else None


def acknowledged_path(signal_file: Path) -> Path:
    """The file a model creates once it acted on a signal file from dflash-serve: after the drain file, no
    request is left (the server may stop); after the failure file, every stream in flight was handed its
    final error (those may leave)."""
    return signal_file.with_name(signal_file.name + ".done")


def drain_signal() -> tuple[Path, float] | None:
    """(file whose appearance means "drain", seconds to let requests finish), when launched by dflash-serve."""
    path = os.environ.get(DRAIN_FILE_ENV)
    return (Path(path), float(os.environ.get(DRAIN_SECONDS_ENV, "0"))) if path else None
