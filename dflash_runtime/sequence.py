"""A request's state as it moves through the engine: waiting -> running -> finished."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling import SamplingParams, SamplingStats


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
    slot: int | None = None
    stats: SamplingStats = field(default_factory=SamplingStats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_position(self) -> int:
        """Absolute position of the newest token: it opens the next draft block, its K/V is not cached yet."""
        return self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
