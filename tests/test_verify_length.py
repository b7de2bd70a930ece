"""Adaptive verify length (block size "auto"): lossless whatever length each step takes, and a cost and
acceptance model whose choice moves the way it must."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import BLOCK, EOS, PROMPTS, load_pair
from dflash_runtime import DFlashError, SamplingParams, SpeculativeEngine
from dflash_runtime.drafter_context import MAX_PENDING_CONTEXT
from dflash_runtime.verify_length import (EXPLORE_BUDGET, FIRST_PLAIN, OVERRULE_AFTER, PLAIN_EVERY, PROFILE_MAX_ROUNDS,
                                          PROFILE_ROUNDS, AcceptanceModel, StepCosts, StepPlan, VerifyLengthPolicy,
                                          auto_in_words, device_signature, doubling, expected_tokens, match_bucket,
                                          profiled_costs)

NEW = 40
LENGTHS = doubling(BLOCK)  # 1, 2, 4, 8, 16


def mixed_requests() -> list[SamplingParams]:
    """Greedy and seeded sampling side by side, with different lengths and stops."""
    return [SamplingParams(max_new_tokens=NEW), SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=7),
            SamplingParams(max_new_tokens=NEW - 13, temperature=1.3, top_k=20, seed=11),
            SamplingParams(max_new_tokens=NEW, temperature=0.7, top_p=0.9, seed=3, stop_token_ids=(EOS, 50))]


def outputs(engine, params) -> list[list[int]]:
    return [s.output_ids for s in engine.generate(PROMPTS, params)]


class Cycle:
    """Drives the real engine through a fixed sequence of plans, one per step (in place of engine._plan): a
    length k (the drafter's block where k > 1), or "suffix k": length k without the drafter, every row that has
    a suffix draft verifying it."""

    def __init__(self, lengths):
        self.lengths, self.used, self.suffix_rows = itertools.cycle(lengths), [], 0

    def __call__(self, batch, suffix):
        self.used.append(next(self.lengths))
        if isinstance(self.used[-1], int):
            return StepPlan(self.used[-1], self.used[-1] > 1)
        rows = frozenset(i for i, draft in enumerate(suffix) if draft is not None)
        self.suffix_rows += len(rows)
        return StepPlan(int(self.used[-1].split()[1]), False, rows)


def cycle_block_size(schedule) -> int | str:
    """An engine's block size for a Cycle: "auto" (suffix drafts are made under it) where the schedule has suffix
    steps, else the drafter's block (any length, no cost model to teach)."""
    return "auto" if any(isinstance(k, str) for k in schedule) else BLOCK


@pytest.mark.parametrize("schedule", [[1, 16, 2, 8, 4, 1, 1, 16], [16, 1], [3, 5, 1, 12],
                                      ["suffix 8", 1, "suffix 16", 16, "suffix 2", "suffix 8"]])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_switching_length_every_step_is_lossless(tiny, schedule, batch_size):
    target, drafter = load_pair(tiny)
    plain = outputs(SpeculativeEngine(target, block_size=1, max_batch_size=batch_size), mixed_requests())
    engine = SpeculativeEngine(target, drafter, block_size=cycle_block_size(schedule), max_batch_size=batch_size)
    engine._plan = cycle = Cycle(schedule)
    seqs = engine.generate(PROMPTS, mixed_requests())
    assert [s.output_ids for s in seqs] == plain
    assert set(cycle.used) == set(schedule)  # every length in the schedule really ran
    if any(isinstance(k, str) for k in schedule):
        accepted = sum(s.stats.sources.accepted["suffix"] for s in seqs)
        assert cycle.suffix_rows > 0 and accepted > 0  # suffix drafts were verified, and some taken


@pytest.mark.parametrize("schedule", [[1] * (MAX_PENDING_CONTEXT + 6) + [2] + [1] * 5 + [BLOCK] * 100,
                                      ["suffix 16", 1] * 20 + [2] + ["suffix 4"] * 5 + [BLOCK] * 100])
def test_long_runs_of_steps_without_the_drafter_keep_its_context(tiny, schedule):
    """Steps without the drafter (plain ones, and those verifying suffix drafts, which commit several tokens)
    defer the drafter's context; past MAX_PENDING_CONTEXT tokens, or at the next drafting step, it is written:
    the draft cache then holds exactly the context K/V of every committed token."""
    target, drafter = load_pair(tiny)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    engine = SpeculativeEngine(target, drafter, block_size=cycle_block_size(schedule), max_batch_size=1)
    engine._plan = Cycle(schedule)
    seq = engine.add_request(PROMPTS[0], params)
    while engine.has_unfinished():
        table = list(seq.block_table)  # the last before the step that ends it frees its blocks (unchanged after)
        engine.step()
    assert seq.output_ids == outputs(SpeculativeEngine(target, block_size=1), params)[0]
    assert "suffix 16" not in schedule or seq.stats.sources.accepted["suffix"] > 0
    # the reference: the target's features of the whole text in one pass, through each draft layer
    tokens = torch.tensor([seq.prompt_ids + seq.output_ids])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.inference_mode():
        _, features = target.whole_pass(tokens, drafter.config.target_layer_ids)
        context = drafter.context(features[0])
        # all but the newest token, whose K/V comes with its block, within the blocks it held before the last step
        written = min(tokens.shape[1] - 1, len(table) * engine.draft_cache.block_size)
        assert written > tokens.shape[1] - 1 - BLOCK
        for layer in range(drafter.config.shape.num_layers):
            k, v = drafter.context_kv(layer, context, positions[0])
            cached_k = engine.draft_cache.k[layer][table].flatten(0, 1)[:written]
            cached_v = engine.draft_cache.v[layer][table].flatten(0, 1)[:written]
            torch.testing.assert_close(cached_k, k[:written], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(cached_v, v[:written], atol=1e-4, rtol=1e-4)


def test_auto_is_lossless_and_uses_the_drafter_it_can_trust(tiny):
    target, drafter = load_pair(tiny)
    plain = outputs(SpeculativeEngine(target, block_size=1, max_batch_size=4), mixed_requests())
    engine = SpeculativeEngine(target, drafter, block_size="auto", max_batch_size=4)
    assert outputs(engine, mixed_requests()) == plain
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    used = {k for s in greedy for k in s.stats.verify_lengths}
    assert used <= set(range(1, BLOCK + 1)) and max(used) >= 8  # the trained tiny drafter is worth verifying at length
    assert max(a for s in greedy for a in s.stats.acceptance_lengths) >= 4


def test_the_profile_covers_every_batch_size_and_length(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, max_batch_size=5)
    costs = engine.policy.costs
    assert costs.device == device_signature(target.device)
    assert set(costs.profile) == {1, 2, 4, 5} and all(set(ks) == set(LENGTHS) for ks in costs.profile.values())
    assert all(s > 0 for ks in costs.profile.values() for s in ks.values())
    assert not engine.has_unfinished() and engine.occupancy().free_slots == 5  # the dummies are gone
    # a settled profile made here is taken as it is (this one may be unsettled on a busy host); one from another
    # device is replaced by a fresh one
    made_here = StepCosts.from_json({**costs.to_json(), "unsettled": ""})
    again = SpeculativeEngine(target, drafter, max_batch_size=5, step_costs=made_here)
    for batch_size, seconds in costs.profile.items():
        assert again.policy.costs.profile[batch_size] == pytest.approx(seconds, abs=1e-6)  # rounded to microseconds
    foreign = StepCosts("NVIDIA H200", {1: {k: 1.0 for k in LENGTHS}})
    assert SpeculativeEngine(target, drafter, max_batch_size=1, step_costs=foreign).policy.costs.device != "NVIDIA H200"
    # nor is one that was too noisy to trust (a build's sanity run on a busy host): the server profiles again
    noisy = StepCosts(costs.device, {1: {k: 1.0 for k in LENGTHS}}, unsettled="at batch 1, ...")
    assert SpeculativeEngine(target, drafter, max_batch_size=1, step_costs=noisy).policy.costs is not noisy


def test_statistics_count_only_what_a_step_emitted(tiny):
    """A step cut short by max_tokens or a stop token counts the tokens it emitted, not the drafts
    the target accepted after them."""
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK)
    for max_new_tokens in (2, 3, 5, 9):
        for seq in engine.generate(PROMPTS, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)):
            stats = seq.stats
            assert 1 + sum(stats.acceptance_lengths) == len(seq.output_ids) == max_new_tokens  # prefill gives 1
            assert stats.accepted_draft_tokens == sum(stats.accepted_by_position)
            assert all(a <= r for a, r in zip(stats.accepted_by_position, stats.reached_by_position))


