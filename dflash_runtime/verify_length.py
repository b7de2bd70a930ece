"""Adaptive verify length: each engine step verifies the k that maximises expected tokens per second.

A step with verify length k checks the newest token plus k - 1 drafts in one target pass; k = 1 skips
the drafter (plain decoding). Output is the target's own either way, so k may change every step.

- Cost: the seconds of a step (draft + verify, or the verify alone when only suffix drafts are verified) at batch
  size B and length k. A short profile when the engine starts gives every (B, k) a figure: the median of rounds that
  time every length in turn (a neighbour's burst then slows one round, not one length), re-measured while a plain
  step times dearer than a longer one or the rounds disagree, and after PROFILE_MAX_ROUNDS marked unsettled: then a
  step of k is priced as k plain steps (plain decoding) until steps of that length are measured (tried: a line from
  a plain step to one measured block; on a busy host it drafted on 2 of 4 prompts at 5 % acceptance, most likely
  from a block timed fast by luck). Each step's own timing overrules the profile: the lower of the two after one or
  two steps (noise only adds time), the median of the last OBSERVED_WINDOW from the third. A plain step is taken at
  the FIRST_PLAIN-th step, then twice as late each time up to every PLAIN_EVERY: its cost is what every other is
  weighed against.
- Acceptance: p_j, the chance that draft j is accepted given drafts 1..j-1 were. DFlash's p_j falls
  along the block, so it is kept per position: counted over recent steps of all requests (older
  counts fade), apart for greedy requests and for each speculative sampling method (sampling accepts
  less, and the methods differ), and per request,
  shrunk towards the global figure until the request has data.
  Expected tokens of one sequence at length k: 1 + sum_{i < k} prod_{j <= i} p_j.
- Exploration: a step at length k only observes positions < k. To keep the estimates of longer
  drafts fresh, a full-block step is spent whenever the time it costs beyond the best step has been
  saved up at EXPLORE_BUDGET of the step time (so exploring costs at most that share).
- Sources: a row may verify its suffix draft (suffix_drafts.py) instead of the drafter's block; its acceptance
  per position is learned apart, by the length of the match the draft came from. A step runs the drafter only
  where some row is expected to gain more from its block than the drafter's pass costs (StepPlan).
"""
from __future__ import annotations

import math
import platform
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import torch

