"""Triton model `dflash_bls`: preprocessing -> dflash (streamed) -> postprocessing, cancellable.

It calls the same three models as the ensemble, with the same tensors, but it watches its own
client: once the client cancels, it sends `dflash` a `stop` request with the stream's request id
(tensorrtllm_backend's protocol), and the engine frees the sequence's slot at its next
cancellation check. Decoupled BLS `cancel()` would do the same, but only Triton >= 25.05 has it.
"""
import json
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_contract.protocol import (CANCELLED_MESSAGE, ENGINE_INPUTS, ENGINE_STOPPED_MESSAGE, FINISH_REASON,
                                      FRONT_INPUTS, INCLUDE_STOP_STR, INTERNAL_ERROR_PREFIX, LOGPROB_OUTPUTS,
                                      STATISTICS, TOKEN_OUTPUTS, error_class, invalid_request, parameters_error)
from dflash_contract.server import acknowledged_path, failure_signal
from dflash_runtime.stop_text import StopText
from dflash_serving.metrics import BLS_CALL_PREFIX, RequestMetrics, TritonRegistry
from dflash_serving.model_args import served_model_name

RESPONSE_OUTPUTS = (FINISH_REASON, *(s.tensor for s in STATISTICS), *LOGPROB_OUTPUTS)  # passed on as they are
TOKENS_SO_FAR = next(s.tensor for s in STATISTICS if s.field == "completion_tokens")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
FAILURE_CHECK_SECONDS = 0.25


class TritonPythonModel:
    def initialize(self, args):
        self.in_flight = InFlight()
        self.requests = RequestMetrics(TritonRegistry(pb_utils.MetricFamily), ("dflash_bls",),
                                       served_model_name(args))
        failure = failure_signal()
        if failure is not None:
            threading.Thread(target=self._end_streams_on_failure, args=(failure,), daemon=True).start()

    def execute(self, requests):
        # a thread per request: a stream lasts many engine steps, and execute must return
        for request in requests:
            timeline = self.requests.timeline("dflash_bls")  # it arrived now
            threading.Thread(target=_serve, args=(request, self.in_flight, timeline), daemon=True).start()
        return None

    def _end_streams_on_failure(self, path):
        # When the engine's process dies, its streams wait for responses forever (Triton 2.51, measured).
        # dflash-serve says so in this file before it stops the server: end them with why, meanwhile.
        while not path.exists():
            time.sleep(FAILURE_CHECK_SECONDS)
        message = f"{ENGINE_STOPPED_MESSAGE} ({path.read_text(errors='replace')}); retry on another replica"
        streams = self.in_flight.take_all()
        for stream in streams:
            stream.end(pb_utils.TritonError(message, pb_utils.TritonError.UNAVAILABLE))
        pb_utils.Logger.log_info(f"dflash_bls: the server is failing: {len(streams)} stream(s) ended with the cause")
        acknowledged_path(path).touch()  # dflash-serve may stop tritonserver now


