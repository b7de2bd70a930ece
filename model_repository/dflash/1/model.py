"""Triton model `dflash`: the DFlash engine behind a decoupled Python-backend model.

This file only translates: request tensors -> SamplingParams + prompt ids for the engine loop
(dflash_serving.requests), and the loop's chunks -> response tensors (dflash_contract.protocol) and
metrics. Scheduling, batching and decoding live in dflash_serving.engine_loop and dflash_runtime,
tested without Triton.
"""
import json
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_contract import DFlashError
from dflash_contract.engine_counts import engine_counts
from dflash_contract.presets import parse_block_size
from dflash_contract.protocol import (CANCELLED_MESSAGE, FINISH_REASON, STATISTICS, config_type, error_class,
                                      invalid_request, response_statistics)
from dflash_contract.server import (TTFT_BUCKETS, acknowledged_path, drain_signal, progress_signal, queue_timeout,
                                    report_engine_failure)
from dflash_contract.versions import version_warning
from dflash_runtime.pipeline import load_pipeline
from dflash_runtime.step_clock import host_seconds
from dflash_runtime.verify_length import StepCosts
from dflash_serving.engine_loop import EngineLoop, EngineStopped, QueueFull
from dflash_serving.kv_events import kv_event_publisher
from dflash_serving.logprobs import TokenTexts
from dflash_serving.metrics import ARRIVAL_INPUT, RequestMetrics, TritonRegistry, front_model
from dflash_serving.model_args import artifact_path, model_parameters, served_model_name
from dflash_serving.requests import is_stop_request, parse_engine_request

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
HOST_BUCKETS = [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05]


class TritonPythonModel:
    def initialize(self, args):
        warning = version_warning("dflash")  # before loading: a failure there may come from it
        if warning:
            pb_utils.Logger.log_warn(warning)
        params = model_parameters(args)
        drafter = params["drafter_dir"]
        max_batch_size = int(json.loads(args["model_config"])["max_batch_size"])

        block_size = parse_block_size(params["block_size"])
        profile = params.get("verify_profile")

        def make_engine():  # on the loop's thread: this thread must stay free of torch work
            pipeline = load_pipeline(str(artifact_path(args, params["target_dir"])),
                                     str(artifact_path(args, drafter)) if drafter else None,
                                     dtype=params["dtype"], device=params["device"],
                                     cpu_weights=params.get("cpu_weights") or None)
            if pipeline.target.served_weights is not None:
                pb_utils.Logger.log_info(f"dflash: target weights {pipeline.target.served_weights.describe()}")
            self.token_texts = TokenTexts(pipeline.tokenizer) if pipeline.tokenizer is not None else None
            # the build's profile of step times (on another device the engine profiles itself) and acceptance
            built = json.loads(artifact_path(args, profile).read_text()) if profile else None
            return pipeline.engine(block_size=block_size, max_batch_size=max_batch_size,
                                   max_context=int(params["max_context"]),
                                   step_costs=StepCosts.from_json(built) if built else None,
                                   learned_acceptance=(built or {}).get("acceptance"),
                                   speculative_sampling=params["speculative_sampling"],
                                   kv_cache_tokens=int(params["kv_cache_tokens"]),
                                   prefill_chunk=int(params["prefill_chunk"]) or None,
                                   prefix_caching=params["prefix_caching"] == "true",
                                   suffix_drafts=params.get("suffix_drafts", "true") == "true",
                                   shared_suffix_tokens=int(params.get("shared_suffix_tokens", "0")))

        reports = queue.SimpleQueue()
        self.loop = EngineLoop(make_engine, int(params["max_queue_size"]), on_step=reports.put,
                               on_failure=self._engine_failed, progress=progress_signal(),
                               max_queue_seconds=queue_timeout(), counts=engine_counts(),
                               kv_events=kv_event_publisher())
        engine = self.loop.engine
        graphs = str(engine.graphs.report) if engine.graphs.capture else "no CUDA graphs"
        pb_utils.Logger.log_info(f"dflash: engine ready on {engine.device}, max batch {engine.scheduler.num_slots}, "
                                 f"context {engine.max_context}, {engine.kv_cache_summary()}: {graphs}")
        model_name = served_model_name(args)
        self.metrics = EngineMetrics(model_name, args["model_name"], engine.block_size, reports)
        # the requests that come through the ensemble or straight here (dflash_bls counts its own)
        self.requests = RequestMetrics(TritonRegistry(pb_utils.MetricFamily), ("ensemble", "dflash"), model_name)
        self.in_flight = {}  # request id -> TritonStream, for `stop` requests
        drain = drain_signal()
        if drain is not None:
            threading.Thread(target=self._drain_on_signal, args=drain, daemon=True).start()

    def is_ready(self):
        # Triton >= 26.03 asks this for /v2/models/dflash/ready (and strict server readiness); older
        # servers never do, and dflash-serve learns of a dead loop from _engine_failed instead
        return self.loop.alive

    def _engine_failed(self, cause):
        pb_utils.Logger.log_error(f"dflash: the engine loop died ({cause}); it serves nothing more until restarted")
        report_engine_failure(cause)

    def _drain_on_signal(self, path, seconds):
        while not path.exists():
            time.sleep(0.5)
        self.loop.drain(seconds)
        self.loop.drained.wait()
        acknowledged_path(path).touch()  # dflash-serve may stop tritonserver now

    def execute(self, requests):
        for request in requests:
            tensor = _tensor_getter(request)
            if is_stop_request(tensor):
                self._stop(request)
                continue
            stream = TritonStream(request, self.in_flight, self._timeline(request, tensor), self.token_texts)
            try:
                prompt_ids, params, streaming = parse_engine_request(tensor, self.loop.engine.max_context)
            except DFlashError as e:
                stream.refuse(invalid_request(str(e)), pb_utils.TritonError.INVALID_ARG)
                continue
            if stream.timeline is not None:
                stream.timeline.streamed = streaming
            if params.guide is None:
                self._submit(prompt_ids, params, stream, streaming)
            else:  # its grammar compiles in submit (up to grammar.COMPILE_SECONDS): not in the way of other requests
                threading.Thread(target=self._submit, args=(prompt_ids, params, stream, streaming), daemon=True).start()
        return None

    def _submit(self, prompt_ids, params, stream, streaming):
        try:
            self.loop.submit(prompt_ids, params, stream, streaming)
        except (QueueFull, EngineStopped) as e:
            stream.refuse(str(e), pb_utils.TritonError.UNAVAILABLE)
        except DFlashError as e:
            stream.refuse(invalid_request(str(e)), pb_utils.TritonError.INVALID_ARG)

    def _timeline(self, request, tensor):
        """The request's timeline for the request metrics, from its arrival at the front model (the ensemble's:
        preprocessing's, which it passes on); None for dflash_bls's calls, which it counts itself."""
        arrival = tensor(ARRIVAL_INPUT)
        model = front_model(request.request_id(), arrival)
        if model is None:
            return None
        return self.requests.timeline(model, None if arrival is None else int(arrival.item()) / 1e9)

    def _stop(self, request):
        """Cancel the in-flight request with this request's id (if any): the loop drops it soon after."""
        stream = self.in_flight.get(request.request_id())
        if stream is not None:
            stream.stopped = True
        request.get_response_sender().send(flags=FINAL)

    def finalize(self):
        self.loop.stop()


