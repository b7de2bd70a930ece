"""The serving loop without a server: streaming chunks, cancellation, queue limit, drain, failure isolation."""
from __future__ import annotations

import re
import struct
import subprocess
import sys
import threading
import time

import pytest

from conftest import PROMPTS, load_pair
from dflash_contract.engine_counts import Counts, EngineCounts
from dflash_contract.protocol import CAPACITY_MESSAGE, ENGINE_STOPPED_MESSAGE, error_class
from dflash_contract.server import FAILED_STEPS_LIMIT, TEST_FAULT_ENV, StepProgress
from dflash_runtime import SamplingParams
from dflash_runtime.config import DFlashError
from dflash_serving import engine_loop
from dflash_serving.engine_loop import EngineLoop, QueueFull


class Collector:
    """A Stream that records what the loop sends."""

    def __init__(self, cancel_after: int | None = None):
        self.chunks, self.error, self.done = [], None, threading.Event()
        self.cancel_after = cancel_after

    def send(self, chunk):
        self.chunks.append(chunk)
        if chunk.finished:
            self.done.set()

    def fail(self, message):
        self.error = message
        self.done.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.chunks) >= self.cancel_after

    def output_ids(self):
        ids = []
        for c in self.chunks:
            ids += c.token_ids[c.read_offset:]
        return ids


def _engine(tiny):
    from dflash_runtime import SpeculativeEngine

    target, drafter = load_pair(tiny)
    return SpeculativeEngine(target, drafter, max_batch_size=2, max_context=256)


class SlowCollector(Collector):
    """A Collector whose client reads slowly: each chunk holds the loop's thread, which sends it, that long."""

    def __init__(self, seconds_per_chunk: float):
        super().__init__()
        self.seconds_per_chunk = seconds_per_chunk

    def send(self, chunk):
        time.sleep(self.seconds_per_chunk)
        super().send(chunk)


def _loop(tiny, **kwargs):
    engine = _engine(tiny)
    return engine, EngineLoop(lambda: engine, **kwargs)


def test_streamed_chunks_rebuild_the_solo_output(tiny):
    engine, loop = _loop(tiny)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    try:
        expected = [s.output_ids for s in engine.generate(PROMPTS, params)]  # before the loop has work
        streams = [Collector() for _ in PROMPTS]
        for prompt, stream in zip(PROMPTS, streams):  # 4 requests, 2 slots: two wait in the queue
            loop.submit(prompt, params, stream)
        for stream in streams:
            assert stream.done.wait(60) and stream.error is None
        assert [s.output_ids() for s in streams] == expected
        assert all(len(s.chunks) > 1 for s in streams) and streams[0].chunks[-1].finish_reason == "length"
        # each chunk carries at most CONTEXT_TOKENS already-sent tokens as decoding context
        assert all(c.read_offset <= 5 for s in streams for c in s.chunks)
    finally:
        loop.stop()


def test_non_streaming_request_gets_one_complete_chunk(tiny):
    engine, loop = _loop(tiny)
    stream = Collector()
    try:
        loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True), stream, streaming=False)
        assert stream.done.wait(60)
        assert len(stream.chunks) == 1 and stream.chunks[0].read_offset == 0 and len(stream.chunks[0].token_ids) == 20
    finally:
        loop.stop()


def test_cancelled_request_frees_its_slot_and_others_continue(tiny, monkeypatch):
    monkeypatch.setattr(engine_loop, "CANCEL_CHECK_SECONDS", 0.0)  # tiny models finish within one interval
    engine, loop = _loop(tiny)
    reports = []
    loop.on_step = reports.append
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    cancelled, other = Collector(cancel_after=2), Collector()
    try:
        loop.submit(PROMPTS[0], params, cancelled)
        loop.submit(PROMPTS[1], params, other)
        assert cancelled.done.wait(60) and cancelled.error == "request cancelled"
        assert other.done.wait(60) and other.error is None and len(other.output_ids()) == 60
        assert sum(r.cancelled for r in reports) == 1
        assert engine.occupancy().free_slots == 2 and engine.occupancy().running == 0 and reports[-1].active == 0
    finally:
        loop.stop()


