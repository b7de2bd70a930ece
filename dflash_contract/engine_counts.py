"""The engine's counts that a router reads from every replica: requests running and waiting, KV blocks used and held,
prompt and generated tokens (and its context, which the gateway's render endpoints check prompts against), shared
between the engine loop (in the dflash model's process, which writes them) and the OpenAI gateway (another process,
which serves them on its /metrics in the dialect of the Kubernetes Inference Gateway's endpoint picker:
gateway/protocol_metrics.py).

Why a mapped file and not the models' Triton metrics: the picker scrapes the port it routes to (the gateway's), and
reads queue depth to choose a replica, so a figure must be the engine's own as of its last change, not a copy that
trails it by a metrics update queue. dflash-serve creates the file (ENGINE_COUNTS_FILE_ENV names it to both
processes); the loop rewrites it when a request arrives and after every step, with no system call.

A seqlock keeps a reader from taking half of one write and half of another: the writer makes the sequence number
odd, writes, then makes it even; a reader takes the counts only between two equal, even readings.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import astuple, dataclass
from pathlib import Path

ENGINE_COUNTS_FILE_ENV = "DFLASH_ENGINE_COUNTS_FILE"
READ_ATTEMPTS = 100  # a write takes a microsecond: a reader that keeps meeting one is meeting a dead writer


@dataclass(frozen=True)
class Counts:
    running: int  # sequences in the running batch
    waiting: int  # requests waiting for a batch slot: the scheduler's queue and those not yet admitted to it
    kv_blocks_used: int  # KV blocks held by running sequences
    kv_blocks: int  # all KV blocks (the null block not counted)
    block_size: int  # tokens per KV block
    prompt_tokens: int  # since the engine started: prompt tokens of the requests its queue took
    generation_tokens: int  # since the engine started
    max_context: int  # tokens a sequence may hold, prompt and output (what a render request is checked against)

    @property
    def kv_cache_usage(self) -> float:
        """KV blocks used / all, from 0 to 1 (vLLM's kv_cache_usage_perc, whatever its name says)."""
        return self.kv_blocks_used / self.kv_blocks if self.kv_blocks else 0.0


class EngineCounts:
    FORMAT = "<Q8q"  # the sequence number, then Counts' fields in order

    def __init__(self, path: Path):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), struct.calcsize(self.FORMAT))
        self._sequence = struct.unpack_from("<Q", self._map)[0]

    @classmethod
    def create(cls, path: Path) -> "EngineCounts":
        path.write_bytes(bytes(struct.calcsize(cls.FORMAT)))
        return cls(path)

    def write(self, counts: Counts) -> None:
        """One writer only (the engine loop, under its lock)."""
        self._sequence += 1
        struct.pack_into("<Q", self._map, 0, self._sequence)  # odd: a write is under way
        struct.pack_into("<8q", self._map, 8, *astuple(counts))
        self._sequence += 1
        struct.pack_into("<Q", self._map, 0, self._sequence)

    def read(self) -> Counts | None:
        """The last counts written; None before the first write, or if every attempt met a write under way."""
        for _ in range(READ_ATTEMPTS):
            before, *fields = struct.unpack(self.FORMAT, self._map[:])
            after = struct.unpack_from("<Q", self._map)[0]
            if before == after and before % 2 == 0:
                return Counts(*fields) if before else None
        return None


def engine_counts() -> EngineCounts | None:
    """Where the engine's counts are shared, when dflash-serve launched this process."""
    path = os.environ.get(ENGINE_COUNTS_FILE_ENV)
    return EngineCounts(Path(path)) if path else None