class TritonStream:
    """The engine loop's view of one request: send chunks, fail, ask whether it was cancelled."""

    def __init__(self, request, in_flight, timeline=None, token_texts=None):
        self.sender = request.get_response_sender()
        self.token_texts = token_texts  # dflash_serving.logprobs.TokenTexts: the text of logprobs' tokens
        self.stopped = False
        self.timeline = timeline  # dflash_serving.metrics.RequestTimeline, or None: not counted here
        self.request_id, self.in_flight = request.request_id(), in_flight
        if self.request_id:
            in_flight[self.request_id] = self

    def send(self, chunk):
        stats = chunk.stats
        values = response_statistics(stats.draft_steps, stats.accepted_draft_tokens, stats.draft_tokens,
                                     chunk.prompt_tokens, chunk.output_tokens, chunk.cached_tokens)
        tensors = [pb_utils.Tensor("output_ids", np.array([chunk.token_ids], dtype=np.int32)),
                   pb_utils.Tensor("read_offset", np.array([[chunk.read_offset]], dtype=np.int32)),
                   pb_utils.Tensor(FINISH_REASON, np.array([[chunk.finish_reason or ""]], dtype=object))]
        tensors += [pb_utils.Tensor(s.tensor, np.array([[values[s.field]]], dtype=_numpy_type(s.data_type)))
                    for s in STATISTICS if values[s.field] is not None]
        if chunk.logprobs is not None:
            tensors += self._logprobs(chunk.token_ids[chunk.read_offset:], chunk.logprobs)
        response = pb_utils.InferenceResponse(tensors)
        if chunk.finished:
            self._forget()
        try:
            self.sender.send(response, flags=FINAL if chunk.finished else 0)
        except Exception:  # the loop drops a request it cannot send to, without fail(): forget it here
            self._forget()
            self._ended_by(CANCELLED_MESSAGE)  # its client is gone
            raise
        if self.timeline is not None:
            self.timeline.responded(chunk.output_tokens)
            if chunk.finished:
                self.timeline.finished(chunk.finish_reason)

    def _logprobs(self, tokens, logprobs):
        """LOGPROB_OUTPUTS of a response's new tokens: one float per token, and OpenAI's entries as JSON."""
        entries = self.token_texts.entries(tokens, logprobs) if self.token_texts is not None else \
            [{"token": "", "bytes": [], "logprob": lp, "top_logprobs": []} for lp, _ in logprobs]
        return [pb_utils.Tensor("output_log_probs", np.array([[lp for lp, _ in logprobs]], dtype=np.float32)),
                pb_utils.Tensor("logprobs", np.array([[json.dumps(entries, ensure_ascii=False)]], dtype=object))]

    def refuse(self, message, code):
        """Refuse the request at the door: counted before the client hears of it."""
        if self.timeline is not None:
            self.timeline.refused_now(error_class(message))
        self.fail(message, code)

    def fail(self, message, code=None):
        self._forget()
        self._ended_by(CANCELLED_MESSAGE if self.stopped else message)
        if self.stopped:
            # a `stop` request ended it (tensorrtllm_backend's protocol): close the stream with a bare final flag.
            # An error response here never reached dflash_bls's BLS iterator once its own client had dropped an
            # HTTP stream (Triton 2.51, measured): its thread waited on, dflash_bls could not unload, and SIGTERM
            # then waited out tritonserver's exit timeout
            self.sender.send(flags=FINAL)
            return
        # the loop's failures (cancelled, shutting down, engine stopped, internal) say their class in words
        code = code if code is not None else getattr(pb_utils.TritonError, error_class(message))
        error = pb_utils.TritonError(message, code)
        self.sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)

    def is_cancelled(self):
        return self.stopped or self.sender.is_cancelled()

    def _ended_by(self, message):
        if self.timeline is not None:
            self.timeline.ended_by_error(message)

    def _forget(self):
        if self.request_id and self.in_flight.get(self.request_id) is self:
            del self.in_flight[self.request_id]


