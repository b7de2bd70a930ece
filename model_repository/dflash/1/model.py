"""Triton model `dflash`: the DFlash engine behind a decoupled Python-backend model.

This file only translates: request tensors -> SamplingParams + prompt ids for the engine loop, and
the loop's chunks -> response tensors and metrics. Scheduling, batching and decoding live in
dflash_runtime (engine_loop, engine), tested without Triton.
"""
import json
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_runtime.config import DFlashError
from dflash_runtime.engine_loop import EngineLoop, QueueFull
from dflash_runtime.model_args import artifact_path, drain_signal, drained_path, model_parameters
from dflash_runtime.pipeline import load_pipeline
from dflash_runtime.sampling import SamplingParams

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        drafter = params["drafter_dir"]
        max_batch_size = int(json.loads(args["model_config"])["max_batch_size"])

        def make_engine():  # on the loop's thread: this thread must stay free of torch work
            pipeline = load_pipeline(str(artifact_path(args, params["target_dir"])),
                                     str(artifact_path(args, drafter)) if drafter else None,
                                     dtype=params["dtype"], device=params["device"])
            return pipeline.engine(block_size=int(params["block_size"]), max_batch_size=max_batch_size,
                                   max_context=int(params["max_context"]))

        reports = queue.SimpleQueue()
        self.loop = EngineLoop(make_engine, int(params["max_queue_size"]), on_step=reports.put)
        self.metrics = EngineMetrics(args["model_name"], args["model_version"], self.loop.engine.block_size, reports)
        self.in_flight = {}  # request id -> TritonStream, for `stop` requests
        drain = drain_signal()
        if drain is not None:
            threading.Thread(target=self._drain_on_signal, args=drain, daemon=True).start()

    def _drain_on_signal(self, path, seconds):
        while not path.exists():
            time.sleep(0.5)
        self.loop.drain(seconds)
        self.loop.drained.wait()
        drained_path(path).touch()  # dflash-serve may stop tritonserver now

    def execute(self, requests):
        for request in requests:
            if _is_stop(request):
                self._stop(request)
                continue
            stream = TritonStream(request, self.in_flight)
            try:
                prompt_ids, params, streaming = _parse(request)
                self.loop.submit(prompt_ids, params, stream, streaming)
            except QueueFull as e:
                stream.fail(str(e), pb_utils.TritonError.UNAVAILABLE)
            except DFlashError as e:
                stream.fail(str(e), pb_utils.TritonError.INVALID_ARG)
        return None

    def _stop(self, request):
        """Cancel the in-flight request with this request's id (if any): the loop drops it soon after."""
        stream = self.in_flight.get(request.request_id())
        if stream is not None:
            stream.stopped = True
        request.get_response_sender().send(flags=FINAL)

    def finalize(self):
        self.loop.stop("the server is shutting down; the request was aborted")


class TritonStream:
    """The engine loop's view of one request: send chunks, fail, ask whether it was cancelled."""

    def __init__(self, request, in_flight):
        self.sender = request.get_response_sender()
        self.stopped = False
        self.request_id, self.in_flight = request.request_id(), in_flight
        if self.request_id:
            in_flight[self.request_id] = self

    def send(self, chunk):
        stats = chunk.stats
        steps = len(stats.acceptance_lengths)
        accepted = sum(stats.acceptance_lengths) - steps
        drafted = steps * (chunk.block_size - 1)
        tensors = {
            "output_ids": np.array([chunk.token_ids], dtype=np.int32),
            "read_offset": np.array([[chunk.read_offset]], dtype=np.int32),
            "finish_reason": np.array([[(chunk.finish_reason or "").encode()]], dtype=object),
            "total_accepted_draft_tokens": np.array([[accepted]], dtype=np.int32),
            "total_draft_tokens": np.array([[drafted]], dtype=np.int32),
            "acceptance_rate": np.array([[accepted / drafted if drafted else 0.0]], dtype=np.float32),
            "draft_steps": np.array([[steps]], dtype=np.int32),
            "mean_acceptance_length": np.array([[stats.mean_acceptance_length]], dtype=np.float32),
        }
        response = pb_utils.InferenceResponse([pb_utils.Tensor(name, value) for name, value in tensors.items()])
        if chunk.finished:
            self._forget()
        try:
            self.sender.send(response, flags=FINAL if chunk.finished else 0)
        except Exception:  # the loop drops a request it cannot send to, without fail(): forget it here
            self._forget()
            raise

    def fail(self, message, code=None):
        self._forget()
        error = pb_utils.TritonError(message, code if code is not None else pb_utils.TritonError.INTERNAL)
        self.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def is_cancelled(self):
        return self.stopped or self.sender.is_cancelled()

    def _forget(self):
        if self.request_id and self.in_flight.get(self.request_id) is self:
            del self.in_flight[self.request_id]


