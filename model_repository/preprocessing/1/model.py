"""Triton model `preprocessing`: text_input (+ apply_chat_template) -> input_ids."""
import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_runtime.config import DFlashError
from dflash_runtime.model_args import artifact_path, model_parameters
from dflash_runtime.text import encode_prompt, load_tokenizer


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
                raise DFlashError(f"send one prompt per request, got {texts.size}")
            ids = encode_prompt(self.tokenizer, _utf8(texts.item()), chat=chat is not None and bool(chat.as_numpy().item()))
        except DFlashError as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"text_input: {e}"))
        return pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32))])


def _utf8(value) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as e:
        raise DFlashError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
