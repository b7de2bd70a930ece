"""Sampling parameters and token choice.

Lossless speculative sampling without a draft distribution: the drafter proposes argmax tokens, the
target samples every block position, and a draft token is accepted while it equals the target's sample.
Each sample draws its uniform number from (seed, absolute position), so a request's output is the
same with or without the drafter and for any block size: speculation only decides how many of the
target's own samples are kept per pass.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .config import DFlashError

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # until then no stop applies: stop ids are never chosen, stop strings wait
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # None with temperature > 0: a random seed is drawn per request
    stop_token_ids: tuple[int, ...] = ()  # in addition to the target's EOS ids
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise DFlashError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise DFlashError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise DFlashError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop_strings):
            raise DFlashError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> "SamplingParams":
        if self.greedy or self.seed is not None:
            return self
        return SamplingParams(**{**self.__dict__, "seed": random.getrandbits(63)})


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position): splitmix64 of both."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def target_probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [N, V], row n sampled with params[n] -> probabilities after temperature, top-k and top-p, in
    float64. Rows are independent: a row's result does not depend on the others. Which filters run is
    decided from the host's parameters: a branch on device values would wait for the device."""
    device, vocab = logits.device, logits.shape[-1]
    floats = to_device([[p.temperature, p.top_p] for p in params], device, torch.float64)
    top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)
    scores = logits.double() / floats[:, :1]
    if any(0 < p.top_k < vocab for p in params):
        kth = scores.sort(dim=-1, descending=True).values.gather(-1, top_k[:, None] - 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))  # top_k = vocab keeps every score
    probs = torch.softmax(scores, dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = floats[:, 1:]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs >= top_p) & (top_p < 1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0)
        probs = torch.where(top_p < 1, probs / probs.sum(-1, keepdim=True), probs)
    return probs


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """The target's sample at each row of logits [N, V], on their device: row n draws with params[n] the
    uniform of (its seed, positions[n]). The parameters and uniforms go up with the rows (computed on the
    host, copied from pinned memory), and nothing comes back."""
    uniforms = to_device([position_uniform(p.seed, position) for p, position in zip(params, positions)],
                         logits.device, torch.float64)
    probs = target_probabilities(logits, params)
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(-1)
    # u * total < total, so the index is in range unless rounding pushes it past the last nonzero
    return tokens.clamp_max(probs.shape[-1] - 1)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, first_position: int) -> list[int]:
    """The target's token at each of T consecutive positions. logits: [T, V]; row t predicts the
    token at absolute position first_position + t."""
    if params.greedy:
        return logits.argmax(-1).tolist()
    positions = list(range(first_position, first_position + len(logits)))
    return sample_tokens(logits, [params] * len(logits), positions).tolist()


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of host data on `device`; on CUDA through pinned memory, so the copy does not wait for
    the work queued before it."""
    tensor = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingStats:
    """What speculation did for one request (or a whole run)."""

    acceptance_lengths: list[int] = field(default_factory=list)  # tokens per verify step (accepted drafts + 1)
    verify_lengths: list[int] = field(default_factory=list)  # per verify step: 1 + drafts verified
    accepted_by_position: list[int] = field(default_factory=list)  # j -> steps whose draft j was accepted
    reached_by_position: list[int] = field(default_factory=list)  # j -> steps that verified draft j after 1..j-1
    draft_tokens: int = 0  # drafts verified
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, accepted: int, drafted: int, reached: int) -> None:
        """One verify step: `drafted` drafts verified; drafts 1..reached decided in turn, the first
        `accepted` of them accepted (reached = accepted + 1, or less where the block or the request ended)."""
        self.acceptance_lengths.append(accepted + 1)
        self.verify_lengths.append(drafted + 1)
        self.draft_tokens += drafted
        self._extend_positions(reached)
        for j in range(reached):
            self.reached_by_position[j] += 1
            self.accepted_by_position[j] += j < accepted

    def merge(self, other: "SamplingStats") -> None:
        """Add another request's statistics (for a summary over many requests)."""
        self.acceptance_lengths += other.acceptance_lengths
        self.verify_lengths += other.verify_lengths
        self.draft_tokens += other.draft_tokens
        self._extend_positions(len(other.reached_by_position))
        for j, (accepted, reached) in enumerate(zip(other.accepted_by_position, other.reached_by_position)):
            self.accepted_by_position[j] += accepted
            self.reached_by_position[j] += reached
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    def _extend_positions(self, n: int) -> None:
        missing = [0] * max(0, n - len(self.reached_by_position))
        self.accepted_by_position += missing
        self.reached_by_position += missing

    @property
    def draft_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def accepted_draft_tokens(self) -> int:
        return sum(self.acceptance_lengths) - self.draft_steps

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per verify step; None before the first (a 1-token answer has none: nothing to report)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else None

    @property
    def conditional_acceptance(self) -> list[float]:
        """P(draft j accepted | drafts 1..j-1 accepted and draft j verified), per position."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_position, self.reached_by_position)]
