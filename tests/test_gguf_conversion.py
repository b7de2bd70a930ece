"""GGUF -> HF conversion of the embedded default under the pinned transformers, and the quantizer marker that
later releases (5.17, where save_pretrained refused the model) leave on an already dequantized model."""
from __future__ import annotations

import json
import types

import pytest
import torch

from conftest import make_target
from dflash_runtime.checkpoint import forget_gguf_quantization, gguf_source, materialize_gguf, resolve_target
from dflash_runtime.config import DFlashError


def _marked_as_gguf(path):
    """A float model marked the way transformers 5.17 leaves a GGUF load that it dequantized on a CPU."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.hf_quantizer = types.SimpleNamespace(quantization_config=types.SimpleNamespace(quant_method="gguf"))
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "model.gguf"}
    return model


def test_cleared_quantizer_marker_lets_save_pretrained_write_a_plain_checkpoint(tmp_path):
    model = _marked_as_gguf(make_target(tmp_path / "target", "llama"))
    with pytest.raises(ValueError, match="not serializable"):  # the refusal seen on the H200 with 5.17
        model.save_pretrained(tmp_path / "refused")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forget_gguf_quantization(model, "model.gguf")
    assert model.hf_quantizer is None and not hasattr(model.config, "quantization_config")
    model.save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in before.items() if k in saved)


def test_weights_left_packed_are_an_error_not_a_silent_float_copy(tmp_path):
    model = _marked_as_gguf(make_target(tmp_path / "target", "qwen3"))
    model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.zeros(128, 64, dtype=torch.uint8),
                                                                   requires_grad=False)
    with pytest.raises(DFlashError, match="left GGUF weights packed .*up_proj"):
        forget_gguf_quantization(model, "model.gguf")


def test_embedded_gguf_converts_bit_identically_under_the_pinned_transformers(tmp_path, monkeypatch):
    """A fresh conversion (~25 s) equals the cached one every other test uses, and is a plain float checkpoint."""
    from safetensors.torch import load_file

    cached, _ = resolve_target("smollm2-135m")
    gguf = gguf_source(cached)
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    fresh = materialize_gguf(gguf, "fresh")
    assert "quantization_config" not in json.loads((fresh / "config.json").read_text())
    a, b = load_file(str(fresh / "model.safetensors")), load_file(str(cached / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
