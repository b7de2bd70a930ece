"""The fused KV-injection kernel in OpenAI Triton.

One program per (token, KV head): it streams its head's rows of W_k and W_v against the token's
context vector (fp32 accumulation), applies k_norm and rotate-half RoPE to K in registers, and stores
K and V straight into the cache slot at the token's position (modulo the slot's capacity: a paged
cache's slot is a block). Tokens of different sequences, with
different cache offsets, share one launch.

The argument order is TensorRT's AOT plugin convention (inputs, integer scalars, outputs; floats are
compile-time constants), so the same kernel serves PyTorch and the TensorRT plugin. The caches come
twice: as inputs and as the outputs aliased to them; only the outputs are written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kv_injection_kernel(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k_in, cache_v_in,
                        hidden, context_stride, cache_slot_stride, cache_head_stride, cache_pos_stride, cache_capacity,
                        cache_k, cache_v, EPS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HALF)
    rows_lo = head * 2 * HALF + d  # this head's first and second halves of W rows
    rows_hi = rows_lo + HALF
    k_lo = tl.zeros([HALF], dtype=tl.float32)
    k_hi = tl.zeros([HALF], dtype=tl.float32)
    v_lo = tl.zeros([HALF], dtype=tl.float32)
    v_hi = tl.zeros([HALF], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        valid = cols < hidden
        h = tl.load(context + token * context_stride + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
        w_mask = valid[None, :]
        lo = rows_lo[:, None] * hidden + cols[None, :]  # [HALF, BLOCK_H] offsets into W_k / W_v
        hi = rows_hi[:, None] * hidden + cols[None, :]
        k_lo += tl.sum(tl.load(k_weight + lo, mask=w_mask, other=0.0).to(tl.float32) * h, axis=1)
        k_hi += tl.sum(tl.load(k_weight + hi, mask=w_mask, other=0.0).to(tl.float32) * h, axis=1)
        v_lo += tl.sum(tl.load(v_weight + lo, mask=w_mask, other=0.0).to(tl.float32) * h, axis=1)
        v_hi += tl.sum(tl.load(v_weight + hi, mask=w_mask, other=0.0).to(tl.float32) * h, axis=1)
    # k_norm: RMS over the whole head
    mean_square = (tl.sum(k_lo * k_lo, axis=0) + tl.sum(k_hi * k_hi, axis=0)) / (2 * HALF)
    scale = 1.0 / tl.sqrt(mean_square + EPS)
    k_lo = k_lo * scale * tl.load(k_norm_weight + d).to(tl.float32)
    k_hi = k_hi * scale * tl.load(k_norm_weight + HALF + d).to(tl.float32)
    # RoPE at the token's absolute position
    position = tl.load(positions + token)
    angle = position.to(tl.float32) * tl.load(inv_freq + d).to(tl.float32)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    rotated_lo = k_lo * cos - k_hi * sin
    rotated_hi = k_hi * cos + k_lo * sin
    slot = tl.load(slots + token)
    base = slot * cache_slot_stride + head * cache_head_stride + (position % cache_capacity) * cache_pos_stride
    out_type = cache_k.dtype.element_ty
    tl.store(cache_k + base + d, rotated_lo.to(out_type))
    tl.store(cache_k + base + HALF + d, rotated_hi.to(out_type))
    tl.store(cache_v + base + d, v_lo.to(out_type))
    tl.store(cache_v + base + HALF + d, v_hi.to(out_type))


BLOCK_H = 128  # hidden elements per loop step: 128 x 64 fp32 weight tiles stay in registers
NUM_WARPS = 4


def kv_injection_triton(context: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
                        k_norm_weight: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor,
                        slots: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, eps: float) -> None:
    """Same contract as reference.kv_injection_reference."""
    n, hidden = context.shape
    _, kv_heads, _, head_dim = cache_k.shape
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"head_dim {head_dim}: the kernel needs head_dim / 2 to be a power of two")
    if cache_k.stride() != cache_v.stride() or cache_k.stride(3) != 1:
        raise ValueError("cache_k and cache_v need the same layout with a contiguous last dimension")
    for name, t in (("k_weight", k_weight), ("v_weight", v_weight)):
        if t.stride() != (hidden, 1):  # fused q/k/v weights are row slices: contiguous, never copied here
            raise ValueError(f"{name} needs contiguous rows")
    if n == 0:
        return
    # The kernel indexes these with unit strides: a stride-0 view of one sequence's slot (or any other
    # view) would be read past its end, and the cache written out of bounds. Each is a no-op when the
    # tensor is contiguous already (the context is not when a CPU run splits the linear by threads).
    context, positions, slots = context.contiguous(), positions.contiguous(), slots.contiguous()
    k_norm_weight, inv_freq = k_norm_weight.contiguous(), inv_freq.contiguous()
    kv_injection_kernel[(n, kv_heads)](
        context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v,
        hidden, context.stride(0), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), cache_k.shape[2],
        cache_k, cache_v, EPS=eps, HALF=head_dim // 2, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS)
