"""Counter-based random numbers: uniforms and Gumbel noise that depend only on (seed, position, stream, index),
made on any device without a generator's state, so that a position's sample is the same whatever batch, block or
device computes it (sampling.py). gumbel_kernel.py computes the same hash in registers.
"""
from __future__ import annotations

import functools

import torch

MASK32 = 0xFFFFFFFF
UNIFORM_BITS = 23  # (m + 0.5) / 2^23 is exact in float32, so no uniform rounds to 0 or 1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2^32) (hash-prospector's two-round mixer): both
    multipliers are below 2^31, so no int64 product overflows, on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


# Noise streams: independent noise of one (seed, position) for each use. The target's samples and the drafts that
# guess them share TARGET; rejection sampling's draws from the drafter, its acceptance tests and its resampling
# each take their own, as its proof needs.
TARGET, DRAFT, ACCEPT, RESIDUAL = range(4)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = TARGET) -> torch.Tensor:
    """The 32-bit key [N, T] (int64) of each (seed, position, stream). seeds: [N, 2] int64, each seed's low and
    high 32 bits; positions: [N, T]."""
    row = _mix32(_mix32(_mix32(seeds[:, 0]) ^ seeds[:, 1]) ^ stream)[:, None]
    return _mix32(row ^ (positions & MASK32))


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, count: int, stream: int = TARGET) -> torch.Tensor:
    """Uniform numbers [N, T, count] in (0, 1), float32, made on the device of `seeds`: entry (n, t, i)
    depends only on (seeds[n], positions[n, t], i, stream). Per entry one XOR and one hash: each index's own
    hash is made once (_index_keys), as are the keys of the positions."""
    bits = _mix32(_index_keys(count, seeds.device) ^ position_keys(seeds, positions, stream)[..., None])
    return ((bits >> (32 - UNIFORM_BITS)).float() + 0.5) * 2.0 ** -UNIFORM_BITS


@functools.cache
def _index_keys(count: int, device: torch.device) -> torch.Tensor:
    """The hashes of 0..count-1, kept per (count, device): a vocabulary's are reused by every step."""
    return _mix32(torch.arange(count, device=device) * 0x9E3779B1 & MASK32)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = TARGET) -> torch.Tensor:
    """Gumbel noise [N, T, vocab] in float32: one draw per token of (seed, position, stream), see uniforms."""
    return -torch.log(-torch.log1p(-uniforms(seeds, positions, vocab, stream)))  # exact near both ends
