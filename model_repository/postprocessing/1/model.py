"""Triton model `postprocessing`: a window of token ids -> the text they add (stateless)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_runtime.text import load_tokenizer
from dflash_serving.detokenize import text_delta
from dflash_serving.model_args import artifact_path, model_parameters


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = load_tokenizer(artifact_path(args, model_parameters(args)["tokenizer_dir"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            offsets = pb_utils.get_input_tensor_by_name(request, "read_offset").as_numpy().reshape(-1)
            texts = [text_delta(self.tokenizer, row.tolist(), int(offset)) for row, offset in zip(ids, offsets)]
            text = np.array([[t.encode("utf-8")] for t in texts], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
