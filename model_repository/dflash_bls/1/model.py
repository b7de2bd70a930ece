"""Triton model `dflash_bls`: preprocessing -> dflash (streamed) -> postprocessing, cancellable.

It calls the same three models as the ensemble, with the same tensors, but it watches its own
client: once the client cancels, it sends `dflash` a `stop` request with the stream's request id
(tensorrtllm_backend's protocol), and the engine frees the sequence's slot at its next
cancellation check. Decoupled BLS `cancel()` would do the same, but only Triton >= 25.05 has it.
"""
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_contract.protocol import ENGINE_INPUTS, FINISH_REASON, STATISTICS, TOKEN_OUTPUTS

RESPONSE_OUTPUTS = (FINISH_REASON, *(s.tensor for s in STATISTICS))  # passed on to the client as they are

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def execute(self, requests):
        # a thread per request: a stream lasts many engine steps, and execute must return
        for request in requests:
            threading.Thread(target=_serve, args=(request,), daemon=True).start()
        return None


def _serve(request):
    sender = request.get_response_sender()
    try:
        error = _generate(request, sender)
    except Exception as e:  # a bug must still end the client's stream
        error = pb_utils.TritonError(f"internal error: {type(e).__name__}: {e}")
    if error is not None:
        try:
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception as e:  # the client is gone: nobody left to tell
            pb_utils.Logger.log_warn(f"dflash_bls: could not send the final error ({e})")


def _generate(request, sender):
    """Stream (or collect) the answer to the client; returns the error to send instead, or None."""
    prompt = _call("preprocessing", _inputs(request, ("text_input", "apply_chat_template")), ["input_ids"])
    if prompt.has_error():
        return prompt.error()
    stream = pb_utils.get_input_tensor_by_name(request, "stream")
    streaming = stream is not None and bool(stream.as_numpy().item())
    request_id = uuid.uuid4().hex
    inputs = [pb_utils.get_output_tensor_by_name(prompt, "input_ids"), pb_utils.Tensor("stream", np.array([[True]]))]
    engine = pb_utils.InferenceRequest(
        model_name="dflash", inputs=inputs + _inputs(request, ENGINE_INPUTS), request_id=request_id,
        requested_output_names=[*TOKEN_OUTPUTS, *RESPONSE_OUTPUTS])
    texts, last, stopped = [], None, False
    # streamed even when the client asked for one response: a response per step is where
    # cancellation is seen
    try:
        for response in engine.exec(decoupled=True):
            if not stopped and sender.is_cancelled():
                _stop(request_id)
                stopped = True
            if response.has_error():
                return response.error()
            if not response.output_tensors():  # an empty final flag
                continue
            ids = [pb_utils.get_output_tensor_by_name(response, name)
                   for name in (*TOKEN_OUTPUTS, FINISH_REASON)]
            text = _call("postprocessing", ids, ["text_output"])
            if text.has_error():
                _stop(request_id)
                return text.error()
            delta = pb_utils.get_output_tensor_by_name(text, "text_output").as_numpy().item()
            finished = bool(pb_utils.get_output_tensor_by_name(response, FINISH_REASON).as_numpy().item())
            if streaming:
                sender.send(_answer(delta, response), flags=FINAL if finished else 0)
            else:
                texts.append(delta)
            last = response
    except Exception:  # e.g. the client is gone and sending fails: do not leave the engine decoding
        if not stopped:
            _stop(request_id)
        raise
    if last is None:
        return pb_utils.TritonError("dflash ended the stream without an answer")
    if not streaming:
        sender.send(_answer(b"".join(texts), last), flags=FINAL)
    return None


def _inputs(request, names):
    """The request's tensors among `names` (optional ones may be absent)."""
    tensors = [pb_utils.get_input_tensor_by_name(request, name) for name in names]
    return [t for t in tensors if t is not None]


def _call(model, inputs, outputs):
    return pb_utils.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs).exec()


def _stop(request_id):
    stop = pb_utils.InferenceRequest(model_name="dflash", inputs=[pb_utils.Tensor("stop", np.array([[True]]))],
                                     request_id=request_id, requested_output_names=[])
    for _ in stop.exec(decoupled=True):
        pass


def _answer(text, engine_response):
    tensors = [pb_utils.Tensor("text_output", np.array([[text]], dtype=object))]
    tensors += [pb_utils.get_output_tensor_by_name(engine_response, name) for name in RESPONSE_OUTPUTS]
    return pb_utils.InferenceResponse(tensors)