def test_bad_block_sizes_and_auto_without_a_drafter(tiny):
    target, drafter = load_pair(tiny)
    for bad, message in [(0, ">= 1"), ("fast", "integer or 'auto'"), (BLOCK * 2, "larger than the drafter")]:
        with pytest.raises(DFlashError, match=message):
            SpeculativeEngine(target, drafter, block_size=bad)
    plain = SpeculativeEngine(target, None, block_size="auto")
    assert plain.block_size == 1 and plain.policy is None
    seq = plain.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6))[0]
    assert set(seq.stats.verify_lengths) == {1}


# -- the models, on synthetic figures -----------------------------------------------------------------

def flat_costs(**override) -> StepCosts:
    """Verify cost nearly flat in k (a small model on a big machine), unless overridden."""
    seconds = {1: 1.0, 2: 1.1, 4: 1.15, 8: 1.2, 16: 1.3} | {int(k): v for k, v in override.items()}
    return StepCosts("test", {1: seconds})


def choice(rates, costs, batch_size=1, remaining=100) -> int:
    policy = VerifyLengthPolicy(BLOCK, costs)
    k, drafted = policy.best(batch_size, [expected_tokens(rates, LENGTHS, remaining)] * batch_size)
    assert drafted or k == 1  # without suffix drafts, nothing verifies without the drafter
    return k