def test_bad_requests_are_refused_at_the_door_and_the_queue_is_bounded(tiny):
    engine, loop = _loop(tiny, max_queue_size=1)
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    streams = [Collector() for _ in range(3)]
    try:
        with pytest.raises(DFlashError, match="context limit"):
            loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=1000), Collector())
        with pytest.raises(DFlashError, match="outside the vocabulary"):
            loop.submit([10**6], long, Collector())
        for stream in streams:  # two slots: whatever the loop has admitted, one request waits
            loop.submit(PROMPTS[0], long, stream)
        with pytest.raises(QueueFull, match="at capacity"):
            loop.submit(PROMPTS[1], long, Collector())
    finally:
        loop.stop()
    assert all(s.error == "the server is shutting down" for s in streams)


def test_drain_refuses_new_requests_and_ends_running_ones_with_an_error(tiny):
    engine, loop = _loop(tiny)
    stream = Collector()
    try:
        loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True), stream)
        assert not loop.drained.is_set()
        loop.drain(0.0)
        with pytest.raises(QueueFull, match="shutting down"):
            loop.submit(PROMPTS[1], SamplingParams(max_new_tokens=5), Collector())
        assert loop.drained.wait(30) and "shutting down" in stream.error  # drained: the error was sent
        assert engine.occupancy().running == 0 and engine.occupancy().free_slots == 2
    finally:
        loop.stop()


def test_a_request_that_ends_in_its_first_step_is_sent_once(tiny):
    engine, loop = _loop(tiny)
    stream = Collector()
    try:  # prefill gives token 1, the same step's verify pass gives token 2 and ends the request
        loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True), stream)
        assert stream.done.wait(30) and stream.error is None
        assert len(stream.chunks) == 1 and len(stream.output_ids()) == 2
        loop.submit(PROMPTS[1], SamplingParams(max_new_tokens=3, ignore_eos=True), stream := Collector())
        assert stream.done.wait(30) and stream.output_ids()  # the loop is still alive
    finally:
        loop.stop()



def test_the_engine_is_built_on_the_loop_thread_and_load_errors_reach_the_caller(tiny):
    built_on = []

    def make_engine():
        built_on.append(threading.current_thread())
        return _engine(tiny)

    loop = EngineLoop(make_engine)
    try:
        assert built_on == [loop._thread] and loop.engine.block_size > 1
    finally:
        loop.stop()

    def broken():
        raise DFlashError("no such checkpoint")

    with pytest.raises(DFlashError, match="no such checkpoint"):
        EngineLoop(broken)


def test_steps_that_fail_every_time_stop_the_engine_after_the_limit(tiny, monkeypatch):
    """A fault in every step (DFLASH_TEST_FAULT=fail-step, as a poisoned CUDA context): the first failures are
    INTERNAL errors for the requests in flight; the FAILED_STEPS_LIMIT-th stops the loop like a dead thread."""
    monkeypatch.setenv(TEST_FAULT_ENV, "fail-step")
    causes = []
    engine, loop = _loop(tiny, on_failure=causes.append)
    params = SamplingParams(max_new_tokens=8)
    try:
        errors = []
        for _ in range(FAILED_STEPS_LIMIT):  # one request at a time: each failed step fails what is in flight
            stream = Collector()
            loop.submit(PROMPTS[0], params, stream)
            assert stream.done.wait(60)
            errors.append(stream.error)
        assert all(error_class(e) == "INTERNAL" for e in errors[:-1]), errors
        assert ENGINE_STOPPED_MESSAGE in errors[-1] and error_class(errors[-1]) == "UNAVAILABLE", errors[-1]
        assert not loop.alive and len(causes) == 1
        assert causes[0].startswith(f"StepsFailing: {FAILED_STEPS_LIMIT} engine steps in a row failed")
        with pytest.raises(engine_loop.EngineStopped):
            loop.submit(PROMPTS[0], params, Collector())
    finally:
        loop.stop()


