"""The PyTorch reference of the KV-injection op: the one definition of its math.

The drafter's training forward (`DFlashDrafter.context_kv`) and the op's CPU path both call it, the
Triton kernel and the TensorRT plugin are tested against it.
"""
from __future__ import annotations

import torch


def injected_kv(context: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                inv_freq: torch.Tensor, positions: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K = RoPE(k_norm(W_k h)) at each token's absolute position and V = W_v h, in float32.

    context: [N, hidden] (already fc + hidden_norm); k_weight, v_weight: [KV * D, hidden];
    k_norm_weight: [D]; inv_freq: [D / 2]; positions: [N] -> k, v: [N, KV, D]. Differentiable.
    """
    n, head_dim = context.shape[0], k_norm_weight.shape[0]
    half = head_dim // 2
    x = context.float()
    k = (x @ k_weight.float().T).view(n, -1, head_dim)
    v = (x @ v_weight.float().T).view(n, -1, head_dim)
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm_weight.float()
    angles = positions[:, None].float() * inv_freq.float()  # [N, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    k1, k2 = k[..., :half], k[..., half:]
    k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)  # rotate-half RoPE
    return k, v


def kv_injection_reference(context: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
                           k_norm_weight: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, eps: float) -> None:
    """Write the injected K/V of N context tokens into the cache, in place.

    positions, slots: [N] (int64, any mix of sequences); cache_k, cache_v: [slots, KV, capacity, D] (any strides).
    A token goes to [slot, :, position % capacity]: a cache of one slot per sequence holds every position as it
    is; a paged cache ([blocks, KV, block_size, D], kv_cache.py) takes the token's block as its slot.
    Math in float32, stored in the cache's dtype.
    """
    k, v = injected_kv(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, eps)
    offsets = positions % cache_k.shape[2]
    cache_k[slots, :, offsets] = k.to(cache_k.dtype)
    cache_v[slots, :, offsets] = v.to(cache_v.dtype)