class EngineMetrics:
    """dflash_* metrics on Triton's metrics endpoint, beside Triton's own nv_* metrics."""

    def __init__(self, model, version, block_size, reports):
        labels = {"model": model, "version": str(version)}
        self.families = []  # a MetricFamily must outlive its Metric objects

        def family(name, description, kind, **kwargs):
            self.families.append(pb_utils.MetricFamily(name, description, kind))
            return self.families[-1].Metric(labels=labels, **kwargs)

        H, C, G = pb_utils.MetricFamily.HISTOGRAM, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.acceptance_length = family("dflash_acceptance_length", "Tokens committed per verify step (accepted "
                                        "drafts + 1)", H, buckets=[float(k) for k in range(1, block_size + 1)])
        self.draft_seconds = family("dflash_draft_duration_seconds", "Draft pass per step", H, buckets=LATENCY_BUCKETS)
        self.verify_seconds = family("dflash_verify_duration_seconds", "Verify pass per step", H,
                                     buckets=LATENCY_BUCKETS)
        self.prefill_seconds = family("dflash_prefill_duration_seconds", "Prefills per step", H,
                                      buckets=LATENCY_BUCKETS)
        self.tokens = family("dflash_generated_tokens_total", "Tokens generated", C)
        self.cancelled = family("dflash_cancelled_requests_total", "Requests cancelled by their clients", C)
        self.active = family("dflash_active_sequences", "Sequences in the running batch", G)
        self.queued = family("dflash_queued_sequences", "Requests waiting for a batch slot", G)
        self.kv_cache = family("dflash_kv_cache_utilization", "Committed tokens / KV-cache token capacity", G)
        # each metric update is a round trip to the server process: off the decoding thread
        threading.Thread(target=self._record_reports, args=(reports,), daemon=True).start()

    def _record_reports(self, reports):
        while True:
            self.record(reports.get())

    def record(self, report):
        for length in report.acceptance_lengths:
            self.acceptance_length.observe(float(length))
        if report.acceptance_lengths:
            self.draft_seconds.observe(report.seconds["draft"])
            self.verify_seconds.observe(report.seconds["verify"])
        if report.seconds["prefill"]:
            self.prefill_seconds.observe(report.seconds["prefill"])
        if report.new_tokens:
            self.tokens.increment(report.new_tokens)
        if report.cancelled:
            self.cancelled.increment(report.cancelled)
        self.active.set(report.active)
        self.queued.set(report.queued)
        self.kv_cache.set(report.kv_cache_utilization)


def _parse(request):
    """(prompt ids, sampling parameters, stream?) from a request's tensors; DFlashError on bad input."""
    ids = _tensor(request, "input_ids")
    if ids is None or ids.ndim != 2 or ids.shape[0] != 1:
        raise DFlashError("send one prompt per request (the server batches requests itself)")
    max_tokens = _scalar(request, "max_tokens", None)
    if max_tokens is None or max_tokens < 1:
        raise DFlashError(f"max_tokens must be >= 1, got {max_tokens}")
    seed = _scalar(request, "seed", None)
    legacy_seed = _scalar(request, "random_seed", None)
    if seed is None:
        seed = legacy_seed
    elif legacy_seed is not None and legacy_seed != seed:
        raise DFlashError("seed and random_seed differ: send one of them")
    bad_words = _strings(request, "bad_words")
    if bad_words:
        raise DFlashError("bad_words is not supported by the DFlash engine")
    end_id = _scalar(request, "end_id", None)
    params = SamplingParams(
        max_new_tokens=int(max_tokens),
        temperature=float(_scalar(request, "temperature", 0.0)),
        top_k=int(_scalar(request, "top_k", 0)),
        top_p=float(_scalar(request, "top_p", 1.0)),
        seed=None if seed is None else int(seed),
        # end_id replaces the model's end-of-sequence ids, as in TensorRT-LLM
        stop_token_ids=(int(end_id),) if end_id is not None else (),
        ignore_eos=end_id is not None,
        stop_strings=tuple(_strings(request, "stop_words")),
    )
    return ids[0].tolist(), params, bool(_scalar(request, "stream", False))


def _is_stop(request):
    stop = _tensor(request, "stop")
    return stop is not None and stop.size == 1 and bool(stop.item())


def _tensor(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _scalar(request, name, default):
    value = _tensor(request, name)
    if value is None:
        return default
    if value.size != 1:
        raise DFlashError(f"{name} must hold one value per request, got shape {list(value.shape)}")
    return value.item()


def _strings(request, name):
    value = _tensor(request, name)
    if value is None:
        return []
    try:
        words = [w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in value.reshape(-1)]
    except UnicodeDecodeError:
        raise DFlashError(f"{name} is not valid UTF-8") from None
    return [w for w in words if w]