def test_expected_tokens_follow_the_acceptance_curve():
    rates = [0.5] * 15
    assert expected_tokens(rates, (1, 2, 4), 100) == {1: 1.0, 2: 1.5, 4: 1.875}
    assert expected_tokens([0.9, 0.0, 1.0], (1, 2, 4), 100) == {1: 1.0, 2: 1.9, 4: 1.9}  # zero stops the chain
    assert expected_tokens(rates, (1, 2, 4), 2) == {1: 1.0, 2: 1.5, 4: 1.5}  # a request that may emit 2 more


def test_what_auto_did_is_said_in_words():
    costly = StepCosts("test", {1: {1: 1.0, 2: 1.6, 4: 2.0, 8: 2.4}}, {1: {1: 1.0, 2: 1.2, 4: 1.5, 8: 1.8}})
    sources = {"drafter": {"steps": 5, "drafted": 35, "accepted": 3},
               "none": {"steps": 54, "drafted": 0, "accepted": 0}, "suffix": {"steps": 4, "drafted": 20, "accepted": 15}}
    assert auto_in_words(costly, sources) == (
        "the drafter's block on 5 of 63 steps (3 of 35 drafts accepted), no draft on 54 of 63 steps, suffix drafts on "
        "4 of 63 steps (15 of 20 drafts accepted): here a verify of 8 tokens costs 2.4x one token with the drafter's "
        "pass, 1.8x without it; a step pays where it brings more tokens than it costs")


def test_choice_moves_to_shorter_lengths_as_acceptance_falls():
    chosen = [choice([p] * 15, flat_costs()) for p in (0.95, 0.8, 0.5, 0.2, 0.02)]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] == 16 and chosen[-1] == 1
    # DFlash's curve: good early positions, poor late ones -> a middle length
    assert 1 < choice([0.9, 0.85, 0.8, 0.4, 0.1] + [0.05] * 10, flat_costs()) < 16


