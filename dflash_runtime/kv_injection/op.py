"""`torch.ops.dflash.kv_injection`: the fused op as a PyTorch custom op.

CUDA tensors run the Triton kernel; everything else runs the reference. The fake implementation lets
the op trace (torch.compile, export): it mutates the caches and returns nothing.
"""
from __future__ import annotations

import torch

from .reference import kv_injection_reference


@torch.library.custom_op("dflash::kv_injection", mutates_args=("cache_k", "cache_v"))
def kv_injection(context: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                 inv_freq: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, eps: float) -> None:
    if context.is_cuda:
        from .triton_kernel import kv_injection_triton

        kv_injection_triton(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v,
                            eps)
    else:
        kv_injection_reference(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k,
                               cache_v, eps)


@kv_injection.register_fake
def _(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v, eps) -> None:
    return None
