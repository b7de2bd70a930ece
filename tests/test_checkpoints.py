"""Checkpoint formats: the z-lab drafter format, malformed drafters, sharded targets, RoPE config spellings."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import MASK, VOCAB, edited_copy, load_pair
from dflash_runtime import DFlashError, SamplingParams, SpeculativeEngine, load_drafter, load_target
from dflash_runtime.config import read_rope
from dflash_runtime.kv_cache import KVCache

ZLAB_LAYER_KEYS = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}


def test_drafter_checkpoint_is_in_the_zlab_format(tiny):
    _, drafter_dir = tiny
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 3]}
    assert config["block_size"] == 16 and config["num_target_layers"] == 4
    keys = set(load_file(str(drafter_dir / "model.safetensors")))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.0.{k}" for k in ZLAB_LAYER_KEYS}
    assert keys == expected  # embedding and LM head are the target's, never stored


@pytest.mark.parametrize("name,edit_config,edit_state,message", [
    ("missing-tensor", None, lambda s: s.pop("layers.0.mlp.up_proj.weight"),
     "missing tensors layers.0.mlp.up_proj.weight"),
    ("wrong-shape", None, lambda s: s.update({"fc.weight": torch.zeros(64, 64)}), "wrong shapes fc.weight"),
    ("extra-tensor", None, lambda s: s.update({"layers.0.extra": torch.zeros(1)}), "unexpected tensors layers.0.extra"),
    ("layer-ids", lambda c: c["dflash_config"].update(target_layer_ids=[1, 9]), None,
     r"target_layer_ids \[9\] out of range"),
    ("mask-id", lambda c: c["dflash_config"].update(mask_token_id=VOCAB), None,
     "mask_token_id 128 outside the vocabulary"),
    ("no-mask", lambda c: c["dflash_config"].pop("mask_token_id"), None, "missing dflash_config.mask_token_id"),
    ("arch", lambda c: c.update(architectures=["Qwen3ForCausalLM"]), None, "DFlashDraftModel"),
    ("hidden", lambda c: c.update(num_target_layers=7), None, "num_target_layers 7"),
    ("rope", lambda c: [c.pop("rope_theta"), c.pop("rope_parameters")], None, "no RoPE base"),
])
def test_malformed_drafters_are_refused_clearly(tiny, tmp_path, name, edit_config, edit_state, message):
    target = load_target(tiny[0])
    broken = edited_copy(tiny[1], tmp_path / name, edit_config, edit_state)
    with pytest.raises(DFlashError, match=message):
        load_drafter(broken, target.config)


def test_missing_files_are_user_errors(tmp_path):
    with pytest.raises(DFlashError, match="missing file"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match="not valid JSON"):
        load_target(tmp_path)


def test_sharded_target_loads_like_the_single_file(tiny, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny[0])
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    single, sharded = load_target(tiny[0]), load_target(tmp_path)
    params = SamplingParams(max_new_tokens=20)
    a = SpeculativeEngine(single).generate([[5, 9, 11]], params)[0].output_ids
    b = SpeculativeEngine(sharded).generate([[5, 9, 11]], params)[0].output_ids
    assert a == b


def test_rope_base_is_read_from_either_transformers_spelling():
    assert read_rope({"rope_theta": 100000.0}, "x").theta == 100000.0  # transformers 4.x
    assert read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}, "x").theta == 100000.0
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    legacy = read_rope({"rope_theta": 5e5, "rope_scaling": scaling}, "x")
    assert legacy.llama3_scaling == (8.0, 1.0, 4.0, 8192)
    with pytest.raises(DFlashError, match="no RoPE base"):
        read_rope({}, "x")
    with pytest.raises(DFlashError, match="unsupported rope_type 'yarn'"):
        read_rope({"rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "x")


def test_kv_cache_writes_and_reads_through_block_tables():
    """Positions land in the block a table names for them, at their offset; a read gathers a row's blocks in
    table order, cut to the keys asked for; rows may share a block (a prefix-cache hit)."""
    cache = KVCache(num_layers=1, num_blocks=5, block_size=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    table = torch.tensor([[3, 1], [4, 2]])
    positions = torch.tensor([[0, 1, 2], [0, 1, 2]])
    kv = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).view(2, 3, 2, 4)
    cache.write(0, cache.address(table, 3, positions), kv, -kv)
    assert torch.equal(cache.k[0, 3], kv[0, :2]) and torch.equal(cache.k[0, 1, 0], kv[0, 2])
    assert torch.equal(cache.v[0, 2, 0], -kv[1, 2]) and not cache.k[0, 0].any()  # the null block untouched
    k, v = cache.read(0, cache.address(table, 3))
    assert k.shape == v.shape == (2, 2, 3, 4)
    assert torch.equal(k[0].transpose(0, 1), kv[0]) and torch.equal(v[1].transpose(0, 1), -kv[1])
    # sequence 0's first block, then sequence 1's second
    shared = cache.read(0, cache.address(torch.tensor([[3, 2]]), 3))[0]
    assert torch.equal(shared[0].transpose(0, 1), torch.cat([kv[0, :2], kv[1, 2:]]))
    assert cache.sequential_table(2, 3).tolist() == [[1, 2], [3, 4]]
    with pytest.raises(ValueError, match="need 6 blocks; the cache has 4"):
        cache.sequential_table(3, 4)


def test_a_loaded_drafter_saves_back_to_the_same_format(tiny, tmp_path):
    from dflash_runtime import save_drafter

    target, drafter = load_pair(tiny)  # loaded for inference: projections fused
    save_drafter(drafter, tmp_path, torch.float32)
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(load_file(str(tiny[1] / "model.safetensors")))
    again = load_drafter(tmp_path, target.config)
    assert torch.equal(again.fc.weight, drafter.fc.weight)
