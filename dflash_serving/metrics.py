"""Requests counted by how they ended, and timed, at the front model the client called.

Why our own: Triton 2.51 cannot count them. Its Python backend reports a request's success once per
execute() call, from whether execute() raised, before a decoupled model has sent anything, so a refusal sent
as an error response counts as a success and a stream's duration is execute()'s; its ensemble counts each
refused request twice as a failure (deploy/README.md, "Metrics", cites the source lines). These counters are
the source of truth, beside Triton's nv_* metrics on its metrics port.

Every series is labelled with `model_name`, the name the model is served under (as the engine's dflash_* metrics
and the gateway's vllm:* ones are: one label to join them by), and `model`, the front model the client called, as
Triton's nv_* metrics name it (FRONT_MODELS). Where each front model is counted:
- dflash_bls: in its own process, from its request's arrival to its last response to the client.
- ensemble: no Python runs at the ensemble itself. Its first step, preprocessing, counts the requests it
  refuses and gives the rest an arrival time (ARRIVAL_INPUT), which the ensemble passes on to dflash; dflash
  counts and times everything after that, up to its own responses (the detokenizing step after them is left out).
- dflash, called directly: in dflash, from its execute().
dflash_bls names its own calls of preprocessing and dflash with BLS_CALL_PREFIX, so those count once, at the front.

Triton-free: the models pass in pb_utils.MetricFamily, and every update goes through a queue to a thread of
its own (each one is a round trip to the server process, and dflash's come from the decoding thread).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Protocol

from dflash_contract.protocol import CAPACITY_MESSAGE, RENDER_CALL_PREFIX, error_class
from dflash_contract.server import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS

FRONT_MODELS = ("ensemble", "dflash_bls", "dflash")
BLS_CALL_PREFIX = "dflash_bls/"  # the request ids dflash_bls gives its own calls: not counted again there
ARRIVAL_INPUT = "arrival_ns"  # preprocessing -> dflash in the ensemble: when preprocessing got the request (ns)
# How a request ended -> the error classes it comes with ("": none). Bounded: every series is made at start-up,
# at 0, so rates and ratios exist before the first event.
#   stop, length  finished (the end-of-sequence or a stop word; max_tokens)
#   cancelled     its client cancelled it or went away (a client's deadline is a cancellation to Triton)
#   timed_out     refused after waiting longer than dflash-serve --queue-timeout for a slot
#   refused       turned away before its first token: a malformed request, a full queue, a server shutting down
#   failed        ended by an error after its first token, or by an internal error at any point
OUTCOMES = {"stop": ("",), "length": ("",), "cancelled": ("CANCELLED",), "timed_out": ("UNAVAILABLE",),
            "refused": ("INVALID_ARG", "UNAVAILABLE"), "failed": ("UNAVAILABLE", "INTERNAL")}
FINISHED = ("stop", "length")
# In the engine loop's message for a request that waited past the queue timeout ("... (waited 61 s for a slot, the
# limit is 60 s); retry later"); a full queue at the door says "at capacity" too, without it.
QUEUE_TIMEOUT_WORDS = "s for a slot"


# (name, description): the same in every process that makes the family
REQUESTS = ("dflash_requests_total", "Requests by the front model the client called (model), how they ended "
            "(outcome: stop, length, cancelled, timed_out, refused, failed) and the error's class (error_class)")
TIME_TO_FIRST_TOKEN = ("dflash_time_to_first_token_seconds", "Streamed requests: from arrival at the front model "
                       "to its first response with tokens")
INTER_TOKEN_LATENCY = ("dflash_inter_token_latency_seconds", "Streamed requests: the time between two responses "
                       "with tokens, divided by the later one's tokens, once per token")
E2E_REQUEST_LATENCY = ("dflash_e2e_request_latency_seconds", "Finished requests (stop, length): from arrival at "
                       "the front model to its last response")


class Counter(Protocol):
    def increment(self, value: float) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class TritonRegistry:
    """Counters and histograms made with the Python backend's pb_utils.MetricFamily (passed in: this module does
    not import Triton). It keeps the families, which must outlive their metrics."""

    def __init__(self, metric_family):
        self._metric_family = metric_family
        self._families = {}

    def counter(self, name: str, description: str, labels: dict[str, str]) -> Counter:
        return self._family(name, description, self._metric_family.COUNTER).Metric(labels=labels)

    def histogram(self, name: str, description: str, labels: dict[str, str], buckets) -> Histogram:
        family = self._family(name, description, self._metric_family.HISTOGRAM)
        return family.Metric(labels=labels, buckets=list(buckets))

    def _family(self, name, description, kind):
        if name not in self._families:
            self._families[name] = self._metric_family(name, description, kind)
        return self._families[name]


def error_outcome(message: str, tokens: int) -> tuple[str, str]:
    """(outcome, error class) of a request that ended with this error message after `tokens` tokens had reached
    its front model."""
    kind = error_class(message)
    if kind == "CANCELLED":
        return "cancelled", kind
    if CAPACITY_MESSAGE in message and QUEUE_TIMEOUT_WORDS in message:
        return "timed_out", kind
    if not tokens and kind in OUTCOMES["refused"]:
        return "refused", kind
    return "failed", kind


def counted_at_front(request_id: str) -> bool:
    """Whether a request that preprocessing refuses is the ensemble's own (counted there), not dflash_bls's call
    (counted by dflash_bls) nor a client's render (no front model's request)."""
    return not request_id.startswith((BLS_CALL_PREFIX, RENDER_CALL_PREFIX))


def front_model(request_id: str, arrival_ns) -> str | None:
    """The front model a `dflash` request came through: None for dflash_bls's calls (it counts its own)."""
    if request_id.startswith(BLS_CALL_PREFIX):
        return None
    return "ensemble" if arrival_ns is not None else "dflash"