class ClientStream:
    """One request's response sender, which a failure may end from another thread. Once a final
    response is sent, the sender must not be touched: Triton 2.51 frees it (is_cancelled() on it then
    crashed the server)."""

    def __init__(self, sender, timeline):
        self._sender, self._lock, self.ended = sender, threading.Lock(), False
        self.timeline = timeline  # dflash_serving.metrics.RequestTimeline: counted once it ends

    def send(self, response, final):
        with self._lock:
            if not self.ended:
                self._sender.send(response, flags=FINAL if final else 0)
                self.ended = final

    def is_cancelled(self):
        with self._lock:
            return not self.ended and self._sender.is_cancelled()

    def end(self, error):
        """Send `error` as the final response, unless the stream has ended already."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            try:
                if self._sender.is_cancelled():  # nobody reads an error: only close the stream
                    self.timeline.ended_by_error(CANCELLED_MESSAGE)
                    self._sender.send(flags=FINAL)
                    return
                self.timeline.ended_by_error(error.message())
                self._sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            except Exception as e:  # the client is gone: nobody left to tell
                pb_utils.Logger.log_warn(f"dflash_bls: could not send the final error ({e})")


class InFlight:
    """The streams in progress, for _end_streams_on_failure."""

    def __init__(self):
        self._streams, self._lock = set(), threading.Lock()

    def add(self, stream):
        with self._lock:
            self._streams.add(stream)

    def discard(self, stream):
        with self._lock:
            self._streams.discard(stream)

    def take_all(self):
        with self._lock:
            streams, self._streams = self._streams, set()
        return streams


def _serve(request, in_flight, timeline):
    stream = ClientStream(request.get_response_sender(), timeline)
    in_flight.add(stream)
    try:
        error = _generate(request, stream)
    except Exception as e:  # a bug must still end the client's stream
        error = pb_utils.TritonError(f"{INTERNAL_ERROR_PREFIX}: {type(e).__name__}: {e}")
    in_flight.discard(stream)
    if error is not None:
        stream.end(_classified(error))


def _generate(request, client):
    """Stream (or collect) the answer to the client; returns the error to send instead, or None."""
    # the request's parameters first, as preprocessing does for the ensemble (the call below passes none on):
    # over HTTP generate, a body field that names no input comes as one, and would be ignored
    unread = parameters_error(request.parameters())
    if unread:
        return pb_utils.TritonError(invalid_request(unread), pb_utils.TritonError.INVALID_ARG)
    # all inputs: preprocessing checks every one before the engine sees the request
    request_id = BLS_CALL_PREFIX + uuid.uuid4().hex  # this request's calls: counted here only
    prompt = _call("preprocessing", _inputs(request, FRONT_INPUTS), ["input_ids"], request_id)
    if prompt.has_error():
        return prompt.error()
    streaming = _flag(request, "stream")
    client.timeline.streamed = streaming
    inputs = [pb_utils.get_output_tensor_by_name(prompt, "input_ids"), pb_utils.Tensor("stream", np.array([[True]]))]
    engine = pb_utils.InferenceRequest(
        model_name="dflash", inputs=inputs + _inputs(request, ENGINE_INPUTS), request_id=request_id,
        requested_output_names=[*TOKEN_OUTPUTS, *RESPONSE_OUTPUTS])
    texts, logprobs, last, finish_reason, stopped = [], [], None, "", False
    stop_text = _stop_text(request)  # the stop strings' place in the text (OpenAI's rule)
    # streamed even when the client asked for one response: a response per step is where
    # cancellation is seen
    try:
        for response in engine.exec(decoupled=True):
            if client.ended:  # by _end_streams_on_failure: the server is going down
                return None
            if not stopped and client.is_cancelled():
                _stop(request_id)
                stopped = True
            if stopped:  # until the engine's final flag: nothing more for a client that is gone
                continue
            if response.has_error():
                return response.error()
            if not response.output_tensors():  # an empty final flag
                continue
            ids = [pb_utils.get_output_tensor_by_name(response, name) for name in TOKEN_OUTPUTS]
            text = _call("postprocessing", ids, ["text_output"])
            if text.has_error():
                _stop(request_id)
                return text.error()
            delta, reason = _client_text(text, response, stop_text)
            if streaming:
                client.send(_answer(delta, response), final=bool(reason))
            else:
                texts.append(delta)
                logprobs.append(response)
            client.timeline.responded(pb_utils.get_output_tensor_by_name(response, TOKENS_SO_FAR).as_numpy().item())
            last, finish_reason = response, reason
    except Exception:  # e.g. the client is gone and sending fails: do not leave the engine decoding
        if not stopped:
            _stop(request_id)
        raise
    if stopped:
        return pb_utils.TritonError(CANCELLED_MESSAGE, pb_utils.TritonError.CANCELLED)
    if last is None:
        return pb_utils.TritonError("dflash ended the stream without an answer")
    if not streaming:
        client.send(_answer(b"".join(texts), last, _joined_logprobs(logprobs)), final=True)
    client.timeline.finished(finish_reason)
    return None


def _client_text(text, engine_response, stop_text):
    """(the text to send the client, the engine's finish reason: "" while it runs): postprocessing's text through
    the stop-string rule."""
    delta = pb_utils.get_output_tensor_by_name(text, "text_output").as_numpy().item().decode("utf-8")
    reason = pb_utils.get_output_tensor_by_name(engine_response, FINISH_REASON).as_numpy().item().decode()
    return stop_text.push(delta, final=bool(reason), stopped=reason == "stop").encode("utf-8"), reason


def _stop_text(request):
    """The answer's text around its stop strings (OpenAI's rule: left out unless include_stop_str_in_output)."""
    words = pb_utils.get_input_tensor_by_name(request, "stop_words")
    return StopText([w.decode("utf-8") for w in words.as_numpy().reshape(-1)] if words is not None else [],
                    _flag(request, INCLUDE_STOP_STR))


def _flag(request, name):
    """A BOOL input's value; False where the request leaves it out."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().item())


def _classified(error):
    """The error with the code its message's class calls for: the models' codes are lost on the way
    (a BLS response keeps the message only), and Triton reports a dead backend process as INTERNAL
    where the client should retry elsewhere (UNAVAILABLE)."""
    code = getattr(pb_utils.TritonError, error_class(error.message()))
    return pb_utils.TritonError(error.message(), code)


def _inputs(request, names):
    """The request's tensors among `names` (optional ones may be absent)."""
    tensors = [pb_utils.get_input_tensor_by_name(request, name) for name in names]
    return [t for t in tensors if t is not None]


def _call(model, inputs, outputs, request_id=""):
    return pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                     request_id=request_id).exec()


def _stop(request_id):
    stop = pb_utils.InferenceRequest(model_name="dflash", inputs=[pb_utils.Tensor("stop", np.array([[True]]))],
                                     request_id=request_id, requested_output_names=[])
    for _ in stop.exec(decoupled=True):
        pass


def _answer(text, engine_response, logprobs=None):
    """The client's response: the text, and the engine response's other outputs (logprobs: all of a collected
    answer's instead of its last response's)."""
    tensors = [pb_utils.Tensor("text_output", np.array([[text]], dtype=object))] + (logprobs or [])
    names = [n for n in RESPONSE_OUTPUTS if not (logprobs and n in LOGPROB_OUTPUTS)]
    passed = [pb_utils.get_output_tensor_by_name(engine_response, name) for name in names]
    return pb_utils.InferenceResponse(tensors + [t for t in passed if t is not None])  # a statistic may be absent


def _joined_logprobs(responses):
    """LOGPROB_OUTPUTS of a whole answer from its responses' (none if the request asked for none)."""
    parts = [tuple(pb_utils.get_output_tensor_by_name(r, name) for name in LOGPROB_OUTPUTS) for r in responses]
    parts = [(floats.as_numpy().reshape(-1), json.loads(entries.as_numpy().item())) for floats, entries in parts
             if floats is not None]
    if not parts:
        return []
    floats = np.concatenate([f for f, _ in parts])[None].astype(np.float32)
    entries = [e for _, batch in parts for e in batch]
    return [pb_utils.Tensor("output_log_probs", floats),
            pb_utils.Tensor("logprobs", np.array([[json.dumps(entries, ensure_ascii=False)]], dtype=object))]
