"""Micro-benchmark: the KV-injection op against the unfused PyTorch sequence, side by side.

    python -m plugins.kv_injection.benchmark [--tokens 16] [--device cuda]

On CPU both sides are PyTorch (the Triton interpreter's timings mean nothing), so the figure is what
fusing the math into one function saves in dispatch and memory traffic. On a GPU the fused side is
the Triton kernel.
"""
from __future__ import annotations

import argparse
import time

import torch

from dflash_runtime.config import RopeConfig
from dflash_runtime.layers import apply_rope

from .torch_op import kv_injection

SHAPES = {"smollm2-135m": (576, 3, 64, 100000.0), "qwen3-8b": (4096, 8, 128, 1000000.0)}


def unfused(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v, eps):
    """The drafter's unfused path: two GEMMs, k_norm, RoPE, two scatters."""
    n, (_, kv_heads, _, head_dim) = context.shape[0], cache_k.shape
    k = (context @ k_weight.T).view(n, kv_heads, head_dim)
    v = (context @ v_weight.T).view(n, kv_heads, head_dim)
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm_weight
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], -1)[:, None]
    k = apply_rope(k.transpose(0, 1), emb.cos().transpose(0, 1), emb.sin().transpose(0, 1)).transpose(0, 1)
    cache_k[slots, :, positions] = k
    cache_v[slots, :, positions] = v


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_op(op, args, device: str, repeat: int) -> float:
    op(*args)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        op(*args)
    sync(device)
    return (time.perf_counter() - start) / repeat


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16, help="new context tokens per call (a verified block)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    for name, (hidden, kv_heads, head_dim, base) in SHAPES.items():
        n = args.tokens * args.sequences
        g = torch.Generator().manual_seed(0)
        make = lambda *shape: torch.randn(*shape, generator=g).to(args.device)  # noqa: E731
        cache = [torch.zeros(args.sequences, kv_heads, 512, head_dim, device=args.device) for _ in range(2)]
        positions = (torch.arange(args.tokens).repeat(args.sequences) + 100).to(args.device)
        slots = torch.arange(args.sequences).repeat_interleave(args.tokens).to(args.device)
        op_args = (make(n, hidden), make(kv_heads * head_dim, hidden) / hidden ** 0.5,
                   make(kv_heads * head_dim, hidden) / hidden ** 0.5, make(head_dim),
                   RopeConfig(base).inverse_frequencies(head_dim).to(args.device), positions, slots, *cache, 1e-6)
        fused_s = time_op(kv_injection, op_args, args.device, args.repeat)
        unfused_s = time_op(unfused, op_args, args.device, args.repeat)
        print(f"{name:13s} {n} tokens: fused {fused_s * 1e6:8.1f} us   unfused {unfused_s * 1e6:8.1f} us   "
              f"unfused/fused {unfused_s / fused_s:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
