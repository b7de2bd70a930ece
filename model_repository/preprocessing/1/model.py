"""Triton model `preprocessing`: text_input (+ apply_chat_template) -> input_ids."""
import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_contract import DFlashError
from dflash_runtime.text import encode_prompt, load_tokenizer
from dflash_serving.model_args import artifact_path, model_parameters
from dflash_serving.requests import utf8


class TritonPythonModel:
    def initialize(self, args):
        tokenizer_dir = artifact_path(args, model_parameters(args)["tokenizer_dir"])
        self.tokenizer = load_tokenizer(tokenizer_dir)
        if self.tokenizer is None:
            raise DFlashError(f"no tokenizer in {tokenizer_dir}")

    def execute(self, requests):
        return [self._encode(request) for request in requests]

    def _encode(self, request):
        texts = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
        chat = pb_utils.get_input_tensor_by_name(request, "apply_chat_template")
        try:
            if texts.size != 1:  # the engine batches requests itself; a batch per request has no use
                raise DFlashError(f"text_input: send one prompt per request, got {texts.size}")
            text = utf8("text_input", texts.item())
            try:
                ids = encode_prompt(self.tokenizer, text, chat=chat is not None and bool(chat.as_numpy().item()))
            except DFlashError as e:
                raise DFlashError(f"text_input: {e}") from None
        except DFlashError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
        return pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32))])
