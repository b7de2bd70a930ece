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


class Deferred:
    """One sequence's committed tokens whose context is not written yet: their features [n, F] and positions [n],
    a step's at a time, and how many (kept as a number: this is asked every step)."""

    def __init__(self):
        self.features: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.tokens = 0


class DrafterContext:
    def __init__(self, drafter: DFlashDrafter | None, cache: KVCache | None, injection_tokens: int,
                 tables: Callable[[list[Sequence], int], torch.Tensor], block_size: int):
        """tables(sequences, keys): their block tables for a pass reading that many keys (the engine's); without a
        drafter every call does nothing."""
        self.drafter, self.cache, self.injection_tokens = drafter, cache, injection_tokens
        self.tables, self.block_size = tables, block_size
        self.pending: dict[Sequence, Deferred] = {}

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
        most = 0
        for seq, row, accepted in rows:
            deferred = self.pending.get(seq)
            if deferred is None:
                deferred = self.pending[seq] = Deferred()
            deferred.features.append(features[row, :accepted + 1].clone())
            deferred.positions.append(positions[row, :accepted + 1])
            deferred.tokens += accepted + 1
            most = max(most, deferred.tokens)
        if most >= MAX_PENDING_CONTEXT:
            self.flush([seq for seq, _, _ in rows])

    def pending_tokens(self, seq: Sequence) -> int:
        deferred = self.pending.get(seq)
        return deferred.tokens if deferred else 0

    def flush(self, seqs: list[Sequence]) -> None:
        """Write the deferred context of `seqs`, padded to one [B, T] pass by repeating each row's last entry
        (writing the same K/V twice to one position is harmless)."""
        rows = [(s, self.pending.pop(s)) for s in seqs if s in self.pending]
        if not rows:
            return
        features = [torch.cat(deferred.features) for _, deferred in rows]
        positions = [torch.cat(deferred.positions) for _, deferred in rows]
        width = max(deferred.tokens for _, deferred in rows)
        features = torch.stack([torch.cat([f, f[-1:].expand(width - len(f), -1)]) for f in features])
        positions = torch.stack([torch.cat([p, p[-1:].expand(width - len(p))]) for p in positions])
        # a step's own tokens are deferred before they are committed: they lie within its block
        table = self.tables([s for s, _ in rows], max(s.num_tokens for s, _ in rows) + self.block_size)
        self.write(features, positions, table)

    def drop(self, seq: Sequence) -> None:
        self.pending.pop(seq, None)