def test_a_good_step_resets_the_count_of_failed_ones(tiny, monkeypatch):
    engine, loop = _loop(tiny)
    try:
        for fault in ["fail-step"] * (FAILED_STEPS_LIMIT - 1) + [None] + ["fail-step"] * (FAILED_STEPS_LIMIT - 1):
            loop._fault = fault  # the switch is read at start-up; here it flips between requests
            stream = Collector()
            loop.submit(PROMPTS[1], SamplingParams(max_new_tokens=2), stream)
            assert stream.done.wait(60)
        assert loop.alive
    finally:
        loop.stop()


def test_the_loop_records_each_step_for_the_progress_watch(tiny, tmp_path):
    path = tmp_path / "progress"
    watch = StepProgress.create(path)
    engine, loop = _loop(tiny, progress=StepProgress(path))
    try:
        stream = Collector()
        loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True), stream)
        assert stream.done.wait(60) and stream.error is None
        since, usual = struct.unpack(StepProgress.FORMAT, path.read_bytes())
        assert since == 0 and 0 < usual < 60  # no step running, and a moving average of real steps
        assert watch.hung(floor_seconds=0) is None
        # a step that began long ago and has not returned is hung, past the floor and the usual multiple
        StepProgress(path).started(usual_seconds=0.001)  # the limit: max(50 x 1 ms, the floor)
        time.sleep(0.3)
        assert watch.hung(floor_seconds=60) is None
        assert "the engine made no progress: a step has run for" in watch.hung(floor_seconds=0.1)
    finally:
        loop.stop()


def test_the_counts_a_router_reads_are_the_engines_own_at_every_change(tiny, tmp_path):
    """Written at each arrival (a request not yet admitted waits too) and after each iteration: during a step, the
    queue grows with every submit; after it, running, waiting and KV blocks are the engine's occupancy exactly."""
    path = tmp_path / "counts"
    reader = EngineCounts.create(path)
    engine, loop = _loop(tiny, counts=EngineCounts(path))  # 2 slots
    gate, stepping, mismatches = threading.Event(), threading.Event(), []
    step = engine.step

    def held_step():
        stepping.set()
        gate.wait()
        return step()

    def check(_report):  # on the loop's thread, after the iteration published its counts
        occupancy, counts = engine.occupancy(), reader.read()
        seen = (counts.running, counts.waiting, counts.kv_blocks_used, counts.kv_blocks)
        want = (occupancy.running, occupancy.waiting + len(loop._pending),  # arrived during the step: not yet admitted
                occupancy.used_blocks, occupancy.used_blocks + occupancy.free_blocks)
        if seen != want:
            mismatches.append((seen, want))

    engine.step, loop.on_step = held_step, check
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    streams = [Collector() for _ in range(4)]
    try:
        # written once loaded
        assert reader.read() == Counts(0, 0, 0, engine.block_manager.num_blocks, 16, 0, 0, engine.max_context)
        loop.submit(PROMPTS[0], params, streams[0])
        assert stepping.wait(60)  # the first step holds: the request is in the scheduler's queue, not yet running
        for stream in streams[1:]:
            loop.submit(PROMPTS[1], params, stream)
            assert reader.read().waiting == 1 + streams.index(stream)  # each arrival counted at once
        assert reader.read().running == 0 and reader.read().prompt_tokens == len(PROMPTS[0])
        gate.set()
        assert all(s.done.wait(60) and s.error is None for s in streams)
        assert not mismatches, mismatches
        final = reader.read()
        assert (final.running, final.waiting, final.kv_blocks_used) == (0, 0, 0)
        assert final.prompt_tokens == len(PROMPTS[0]) + 3 * len(PROMPTS[1])
        assert final.generation_tokens == sum(len(s.output_ids()) for s in streams) == 4 * 12
    finally:
        gate.set()
        loop.stop()


