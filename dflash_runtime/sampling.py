"""Sampling parameters and token choice.

Lossless speculative sampling that keeps the sample: the target's token at a position is the Gumbel-max
of its (temperature, top-k, top-p) scores with noise that depends only on (seed, position, token), made on
the device. A request's output is therefore the same with or without the drafter and for any block size:
speculation only decides how many of the target's own samples a pass keeps. A draft is accepted while it
equals the target's token; the drafter guesses a sampled position with the same noise added to its own
scores (drafter-invariant speculative sampling, Daliri, Musco & Suresh, arXiv 2408.07978), so its guess
matches whenever both argmaxes agree, not only when the target happens to sample the drafter's argmax.
"""
from __future__ import annotations

import os
import random
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from dflash_contract.guided_decoding import Guide
from dflash_contract.presets import check_speculative_sampling

from .config import DFlashError
from .counter_noise import ACCEPT, MASK32, RESIDUAL, TARGET, gumbel_noise, position_keys, uniforms
from .gguf_kernels import first_max_indices


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
    speculative_sampling: str | None = None  # SPECULATIVE_SAMPLING; None: the engine's (the build's)
    guide: Guide | None = None  # guided decoding: every token chosen under its grammar (grammar.py)
    # vLLM's penalties (penalties.py): 1 and 0 are off
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # report each token's log-probability and this many top ones (logprobs.py)

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
        if self.speculative_sampling is not None:
            check_speculative_sampling(self.speculative_sampling)
        if not self.repetition_penalty > 0:
            raise DFlashError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise DFlashError(f"logprobs must be in [0, 20] top tokens, got {self.logprobs}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise DFlashError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def acceptance_kind(self) -> str:
        """What decides acceptance: "greedy", or the speculative sampling method (set by the engine)."""
        return "greedy" if self.greedy else self.speculative_sampling

    def for_engine(self, speculative_sampling: str) -> "SamplingParams":
        """These parameters as a request runs them: a seed drawn where sampling has none, the engine's
        speculative sampling method where the request names none."""
        seed = self.seed if self.greedy or self.seed is not None else random.getrandbits(63)
        return replace(self, seed=seed, speculative_sampling=self.speculative_sampling or speculative_sampling)


# The proposal rules of sampled rows under "exact" (propose_tokens' sharpness), among which the engine learns
# (ProposalRule); the default until it has seen drafts: the best on the embedded default (docs/performance.md).
DRAFT_SHARPNESS_CHOICES = (0.0, 0.25, 0.5, 1.0)
DEFAULT_DRAFT_SHARPNESS = 0.5
PROPOSAL_MEMORY = 0.998  # per step: the hit counts fade with a horizon of ~500 steps (near rules differ by a few %)
# Where the Gumbel-max runs: "auto" (the Triton kernel on CUDA, eager elsewhere), "eager", or "triton" (also on a
# CPU under TRITON_INTERPRET=1, as the tests do). Read once.
GUMBEL_IMPLEMENTATIONS = ("auto", "eager", "triton")
GUMBEL_IMPLEMENTATION = os.environ.get("DFLASH_GUMBEL", "auto")
if GUMBEL_IMPLEMENTATION not in GUMBEL_IMPLEMENTATIONS:
    raise ValueError(f"DFLASH_GUMBEL={GUMBEL_IMPLEMENTATION!r}: expected one of {', '.join(GUMBEL_IMPLEMENTATIONS)}")


class GumbelNoise:
    """The Gumbel noise of (seeds [N, 2], positions [N, T], stream) over a vocabulary, and argmaxes with it.

    The target samples its token at a position as argmax(scores + noise), and a drafter guessing that
    position can add the same noise to its own scores: the guess then matches whenever the two argmaxes
    agree, while the target's token stays exactly its own sample (drafter-invariant sampling). Eager, the
    noise is made once, at the first argmax, and shared by the others; with the Triton kernel (CUDA) each
    argmax makes it in registers and nothing is stored (gumbel_kernel.py)."""

    def __init__(self, seeds: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = TARGET,
                 values: torch.Tensor | None = None):
        self.seeds, self.positions, self.vocab, self.stream = seeds, positions, vocab, stream
        self._values = values

    @property
    def values(self) -> torch.Tensor:
        if self._values is None:
            self._values = gumbel_noise(self.seeds, self.positions, self.vocab, self.stream)
        return self._values

    def first(self, count: int) -> "GumbelNoise":
        """The noise of each row's first `count` positions: eager, a view of this noise (made now if not yet)."""
        values = None if _in_kernel(self.seeds.device) else self.values[:, :count]
        return GumbelNoise(self.seeds, self.positions[:, :count], self.vocab, self.stream, values)

    def argmax(self, scores: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """argmax(scores * scale + noise) [N, T] for scores [N, T, vocab]."""
        if _in_kernel(scores.device):
            from .gumbel_kernel import gumbel_argmax_triton

            keys = position_keys(self.seeds, self.positions, self.stream)
            return gumbel_argmax_triton(scores.reshape(-1, self.vocab), keys.reshape(-1), scale).view(keys.shape)
        if scale != 1:
            scores = scores * scale
        return greedy_tokens(scores + self.values)


def _in_kernel(device: torch.device) -> bool:
    """Whether Gumbel-maxes on `device` run the Triton kernel (GUMBEL_IMPLEMENTATION)."""
    return GUMBEL_IMPLEMENTATION == "triton" or (GUMBEL_IMPLEMENTATION == "auto" and device.type == "cuda")


@dataclass
class RowParams:
    """The sampling parameters of sampled rows, on the device, and from the host which of top-k and top-p
    any row uses: a branch on device values would wait for the device."""

    temperature: torch.Tensor  # [N, 1, 1] float32
    top_k: torch.Tensor  # [N, 1, 1] long; 0 where off
    top_p: torch.Tensor  # [N, 1, 1] float32
    seeds: torch.Tensor  # [N, 2] long: each seed's low and high 32 bits
    max_top_k: int  # 0: no row uses top-k
    all_top_k: bool  # every row uses top-k
    uses_top_p: bool

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> "RowParams":
        floats = to_device([[p.temperature, p.top_p] for p in params], device, torch.float32)[:, :, None, None]
        top_k = to_device([p.top_k if 0 < p.top_k < vocab else 0 for p in params], device)[:, None, None]
        seeds = to_device([[p.seed & MASK32, (p.seed >> 32) & MASK32] for p in params], device)
        max_top_k = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
        return cls(floats[:, 0], top_k, floats[:, 1], seeds, max_top_k, all(0 < p.top_k < vocab for p in params),
                   any(p.top_p < 1 for p in params))


def sampling_scores(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """logits [N, T, V] -> float32 scores: logits / temperature, -inf outside each row's top-k and top-p.
    Their softmax is the distribution a row samples from; rows are independent of each other."""
    scores = logits.float() / rows.temperature
    if rows.max_top_k:
        top = scores.topk(rows.max_top_k, dim=-1)  # sorted, largest first
        kth = top.values.gather(-1, (rows.top_k - 1).clamp_min(0).expand(*scores.shape[:-1], 1))
        scores = scores.masked_fill((scores < kth) & (rows.top_k > 0), float("-inf"))
    if rows.uses_top_p:
        log_total = torch.logsumexp(scores, dim=-1, keepdim=True)
        if rows.all_top_k:  # every nucleus lies in its row's top-k: only those are sorted
            sorted_scores, order = top.values.masked_fill(top.values < kth, float("-inf")), top.indices
        else:
            sorted_scores, order = _nucleus_candidates(scores, rows, log_total)
        sorted_probs = (sorted_scores - log_total).exp()
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs >= rows.top_p) & (rows.top_p < 1)
        if order.shape[-1] < scores.shape[-1]:  # what no candidate covers lies outside every nucleus
            scores = scores.masked_fill(rows.top_p < 1, float("-inf"))
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores


NUCLEUS_CANDIDATES = 256


def _nucleus_candidates(scores: torch.Tensor, rows: RowParams, log_total: torch.Tensor):
    """The scores, sorted, and the token ids of a set that holds every top-p row's nucleus: on a CPU, where a
    branch on values costs nothing and sorting the vocabulary costs ~15 % of a block-8 step of the embedded
    default, the top NUCLEUS_CANDIDATES when their mass reaches every row's top_p; else the whole vocabulary.
    A row's probabilities are the same either way up to rounding, as its logits are in batches of other sizes."""
    if scores.device.type == "cpu" and NUCLEUS_CANDIDATES < scores.shape[-1]:
        top = scores.topk(NUCLEUS_CANDIDATES, dim=-1)
        mass = (top.values - log_total).exp().sum(-1, keepdim=True)
        if bool(((mass >= rows.top_p + 1e-4) | (rows.top_p >= 1)).all()):  # the margin outweighs any rounding
            return top.values, top.indices
    return scores.sort(dim=-1, descending=True)


def sample_tokens(logits: torch.Tensor, rows: RowParams, noise: GumbelNoise) -> torch.Tensor:
    """The samples [N, T] for logits [N, T, V]: the Gumbel-max of each row's sampling scores with the noise of
    its seed at its positions. All on the device."""
    return noise.argmax(sampling_scores(logits, rows))


def propose_tokens(logits: torch.Tensor, scores: torch.Tensor, noise: GumbelNoise, sharpness: float) -> torch.Tensor:
    """The drafter's guesses [N, T] for sampled positions from its logits [N, T, V] and their sampling scores:
    the Gumbel-max of the scores over `sharpness`, with the noise the target's samples there use. sharpness 1
    couples the two samples (best where both distributions are flat and close); towards 0 it becomes the
    drafter's argmax, which wins where the target is sure and the drafter is not."""
    return greedy_tokens(logits) if sharpness == 0 else noise.argmax(scores, 1 / sharpness)


def proposal_hits(logits: torch.Tensor, scores: torch.Tensor, noise: GumbelNoise,
                  samples: torch.Tensor) -> torch.Tensor:
    """How many of the target's samples [N, T] each rule of DRAFT_SHARPNESS_CHOICES would have guessed from
    the drafter's logits [N, T, V], their sampling scores and the noise there: [C] on the device."""
    return torch.stack([(propose_tokens(logits, scores, noise, s) == samples).sum() for s in DRAFT_SHARPNESS_CHOICES])


class ProposalRule:
    """The sharpness of exact sampling's drafts: a fixed one, or learned. Which rule guesses best depends on
    the pair (on the embedded default 0.5, on a pair whose distributions are flat and close 1: docs/performance.md), so
    each step judges every rule of DRAFT_SHARPNESS_CHOICES on its sampled rows' first draft position, which
    every step verifies whatever was drafted there (proposal_hits), and drafts use the rule with the most
    hits over recent steps. The output never depends on it."""

    def __init__(self, fixed: float | None = None):
        if fixed is not None and not fixed >= 0:
            raise DFlashError(f"draft_sharpness must be >= 0, got {fixed}")
        self.fixed = fixed
        # half a hit ahead: the default until a rule guesses better
        self.hits = {s: 0.5 * (s == DEFAULT_DRAFT_SHARPNESS) for s in DRAFT_SHARPNESS_CHOICES}
        self.pending: list[torch.Tensor] = []  # device counts, read at the next choice: no wait for the device

    @property
    def learning(self) -> bool:
        return self.fixed is None

    def observe(self, hits: torch.Tensor) -> None:
        self.pending.append(hits)

    def sharpness(self) -> float:
        if self.fixed is not None:
            return self.fixed
        for hits in self.pending:
            for s, n in zip(DRAFT_SHARPNESS_CHOICES, hits.tolist()):
                self.hits[s] = self.hits[s] * PROPOSAL_MEMORY + n
        self.pending.clear()
        return max(self.hits, key=self.hits.get)


def rejection_choices(scores: torch.Tensor, draft_scores: torch.Tensor, drafts: torch.Tensor, seeds: torch.Tensor,
                      positions: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """Speculative rejection sampling (min(1, p/q), then a draw from max(0, p - q)), the target's choices
    [N, k] for a block whose drafts [N, k - 1] were sampled from the drafter's distributions q (sampling
    scores [N, k - 1, V]); scores [N, k, V] are the target's, seeds [N, 2] the rows', positions [N, k] the
    block's, samples [N, k] the target's own Gumbel-max samples (the last position's choice, and the fallback
    where p - q rounds to nothing). A draft is kept iff its choice equals it: a rejected draft has p < q, so
    the residual never draws it. The output follows the target's distribution, but which sample a request gets
    depends on the drafter and the verify lengths."""
    draw = positions[:, :-1]
    p = torch.softmax(scores[:, :-1], dim=-1)
    q = torch.softmax(draft_scores, dim=-1)
    p_draft, q_draft = (probs.gather(-1, drafts[..., None])[..., 0] for probs in (p, q))
    accepted = uniforms(seeds, draw, 1, ACCEPT)[..., 0] * q_draft < p_draft
    residual = (p - q).clamp_min(0)
    resampled = GumbelNoise(seeds, draw, residual.shape[-1], RESIDUAL).argmax(residual.log())
    resampled = torch.where(residual.sum(-1) > 0, resampled, samples[:, :-1])
    return torch.cat([torch.where(accepted, drafts, resampled), samples[:, -1:]], dim=1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of the largest value along the last axis, the first of ties: torch.max's indices, which argmax is
    defined as (torch's docs), at 2-2.5x its speed on a CPU (torch 2.13, [32, 8, 49152] float32: 8.6 against 18 ms;
    a step's argmaxes over the 49K vocabulary cost 3 % of the embedded default's block-8 step before); on a CPU with
    the GGUF kernels, their first_max_indices, the same indices several times faster again."""
    indices = first_max_indices(logits)
    return indices if indices is not None else logits.max(-1).indices


def choose_tokens(logits: torch.Tensor, params: SamplingParams, first_position: int) -> list[int]:
    """The target's token at each of T consecutive positions. logits: [T, V]; row t predicts the
    token at absolute position first_position + t."""
    if params.greedy:
        return greedy_tokens(logits).tolist()
    rows = RowParams.of([params], logits.shape[-1], logits.device)
    positions = torch.arange(first_position, first_position + len(logits), device=logits.device)[None]
    return sample_tokens(logits[None], rows, GumbelNoise(rows.seeds, positions, logits.shape[-1]))[0].tolist()


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of host data on `device`; on CUDA through pinned memory, so the copy does not wait for
    the work queued before it."""
    tensor = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _count_positions(accepted_by_position: list[int], reached_by_position: list[int], accepted: int,
                     reached: int) -> None:
    """Drafts 1..reached decided in turn, the first `accepted` of them accepted, added to per-position counts."""
    missing = [0] * max(0, reached - len(reached_by_position))
    accepted_by_position += missing
    reached_by_position += missing
    for j in range(reached):
        reached_by_position[j] += 1
        accepted_by_position[j] += j < accepted


@dataclass
class DraftSources:
    """Steps, drafts made and drafts accepted by draft source: "drafter", "suffix" (suffix_drafts.py), "none" (a step
    that verified no draft of its own)."""

    steps: Counter = field(default_factory=Counter)
    drafted: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)

    def count(self, source: str, drafted: int, accepted: int) -> None:
        self.steps[source] += 1
        self.drafted[source] += drafted
        self.accepted[source] += accepted

    def summary(self) -> dict[str, dict[str, int]]:
        """{source: {"steps", "drafted", "accepted"}}, for reports."""
        return {source: {"steps": n, "drafted": self.drafted[source], "accepted": self.accepted[source]}
                for source, n in sorted(self.steps.items())}

    def merge(self, other: "DraftSources") -> None:
        self.steps.update(other.steps)
        self.drafted.update(other.drafted)
        self.accepted.update(other.accepted)


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
    sources: DraftSources = field(default_factory=DraftSources)
    suffix_accepted_by_position: list[int] = field(default_factory=list)  # as above, for suffix drafts
    suffix_reached_by_position: list[int] = field(default_factory=list)

    def record(self, accepted: int, drafted: int, reached: int, source: str = "drafter",
               own_drafts: int | None = None) -> None:
        """One verify step: `drafted` drafts verified; drafts 1..reached decided in turn, the first
        `accepted` of them accepted (reached = accepted + 1, or less where the block or the request ended).
        source: what made the drafts; own_drafts: how many of them it made (the rest pad the verify; default all).
        Acceptance by position is counted per source (the drafter's, the suffix drafts'): each is that source's
        estimate."""
        own = drafted if own_drafts is None else own_drafts
        self.acceptance_lengths.append(accepted + 1)
        self.verify_lengths.append(drafted + 1)
        self.draft_tokens += drafted
        self.sources.count(source, own, min(accepted, own))
        if source == "drafter":
            _count_positions(self.accepted_by_position, self.reached_by_position, accepted, reached)
        elif source == "suffix":
            _count_positions(self.suffix_accepted_by_position, self.suffix_reached_by_position, min(accepted, own),
                             min(reached, own))

    def merge(self, other: "SamplingStats") -> None:
        """Add another request's statistics (for a summary over many requests)."""
        self.acceptance_lengths += other.acceptance_lengths
        self.verify_lengths += other.verify_lengths
        self.draft_tokens += other.draft_tokens
        for mine, theirs in ((self.accepted_by_position, other.accepted_by_position),
                             (self.reached_by_position, other.reached_by_position),
                             (self.suffix_accepted_by_position, other.suffix_accepted_by_position),
                             (self.suffix_reached_by_position, other.suffix_reached_by_position)):
            mine += [0] * (len(theirs) - len(mine))
            for j, count in enumerate(theirs):
                mine[j] += count
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.sources.merge(other.sources)

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