class EngineMetrics:
    """dflash_* metrics on Triton's metrics endpoint, beside Triton's own nv_* metrics, labelled as the request
    metrics are (dflash_serving.metrics): model_name, the name the model is served under, and model, this Triton
    model's."""

    def __init__(self, model_name, model, block_size, reports):
        labels = {"model_name": model_name, "model": model}
        self.families = []  # a MetricFamily must outlive its Metric objects

        def family(name, description, kind, **kwargs):
            self.families.append(pb_utils.MetricFamily(name, description, kind))
            return self.families[-1].Metric(labels=labels, **kwargs)

        H, C, G = pb_utils.MetricFamily.HISTOGRAM, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.acceptance_length = family("dflash_acceptance_length", "Tokens committed per verify step (accepted "
                                        "drafts + 1)", H, buckets=[float(k) for k in range(1, block_size + 1)])
        self.verify_length = family("dflash_verify_length", "Tokens verified per step: 1 + drafts per sequence "
                                    "(block size auto picks it per step; 1 = plain decoding)", H,
                                    buckets=[float(k) for k in range(1, block_size + 1)])
        self.draft_seconds = family("dflash_draft_duration_seconds", "Draft pass per step", H, buckets=LATENCY_BUCKETS)
        self.verify_seconds = family("dflash_verify_duration_seconds", "Verify pass per step", H,
                                     buckets=LATENCY_BUCKETS)
        self.prefill_seconds = family("dflash_prefill_duration_seconds", "Prefills per step", H,
                                      buckets=LATENCY_BUCKETS)
        self.request_queue_seconds = family("dflash_request_queue_time_seconds", "Requests' wait for a place in the "
                                            "engine's batch: from their arrival at the engine to the start of the step "
                                            "that first scheduled them (vLLM's request_queue_time)", H,
                                            buckets=list(TTFT_BUCKETS))
        self.request_prefill_seconds = family("dflash_request_prefill_time_seconds", "Requests' prefill: from the "
                                              "step that first scheduled them to the end of the step that gave their "
                                              "first token (vLLM's request_prefill_time)", H,
                                              buckets=list(TTFT_BUCKETS))
        self.host_seconds = family("dflash_step_host_seconds", "Host time per engine step outside the model's "
                                   "passes and the device-to-host copy: scheduling, inputs, sampling, acceptance, "
                                   "commits and the loop's own work", H, buckets=HOST_BUCKETS)
        self.tokens = family("dflash_generated_tokens_total", "Tokens generated", C)
        self.cancelled = family("dflash_cancelled_requests_total", "Requests cancelled by their clients", C)
        self.active = family("dflash_active_sequences", "Sequences in the running batch", G)
        self.queued = family("dflash_queued_sequences", "Requests waiting for a batch slot", G)
        self.kv_cache = family("dflash_kv_cache_utilization", "KV blocks held by running sequences / all blocks", G)
        self.kv_blocks_used = family("dflash_kv_blocks_used", "KV-cache blocks held by running sequences", G)
        self.shared_suffix_tokens = family("dflash_shared_suffix_tokens", "Earlier requests' output tokens held for "
                                           "suffix drafts across requests (dflash-build --shared-suffix-tokens caps "
                                           "them; 4 bytes each)", G)
        self.kv_blocks_free = family("dflash_kv_blocks_free", "KV-cache blocks free (prefix-cached ones included)", G)
        self.prefix_queried = family("dflash_prefix_cache_queried_tokens_total", "Prompt tokens looked up in the "
                                     "prefix cache", C)
        self.prefix_hits = family("dflash_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache", C)
        self.preemptions = family("dflash_preemptions_total", "Sequences preempted for KV blocks (requeued and "
                                  "recomputed, output unchanged)", C)
        self.kv_events_dropped = family("dflash_kv_events_dropped_total", "Engine steps whose prefix-cache events "
                                        "were dropped, the publisher's queue full (dflash-serve --kv-events-port)", C)
        self.totals = {"prefix_queried_tokens": 0, "prefix_hit_tokens": 0, "preemptions": 0,  # reported so far
                       "kv_events_dropped": 0}
        # by draft source (a label), for each count of StepReport.draft_sources
        self.source_families = {count: pb_utils.MetricFamily(name, description, C) for count, name, description in (
            ("steps", "dflash_draft_steps_total", "Sequence steps by draft source: drafter (the DFlash drafter's "
             "block), suffix (a continuation of the request's own earlier text), none (no draft)"),
            ("drafted", "dflash_draft_tokens_total", "Drafts verified, by the source that made them"),
            ("accepted", "dflash_accepted_draft_tokens_total", "Drafts accepted, by the source that made them"))}
        self.source_metrics = {}  # (count, source) -> Metric, made when the source first reports
        self.families += self.source_families.values()
        self.labels = labels
        # each metric update is a round trip to the server process: off the decoding thread
        threading.Thread(target=self._record_reports, args=(reports,), daemon=True).start()

    def _record_reports(self, reports):
        while True:
            self.record(reports.get())

    def record(self, report):
        for length in report.acceptance_lengths:
            self.acceptance_length.observe(float(length))
        if report.verify_length is not None:
            self.verify_length.observe(float(report.verify_length))
        if report.acceptance_lengths:
            self.draft_seconds.observe(report.seconds["draft"])
            self.verify_seconds.observe(report.seconds["verify"])
        if report.seconds["prefill"]:
            self.prefill_seconds.observe(report.seconds["prefill"])
        for seconds in report.request_queue_seconds:
            self.request_queue_seconds.observe(seconds)
        for seconds in report.request_prefill_seconds:
            self.request_prefill_seconds.observe(seconds)
        if report.phases:
            self.host_seconds.observe(host_seconds(report.phases))
        if report.new_tokens:
            self.tokens.increment(report.new_tokens)
        if report.cancelled:
            self.cancelled.increment(report.cancelled)
        self.active.set(report.active)
        self.queued.set(report.queued)
        self.kv_cache.set(report.kv_cache_utilization)
        self.kv_blocks_used.set(report.kv_blocks_used)
        self.kv_blocks_free.set(report.kv_blocks_free)
        self.shared_suffix_tokens.set(report.shared_suffix_tokens)
        for name, counter in (("prefix_queried_tokens", self.prefix_queried), ("prefix_hit_tokens", self.prefix_hits),
                              ("preemptions", self.preemptions), ("kv_events_dropped", self.kv_events_dropped)):
            total = getattr(report, name)
            if total > self.totals[name]:
                counter.increment(total - self.totals[name])
                self.totals[name] = total
        for source, counts in report.draft_sources.items():
            for count, total in counts.items():
                key = count, source
                if key not in self.source_metrics:
                    labels = {**self.labels, "source": source}
                    self.source_metrics[key], self.totals[key] = self.source_families[count].Metric(labels=labels), 0
                if total > self.totals[key]:
                    self.source_metrics[key].increment(total - self.totals[key])
                    self.totals[key] = total


def _numpy_type(data_type):
    return pb_utils.triton_string_to_numpy(config_type(data_type))


def _tensor_getter(request):
    def tensor(name):
        value = pb_utils.get_input_tensor_by_name(request, name)
        return None if value is None else value.as_numpy()

    return tensor