def test_choice_moves_to_shorter_lengths_as_verify_cost_rises():
    rates = [0.85] * 15
    steeper = [flat_costs(), StepCosts("test", {1: {k: 1 + 0.1 * k for k in LENGTHS}}),
               StepCosts("test", {1: {k: 1 + 0.5 * k for k in LENGTHS}}),
               StepCosts("test", {1: {k: k for k in LENGTHS}})]
    chosen = [choice(rates, c) for c in steeper]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] == 16 and chosen[-1] == 1


def test_costs_interpolate_between_batch_sizes_and_learn_from_steps():
    costs = StepCosts("test", {1: {1: 1.0, 2: 2.0}, 4: {1: 4.0, 2: 6.0}})
    assert costs.seconds(2, 1) == pytest.approx(2.0) and costs.seconds(3, 2) == pytest.approx(2 + 4 * 2 / 3)
    assert costs.seconds(8, 1) == pytest.approx(8.0)  # beyond the largest profiled size: proportional
    for _ in range(50):
        costs.observe(2, 1, 0.5)
    assert costs.seconds(2, 1) == pytest.approx(0.5, rel=1e-3) and costs.seconds(2, 2) == pytest.approx(2 + 4 / 3)


def test_a_profile_slowed_at_a_short_length_is_made_monotone():
    """A busy host slowed the one-token step while it was timed (seen: 1.339 s against 0.015 s in another build):
    no length is estimated dearer than a longer one, so plain decoding stays a choice, and its own steps then
    correct it."""
    costs = StepCosts("test", {1: {1: 1.339, 2: 0.02, 4: 0.03, 8: 0.05}}, {1: {1: 1.339, 2: 0.018, 4: 0.5, 8: 0.04}})
    assert [costs.seconds(1, k) for k in LENGTHS[:4]] == [0.02, 0.02, 0.03, 0.05]
    assert [costs.seconds(1, k, drafted=False) for k in (2, 4, 8)] == [0.018, 0.04, 0.04]
    assert StepCosts.from_json(costs.to_json()).profile == costs.profile


def test_a_plain_step_is_taken_now_and_then_so_that_its_cost_stays_measured():
    """The profile was made while the host was busy, the one-token step timed at twice its cost: drafting looks
    cheap, and plain decoding, never taken, would never be corrected. The FIRST_PLAIN-th step is plain, the next
    ones twice as late each time, then one at least every PLAIN_EVERY; the first timing overrules the profile at
    once."""
    costs = StepCosts("test", {1: {1: 2.0, 2: 2.1, 4: 2.2, 8: 2.4, 16: 2.6}})
    policy = VerifyLengthPolicy(BLOCK, costs)
    fair = [expected_tokens([0.3] * 15, LENGTHS, 100)]
    plans = []
    for _ in range(FIRST_PLAIN * 15 + 2 * PLAIN_EVERY):
        plans.append(policy.choose(fair).k)
        costs.observe(1, plans[-1], 1.9 if plans[-1] == 1 else costs.seconds(1, plans[-1]))  # drafts still pay
    plain = [i for i, k in enumerate(plans) if k == 1]
    assert plain[:3] == [FIRST_PLAIN - 1, 3 * FIRST_PLAIN - 1, 7 * FIRST_PLAIN - 1]
    assert all(b - a <= PLAIN_EVERY for a, b in zip(plain, plain[1:])) and plain[-1] - plain[-2] == PLAIN_EVERY
    assert costs.seconds(1, 1) == 1.9


