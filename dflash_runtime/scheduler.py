"""Which sequences run: the waiting queue, the running batch, and the KV blocks they hold (block_manager.py).

The engine asks the scheduler what to run and tells it when a sequence ends; the scheduler never touches a
model or a cache (nano-vllm's split between scheduler and engine). A sequence is admitted when the batch has
room and the free blocks cover its prompt plus one step's draft block; when a running sequence needs a block
and none is free, the newest running sequence is preempted: its blocks go back (its cached ones stay findable)
and it waits at the head of the queue to be recomputed, as vLLM does. Its output so far is kept, and decoding
resumes where it stopped: greedy and seeded choices depend only on the tokens and their positions.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass(frozen=True)
class Occupancy:
    """How busy the engine is between two steps, for admission control and metrics."""

    running: int
    waiting: int
    free_slots: int  # places left in the running batch
    committed_tokens: int  # prompt + output tokens of the running sequences
    token_capacity: int  # the KV blocks' positions
    used_blocks: int  # KV blocks held by running sequences
    free_blocks: int  # the others (cached ones included: they are reused when needed)
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache so far, and those found
    prefix_hit_tokens: int
    preemptions: int  # so far

    @property
    def kv_cache_utilization(self) -> float:
        return self.used_blocks / (self.used_blocks + self.free_blocks)


class Scheduler:
    def __init__(self, max_running: int, blocks: BlockManager, lookahead: int):
        """lookahead: positions a step writes past a sequence's newest token (the draft block)."""
        self.num_slots = max_running
        self.blocks = blocks
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in the order they were admitted
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> Iterator[Sequence]:
        """Move waiting sequences into the batch, oldest first, while there is room and their blocks are free,
        yielding each with its prefix-cache hit counted in seq.num_computed (a generator: a caller may prefill each
        before the next is admitted, as the engine's start-up profile does)."""
        while self.waiting and len(self.running) < self.num_slots:
            seq = self.waiting[0]
            hit = self.blocks.admit(seq.block_table, seq.block_hashes, seq.token_ids[:seq.num_tokens - 1],
                                    seq.prefill_end + self.lookahead)
            if hit is None:
                return
            self.waiting.popleft()
            seq.num_computed = hit
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
            seq.status = Status.RUNNING
            self.running.append(seq)
            yield seq

    def reserve(self, batch: list[Sequence]) -> list[Sequence]:
        """Blocks for the next step of `batch` (running sequences, oldest first): each must cover its newest token
        and the draft block after it. Preempts the newest running sequences as needed; returns those of the
        batch that still run."""
        for seq in batch:
            while seq.status is Status.RUNNING and not self.blocks.grow(seq.block_table, seq.last_position + self.lookahead):
                self.preempt(self.running[-1])
        return [seq for seq in batch if seq.status is Status.RUNNING]

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`, waiting or running, and give back its blocks."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.release(seq.block_table)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def occupancy(self) -> Occupancy:
        free = self.blocks.num_free
        return Occupancy(running=len(self.running), waiting=len(self.waiting),
                         free_slots=self.num_slots - len(self.running),
                         committed_tokens=sum(s.num_tokens for s in self.running),
                         token_capacity=self.blocks.num_blocks * self.blocks.block_size,
                         used_blocks=self.blocks.num_blocks - free, free_blocks=free,
                         prefix_queried_tokens=self.blocks.queried_tokens, prefix_hit_tokens=self.blocks.hit_tokens,
                         preemptions=self.preemptions)
