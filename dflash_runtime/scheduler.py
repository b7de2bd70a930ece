"""Which sequences run: the waiting queue, the running batch and the KV-cache slots they hold.

The engine asks the scheduler what to run and tells it when a sequence ends; the scheduler never
touches a model or a cache (nano-vllm's split between scheduler and engine).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from .sequence import Sequence, Status


@dataclass(frozen=True)
class Occupancy:
    """How busy the engine is between two steps, for admission control and metrics."""

    running: int
    waiting: int
    free_slots: int
    committed_tokens: int  # prompt + output tokens of the running sequences
    token_capacity: int  # slots x tokens per slot

    @property
    def kv_cache_utilization(self) -> float:
        return self.committed_tokens / self.token_capacity


class Scheduler:
    def __init__(self, num_slots: int, tokens_per_slot: int):
        self.num_slots = num_slots
        self.tokens_per_slot = tokens_per_slot
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(num_slots))  # a heap: the lowest free slot goes first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> Iterator[Sequence]:
        """Move waiting sequences into free slots, oldest first, yielding each as it starts running.

        A generator, so that the caller prefills each before the next is admitted: a sequence that
        finishes in its prefill hands its slot to the next in line within the same step. The lowest
        free slot is taken, which keeps a batch in few leading slots: the CUDA-graph path runs the
        rows up to the highest slot in use."""
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)
            seq.status = Status.RUNNING
            self.running.append(seq)
            yield seq

    def batch(self) -> list[Sequence]:
        """The running sequences in slot order: a full batch then reads its KV cache as a view."""
        return sorted(self.running, key=lambda s: s.slot)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`, waiting or running, and free its slot."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = None
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def occupancy(self) -> Occupancy:
        return Occupancy(running=len(self.running), waiting=len(self.waiting), free_slots=len(self.free_slots),
                    committed_tokens=sum(s.num_tokens for s in self.running),
                    token_capacity=self.num_slots * self.tokens_per_slot)