def test_steps_overrule_the_profile_and_noise_only_adds_time():
    """A step timed faster than the profile overrules it at once; a first step slower than it (a neighbour's
    burst) does not; from the OVERRULE_AFTER-th on, the median of the last steps, whatever the profile said (the
    host got busier: plain steps and drafts both cost more now)."""
    costs = StepCosts("test", {1: {1: 1.0, 2: 2.0}})
    costs.observe(1, 2, 1.5)
    assert costs.seconds(1, 2) == 1.5
    costs.observe(1, 1, 30.0)  # descheduled once
    assert costs.seconds(1, 1) == 1.0
    for seconds in [3.0, 3.2, 2.9]:
        costs.observe(1, 1, seconds)
    assert costs.measured(1, 1) == OVERRULE_AFTER + 1 and costs.seconds(1, 1) == pytest.approx((3.0 + 3.2) / 2)
    for _ in range(20):
        costs.observe(1, 1, 1.2)
    assert costs.seconds(1, 1) == 1.2  # the burst and the busy spell have left the window


class Host:
    """Steps of a CPU whose verify of k costs k + 1 units with the drafter's pass (k without it), and a plain step
    2: drafting does not pay at any tau below 1.5. `slow` marks the calls (counted from 0) a neighbour's burst
    made `slow_by` times dearer."""

    def __init__(self, slow=(), slow_by=10.0):
        self.calls, self.slow, self.slow_by = [], set(slow), slow_by

    def __call__(self, batch_size, k):
        base = 2.0 if k == 1 else k + 1.0
        factor = self.slow_by if len(self.calls) in self.slow else 1.0
        self.calls.append((batch_size, k))
        return base * factor, (base if k == 1 else k) * factor


def test_a_profile_takes_the_median_of_rounds_of_every_length_in_turn():
    """A neighbour's burst slows one step: the median of PROFILE_ROUNDS rounds ignores it, and the profile stops
    there (one warm-up step per length first)."""
    lengths = (1, 2, 4, 8)
    host = Host(slow={len(lengths) + 0, len(lengths) + 2 * len(lengths) + 3})  # round 1's plain step, round 3's 8
    costs = profiled_costs("test", (1,), lengths, host)
    assert not costs.unsettled and costs.profile == {1: {1: 2, 2: 3, 4: 5, 8: 9}}
    assert costs.verify_profile == {1: {1: 2, 2: 2, 4: 4, 8: 8}}
    assert host.calls == [(1, k) for k in lengths] * (1 + PROFILE_ROUNDS)


def test_a_profile_that_stays_noisy_is_re_measured_then_falls_back_to_plain_decoding():
    """A host so busy that the plain step times dearer than drafting in most rounds (the profile that made a server
    draft on 30 of 34 steps at tau 1.03): rounds are added up to PROFILE_MAX_ROUNDS, then the profile is marked
    unsettled, a step of k is priced as k plain ones (so nothing drafts on its word), and the words say why.
    Steps that measure a draft overrule that price like any profile's."""
    lengths = (1, 2, 4, 8)
    plain_calls = range(len(lengths), len(lengths) * (1 + PROFILE_MAX_ROUNDS), len(lengths))
    host = Host(slow=[c for i, c in enumerate(plain_calls) if i % 3], slow_by=8.0)  # two plain steps in three
    costs = profiled_costs("test", (1, 2), lengths, host)
    assert costs.unsettled == "at batch 1, a step of length 1 timed 5.33x one of 2"
    assert len(host.calls) == len(lengths) * (2 + PROFILE_MAX_ROUNDS + PROFILE_ROUNDS)  # batch 2 settled at once
    plain = costs.seconds(1, 1)
    assert [costs.seconds(1, k) for k in lengths] == [plain * k for k in lengths]
    assert [costs.seconds(1, k, drafted=False) for k in lengths] == [plain * k for k in lengths]
    rates = [0.6] * 7  # tau 2.5 at length 8 if the profile were believed (and it was not measured)
    policy = VerifyLengthPolicy(8, costs, lengths)
    assert policy.best(1, [expected_tokens(rates, lengths, 100)]) == (1, True)
    assert "too noisy to trust: at batch 1, a step of length 1 timed 5.33x one of 2" in auto_in_words(costs, {})
    assert StepCosts.from_json(costs.to_json()).unsettled == costs.unsettled
    # no step is spent to measure a draft: one block timed fast by luck would make every length look cheap
    assert policy.choose([expected_tokens([0.1] * 7, lengths, 100)]) == StepPlan(1, False)
    costs.observe(1, 1, 2.0)
    costs.observe(1, 8, 9.0)  # a block (exploration's), then a verify of 8 alone: measured, they overrule
    costs.observe(1, 8, 5.0, drafted=False)
    assert [costs.seconds(1, k) for k in lengths] == [2.0, 4.0, 8.0, 9.0]
    assert [costs.seconds(1, k, drafted=False) for k in (2, 4, 8)] == [4.0, 8.0, 5.0]
    assert policy.choose([expected_tokens([0.1] * 7, lengths, 100)]) == StepPlan(1, False)
    sure = {1: 1.0, 2: 1.95, 4: 3.8, 8: 7.0}  # a suffix draft nearly sure to be accepted pays where measured
    assert policy.choose([expected_tokens([0.1] * 7, lengths, 100)], [sure]) == StepPlan(8, False, frozenset({0}))


