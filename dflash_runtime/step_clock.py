"""Where an engine step's time goes: the passes' time (StepClock) and every phase's wall time (PhaseTimer).

The passes are the model's work. Everything else in a step is host time: Python building block tables and input
tensors, sampling and grammar preparation, acceptance bookkeeping, commits and stop checks. At a small model or a
large batch that host time is a fixed cost per step which speculation cannot amortise, so it is measured on every
step, in production too (a lap is one perf_counter call and a dict update, well under a microsecond).
"""
from __future__ import annotations

import time

import torch

# Phases that run the model. On a CPU they are its compute; on CUDA the launches (the device runs behind the host),
# and the wait for the device falls into COPY, the step's one device-to-host copy.
PASSES = ("prefill pass", "context pass", "draft pass", "verify pass")
COPY = "copy"


class StepClock:
    """Times between marks of a step: host time on a CPU; on CUDA, events on the device, where the host
    runs ahead of the work it queues. Read after the step's device-to-host copy, they wait for nothing."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()  # done already where the step's results were copied back
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class PhaseTimer:
    """Wall seconds per phase of the current step: each lap charges the time since the previous one to a phase."""

    def __init__(self):
        self.start()

    def start(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def host_seconds(phases: dict[str, float]) -> float:
    """A step's host time: its phases outside the passes and the device-to-host copy."""
    return sum(seconds for phase, seconds in phases.items() if phase not in PASSES and phase != COPY)
