"""Micro-benchmark: the fused KV-injection kernel, its unfused reference and the op, side by side.

    python -m plugins.kv_injection.benchmark [--tokens 16] [--device cuda]

The unfused side is the reference (two GEMMs, k_norm, RoPE, two scatters); the fused side is the Triton
kernel; the op runs whichever of the two it measured faster for the shape. On a GPU each is timed as a
CUDA graph of repeated calls (as the engine's graphs run them). On CPU the op runs the reference and
there is no kernel to time (the Triton interpreter's timings mean nothing): the ratio shows the op's
dispatch overhead only.
"""
from __future__ import annotations

import argparse
import time

import torch

from dflash_runtime.config import RopeConfig
from dflash_runtime.kv_injection import kv_injection, kv_injection_reference
from dflash_runtime.kv_injection.op import graph_seconds

SHAPES = {"smollm2-135m": (576, 3, 64, 100000.0), "qwen3-8b": (4096, 8, 128, 1000000.0)}


def time_op(op, args, device: str, repeat: int) -> float:
    if device == "cuda":
        return graph_seconds(op, args, repeat)
    op(*args)
    start = time.perf_counter()
    for _ in range(repeat):
        op(*args)
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
        unfused_s = time_op(kv_injection_reference, op_args, args.device, args.repeat)
        op_s = time_op(kv_injection, op_args, args.device, args.repeat)
        fused = ""
        if args.device == "cuda":
            from dflash_runtime.kv_injection.triton_kernel import kv_injection_triton

            fused_s = time_op(kv_injection_triton, op_args, args.device, args.repeat)
            fused = f"fused {fused_s * 1e6:8.1f} us   unfused/fused {unfused_s / fused_s:5.2f}x   "
        print(f"{name:13s} {n} tokens: {fused}unfused {unfused_s * 1e6:8.1f} us   op {op_s * 1e6:8.1f} us   "
              f"unfused/op {unfused_s / op_s:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
