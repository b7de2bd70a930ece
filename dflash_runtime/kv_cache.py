"""Paged KV cache: fixed-size blocks of positions, addressed through a block table per sequence.

Allocated once (no per-step allocation); which blocks a sequence holds is block_manager.py's business. A table
is a [B, W] tensor of block ids: row b's position p lives in block table[b, p // block_size] at offset
p % block_size. Rolling back after a rejected draft is only a length change: entries past a sequence's length
are never visible (attention masks use positions) and are overwritten later.

Attention reads a sequence's keys by gathering its blocks, per layer. Measured on a CPU (SmolLM2's layer shapes,
2 threads, whole engine, 139-token prompts + 128 tokens): 0.96-0.99x the tokens per second of reading a static
per-slot cache as a view; a block of 16 positions gathered as fast as 64 and twice as fast as 256.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .block_manager import NULL_BLOCK
from .kv_injection.op import CHECK_BOUNDS

BLOCK_SIZE = 16  # positions per block: the prefix cache's granularity; see the module's note for the measurement


class PassAddress(NamedTuple):
    """Where one pass writes and what it reads in every layer's cache, worked out once for all its layers."""

    blocks: torch.Tensor | None  # [B, T] the block of each new position (None: a pass that only reads)
    offsets: torch.Tensor | None  # [B, T] its offset within the block
    reads: torch.Tensor  # [B * W] the blocks holding each row's first `length` keys, row after row
    batch: int
    length: int  # keys each row reads


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        # tokens before heads: a gathered run of blocks is then a [B, L, KV, D] view without a second copy
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def sequential_table(self, batch: int, tokens: int) -> torch.Tensor:
        """A table giving `batch` sequences of `tokens` positions their own consecutive blocks (block 0 aside):
        for one-off passes (training, calibration) over a cache made for them."""
        width = -(-tokens // self.block_size)
        if batch * width >= self.num_blocks:
            raise ValueError(f"{batch} x {tokens} positions need {batch * width} blocks; the cache has "
                             f"{self.num_blocks - 1}")
        return torch.arange(1, 1 + batch * width, device=self.k.device).view(batch, width)

    def locate(self, table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks and offsets [B, T] of positions [B, T] through table [B, W]."""
        if CHECK_BOUNDS:
            self.check_positions(table, positions)
        return table.gather(1, positions // self.block_size), positions % self.block_size

    def check_positions(self, table: torch.Tensor, positions: torch.Tensor) -> None:
        """Only with DFLASH_CHECK_BOUNDS=1: the engine keeps positions in bounds by construction. Eagerly a
        device-to-host copy per layer (an IndexError naming the position); inside a CUDA-graph capture or a
        torch.compile trace, where a host copy is forbidden, an assertion on the device instead."""
        capacity = table.shape[1] * self.block_size
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or torch.compiler.is_compiling():
            torch._assert_async(positions.max() < capacity, f"KV cache write beyond the table's {capacity} positions")
        elif int(positions.max()) >= capacity:
            raise IndexError(f"KV cache write at position {int(positions.max())} beyond the table's {capacity} positions")

    def address(self, table: torch.Tensor, length: int, positions: torch.Tensor | None = None) -> PassAddress:
        """A pass's PassAddress: table [B, W], each row's blocks; it reads each row's first `length` keys and, given
        positions [B, T], writes those."""
        blocks, offsets = self.locate(table, positions) if positions is not None else (None, None)
        reads = table[:, :-(-length // self.block_size)].flatten()
        return PassAddress(blocks, offsets, reads, table.shape[0], length)

    def write(self, layer: int, address: PassAddress, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, T, KV, D] at the address's positions
        self.k[layer][address.blocks, address.offsets] = k
        self.v[layer][address.blocks, address.offsets] = v

    def read(self, layer: int, address: PassAddress) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [B, KV, length, D], gathered: a copy of the live prefix per layer and step
        shape = (address.batch, -1, *self.k.shape[3:])
        k = self.k[layer].index_select(0, address.reads).view(shape)[:, :address.length]
        v = self.v[layer].index_select(0, address.reads).view(shape)[:, :address.length]
        return k.transpose(1, 2), v.transpose(1, 2)

    def write_and_read(self, layer: int, address: PassAddress, k: torch.Tensor,
                       v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's KeysValues over this cache: write the new k, v, then read the first `length` keys."""
        self.write(layer, address, k, v)
        return self.read(layer, address)

    def injection_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's caches as the KV-injection op addresses them, [blocks, KV, block_size, D] (views): a token's
        slot is its block, and the op stores at its position modulo the block size."""
        return self.k[layer].transpose(1, 2), self.v[layer].transpose(1, 2)


def null_padded(tables: list[list[int]], width: int) -> list[list[int]]:
    """Block tables as rows of one width, the null block past each sequence's blocks."""
    return [t[:width] + [NULL_BLOCK] * (width - len(t)) for t in tables]
