"""Triton model `preprocessing`: a front-model request -> input_ids, every input checked first.

It is the first step of both front models (the ensemble's, and dflash_bls's first call), and it gets
all their inputs: one set of checks (dflash_serving.requests) refuses malformed requests with the
same message wherever they come in, before anything reaches the engine. Through the ensemble it gets the
client's request parameters too (Triton 2.51 passes them to the steps: measured), where an HTTP generate
body's misspelt field arrives; dflash_bls checks its own (a BLS call passes none on).

For the ensemble's request metrics (dflash_serving.metrics) it counts the requests it refuses, and gives the
others their arrival time, which the ensemble passes on to dflash. A client may call it alone, for the token ids a
prompt becomes (the OpenAI gateway's render endpoints): such calls are nobody's requests, and not counted.
"""
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_contract import DFlashError
from dflash_contract.protocol import invalid_request
from dflash_runtime.text import encode_prompt, load_tokenizer
from dflash_serving.metrics import ARRIVAL_INPUT, RequestMetrics, TritonRegistry, counted_at_front
from dflash_serving.model_args import artifact_path, model_parameters, served_model_name
from dflash_serving.requests import parse_front_request


class TritonPythonModel:
    def initialize(self, args):
        tokenizer_dir = artifact_path(args, model_parameters(args)["tokenizer_dir"])
        self.tokenizer = load_tokenizer(tokenizer_dir)
        if self.tokenizer is None:
            raise DFlashError(f"no tokenizer in {tokenizer_dir}")
        # only the series of the refusals: dflash counts the rest of the ensemble's requests
        self.requests = RequestMetrics(TritonRegistry(pb_utils.MetricFamily), ("ensemble",), served_model_name(args),
                                       {"refused": ("INVALID_ARG",)}, latencies=False)

    def execute(self, requests):
        arrival = np.array([[time.monotonic_ns()]], dtype=np.int64)
        return [self._encode(request, arrival) for request in requests]

    def _encode(self, request, arrival):
        def tensor(name):
            value = pb_utils.get_input_tensor_by_name(request, name)
            return None if value is None else value.as_numpy()

        try:
            # the request's parameters too: over HTTP generate, the body's fields that name no input
            prompt, chat, template = parse_front_request(tensor, request.parameters())
            try:
                ids = encode_prompt(self.tokenizer, prompt, chat=chat, template_args=template)
            except DFlashError as e:
                raise DFlashError(f"{'text_input' if isinstance(prompt, str) else 'messages'}: {e}") from None
        except DFlashError as e:
            if counted_at_front(request.request_id()):  # the ensemble's, still in flight: count now
                self.requests.count_now("ensemble", "refused", "INVALID_ARG")
            error = pb_utils.TritonError(invalid_request(str(e)), pb_utils.TritonError.INVALID_ARG)
            return pb_utils.InferenceResponse(error=error)
        return pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
                                           pb_utils.Tensor(ARRIVAL_INPUT, arrival)])
