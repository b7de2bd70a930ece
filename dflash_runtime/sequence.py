"""A request's state as it moves through the engine: waiting -> running -> finished."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .grammar import SequenceGrammar
from .sampling import SamplingParams, SamplingStats
from .suffix_drafts import TokenHistory


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    stats: SamplingStats = field(default_factory=SamplingStats)
    block_table: list[int] = field(default_factory=list)  # its KV blocks while running (block_manager.py)
    block_hashes: list[int] = field(default_factory=list)  # the prefix-cache chain of its full blocks
    num_computed: int = 0  # tokens whose K/V are in the caches
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held when it was first admitted
    preemptions: int = 0  # times its blocks were taken back and it was requeued to be recomputed
    grammar: SequenceGrammar | None = None  # a guided request's grammar state (grammar.py)
    logprobs: list = field(default_factory=list)  # per output token, where asked for (logprobs.TokenLogprobs)
    history: TokenHistory | None = None  # its tokens as suffix drafts search them, made at its first draft-able step

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_end(self) -> int:
        """Tokens whose K/V a prefill writes: the whole prompt (its last token's logits choose the first output),
        or, for a sequence recomputed after a preemption, all but the newest token."""
        return self.num_tokens - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_end

    @property
    def last_position(self) -> int:
        """Absolute position of the newest token: it opens the next draft block, its K/V is not cached yet."""
        return self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