class RequestMetrics:
    """The request counters and latency histograms of some front models, in one process; `outcomes` limits the
    counters it makes at start-up.

    Triton 2.51 removes a series when a model that made it unloads, even while another model still counts in it.
    One series is made by two models: the ensemble's refusals as INVALID_ARG (preprocessing's, and dflash's at its
    door). Both count it with count_now, while the ensemble's request is in flight, which keeps both loaded."""

    def __init__(self, registry, models: tuple[str, ...], model_name: str,
                 outcomes: dict[str, tuple[str, ...]] = OUTCOMES, latencies: bool = True):
        self._registry, self._model_name = registry, model_name
        self._counters = {}
        for model in models:
            for outcome, classes in outcomes.items():
                for kind in classes:
                    self._counter(model, outcome, kind)
        self._histograms = {}
        if latencies:
            for (name, description), buckets in ((TIME_TO_FIRST_TOKEN, TTFT_BUCKETS),
                                                  (INTER_TOKEN_LATENCY, ITL_BUCKETS),
                                                  (E2E_REQUEST_LATENCY, E2E_BUCKETS)):
                for model in models:
                    labels = {"model_name": model_name, "model": model}
                    self._histograms[name, model] = registry.histogram(name, description, labels, buckets)
        self._updates = queue.SimpleQueue()
        threading.Thread(target=self._apply_updates, name="dflash-request-metrics", daemon=True).start()

    def timeline(self, model: str, arrived: float | None = None, streamed: bool = True) -> RequestTimeline:
        """A request's timeline; arrived: time.monotonic() when it reached the front model (default: now)."""
        return RequestTimeline(self, model, time.monotonic() if arrived is None else arrived, streamed)

    def count_now(self, model: str, outcome: str, kind: str = "") -> None:
        """Count on this thread, before the request is answered (see the class's note)."""
        self._counter(model, outcome, kind).increment(1)

    def count(self, model: str, outcome: str, kind: str = "") -> None:
        self._updates.put(lambda: self.count_now(model, outcome, kind))

    def observe(self, name: str, model: str, value: float, times: int = 1) -> None:
        histogram = self._histograms[name, model]
        self._updates.put(lambda: [histogram.observe(value) for _ in range(times)])

    def flush(self, timeout: float = 5) -> bool:
        """Wait until the updates queued so far are applied (tests)."""
        done = threading.Event()
        self._updates.put(done.set)
        return done.wait(timeout)

    def _counter(self, model: str, outcome: str, kind: str) -> Counter:
        key = model, outcome, kind
        if key not in self._counters:  # an unusual pair (failed INVALID_ARG): made when it first happens
            labels = {"model_name": self._model_name, "model": model, "outcome": outcome, "error_class": kind}
            self._counters[key] = self._registry.counter(*REQUESTS, labels)
        return self._counters[key]

    def _apply_updates(self) -> None:
        while True:
            update = self._updates.get()
            try:
                update()
            except Exception as e:  # a metric is not worth the thread
                print(f"dflash: a request metric update failed: {type(e).__name__}: {e}", flush=True)


class RequestTimeline:
    """One request at its front model: its arrival, the responses that carried tokens, and how it ended. Only the
    first end counts (a stream can be ended from two threads: its own, and a failure's)."""

    def __init__(self, metrics: RequestMetrics, model: str, arrived: float, streamed: bool,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics, self.model, self.arrived, self.streamed = metrics, model, arrived, streamed
        self.tokens = 0  # that reached the front model
        self._last: float | None = None  # when the last response with tokens did
        self._ended = False
        self._lock = threading.Lock()
        self._clock = clock

    def responded(self, tokens: int) -> None:
        """A response reached the front model with `tokens` generated so far (cumulative)."""
        new = tokens - self.tokens
        if new <= 0:
            return
        now = self._clock()
        if self.streamed:
            if self._last is None:
                self.metrics.observe(TIME_TO_FIRST_TOKEN[0], self.model, now - self.arrived)
            else:
                self.metrics.observe(INTER_TOKEN_LATENCY[0], self.model, (now - self._last) / new, times=new)
        self.tokens, self._last = tokens, now

    def finished(self, reason: str) -> None:
        """It ended with its last response: reason is the engine's finish reason (stop, length, cancelled)."""
        if not self._end():
            return
        if reason not in FINISHED:  # the engine's "cancelled"
            self.metrics.count(self.model, "cancelled", "CANCELLED")
            return
        self.metrics.count(self.model, reason)
        self.metrics.observe(E2E_REQUEST_LATENCY[0], self.model, self._clock() - self.arrived)

    def ended_by_error(self, message: str) -> None:
        if self._end():
            self.metrics.count(self.model, *error_outcome(message, self.tokens))

    def refused_now(self, kind: str) -> None:
        """Refused at the door, counted before the refusal is sent (RequestMetrics.count_now)."""
        if self._end():
            self.metrics.count_now(self.model, "refused", kind)

    def _end(self) -> bool:
        with self._lock:
            ended, self._ended = self._ended, True
        return not ended