def test_a_reader_never_takes_half_of_one_write(tmp_path):
    """A reader in another process, reading while the writer rewrites as fast as it can, sees every field of one
    write or none: the seqlock."""
    path = tmp_path / "counts"
    writer = EngineCounts.create(path)
    code = ("import sys; from pathlib import Path; from dflash_contract.engine_counts import EngineCounts\n"
            "reader, seen = EngineCounts(Path(sys.argv[1])), set()\n"
            "while len(seen) < 2000:\n"
            "    c = reader.read()\n"
            "    if c is not None:\n"
            "        assert len(set(vars(c).values())) == 1, c\n"
            "        seen.add(c.running)\n"
            "print(len(seen))\n")
    reading = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    n = 0
    while reading.poll() is None:
        n += 1
        writer.write(Counts(*[n] * 8))
    assert reading.returncode == 0 and reading.stdout.read().strip() == "2000"


def test_submit_never_waits_for_the_step_in_progress(tiny):
    """A server's requests arrive on one thread (Triton's execute): a submit that waited for the step in progress
    let one request in per step, so a burst of 64 took about 64 steps to be queued or refused."""
    engine, loop = _loop(tiny, max_queue_size=2)  # 2 slots
    gate, stepping = threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        stepping.set()
        gate.wait()
        return step()

    engine.step = held_step
    accepted, refused = [Collector()], []

    def burst():
        for _ in range(8):
            stream = Collector()
            try:
                loop.submit(PROMPTS[1], SamplingParams(max_new_tokens=4), stream)
                accepted.append(stream)
            except QueueFull as e:
                refused.append(str(e))

    worker = threading.Thread(target=burst)
    try:
        loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=4), accepted[0])
        assert stepping.wait(60)  # a step is in progress, and stays so until the gate opens
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "submit waited for the step in progress"
        assert len(accepted) == 4 and len(refused) == 5  # the 2 slots and the queue of 2 filled, no more
        assert all(CAPACITY_MESSAGE in e and "4 queued, queue limit 2" in e for e in refused), refused
    finally:
        gate.set()
        worker.join(60)
        try:
            assert all(s.done.wait(60) and s.error is None for s in accepted)
        finally:
            loop.stop()


def test_a_request_that_waits_too_long_for_a_slot_is_refused_as_at_capacity(tiny):
    engine, loop = _loop(tiny, max_queue_seconds=0.5)  # 2 slots
    try:
        long = SamplingParams(max_new_tokens=200, ignore_eos=True)
        # slow readers hold the slots past the limit however fast this machine decodes: a chunk per request per step,
        # and a step commits at most a block (16), so 200 tokens take at least 13 steps x 2 chunks x 0.05 s = 1.3 s
        running = [SlowCollector(seconds_per_chunk=0.05) for _ in range(2)]
        for stream in running:
            loop.submit(PROMPTS[0], long, stream)
        waiting = Collector()
        loop.submit(PROMPTS[1], SamplingParams(max_new_tokens=4), waiting)
        assert waiting.done.wait(60)
        assert error_class(waiting.error) == "UNAVAILABLE", waiting.error
        assert re.search(r"waited \d+ s for a slot, the limit is 0.5 s\); retry later", waiting.error), waiting.error
        assert all(s.done.wait(120) and s.error is None for s in running)  # those that had a slot finish
    finally:
        loop.stop()


