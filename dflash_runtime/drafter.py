"""The DFlash drafter (arXiv 2602.06036): a few Qwen3-style layers that draft a whole block in one pass.

Context enters only through KV injection: the target's features of committed tokens go through each
layer's own k_proj/v_proj (k_norm, RoPE at their absolute positions) into the draft KV cache. The block
[last token, MASK, ...] attends to that context and, non-causally, to itself. Embedding and LM head are
the target's. Module names equal the z-lab / ModelOpt checkpoint keys, so loading is a state-dict load.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from plugins.kv_injection.torch_op import kv_injection

from .checkpoint import load_weights, read_safetensors
from .config import DrafterConfig, TargetConfig
from .kv_cache import KVCache
from .layers import MLP, AttentionProjections, RMSNorm, Rotary, prepare_for_inference


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        s = config.shape
        self.self_attn = AttentionProjections(s, bias=False, head_norms=True)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, h, cos, sin, context_k, context_v, mask):
        attn = self.self_attn
        q, k, v = attn.query_key_value(self.input_layernorm(h), cos, sin)
        k = torch.cat([context_k, k.transpose(1, 2)], dim=2)
        v = torch.cat([context_v, v.transpose(1, 2)], dim=2)
        h = h + attn.attend(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        s = config.shape
        self.fc = nn.Linear(len(config.target_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.rotary = Rotary(s.rope, s.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, num_slots: int, capacity: int) -> KVCache:
        s = self.config.shape
        return KVCache(s.num_layers, num_slots, s.num_kv_heads, s.head_dim, capacity,
                       self.dtype, self.fc.weight.device)

    def inject_context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       slots: torch.Tensor) -> None:
        """KV injection: write the context K/V of target features at their absolute positions.

        features: [B, T, len(target_layer_ids) * hidden]; positions: [B, T]. Lengths are not changed:
        the caller commits how many of the T positions are real context with cache.crop.
        """
        cache.check_positions(positions)
        context = self.hidden_norm(self.fc(features)).flatten(0, 1)  # [B * T, hidden]
        token_positions = positions.flatten()
        token_slots = slots[:, None].expand_as(positions).flatten()
        inv_freq = self.rotary.inv_freq.to(context.device)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kv_injection(context, attn.k_proj.weight, attn.v_proj.weight, attn.k_norm.weight, inv_freq,
                         token_positions, token_slots, cache.k[i], cache.v[i], attn.k_norm.eps)

    def forward(self, block_embeddings: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                slots: torch.Tensor) -> torch.Tensor:
        """Draft one block per sequence. block_embeddings: [B, S, hidden]; positions: [B, S].

        Returns the final-normed hidden states [B, S, hidden]; the target's LM head turns positions
        1..S-1 into draft tokens. The block's own K/V never enter the cache.
        """
        context_lengths = cache.lengths[slots]
        length = int(context_lengths.max())
        cos, sin = self.rotary(positions, block_embeddings.dtype)
        in_context = torch.arange(length, device=positions.device)[None, :] < context_lengths[:, None]
        in_block = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        mask = torch.cat([in_context, in_block], dim=1)[:, None, None, :]  # [B, 1, 1, L + S]
        h, rows = block_embeddings, cache.rows(slots)
        for i, layer in enumerate(self.layers):
            context_k, context_v = cache.read(i, rows, length)
            h = layer(h, cos, sin, context_k, context_v, mask)
        return self.norm(h)


def save_drafter(drafter: DFlashDrafter, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json + model.safetensors in the z-lab format (the shipped drafter is stored in bf16)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.config.to_dict(), indent=2) + "\n")
    # only the checkpoint's own keys: an inference-prepared drafter also holds fused views of them
    with torch.device("meta"):
        keys = DFlashDrafter(drafter.config).state_dict().keys()
    weights = drafter.state_dict()
    state = {k: weights[k].detach().to(dtype).contiguous() for k in keys}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_drafter(path: str | Path, target: TargetConfig, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> DFlashDrafter:
    path = Path(path)
    config = DrafterConfig.from_dir(path)
    config.check_against(target, str(path))
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    load_weights(drafter, read_safetensors(path), str(path), dtype, device)
    prepare_for_inference(drafter)
    return drafter.eval()