def test_what_auto_learned_of_acceptance_starts_another_engine(tiny):
    """A build's sanity run hands the server what it learned (its profile file's "acceptance"): the server's
    estimates start from those counts, not from the benefit of the doubt."""
    policy = VerifyLengthPolicy(BLOCK, flat_costs())
    for _ in range(30):
        policy.acceptance["greedy"].observe(accepted=0, reached=1)  # a drafter that is never right here
        policy.suffix["greedy", match_bucket(5)].observe(accepted=3, reached=4)
    learned = json.loads(json.dumps(policy.learned()))
    target, drafter = load_pair(tiny)
    started = SpeculativeEngine(target, drafter, max_batch_size=1, learned_acceptance=learned).policy
    fresh = SpeculativeEngine(target, drafter, max_batch_size=1).policy
    assert started.acceptance["greedy"].rates() == pytest.approx(policy.acceptance["greedy"].rates(), abs=1e-3)
    assert started.acceptance["greedy"].rates()[0] < 0.1 < 0.5 < fresh.acceptance["greedy"].rates()[0]
    bucket = "greedy", match_bucket(5)
    assert started.suffix[bucket].rates() == pytest.approx(policy.suffix[bucket].rates(), abs=1e-3)


def test_acceptance_is_per_position_and_per_request():
    model = AcceptanceModel(3)
    unknown = model.rates()[0]
    assert model.rates() == [unknown] * 3 and unknown > 0.5  # no data: the benefit of the doubt
    for _ in range(400):
        model.observe(accepted=1, reached=2)  # draft 1 always accepted, draft 2 always rejected
    first, second, third = model.rates()
    assert first > 0.95 and second < 0.05 and third == unknown  # the third was never reached
    # a request whose own second drafts were accepted 20 of 20 times moves most of the way to them
    own = model.rates(request_accepted=[20, 20], request_reached=[20, 20])
    assert own[1] > 0.7 and own[0] > 0.95
    # the global estimate is kept between changes: counts loaded from another engine replace it
    other = AcceptanceModel(3)
    assert other.rates() == [unknown] * 3
    other.load(model.to_json())
    assert other.rates() == pytest.approx(model.rates(), abs=1e-3)


def test_exploration_spends_about_its_budget():
    costs = StepCosts("test", {1: {1: 1.0, 2: 1.5, 4: 1.6, 8: 1.8, 16: 2.0}})
    policy = VerifyLengthPolicy(BLOCK, costs)
    poor = [expected_tokens([0.05] * 15, LENGTHS, 100)]
    chosen = [policy.choose(poor).k for _ in range(1000)]
    explored = chosen.count(16)
    assert set(chosen) == {1, 16}
    # each exploration costs 1 s beyond the best step: 1 % of 1000 s buys about 10 of them
    assert explored == pytest.approx(1000 * EXPLORE_BUDGET * 1.0 / (2.0 - 1.0), abs=2)