def test_each_request_reports_its_queue_time_and_its_prefill_time_once(tiny):
    """Three requests on two batch places: each has one queue time (arrival to the step that scheduled it) and one
    prefill time (that step to its first token); the third waited at least until a first one had finished."""
    engine, loop = _loop(tiny)
    reports, finished_at = [], []

    class Timed(Collector):
        def send(self, chunk):
            super().send(chunk)
            if chunk.finished:
                finished_at.append(time.monotonic())

    loop.on_step = reports.append
    streams = [Timed() for _ in range(3)]
    try:
        for stream in streams[:2]:
            loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True), stream)
        loop.submit(PROMPTS[1], SamplingParams(max_new_tokens=4, ignore_eos=True), streams[2])
        submitted = time.monotonic()
        assert all(s.done.wait(60) and s.error is None for s in streams)
    finally:
        loop.stop()
    queue = [seconds for r in reports for seconds in r.request_queue_seconds]
    prefill = [seconds for r in reports for seconds in r.request_prefill_seconds]
    assert len(queue) == len(prefill) == 3 and min(queue + prefill) > 0
    assert max(queue) >= min(finished_at) - submitted  # the third's: it waited for a place
    assert sorted(queue)[:2] < [max(queue)] * 2


def test_each_step_report_says_where_the_iterations_time_went(tiny):
    """Every iteration that steps the engine reports its wall time by phase: the passes (the model's work), the
    host's phases around them and the loop's own; they add up to the iteration, measured around it here."""
    from dflash_runtime.step_clock import host_seconds

    engine, loop = _loop(tiny)
    reports, walls = [], []
    step = loop._step

    def timed_step():
        started = time.perf_counter()
        result = step()
        walls.append(time.perf_counter() - started)
        return result

    loop._step = timed_step
    loop.on_step = reports.append
    stream = Collector()
    try:
        loop.submit(PROMPTS[2], SamplingParams(max_new_tokens=24, ignore_eos=True), stream)
        assert stream.done.wait(60) and stream.error is None
        count = len(reports)
        loop._wake.set()  # an iteration with nothing to step: it must not report the last step's figures again
        deadline = time.monotonic() + 10
        while len(reports) == count and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    idle = [r for r in reports if not r.phases]
    assert idle and all(r.verify_length is None and not any(r.seconds.values()) for r in idle)
    stepped = [(r, wall) for r, wall in zip(reports, walls) if r.phases]
    assert len(stepped) >= 2
    for report, wall in stepped:
        assert {"schedule", "loop"} <= set(report.phases) and min(report.phases.values()) >= 0
        assert sum(report.phases.values()) <= wall * 1.05 + 2e-4  # timed within the iteration
        assert 0 < host_seconds(report.phases) < sum(report.phases.values())
    # and they account for it: summed over the steps, so that one preemption between the clocks (a busy host: 1 ms
    # of a 16 ms step once) does not decide
    assert sum(sum(r.phases.values()) for r, _ in stepped) == pytest.approx(sum(w for _, w in stepped), rel=0.05)
    phases = set().union(*(r.phases for r, _ in stepped))
    assert {"prefill pass", "verify pass", "inputs", "accept", "commit", "copy"} <= phases


def test_a_step_that_raises_midway_fails_its_requests_leaks_nothing_and_the_engine_serves_on(tiny):
    """A fault inside a step, after its blocks were reserved and its drafts made (the verify pass raises, as an
    out-of-memory would): the requests it held fail as INTERNAL errors; no KV block, batch place or deferred
    context is left behind; the next request decodes exactly what a fresh engine decodes."""
    engine, loop = _loop(tiny)
    verify, calls = engine._verify_pass, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory (simulated)")
        return verify(*args, **kwargs)

    engine._verify_pass = failing_once
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    try:
        held = [Collector(), Collector()]
        for prompt, stream in zip(PROMPTS[:2], held):
            loop.submit(prompt, params, stream)
        assert all(stream.done.wait(60) for stream in held)
        assert all(error_class(s.error) == "INTERNAL" and "out of memory" in s.error for s in held), held[0].error
        occupancy = engine.occupancy()
        assert (occupancy.running, occupancy.waiting, occupancy.used_blocks) == (0, 0, 0)
        assert occupancy.free_slots == 2 and not engine.context.pending
        after = Collector()
        loop.submit(PROMPTS[2], params, after)
        assert after.done.wait(60) and after.error is None
    finally:
        loop.stop()
    fresh = _engine(tiny).generate([PROMPTS[2]], params)[0].output_ids
    assert after.output_ids() == fresh
