"""The DFlash drafter (arXiv 2602.06036): a few Qwen3-style layers that draft a whole block in one pass.

Context enters only through KV injection: the target's features of committed tokens go through each
layer's own k_proj/v_proj (k_norm, RoPE at their absolute positions) into the draft KV cache. The block
[last token, MASK, ...] attends to that context and, non-causally, to itself. Embedding and LM head are
the target's. Module names equal the z-lab / ModelOpt checkpoint keys, so loading is a state-dict load.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .checkpoint import load_weights, read_safetensors
from .config import DrafterConfig, TargetConfig
from .kv_cache import BLOCK_SIZE, KVCache
from .kv_injection import inject, injected_kv
from .layers import (MLP, AttentionMask, AttentionProjections, KeysValues, RMSNorm, Rotary, prepare_for_inference,
                     signed_sin)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        s = config.shape
        self.self_attn = AttentionProjections(s, bias=False, head_norms=True)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, h, cos, sin, keys_values: KeysValues, mask: AttentionMask):
        attn = self.self_attn
        q, k, v = attn.query_key_value(self.input_layernorm(h), cos, sin)
        h = h + attn.attend(q, *keys_values(k, v), mask)
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

    def new_cache(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCache:
        s = self.config.shape
        return KVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, self.dtype,
                       self.fc.weight.device)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The context vectors KV injection projects: [..., len(target_layer_ids) * hidden] -> [..., hidden]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, layer: int, context: torch.Tensor, positions: torch.Tensor):
        """Layer `layer`'s injected K/V of context vectors [N, hidden] at positions [N] -> k, v [N, KV, D].

        The op's reference math, differentiable: the training forward uses it where inference writes
        the same values into the cache with `inject_context`.
        """
        attn = self.layers[layer].self_attn
        return injected_kv(context, attn.k_proj.weight, attn.v_proj.weight, attn.k_norm.weight,
                           self.rotary.inverse_frequencies(context.device), positions, attn.k_norm.eps)

    def inject_context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       table: torch.Tensor, max_tokens: int | None = None) -> None:
        """KV injection: write the context K/V of target features at their absolute positions.

        features: [B, T, len(target_layer_ids) * hidden]; positions: [B, T]; table: [B, W], each row's blocks.
        Which of the T positions are real context is the caller's to know (attention reads by position).
        max_tokens: the most B * T positions one call of the op gets (more are written in parts): on CUDA the op
        times its kernel once per token bucket, and a bucket never timed before is a stall mid-serving.
        """
        context = self.context(features).flatten(0, 1)  # [B * T, hidden]
        blocks, _ = cache.locate(table, positions)
        token_positions, token_blocks = positions.flatten(), blocks.flatten()  # contiguous: the kernel reads them with unit stride
        inv_freq = self.rotary.inverse_frequencies(context.device)
        part = max_tokens or len(context)
        for start in range(0, len(context), part):  # row slices of contiguous tensors stay contiguous
            end = start + part
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                inject(context[start:end], attn.k_proj.weight, attn.v_proj.weight, attn.k_norm.weight, inv_freq,
                       token_positions[start:end], token_blocks[start:end], *cache.injection_views(i), attn.k_norm.eps)

    def draft(self, h: torch.Tensor, positions: torch.Tensor, keys_values: Callable[[int], KeysValues],
              visible: torch.Tensor) -> torch.Tensor:
        """The draft layers over block embeddings h [B, Q, hidden] at positions [B, Q].

        keys_values(layer) -> that layer's KeysValues: the block's own k, v joined to the context's, [B, KV, L, D]
        each; visible [B, 1, Q or 1, L] (True = visible). Returns the final-normed hidden states; the target's
        LM head turns them into draft tokens.
        """
        s = self.config.shape
        mask = AttentionMask(visible, s.num_heads, s.num_kv_heads)
        cos, sin = self.rotary(positions, h.dtype)
        sin = signed_sin(sin)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, keys_values(i), mask)
        return self.norm(h)

    def forward(self, block_embeddings: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                table: torch.Tensor, length: int) -> torch.Tensor:
        """Draft one block per sequence from the cached context. block_embeddings: [B, S, hidden];
        positions: [B, S], each row's block right after its committed context; table: [B, W], each row's
        blocks; length: keys to read, more than the highest position (the engine knows it on the host).

        The block's own K/V are written into the cache after the context, where attention reads them with
        it (no copy of the context per layer); they lie past the committed length, so the next context
        written there replaces them and nothing else ever sees them."""
        # every key up to the block's last position: the context before the block, and the whole block
        visible = (torch.arange(length, device=positions.device)[None, :] <= positions[:, -1:])[:, None, None, :]
        address = cache.address(table, length, positions)
        return self.draft(block_embeddings, positions, lambda i: partial(cache.write_and_read, i, address), visible)


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
