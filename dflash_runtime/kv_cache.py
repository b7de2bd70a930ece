"""Static KV cache shared by a batch of sequences of different lengths.

One slot per running sequence, allocated once at the maximum length (gpt-fast style: no per-step
allocation). Rolling back after a rejected draft is only a length change: entries past a slot's
length are never visible (attention masks use positions and lengths) and are overwritten later.
"""
from __future__ import annotations

import torch

from .kv_injection.op import CHECK_BOUNDS


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)  # committed tokens per slot
        self.capacity = capacity

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [B]; positions: [B, T]; k, v: [B, T, KV, D]
        if CHECK_BOUNDS:
            self.check_positions(positions)
        self.k[layer][slots[:, None], :, positions] = k
        self.v[layer][slots[:, None], :, positions] = v

    def check_positions(self, positions: torch.Tensor) -> None:
        """Only with DFLASH_CHECK_BOUNDS=1: the engine keeps positions in bounds by construction. Eagerly a
        device-to-host copy per layer (an IndexError naming the position); inside a CUDA-graph capture or a
        torch.compile trace, where a host copy is forbidden, an assertion on the device instead."""
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing or torch.compiler.is_compiling():
            torch._assert_async(positions.max() < self.capacity, f"KV cache write beyond capacity {self.capacity}")
        elif int(positions.max()) >= self.capacity:
            raise IndexError(f"KV cache write at position {int(positions.max())} beyond capacity {self.capacity}")

    @staticmethod
    def rows(slots: list[int], slot_tensor: torch.Tensor) -> torch.Tensor | slice:
        """What read() takes for `slots`, decided on the host: a slice when they are one increasing
        run (one sequence, or a batch in slot order), else `slot_tensor`, the same slots on the device."""
        first, n = slots[0], len(slots)
        if slots == list(range(first, first + n)):
            return slice(first, first + n)
        return slot_tensor

    def read(self, layer: int, rows: torch.Tensor | slice, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [B, KV, length, D]. A slice of rows is a view; other rows are gathered, a copy of
        # the live prefix per layer and step: at batch 48 x 400 tokens that copy cost more than the
        # attention itself (14 vs 5 ms per SmolLM2 layer, 1 thread).
        if isinstance(rows, slice):
            return self.k[layer][rows, :, :length], self.v[layer][rows, :, :length]
        return (self.k[layer][:, :, :length].index_select(0, rows),
                self.v[layer][:, :, :length].index_select(0, rows))

    def write_and_read(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | slice,
                       length: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's KeysValues over this cache: write the new k, v, then read the first `length` keys."""
        self.write(layer, slots, positions, k, v)
        return self.read(layer, rows, length)

    def crop(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Commit (or roll back to) `lengths` tokens per slot."""
        self.lengths[slots] = lengths
