"""Target models (Llama, Qwen3) that return the hidden states DFlash conditions on, beside the logits."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from . import cpu_weights
from .checkpoint import load_weights, read_safetensors
from .config import TargetConfig
from .gguf_blocks import load_blocks
from .kv_cache import BLOCK_SIZE, KVCache
from .layers import (MLP, AttentionMask, AttentionProjections, KeysValues, RMSNorm, Rotary, prepare_for_inference,
                     signed_sin)


class DecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        s = config.shape
        self.self_attn = AttentionProjections(s, bias=config.attention_bias, head_norms=config.arch == "qwen3")
        self.mlp = MLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, h, cos, sin, keys_values: KeysValues, mask: AttentionMask):
        attn = self.self_attn
        q, k, v = attn.query_key_value(self.input_layernorm(h), cos, sin)
        h = h + attn.attend(q, *keys_values(k, v), mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        s = config.shape
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        s = config.shape
        self.model = Backbone(config)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(s.rope, s.head_dim)
        self.attention_dtype = None  # cpu_weights: float64 where the linears round their inputs to bfloat16
        # gguf_kernels.LlamaKernels where cpu_weights serves the whole model on them: forward runs those instead of
        # the modules (the head aside)
        self.kernels = None

    # the embedding's: a CPU may serve the linears in another format (cpu_weights)
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCache:
        s = self.config.shape
        return KVCache(s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, self.dtype, self.device)

    def whole_pass(self, tokens: torch.Tensor, feature_layers: tuple[int, ...] = (), apply_head: bool = True):
        """forward() over whole sequences, tokens [B, T] at positions 0..T-1, with a cache made for this pass
        alone (training, calibration)."""
        batch, length = tokens.shape
        cache = self.new_cache(batch * -(-length // BLOCK_SIZE) + 1)
        positions = torch.arange(length, device=tokens.device)[None].expand(batch, length)
        return self(tokens, positions, cache, cache.sequential_table(batch, length), feature_layers,
                    apply_head=apply_head, causal=True)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, table: torch.Tensor,
                feature_layers: tuple[int, ...] = (), logits_at: torch.Tensor | None = None, apply_head: bool = True,
                length: int | None = None, causal: bool = False):
        """Run new tokens of several sequences at once, writing their K/V into the cache.

        tokens, positions: [B, T] (positions are absolute; each row may start at a different length)
        returns logits [B, T, V] (with logits_at [B], each row's index of the one token to return: [B, 1, V])
        and, if feature_layers, features [B, T, len(feature_layers) * hidden]
        (the output of each listed layer, i.e. HF hidden_states[layer + 1], concatenated).
        With apply_head=False the final-normed hidden states come back instead of logits.
        table: [B, W], each row's blocks of the cache (kv_cache.py). length (keys to attend to: more than the
        highest position) is the engine's, known on the host; without it, it is read from the tensors, which
        waits for the device. causal: the rows are whole prompts, positions 0..T-1 with nothing cached before
        them (a prefill), which attention runs without a mask.
        """
        def rows_at(h: torch.Tensor) -> torch.Tensor:
            return h if logits_at is None else h[torch.arange(len(h), device=h.device), logits_at][:, None]

        if self.kernels is not None:  # final-normed already
            h, features = self.kernels(tokens, positions, table, cache.k, cache.v, cache.block_size, feature_layers)
            h = rows_at(h)
        else:
            h, features = self._layers(tokens, positions, cache, table, feature_layers, length, causal)
            h = self.model.norm(rows_at(h))
        return (self.lm_head(h) if apply_head else h), features

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, table: torch.Tensor,
                feature_layers: tuple[int, ...], length: int | None,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The embedding and decoder layers on torch's operations: the last layer's output, and the feature layers'
        side by side."""
        h = self.embed(tokens)
        cos, sin = self.rotary(positions, h.dtype)
        if length is None:
            length = h.shape[1] if causal else int(positions.max()) + 1
        visible = None
        if not causal:
            key_positions = torch.arange(length, device=positions.device)
            visible = key_positions[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, L]: causal, ragged
        s = self.config.shape
        mask = AttentionMask(visible, s.num_heads, s.num_kv_heads, self.attention_dtype)
        sin, address = signed_sin(sin), cache.address(table, length, positions)
        selected = {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, partial(cache.write_and_read, i, address), mask)
            if i in feature_layers:
                selected[i] = h
        return h, torch.cat([selected[i] for i in feature_layers], dim=-1) if feature_layers else None


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                prepare: bool = True, cpu_weights: str | None = None) -> TargetModel:
    """prepare=False: the checkpoint's own modules, unfused and unsplit (frozen all the same), for a target whose
    parameters are sharded afterwards: a fused linear's parts are views of it, which sharding would copy.
    cpu_weights: the format a CPU serves the linears in (cpu_weights.py; None: DFLASH_CPU_WEIGHTS, else auto);
    what it got is in model.served_weights."""
    path = Path(path)
    config = TargetConfig.from_dir(path)
    with torch.device("meta"):
        model = TargetModel(config)
    state = read_safetensors(path)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    load_weights(model, state, str(path), dtype, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.served_weights = None
    if prepare:
        prepare_for_inference(model, partial(serve_cpu_weights, path=path, flag=cpu_weights))
    return model.requires_grad_(False).eval()


def serve_cpu_weights(model: TargetModel, path: Path, flag: str | None) -> None:
    blocks = load_blocks(path)
    requested = cpu_weights.requested_format(flag)
    asked_by = "asked for" if flag not in (None, cpu_weights.AUTO) else cpu_weights.ENV
    fmt, why = cpu_weights.choose(model, requested, blocks, asked_by)
    model.served_weights = cpu_weights.serve(model, requested, fmt, why, blocks)
    model.attention_dtype = cpu_weights.attention_dtype(fmt)
