"""The drafter's context of each sequence: the target's features of its committed tokens, written into the
drafter's cache by KV injection (drafter.inject_context). A step the drafter runs in writes its block's at once;
the other steps (plain decoding, suffix drafts) defer theirs to the next step that drafts, which writes them all
in one pass: under "auto" many steps may run without the drafter in a row."""
from __future__ import annotations

from typing import Callable

import torch

from .drafter import DFlashDrafter
from .kv_cache import KVCache
from .sequence import Sequence

# Deferred context per sequence is written once it reaches this many tokens: features of a large target
# are tens of KB per token, and "auto" may run hundreds of steps between drafts at a large batch.
MAX_PENDING_CONTEXT = 64


class DrafterContext:
    def __init__(self, drafter: DFlashDrafter | None, cache: KVCache | None, injection_tokens: int,
                 tables: Callable[[list[Sequence], int], torch.Tensor], block_size: int):
        """tables(sequences, keys): their block tables for a pass reading that many keys (the engine's); without a
        drafter every call does nothing."""
        self.drafter, self.cache, self.injection_tokens = drafter, cache, injection_tokens
        self.tables, self.block_size = tables, block_size
        # sequence -> (features [n, F], positions [n]) of committed tokens whose context is not written yet
        self.pending: dict[Sequence, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def write(self, features: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> None:
        """The context of the target's features at `positions` [R, T]: written for every position given; where
        those are a block's, the committed ones are what the step's caller counts (the rest are overwritten
        later)."""
        if self.drafter is not None:
            self.drafter.inject_context(features, positions, self.cache, table, self.injection_tokens)

    def defer(self, features: torch.Tensor, positions: torch.Tensor, rows: list[tuple[Sequence, int, int]]) -> None:
        """Keep the features of each (sequence, row, accepted drafts)'s committed block positions for the next step
        that drafts; past MAX_PENDING_CONTEXT tokens, write them now. They are copies: a CUDA graph's outputs are
        overwritten by the next pass."""
        if self.drafter is None:
            return
        for seq, row, accepted in rows:
            kept = (features[row, :accepted + 1].clone(), positions[row, :accepted + 1])
            self.pending.setdefault(seq, []).append(kept)
        if max(self.pending_tokens(seq) for seq, _, _ in rows) >= MAX_PENDING_CONTEXT:
            self.flush([seq for seq, _, _ in rows])

    def pending_tokens(self, seq: Sequence) -> int:
        return sum(len(p) for _, p in self.pending.get(seq, ()))

    def flush(self, seqs: list[Sequence]) -> None:
        """Write the deferred context of `seqs`, padded to one [B, T] pass by repeating each row's last entry
        (writing the same K/V twice to one position is harmless)."""
        rows = [(s, self.pending.pop(s)) for s in seqs if s in self.pending]
        if not rows:
            return
        features = [torch.cat([f for f, _ in chunks]) for _, chunks in rows]
        positions = [torch.cat([p for _, p in chunks]) for _, chunks in rows]
        width = max(len(p) for p in positions)
        features = torch.stack([torch.cat([f, f[-1:].expand(width - len(f), -1)]) for f in features])
        positions = torch.stack([torch.cat([p, p[-1:].expand(width - len(p))]) for p in positions])
        # a step's own tokens are deferred before they are committed: they lie within its block
        table = self.tables([s for s, _ in rows], max(s.num_tokens for s, _ in rows) + self.block_size)
        self.write(features, positions, table)

    def drop(self, seq: Sequence) -> None:
        self.pending.pop(seq, None)