EXPLORE_BUDGET = 0.01  # share of step time that exploration may cost
OBSERVED_WINDOW = 9  # a (B, k)'s cost: the median of its last steps, once it has OVERRULE_AFTER
OVERRULE_AFTER = 3
PROFILE_ROUNDS = 3  # rounds of every length per profiled batch size, more while unsettled, up to
PROFILE_MAX_ROUNDS = 9
PROFILE_SPREAD = 0.25  # a length's rounds may differ from their median by this share (median absolute deviation)
PROFILE_SLACK = 0.10  # and a plain step this much slower than a longer one (a GPU's lengths cost alike)
# A plain step among this many at least (the first: the FIRST_PLAIN-th step, then 2x, 4x ... later): its cost is
# the yardstick of every other, and a profile made on a busy host may have it wrong; a step never taken is never
# corrected.
PLAIN_EVERY = 50
FIRST_PLAIN = 4
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
    """Seconds per step by (batch size, verify length, whether the drafter ran): a profile, overruled by observed
    steps. A step that verifies a draft the drafter did not make (a suffix draft, suffix_drafts.py) costs its
    verify alone. unsettled: why the profile could not be trusted (profiled_costs), or ""."""

    device: str
    profile: dict[int, dict[int, float]]  # profiled batch size -> k -> seconds of a step (with the drafter's pass)
    verify_profile: dict[int, dict[int, float]] = field(default_factory=dict)  # ... of its verify alone
    unsettled: str = ""
    observed: dict[tuple[int, int, bool], float] = field(default_factory=dict)
    profiled: dict[tuple[int, int, bool], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    windows: dict[tuple[int, int, bool], deque] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        """Each batch size's seconds made monotone in k (monotone_in_length), whoever made the profile."""
        for profile in (self.profile, self.verify_profile):
            for batch_size, seconds in profile.items():
                profile[batch_size] = monotone_in_length(seconds)

    def seconds(self, batch_size: int, k: int, drafted: bool = True) -> float:
        key = batch_size, k, drafted and k > 1
        if key in self.observed:
            return self.observed[key]
        return self._prior(key)

    def _prior(self, key: tuple[int, int, bool]) -> float:
        """The profile's figure (interpolated once: a step asks for every length). An unsettled profile prices a
        step of k as k plain steps, so that only steps that were measured can make drafting pay."""
        if key not in self.profiled:
            batch_size, k, drafted = key
            if self.unsettled and k > 1:
                return k * self.seconds(batch_size, 1)
            alone = k > 1 and not drafted and self.verify_profile  # a verify without the drafter's pass
            self.profiled[key] = _interpolated(self.verify_profile if alone else self.profile, batch_size, k)
        return self.profiled[key]

    def observe(self, batch_size: int, k: int, seconds: float, drafted: bool = True) -> None:
        """A step's own timing. A busy host only ever adds time: the first two steps overrule the profile where
        they ran faster, and from the third the profile no longer counts (the median of the last few steps)."""
        key = batch_size, k, drafted and k > 1
        window = self.windows.setdefault(key, deque(maxlen=OBSERVED_WINDOW))
        window.append(seconds)
        measured = median(window)
        self.observed[key] = measured if len(window) >= OVERRULE_AFTER else min(measured, self._prior(key))

    def measured(self, batch_size: int, k: int, drafted: bool = True) -> int:
        """How many of the last steps of this kind were timed (at most OBSERVED_WINDOW)."""
        return len(self.windows.get((batch_size, k, drafted and k > 1), ()))

    def to_json(self) -> dict:
        def rounded(profile):
            return {str(b): {str(k): round(s, 6) for k, s in ks.items()} for b, ks in profile.items()}
        return {"device": self.device, "seconds": rounded(self.profile),
                "verify_seconds": rounded(self.verify_profile), "unsettled": self.unsettled}

    @classmethod
    def from_json(cls, data: dict) -> "StepCosts":
        def parsed(profile):
            return {int(b): {int(k): float(s) for k, s in ks.items()} for b, ks in profile.items()}
        return cls(str(data["device"]), parsed(data["seconds"]), parsed(data.get("verify_seconds", {})),
                   str(data.get("unsettled", "")))


def profiled_costs(device: str, batch_sizes: tuple[int, ...], lengths: tuple[int, ...],
                   time_step: Callable[[int, int], tuple[float, float]]) -> StepCosts:
    """StepCosts from timing steps: time_step(batch size, k) -> (seconds of a step of k with the drafter's pass,
    of its verify pass); the caller readies each batch size's sequences before its first call. Per batch size:
    one warm-up step per length, then rounds of every length in turn, PROFILE_ROUNDS at a time until the
    medians are settled (profile_problem) or PROFILE_MAX_ROUNDS were spent; then the medians, with the first
    problem left."""
    profile, verify_profile, problems = {}, {}, []
    for batch_size in batch_sizes:
        for k in lengths:
            time_step(batch_size, k)
        steps, verifies = defaultdict(list), defaultdict(list)
        while True:
            for _ in range(PROFILE_ROUNDS):
                for k in lengths:
                    step, verify = time_step(batch_size, k)
                    steps[k].append(step)
                    verifies[k].append(verify)
            problem = profile_problem(steps)
            if not problem or len(steps[lengths[0]]) >= PROFILE_MAX_ROUNDS:
                break
        profile[batch_size] = {k: median(times) for k, times in steps.items()}
        verify_profile[batch_size] = {k: median(times) for k, times in verifies.items()}
        problems += [f"at batch {batch_size}, {problem}"] if problem else []
    return StepCosts(device, profile, verify_profile, problems[0] if problems else "")


def profile_problem(rounds: dict[int, list[float]]) -> str:
    """Why step seconds timed in rounds (length -> one figure per round) are too noisy to plan from, or "": a
    length whose rounds spread beyond PROFILE_SPREAD of their median, or a plain step (the shortest length, the
    yardstick of the others) timed more than PROFILE_SLACK slower than a longer one: something else slowed it.
    Between longer lengths an inversion can be real (a kernel of 2 rows slower than one of 4, seen on a CPU);
    monotone_in_length evens those out."""
    middle = {k: median(times) for k, times in rounds.items()}
    for k, times in sorted(rounds.items()):
        spread = median(abs(t - middle[k]) for t in times) / middle[k]
        if spread > PROFILE_SPREAD:
            return f"steps of length {k} varied by {spread:.0%} between rounds"
    plain, cheapest = min(middle), min((j for j in middle if j > min(middle)), key=middle.get, default=None)
    if cheapest is not None and middle[plain] > (1 + PROFILE_SLACK) * middle[cheapest]:
        return f"a step of length {plain} timed {middle[plain] / middle[cheapest]:.2f}x one of {cheapest}"
    return ""


def monotone_in_length(seconds: dict[int, float]) -> dict[int, float]:
    """Step seconds by verify length, each at most those of every longer length: more rows never cost less, so a
    shorter length timed slower was slowed by something else (a busy host). Left as timed, it would never be tried
    again, and never corrected by the steps' own timings."""
    result, floor = {}, math.inf
    for k in sorted(seconds, reverse=True):
        floor = min(floor, seconds[k])
        result[k] = floor
    return dict(sorted(result.items()))


def _interpolated(profile: dict[int, dict[int, float]], batch_size: int, k: int) -> float:
    """Linear in the batch size between profiled sizes, proportional beyond the largest; linear in k between
    profiled lengths (a CPU's cost grows with the rows: a length between two profiled ones costs between them)."""
    sizes = sorted(profile)
    below = max((b for b in sizes if b <= batch_size), default=sizes[0])
    above = min((b for b in sizes if b >= batch_size), default=sizes[-1])
    low, high = _between(profile[below], k), _between(profile[above], k)
    if below == above:
        return low * batch_size / below
    return low + (high - low) * (batch_size - below) / (above - below)


def _between(seconds: dict[int, float], k: int) -> float:
    if k in seconds:
        return seconds[k]
    shorter = max(j for j in seconds if j < k)
    longer = min(j for j in seconds if j > k)
    return seconds[shorter] + (seconds[longer] - seconds[shorter]) * (k - shorter) / (longer - shorter)


class AcceptanceModel:
    """Per-position conditional acceptance: global counts that fade, and each request's own."""

    def __init__(self, num_drafts: int):
        self.reached = [0.0] * num_drafts  # steps that verified draft j after accepting drafts 1..j-1
        self.accepted = [0.0] * num_drafts
        self._bounds: list[float] | None = None  # the global estimate (bounds()) until the counts change

    def observe(self, accepted: int, reached: int) -> None:
        """One sequence's step: drafts 1..reached were verified in turn, the first `accepted` accepted."""
        for j in range(reached):
            self.reached[j] = self.reached[j] * ACCEPTANCE_MEMORY + 1
            self.accepted[j] = self.accepted[j] * ACCEPTANCE_MEMORY + (j < accepted)
        self._bounds = None if reached else self._bounds

    def to_json(self) -> dict:
        return {"accepted": [round(a, 3) for a in self.accepted], "reached": [round(r, 3) for r in self.reached]}

    def load(self, counts: dict) -> None:
        """Counts another engine learned (to_json), for the positions both have."""
        for mine, theirs in ((self.accepted, counts["accepted"]), (self.reached, counts["reached"])):
            n = min(len(mine), len(theirs))
            mine[:n] = [float(c) for c in theirs[:n]]
        self._bounds = None

    def bounds(self) -> list[float]:
        """The global estimate per position: an upper confidence bound (Laplace-smoothed mean + one standard
        error), so a position with little data gets the benefit of the doubt and a few early rejections do not
        switch the drafter off for good; the bound closes as counts grow. Kept until the counts change: every
        step asks, few steps draft."""
        if self._bounds is None:
            means = [(accepted + 1) / (reached + 2) for accepted, reached in zip(self.accepted, self.reached)]
            self._bounds = [min(1.0, mean + math.sqrt(mean * (1 - mean) / (reached + 2)))
                            for mean, reached in zip(means, self.reached)]
        return self._bounds

    def rates(self, request_accepted: list[int] = (), request_reached: list[int] = ()) -> list[float]:
        """p_j for one request: its own counts, shrunk towards the global estimate (bounds(); itself where the
        request has none, not to be changed)."""
        if not any(request_reached):
            return self.bounds()
        rates = []
        for j, p in enumerate(self.bounds()):
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


SOURCE_NAMES = {"none": "no draft", "drafter": "the drafter's block", "suffix": "suffix drafts"}


def auto_in_words(costs: StepCosts, sources: dict[str, dict[str, int]]) -> str:
    """What `auto` did over a run and why, for people, from what was measured: the steps of each draft source with
    their accepted drafts (DraftSources.summary), and what a block costs here at batch 1 against one token, e.g.
    "no draft on 54 of 59 steps, the drafter's block on 5 of 59 (3 of 35 drafts accepted): here a verify of 8
    tokens costs 4.8x one token with the drafter's pass, 3.4x without it; a step pays where it brings more tokens
    than it costs"."""
    steps = sum(s["steps"] for s in sources.values())
    done = ", ".join(f"{SOURCE_NAMES.get(source, source)} on {s['steps']} of {steps} steps"
                     + (f" ({s['accepted']} of {s['drafted']} drafts accepted)" if s["drafted"] else "")
                     for source, s in sources.items())
    one, full = costs.seconds(1, 1), max(costs.profile[min(costs.profile)])  # the drafter's block
    unsettled = (f" (the start-up timings were too noisy to trust: {costs.unsettled}; until steps measured it, a "
                 "step of length k was priced as k plain steps)") if costs.unsettled else ""
    return (f"{done or 'no steps'}: here a verify of {full} tokens costs "
            f"{costs.seconds(1, full) / one:.1f}x one token with the drafter's pass, "
            f"{costs.seconds(1, full, drafted=False) / one:.1f}x without it{unsettled}; a step pays where it brings "
            "more tokens than it costs")


def match_bucket(match_length: int) -> int:
    return match_length.bit_length()  # 1, 2-3, 4-7, 8-15, ...: longer matches are trusted apart


def suffix_rates(rates: list[float], probabilities: list[float]) -> list[float]:
    """A suffix draft's chance per position of being accepted once those before it were: the rate measured for
    drafts like it (AcceptanceModel, by match length) times the draft's own conditional estimate there (below 1
    where earlier occurrences disagreed); nothing past its end."""
    conditional = [p / before for p, before in zip(probabilities, [1.0] + probabilities[:-1])]
    return [rate * c for rate, c in zip(rates, conditional)]


@dataclass(frozen=True)
class StepPlan:
    """What one step verifies: length k, whether the drafter runs (k > 1), and which of the batch's rows (by
    index) verify their suffix draft instead of the drafter's (or instead of nothing when it does not run)."""

    k: int
    drafted: bool
    suffix_rows: frozenset[int] = frozenset()


class VerifyLengthPolicy:
    """Picks each step's verify length and draft sources from the cost and acceptance models, and learns from
    the step."""

    def __init__(self, block_size: int, costs: StepCosts, lengths: tuple[int, ...] | None = None):
        """lengths: the verify lengths a step may take (default: doubling(block_size), what the profile times)."""
        self.lengths = lengths or doubling(block_size)
        self.costs = costs
        # acceptance kind ("greedy", or a speculative sampling method) -> its model, made when first seen
        self.acceptance = defaultdict(lambda: AcceptanceModel(block_size - 1))
        # (acceptance kind, match-length bucket) -> suffix drafts' acceptance: a one-token match's first draft is
        # taken far less often than a long match's
        self.suffix = defaultdict(lambda: AcceptanceModel(block_size - 1))
        self.explore_credit = 0.0  # seconds of exploration saved up
        self.since_plain = Counter()  # batch size -> steps since its last plain one

    def learned(self) -> dict:
        """The acceptance counts learned so far, by kind (and match-length bucket for suffix drafts): what another
        engine of the same drafter starts from (start_from) instead of its benefit of the doubt."""
        return {"drafter": {kind: model.to_json() for kind, model in self.acceptance.items()},
                "suffix": {f"{kind}/{bucket}": model.to_json() for (kind, bucket), model in self.suffix.items()}}

    def start_from(self, learned: dict) -> None:
        for kind, counts in learned.get("drafter", {}).items():
            self.acceptance[kind].load(counts)
        for key, counts in learned.get("suffix", {}).items():
            kind, bucket = key.rsplit("/", 1)
            self.suffix[kind, int(bucket)].load(counts)

    def best(self, batch_size: int, expected: list[dict[int, float]],
             suffix: list[dict[int, float] | None] | None = None) -> tuple[int, bool]:
        """argmax over (k, whether the drafter runs) of the batch's expected tokens / step seconds, each row
        taking its better source at that k (suffix: each row's expected tokens with its suffix draft, or None)."""
        suffix = suffix or [None] * len(expected)

        def tokens(k: int, drafted: bool) -> float:
            return sum(max(e[k] if drafted else 1.0, s[k] if s else 1.0) for e, s in zip(expected, suffix))

        options = [(k, True) for k in self.lengths]
        if any(suffix):
            options += [(k, False) for k in self.lengths if k > 1]
        return max(options, key=lambda o: tokens(*o) / self.costs.seconds(batch_size, *o))

    def expected(self, kind: str, stats, remaining: int) -> dict[int, float]:
        """One sequence's expected tokens per length from its SamplingStats and the global estimate of its
        acceptance kind (SamplingParams.acceptance_kind)."""
        rates = self.acceptance[kind].rates(stats.accepted_by_position, stats.reached_by_position)
        return expected_tokens(rates, self.lengths, remaining)

    def suffix_expected(self, kind: str, stats, draft, remaining: int) -> dict[int, float]:
        """One sequence's expected tokens per length with its suffix draft (suffix_drafts.SuffixDraft)."""
        rates = self.suffix[kind, match_bucket(draft.match_length)].rates(stats.suffix_accepted_by_position,
                                                                          stats.suffix_reached_by_position)
        return expected_tokens(suffix_rates(rates, draft.probabilities), self.lengths, remaining)

    def choose(self, expected: list[dict[int, float]],
               suffix: list[dict[int, float] | None] | None = None) -> StepPlan:
        """The plan for a batch, given each sequence's expected tokens per length (expected_tokens) and with its
        suffix draft where it has one (suffix_expected). A full drafter block is spent now and then to keep the
        drafter's estimates fresh, and a plain step to keep its cost measured (the module's docstring)."""
        batch_size, full = len(expected), self.lengths[-1]
        suffix = suffix or [None] * batch_size
        k, drafted = self.best(batch_size, expected, suffix)
        if not (k == full and drafted):
            step_seconds = self.costs.seconds(batch_size, k, drafted)
            extra = self.costs.seconds(batch_size, full) - step_seconds
            self.explore_credit += EXPLORE_BUDGET * step_seconds
            if self.explore_credit >= extra:
                self.explore_credit -= max(extra, 0.0)
                k, drafted = full, True
        if k > 1:
            self.since_plain[batch_size] += 1
            timed = self.costs.measured(batch_size, 1)
            if self.since_plain[batch_size] >= min(PLAIN_EVERY, FIRST_PLAIN << timed):
                k = 1
        if k == 1:
            self.since_plain[batch_size] = 0
            return StepPlan(1, False)
        rows = frozenset(i for i, (e, s) in enumerate(zip(expected, suffix))
                         if s and s[k] > (e[k] if drafted else 1.0))
        return StepPlan(k, drafted and k > 1, rows)
