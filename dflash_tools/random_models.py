"""Random-weight models at real targets' shapes, for timings that do not depend on the weights (gpu_check.py,
step_profile.py): transformers' model, and our target and a DFlash drafter of the matching shape."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_runtime.config import DrafterConfig, TargetConfig
from dflash_runtime.drafter import DFlashDrafter
from dflash_runtime.layers import prepare_for_inference
from dflash_runtime.target import TargetModel

# HF config fields of each target shape, and its drafter's (layers, target_layer_ids): z-lab's for Qwen3-8B
SHAPES = {
    "tiny": ({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
              "tie_word_embeddings": True}, (1, [1, 3])),
    "smollm2-135m": ({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                      "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                      "rope_theta": 100000.0, "tie_word_embeddings": True}, (2, [1, 8, 15, 22, 29])),
    "qwen3-8b": ({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                  "rope_theta": 1000000.0, "tie_word_embeddings": False}, (5, [1, 9, 17, 25, 33])),
}
COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096, "attention_bias": False,
          "eos_token_id": 0, "hidden_act": "silu"}
DRAFTER_BLOCK = 16  # the random drafters' block: any verify length up to it can be timed


def random_models(name: str, device: torch.device, dtype: torch.dtype, folder: Path):
    """transformers' model of the shape with random weights, and our target and drafter on the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields, (draft_layers, layer_ids) = SHAPES[name]
    config = {**COMMON, **fields}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    (folder / "config.json").write_text(json.dumps(config))
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype).eval()
    with torch.device("meta"):
        target = TargetModel(TargetConfig.from_dir(folder))
    state = dict(hf.state_dict())
    target.load_state_dict({k: state[k] for k in target.state_dict()}, assign=True)
    if target.config.tie_word_embeddings:
        target.lm_head.weight = target.model.embed_tokens.weight
    drafter_config = {**config, "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                      "num_hidden_layers": draft_layers, "num_target_layers": config["num_hidden_layers"],
                      "block_size": DRAFTER_BLOCK, "dflash_config": {"mask_token_id": 1, "target_layer_ids": layer_ids}}
    (folder / "drafter").mkdir()
    (folder / "drafter" / "config.json").write_text(json.dumps(drafter_config))
    with torch.device("meta"):
        drafter = DFlashDrafter(DrafterConfig.from_dir(folder / "drafter"))
    drafter = drafter.to_empty(device=device).to(dtype)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    prepare_for_inference(target)
    prepare_for_inference(drafter)
    return hf, target.eval(), drafter.eval()
