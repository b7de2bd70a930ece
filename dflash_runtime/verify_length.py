"""Adaptive verify length: each engine step verifies the k that maximises expected tokens per second.

A step with verify length k checks the newest token plus k - 1 drafts in one target pass; k = 1 skips
the drafter (plain decoding). Output is the target's own either way, so k may change every step.

- Cost: the seconds of a step (draft + verify) at batch size B and length k. A short profile when the
  engine starts gives every (B, k) a figure; each step's own timing then corrects its (B, k) entry.
- Acceptance: p_j, the chance that draft j is accepted given drafts 1..j-1 were. DFlash's p_j falls
  along the block, so it is kept per position: counted over recent steps of all requests (older
  counts fade), apart for greedy requests and for each speculative sampling method (sampling accepts
  less, and the methods differ), and per request,
  shrunk towards the global figure until the request has data.
  Expected tokens of one sequence at length k: 1 + sum_{i < k} prod_{j <= i} p_j.
- Exploration: a step at length k only observes positions < k. To keep the estimates of longer
  drafts fresh, a full-block step is spent whenever the time it costs beyond the best step has been
  saved up at EXPLORE_BUDGET of the step time (so exploring costs at most that share).
"""
from __future__ import annotations

import math
import platform
from collections import defaultdict
from dataclasses import dataclass, field

import torch

EXPLORE_BUDGET = 0.01  # share of step time that exploration may cost
COST_SMOOTHING = 0.2  # weight of a new timing in its (B, k) estimate
ACCEPTANCE_MEMORY = 0.995  # per observation: counts fade with a horizon of ~200 observations per position
REQUEST_PRIOR_WEIGHT = 8.0  # a request's own counts weigh as much as the global estimate after 8 observations


