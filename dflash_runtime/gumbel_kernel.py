"""The Gumbel-max of sampled decoding as one OpenAI Triton kernel: argmax(scores * scale + noise) per row.

The noise is counter_noise.uniforms' hash, computed in registers from the row's key (its seed, position
and stream) and each token's index, and never stored: a pass over the scores is the whole cost, where the
eager path writes and reads the [rows, vocab] noise a dozen times (a verify of 32 x 16 positions over a
152K vocabulary is 78M noise values). One program per row streams the vocabulary in blocks, keeping the
best value and its first index, so ties go to the lowest index as in torch.argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .counter_noise import UNIFORM_BITS

BLOCK_V = 1024
NUM_WARPS = 4


@triton.jit
def _mix32(x):
    """counter_noise._mix32 on uint32 lanes: products wrap modulo 2^32 as the eager version's masks do."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def gumbel_argmax_kernel(scores, keys, out, vocab, scale, BITS: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    key = tl.load(keys + row).to(tl.uint32)
    base = scores + row.to(tl.int64) * vocab
    best_value = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        index = start + tl.arange(0, BLOCK_V)
        valid = index < vocab
        score = tl.load(base + index, mask=valid, other=float("-inf")).to(tl.float32)
        bits = _mix32(_mix32(index.to(tl.uint32) * 0x9E3779B1) ^ key) >> (32 - BITS)
        uniform = (bits.to(tl.float32) + 0.5) * (1.0 / (1 << BITS))
        # 1 - uniform is exact in float32 (24 significant bits), so log(1 - u) is the eager log1p(-u)
        value = tl.where(valid, score * scale - tl.log(-tl.log(1.0 - uniform)), float("-inf"))
        block_best = tl.max(value, axis=0)
        block_index = tl.argmax(value, axis=0)
        better = block_best > best_value  # strict: an equal value later in the vocabulary loses
        best_index = tl.where(better, start + block_index, best_index)
        best_value = tl.where(better, block_best, best_value)
    tl.store(out + row, best_index)


def gumbel_argmax_triton(scores: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [M, V] (float), keys [M] int64 (counter_noise.position_keys) -> the argmax [M] (long) of
    scores * scale + the noise of each row's key."""
    scores = scores.contiguous()
    out = torch.empty(len(scores), dtype=torch.int32, device=scores.device)
    if not len(scores):
        return out.long()
    gumbel_argmax_kernel[(len(scores),)](scores, keys.contiguous(), out, scores.shape[1], float(scale),
                                         BITS=UNIFORM_BITS, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS)
    return out.long()
