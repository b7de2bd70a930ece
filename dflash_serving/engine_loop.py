"""The serving loop: one thread owns the engine and steps it while requests come and go.

Requests are submitted from server threads; between steps the loop drops cancelled requests and
the engine admits waiting ones (continuous batching), then one step drafts and verifies the whole
running batch, and every request with new tokens gets a chunk. A server translates chunks into its
own responses through the `Stream` it passes in; nothing here knows which server that is.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence as Seq

from dflash_contract import DFlashError
from dflash_contract.engine_counts import Counts, EngineCounts
from dflash_contract.protocol import (CANCELLED_MESSAGE, CAPACITY_MESSAGE, ENGINE_STOPPED_MESSAGE,
                                      INTERNAL_ERROR_PREFIX, SHUTTING_DOWN_MESSAGE, context_error)
from dflash_contract.server import FAILED_STEPS_LIMIT, TEST_FAULT_ENV, StepProgress
from dflash_runtime.engine import SpeculativeEngine, StepOutput
from dflash_runtime.sampling import SamplingParams, SamplingStats
from dflash_runtime.scheduler import Occupancy
from dflash_runtime.sequence import Sequence, Status

from .detokenize import token_window
from .kv_events import KVEventPublisher


CANCEL_CHECK_SECONDS = 0.25
USUAL_STEP_WEIGHT = 0.1  # of each step in the moving average of step seconds the progress record carries


class QueueFull(DFlashError):
    """The server is at capacity: retrying later can succeed (unlike other DFlashErrors)."""


class EngineStopped(DFlashError):
    """The loop thread died: this engine serves nothing more until its server restarts (retry elsewhere)."""


class StepsFailing(RuntimeError):
    """FAILED_STEPS_LIMIT steps in a row raised: a fault no request causes, which ends the loop."""


@dataclass
class Chunk:
    """New output for one request: `token_ids[read_offset:]` are new, the rest is decoding context."""

    token_ids: list[int]
    read_offset: int
    finished: bool
    finish_reason: str | None
    stats: SamplingStats
    prompt_tokens: int
    output_tokens: int  # so far
    cached_tokens: int  # of the prompt's, found in the prefix cache (0 before the sequence is admitted)
    logprobs: list | None = None  # the new tokens' (dflash_runtime.logprobs.TokenLogprobs), where asked for


class Stream(Protocol):
    def send(self, chunk: Chunk) -> None: ...

    def fail(self, message: str) -> None: ...

    def is_cancelled(self) -> bool: ...


@dataclass(eq=False)
class _Request:
    sequence: Sequence
    stream: Stream
    streaming: bool
    shown: int = 0  # output tokens already sent
    queued_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # the start of the step that first gave it a place in the batch


@dataclass
class StepReport:
    """What one loop iteration did, for metrics."""

    acceptance_lengths: list[int] = field(default_factory=list)
    verify_length: int | None = None  # the step's verify length (1 + drafts per sequence); None: no verify
    seconds: dict[str, float] = field(default_factory=dict)  # prefill / draft / verify
    # the iteration's wall seconds by phase: the engine step's (step_clock.py) and the loop's own ("loop": admissions,
    # cancellation checks, occupancy); empty for an iteration that ran no step
    phases: dict[str, float] = field(default_factory=dict)
    new_tokens: int = 0
    active: int = 0
    queued: int = 0
    kv_cache_utilization: float = 0.0  # KV blocks held by running sequences / all blocks
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0  # cached ones included: they are reused when needed
    cancelled: int = 0
    # cumulative since the engine started (counters take the difference)
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    kv_events_dropped: int = 0  # steps whose prefix-cache events the publisher dropped (kv_events.py)
    shared_suffix_tokens: int = 0  # earlier requests' output tokens held for suffix drafts (suffix_drafts.py)
    # draft source ("drafter", "suffix", "none") -> {"steps", "drafted", "accepted"} (DraftSources.summary)
    draft_sources: dict[str, dict[str, int]] = field(default_factory=dict)
    # per request, as vLLM's request_queue_time and request_prefill_time: the requests first scheduled in this step,
    # from their arrival to the step's start; those whose first token came in it, from their scheduling to the end
    request_queue_seconds: list[float] = field(default_factory=list)
    request_prefill_seconds: list[float] = field(default_factory=list)


class EngineLoop:
    def __init__(self, make_engine: Callable[[], SpeculativeEngine], max_queue_size: int = 64,
                 on_step: Callable[[StepReport], None] | None = None,
                 on_failure: Callable[[str], None] | None = None, progress: StepProgress | None = None,
                 max_queue_seconds: float | None = None, counts: EngineCounts | None = None,
                 kv_events: KVEventPublisher | None = None):
        """make_engine runs on the loop thread, and no other thread should run torch afterwards.

        Why: each thread that runs a parallel torch op gets its own OpenMP team, and on a small CPU
        a live idle team slows the other down. Measured on 2 cores: the engine loaded on the main
        thread and stepped on a worker decoded 25-30% slower than loaded and stepped on one thread.
        Raises what make_engine raises. on_failure(cause) is called once if the loop thread dies (or
        FAILED_STEPS_LIMIT steps in a row raise). progress, when given, records each step's start and end
        for a watch in another process (dflash_contract.server.StepProgress). A request still waiting for a
        slot after max_queue_seconds is refused as at capacity (None: it waits as long as it takes). counts, when
        given, gets the engine's counts whenever they change: at each request's arrival and after each iteration
        (dflash_contract.engine_counts, what a router reads). kv_events, when given, gets each iteration's changes of
        the prefix cache (kv_events.py), and is closed with the loop.
        """
        if max_queue_size < 0:
            raise DFlashError(f"max queue size must be >= 0, got {max_queue_size}")
        self.max_queue_size = max_queue_size
        self.max_queue_seconds = max_queue_seconds
        self.on_step = on_step
        self.on_failure = on_failure
        self.failure: str | None = None  # why the loop thread died
        self.progress = progress
        self.counts, self.kv_events = counts, kv_events
        self._prompt_tokens = self._generation_tokens = 0  # since the engine started, for `counts`
        self._usual_step_seconds = 0.0
        self._failed_steps = 0
        self._fault = os.environ.get(TEST_FAULT_ENV)  # tests only (dflash_contract.server)
        self._requests: dict[Sequence, _Request] = {}
        # the admitted requests not yet scheduled, and the scheduled ones without a first token: only these are
        # looked at for their queue and prefill times
        self._unscheduled: list[_Request] = []
        self._prefilling: list[_Request] = []
        self._lock = threading.Lock()  # guards the engine's queues and self._requests; held through each step
        # Admission must not wait for a step: a submit that did took a whole step per request (a server's
        # requests arrive on one thread), so a burst of 64 waited ~64 steps to be queued or refused. Requests
        # wait in _pending, admitted at the next step; _occupancy is the engine's as of the last admission or step.
        self._admit_lock = threading.Lock()  # guards _pending, _occupancy and the flags submit reads
        self._pending: list[_Request] = []
        self._occupancy: Occupancy | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._drain_deadline: float | None = None
        self._next_cancel_check = 0.0
        self.drained = threading.Event()
        self._started = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_guarded, args=(make_engine,), name="dflash-engine-loop",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        if self._load_error is not None:
            raise self._load_error

    def submit(self, prompt_ids: Seq[int], params: SamplingParams, stream: Stream, streaming: bool = True) -> None:
        """Queue a request; raises DFlashError for bad input and QueueFull when the queue is full. Returns at once,
        whatever the engine is doing: the request joins the engine at its next step."""
        seq = self.engine.new_sequence(prompt_ids, params)  # first: it says why the context is what it is
        error = context_error(len(prompt_ids), params.max_new_tokens, self.engine.max_context)
        if error:
            raise DFlashError(error)
        with self._admit_lock:
            if self.failure is not None:
                raise EngineStopped(f"{ENGINE_STOPPED_MESSAGE} ({self.failure}); retry on another replica")
            if self._stopping or self._drain_deadline is not None:
                raise QueueFull(SHUTTING_DOWN_MESSAGE)
            occupancy, pending = self._occupancy, len(self._pending)
            if occupancy.waiting + pending - occupancy.free_slots >= self.max_queue_size:
                raise QueueFull(f"{CAPACITY_MESSAGE} ({occupancy.running} running, {occupancy.waiting + pending} "
                                f"queued, queue limit {self.max_queue_size}); retry later")
            self._pending.append(_Request(seq, stream, streaming))
            self._publish_counts()
            self._wake.set()

    def drain(self, grace_seconds: float) -> None:
        """Refuse new requests; requests still unfinished after `grace_seconds` get a final error.

        `drained` is set once no request is left (each has had its final response sent)."""
        with self._lock, self._admit_lock:
            self._drain_deadline = time.monotonic() + grace_seconds
        self._wake.set()

    def stop(self, message: str = SHUTTING_DOWN_MESSAGE) -> None:
        """Stop stepping; requests still in flight get `message` as a final error."""
        with self._lock, self._admit_lock:
            self._stopping = True
        self._wake.set()
        self._thread.join()
        for request in [*self._requests.values(), *self._pending]:
            _fail(request, message)
        self._requests.clear()
        self._pending.clear()
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def alive(self) -> bool:
        """The loop is stepping (or waiting for work): not died, not stopped."""
        return self.failure is None and self._thread.is_alive()

    # -- the loop thread ---------------------------------------------------------------------------
    def _run_guarded(self, make_engine: Callable[[], SpeculativeEngine]) -> None:
        # A step's exceptions are handled in _run; anything that still escapes ends the thread, and
        # a dead loop must not look alive: requests would queue forever behind it.
        try:
            self._run(make_engine)
        except BaseException as e:
            traceback.print_exc()
            self._die(f"{type(e).__name__}: {e}")

    def _die(self, cause: str) -> None:
        with self._lock, self._admit_lock:
            self.failure = cause
            requests = [*self._requests.values(), *self._pending]
            self._requests.clear()
            self._pending.clear()
        for request in requests:
            _fail(request, f"{ENGINE_STOPPED_MESSAGE} ({cause}); retry on another replica")
        self.drained.set()  # nothing is left to drain: a shutdown need not wait for it
        if self.on_failure is not None:
            self.on_failure(cause)

    def _run(self, make_engine: Callable[[], SpeculativeEngine]) -> None:
        try:
            self.engine = make_engine()
            self._occupancy = self.engine.occupancy()
            self._publish_counts()
            if self.kv_events is not None:  # from now: the start-up's dummy sequences are nobody's prefixes
                self.engine.block_manager.record_events()
                self.kv_events.medium = "GPU" if self.engine.device.type == "cuda" else "CPU"
        except BaseException as e:
            self._load_error = e
            return
        finally:
            self._started.set()
        while True:
            self._wake.wait(timeout=None if self._drain_deadline is None else 0.5)
            with self._lock:
                if self._stopping:
                    return
                try:
                    ready, report = self._step()
                except Exception as e:  # a bug or out-of-memory: fail what is in flight, keep serving
                    traceback.print_exc()
                    self._failed_steps += 1
                    if self._failed_steps >= FAILED_STEPS_LIMIT:  # not one request's fault: the engine's
                        raise StepsFailing(f"{self._failed_steps} engine steps in a row failed, the last with "
                                           f"{type(e).__name__}: {e}") from e
                    self._abort(list(self._requests.values()), f"{INTERNAL_ERROR_PREFIX}: {type(e).__name__}: {e}")
                    continue
            for request in ready:
                self._emit(request)
            if self._drain_deadline is not None and not self._requests:
                self.drained.set()
            if self.on_step is not None:
                try:
                    self.on_step(report)
                except Exception:  # metrics are not worth a dead loop
                    traceback.print_exc()

    def _step(self) -> tuple[list[_Request], StepReport]:
        """One iteration under the lock: admissions, drain deadline, cancellations, one engine step."""
        started = time.perf_counter()
        self._admit()
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self._abort(list(self._requests.values()), f"{SHUTTING_DOWN_MESSAGE}; the request was aborted")
        cancelled = self._drop_cancelled()
        self._drop_overdue()
        outputs, phases, step_started = [], {}, time.monotonic()
        if self.engine.has_unfinished():
            outputs = self._timed_step()
            phases = dict(self.engine.phases.seconds)
        request_seconds = self._queue_and_prefill_seconds(step_started)
        self._generation_tokens += sum(len(o.new_token_ids) for o in outputs)
        if self.kv_events is not None:
            self.kv_events.publish(self.engine.block_manager.take_events())
        with self._admit_lock:
            self._occupancy = self.engine.occupancy()  # the slots this step freed
            self._publish_counts()
            if not self.engine.has_unfinished() and not self._pending:
                self._wake.clear()  # under the admission lock: a submit's wake-up cannot fall between
        # a request prefilled in this step is also in its draft/verify pass: one chunk covers both
        ready = list({o.sequence: self._requests[o.sequence] for o in outputs}.values())
        for request in ready:
            if request.sequence.finished:
                del self._requests[request.sequence]
        if phases:  # the loop's own: the iteration less the step's phases
            phases["loop"] = time.perf_counter() - started - sum(phases.values())
        return ready, self._report(outputs, cancelled, phases, *request_seconds)

    def _admit(self) -> None:
        with self._admit_lock:
            for request in self._pending:
                self.engine.scheduler.add(request.sequence)
                self._requests[request.sequence] = request
                self._unscheduled.append(request)
                self._prompt_tokens += len(request.sequence.prompt_ids)
            self._pending.clear()
            self._occupancy = self.engine.occupancy()

    def _queue_and_prefill_seconds(self, step_started: float) -> tuple[list[float], list[float]]:
        """The queue times of the requests this step scheduled first, the prefill times of those it gave their first
        token (StepReport). Before finished requests leave: one that ends in its first step has its prefill counted."""
        queue, prefill, unscheduled, prefilling = [], [], [], []
        for request in self._unscheduled:
            if request.sequence not in self._requests:  # aborted while it waited
                continue
            if request.sequence.status is Status.WAITING:
                unscheduled.append(request)
                continue
            request.scheduled_at = step_started
            queue.append(step_started - request.queued_at)
            self._prefilling.append(request)
        now = time.monotonic()
        for request in self._prefilling:
            if request.sequence not in self._requests:
                continue
            if request.sequence.output_ids:
                prefill.append(now - request.scheduled_at)
            else:
                prefilling.append(request)
        self._unscheduled, self._prefilling = unscheduled, prefilling
        return queue, prefill

    def _publish_counts(self) -> None:
        """The engine's counts as of the last admission or step, with the requests not yet admitted as waiting.
        Under the admission lock."""
        if self.counts is None:
            return
        occupancy = self._occupancy
        self.counts.write(Counts(occupancy.running, occupancy.waiting + len(self._pending), occupancy.used_blocks,
                                 occupancy.used_blocks + occupancy.free_blocks, self.engine.block_manager.block_size,
                                 self._prompt_tokens, self._generation_tokens, self.engine.max_context))

    def _timed_step(self) -> list[StepOutput]:
        started = time.monotonic()
        if self.progress is not None:
            self.progress.started(self._usual_step_seconds)
        try:
            if self._fault == "hang-step":
                threading.Event().wait()
            if self._fault == "fail-step":
                raise RuntimeError(f"a failing step ({TEST_FAULT_ENV}=fail-step)")
            outputs = self.engine.step()
            self._failed_steps = 0  # only a step that ran counts: idle iterations say nothing of the engine
            return outputs
        finally:
            seconds = time.monotonic() - started
            usual = self._usual_step_seconds
            self._usual_step_seconds = (seconds if not usual else
                                        (1 - USUAL_STEP_WEIGHT) * usual + USUAL_STEP_WEIGHT * seconds)
            if self.progress is not None:
                self.progress.finished(self._usual_step_seconds)

    def _drop_cancelled(self) -> int:
        # asking a server whether a request was cancelled can be a round trip to another process:
        # a few times a second frees slots soon enough without taxing every step
        now = time.monotonic()
        if now < self._next_cancel_check:
            return 0
        self._next_cancel_check = now + CANCEL_CHECK_SECONDS
        cancelled = [r for r in self._requests.values() if _is_cancelled(r)]
        self._abort(cancelled, CANCELLED_MESSAGE)
        return len(cancelled)

    def _drop_overdue(self) -> None:
        """Requests that waited for a slot longer than max_queue_seconds: refused, as if the queue were full."""
        if self.max_queue_seconds is None:
            return
        now = time.monotonic()
        overdue = [r for r in self._requests.values() if r.sequence.status is Status.WAITING
                   and now - r.queued_at > self.max_queue_seconds]
        for request in overdue:
            self._abort([request], f"{CAPACITY_MESSAGE} (waited {now - request.queued_at:.0f} s for a slot, the "
                                   f"limit is {self.max_queue_seconds:g} s); retry later")

    def _abort(self, requests: list[_Request], message: str) -> None:
        for request in requests:
            self.engine.cancel(request.sequence)
            del self._requests[request.sequence]
            _fail(request, message)

    def _emit(self, request: _Request) -> None:
        seq = request.sequence
        if not request.streaming and not seq.finished:
            return
        window, read_offset = token_window(seq.output_ids, request.shown)
        chunk = Chunk(window, read_offset, seq.finished, seq.finish_reason, seq.stats, len(seq.prompt_ids),
                      len(seq.output_ids), seq.num_cached_tokens or 0,
                      seq.logprobs[request.shown:] if seq.params.logprobs is not None else None)
        request.shown = len(seq.output_ids)
        try:
            request.stream.send(chunk)
        except Exception:  # the client went away: the next iteration frees its slot
            with self._lock:
                if not seq.finished:
                    self.engine.cancel(seq)
                    self._requests.pop(seq, None)

    def _report(self, outputs: list[StepOutput], cancelled: int, phases: dict[str, float],
                queue_seconds: list[float], prefill_seconds: list[float]) -> StepReport:
        occupancy = self._occupancy  # the engine's, taken after this iteration's step
        stepped = bool(phases)  # an iteration that ran no step must not report the last step's figures again
        return StepReport(
            acceptance_lengths=[o.acceptance_length for o in outputs if o.acceptance_length is not None],
            verify_length=self.engine.last_verify_length if stepped else None,
            seconds={k: v if stepped else 0.0 for k, v in self.engine.last_step_seconds.items()},
            phases=phases,
            new_tokens=sum(len(o.new_token_ids) for o in outputs),
            active=occupancy.running,
            queued=occupancy.waiting,
            kv_cache_utilization=occupancy.kv_cache_utilization,
            kv_blocks_used=occupancy.used_blocks,
            kv_blocks_free=occupancy.free_blocks,
            cancelled=cancelled,
            prefix_queried_tokens=occupancy.prefix_queried_tokens,
            prefix_hit_tokens=occupancy.prefix_hit_tokens,
            preemptions=occupancy.preemptions,
            kv_events_dropped=self.kv_events.dropped if self.kv_events is not None else 0,
            shared_suffix_tokens=self.engine.shared_responses.held if self.engine.shared_responses else 0,
            draft_sources=self.engine.draft_sources.summary(),
            request_queue_seconds=queue_seconds,
            request_prefill_seconds=prefill_seconds,
        )


def _is_cancelled(request: _Request) -> bool:
    try:
        return request.stream.is_cancelled()
    except Exception:
        return True


def _fail(request: _Request, message: str) -> None:
    try:
        request.stream.fail(message)
    except Exception:
        pass  # the client is gone already; nothing is waiting for this error