def doubling(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... below n, and n: the verify lengths of a block of n, the profiled batch sizes."""
    values, k = [], 1
    while k < n:
        values.append(k)
        k *= 2
    return tuple(values + [n])


def device_signature(device: torch.device) -> str:
    """What a cost profile is valid for: the accelerator, or the CPU and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


@dataclass
class StepCosts:
    """Seconds per step by (batch size, verify length): a profile, corrected by observed steps."""

    device: str
    profile: dict[int, dict[int, float]]  # profiled batch size -> k -> seconds
    observed: dict[tuple[int, int], float] = field(default_factory=dict)

    def seconds(self, batch_size: int, k: int) -> float:
        if (batch_size, k) in self.observed:
            return self.observed[batch_size, k]
        return self._profiled(batch_size, k)

    def observe(self, batch_size: int, k: int, seconds: float) -> None:
        old = self.seconds(batch_size, k)
        self.observed[batch_size, k] = old + COST_SMOOTHING * (seconds - old)

    def _profiled(self, batch_size: int, k: int) -> float:
        """Linear in the batch size between profiled sizes; proportional beyond the largest."""
        sizes = sorted(self.profile)
        below = max((b for b in sizes if b <= batch_size), default=sizes[0])
        above = min((b for b in sizes if b >= batch_size), default=sizes[-1])
        low, high = self.profile[below][k], self.profile[above][k]
        if below == above:
            return low * batch_size / below
        return low + (high - low) * (batch_size - below) / (above - below)

    def to_json(self) -> dict:
        return {"device": self.device,
                "seconds": {str(b): {str(k): round(s, 6) for k, s in ks.items()} for b, ks in self.profile.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "StepCosts":
        profile = {int(b): {int(k): float(s) for k, s in ks.items()} for b, ks in data["seconds"].items()}
        return cls(str(data["device"]), profile)


class AcceptanceModel:
    """Per-position conditional acceptance: global counts that fade, and each request's own."""

    def __init__(self, num_drafts: int):
        self.reached = [0.0] * num_drafts  # steps that verified draft j after accepting drafts 1..j-1
        self.accepted = [0.0] * num_drafts

    def observe(self, accepted: int, reached: int) -> None:
        """One sequence's step: drafts 1..reached were verified in turn, the first `accepted` accepted."""
        for j in range(reached):
            self.reached[j] = self.reached[j] * ACCEPTANCE_MEMORY + 1
            self.accepted[j] = self.accepted[j] * ACCEPTANCE_MEMORY + (j < accepted)

    def rates(self, request_accepted: list[int] = (), request_reached: list[int] = ()) -> list[float]:
        """p_j for one request: its own counts, shrunk towards the global estimate.

        The global estimate is an upper confidence bound (Laplace-smoothed mean + one standard error):
        a position with little data gets the benefit of the doubt, so a few early rejections do not
        switch the drafter off for good; the bound closes as counts grow."""
        rates = []
        for j, (accepted, reached) in enumerate(zip(self.accepted, self.reached)):
            mean = (accepted + 1) / (reached + 2)
            p = min(1.0, mean + math.sqrt(mean * (1 - mean) / (reached + 2)))
            own_accepted = request_accepted[j] if j < len(request_accepted) else 0
            own_reached = request_reached[j] if j < len(request_reached) else 0
            rates.append((own_accepted + REQUEST_PRIOR_WEIGHT * p) / (own_reached + REQUEST_PRIOR_WEIGHT))
        return rates


def expected_tokens(rates: list[float], lengths: tuple[int, ...], remaining: int) -> dict[int, float]:
    """Expected tokens of one sequence's step at each verify length; no more than it may still generate."""
    totals, total, survive = [1.0], 1.0, 1.0
    for p in rates[:max(0, remaining - 1)]:
        survive *= p
        total += survive
        totals.append(total)
    return {k: totals[min(k, len(totals)) - 1] for k in lengths}


def auto_in_words(verify_lengths: dict[int, int], costs: StepCosts, rates: list[float]) -> str:
    """What `auto` did over a run and why, at batch 1, for people: e.g. "plain decoding on 54 of 59 steps: here a
    verify of 8 tokens costs 2.4x one token and the engine's acceptance estimate gives tau 1.30 at 8, so drafting
    is slower (by this estimate 0.54x plain decoding at 8)". rates: the acceptance model's per-position rates
    after the run (an optimistic bound: AcceptanceModel.rates)."""
    steps, plain = sum(verify_lengths.values()), verify_lengths.get(1, 0)
    lengths = doubling(len(rates) + 1)
    tokens = expected_tokens(rates, lengths, len(rates) + 1)
    speed = {k: tokens[k] * costs.seconds(1, 1) / costs.seconds(1, k) for k in lengths}  # vs plain decoding
    full, best = lengths[-1], max(lengths, key=speed.get)
    why = (f"here a verify of {full} tokens costs {costs.seconds(1, full) / costs.seconds(1, 1):.1f}x one token and "
           f"the engine's acceptance estimate gives tau {tokens[full]:.2f} at {full}")
    verdict = (f"so drafting is slower (by this estimate {speed[full]:.2f}x plain decoding at {full})" if best == 1
               else f"so drafting pays (by this estimate {speed[best]:.2f}x plain decoding at {best})")
    done = (f"plain decoding on all {steps} steps" if plain == steps else f"drafting on all {steps} steps"
            if plain == 0 else f"plain decoding on {plain} of {steps} steps, drafting on the others")
    return f"{done}: {why}, {verdict}"


class VerifyLengthPolicy:
    """Picks each step's verify length from the cost and acceptance models, and learns from the step."""

    def __init__(self, block_size: int, costs: StepCosts):
        self.lengths = doubling(block_size)
        self.costs = costs
        # acceptance kind ("greedy", or a speculative sampling method) -> its model, made when first seen
        self.acceptance = defaultdict(lambda: AcceptanceModel(block_size - 1))
        self.explore_credit = 0.0  # seconds of exploration saved up

    def best(self, batch_size: int, expected: list[dict[int, float]]) -> int:
        """argmax_k (sum of the batch's expected tokens) / step seconds."""
        return max(self.lengths, key=lambda k: sum(e[k] for e in expected) / self.costs.seconds(batch_size, k))

    def expected(self, kind: str, stats, remaining: int) -> dict[int, float]:
        """One sequence's expected tokens per length from its SamplingStats and the global estimate of its
        acceptance kind (SamplingParams.acceptance_kind)."""
        rates = self.acceptance[kind].rates(stats.accepted_by_position, stats.reached_by_position)
        return expected_tokens(rates, self.lengths, remaining)

    def choose(self, expected: list[dict[int, float]]) -> int:
        """The length for a batch, given each sequence's expected tokens per length (expected_tokens)."""
        batch_size, full = len(expected), self.lengths[-1]
        k = self.best(batch_size, expected)
        if k == full:
            return k
        step_seconds = self.costs.seconds(batch_size, k)
        extra = self.costs.seconds(batch_size, full) - step_seconds
        self.explore_credit += EXPLORE_BUDGET * step_seconds
        if self.explore_credit >= extra:
            self.explore_credit -= max(extra, 0.0)
            return full
        return k
