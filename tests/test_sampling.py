"""Sampled decoding with drafts (dflash_runtime/sampling.py): the target's Gumbel-max sample is the output
whatever the drafter, the block size or the batch; rejection sampling keeps the target's distribution."""
from __future__ import annotations

import pytest
import torch

from conftest import BLOCK, EOS, PROMPTS, VOCAB, load_pair
from dflash_runtime import DFlashError, SamplingParams, SpeculativeEngine
from dflash_runtime.counter_noise import DRAFT, gumbel_noise
from dflash_runtime.sampling import (DEFAULT_DRAFT_SHARPNESS, DRAFT_SHARPNESS_CHOICES, GumbelNoise,
                                     ProposalRule, RowParams, choose_tokens, proposal_hits,
                                     propose_tokens, rejection_choices, sample_tokens, sampling_scores)

SAMPLED = [SamplingParams(max_new_tokens=40, temperature=t, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
           for t in (0.7, 1.0)]


def outputs(target, drafter, block_size, params, **engine_args) -> list[list[int]]:
    engine = SpeculativeEngine(target, drafter if block_size != 1 else None, block_size=block_size,
                               max_batch_size=4, **engine_args)
    return [s.output_ids for s in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize("params", SAMPLED, ids=["T0.7", "T1"])
def test_a_sampled_output_is_the_same_at_every_block_size_and_proposal_rule(tiny, params):
    target, drafter = load_pair(tiny)
    plain = outputs(target, drafter, 1, params)
    for block_size in (4, 8, BLOCK, "auto"):
        for sharpness in (None, 0.0, 0.5, 1.0):  # None: learned
            assert outputs(target, drafter, block_size, params, draft_sharpness=sharpness) == plain, \
                (block_size, sharpness)
    other_seed = outputs(target, drafter, BLOCK, SamplingParams(**{**params.__dict__, "seed": 99}))
    assert other_seed != plain


def test_greedy_and_sampled_rows_in_one_batch_each_get_their_own_output(tiny):
    """Mixed batches: greedy rows keep argmax, sampled rows their own sample; rejection sampling rows beside
    them change nothing for the others."""
    target, drafter = load_pair(tiny)
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    rejection = SamplingParams(**{**SAMPLED[1].__dict__, "speculative_sampling": "rejection", "seed": 7})
    mixed = [greedy, SAMPLED[0], rejection, SAMPLED[1]]
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4)
    together = [s.output_ids for s in engine.generate(PROMPTS, mixed)]
    for n, (prompt, params) in enumerate(zip(PROMPTS, mixed)):
        alone = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=1).generate([prompt], params)
        assert together[n] == alone[0].output_ids, n
        if params is not rejection:
            assert together[n] == outputs(target, drafter, 1, [params] * 4)[n], n


def test_rejection_sampling_is_deterministic_per_seed_and_ignored_by_greedy(tiny):
    target, drafter = load_pair(tiny)
    rejection = SamplingParams(**{**SAMPLED[1].__dict__, "speculative_sampling": "rejection"})
    assert outputs(target, drafter, BLOCK, rejection) == outputs(target, drafter, BLOCK, rejection)
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    assert outputs(target, drafter, BLOCK, SamplingParams(**{**greedy.__dict__, "speculative_sampling": "rejection"})) \
        == outputs(target, drafter, 1, greedy)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, speculative_sampling="rejection")
    assert engine.generate([PROMPTS[0]], SAMPLED[1])[0].params.speculative_sampling == "rejection"


def test_min_tokens_and_max_tokens_hold_for_both_methods(tiny):
    target, drafter = load_pair(tiny)
    for method in ("exact", "rejection"):
        params = SamplingParams(max_new_tokens=30, min_new_tokens=12, temperature=1.0, seed=3, stop_token_ids=(5, 9),
                                speculative_sampling=method)
        for seq in SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4).generate(PROMPTS, params):
            early = seq.output_ids[:12]
            assert not {EOS, 5, 9} & set(early) and len(seq.output_ids) <= 30, (method, seq.output_ids)


def test_an_unknown_method_is_refused_naming_it(tiny):
    with pytest.raises(DFlashError, match="speculative_sampling must be one of exact, rejection; got 'typical'"):
        SamplingParams(temperature=1.0, speculative_sampling="typical")
    target, drafter = load_pair(tiny)
    with pytest.raises(DFlashError, match="got 'greedy'"):
        SpeculativeEngine(target, drafter, block_size=BLOCK, speculative_sampling="greedy")


def reference_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent oracle, HF's convention: keep the top-k, renormalise, keep the nucleus, renormalise."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]
    total = sum(probs[t].item() for t in order)
    out, mass = torch.zeros_like(probs), 0.0
    for token in order:
        if mass >= top_p:
            break
        out[token] = probs[token] / total
        mass += out[token].item()
    return out / out.sum()


def assert_follows(samples: torch.Tensor, expected: torch.Tensor) -> None:
    """Pearson chi-square over outcomes expected >= 5 times; tolerance: df + 5 standard deviations
    (sqrt(2 df)), which a correct sampler exceeds with probability well below 1e-4."""
    n = len(samples)
    observed = torch.bincount(samples, minlength=len(expected)).double()
    assert observed[expected == 0].sum() == 0, "sampled a token the distribution excludes"
    counts = expected * n
    used = counts >= 5
    chi2 = ((observed[used] - counts[used]) ** 2 / counts[used]).sum().item()
    df = int(used.sum()) - 1
    assert chi2 < df + 5 * (2 * df) ** 0.5, (chi2, df)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.9, 25, 0.9)])
def test_gumbel_max_samples_follow_the_target_distribution(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(VOCAB) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=5)
    # rows are positions: every row draws its own (seed, position) noise
    samples = torch.tensor(choose_tokens(logits.expand(20000, VOCAB), params, first_position=0))
    assert_follows(samples, reference_probabilities(logits, temperature, top_k, top_p))


def test_top_p_over_a_large_vocabulary_keeps_the_nucleus_whichever_tokens_are_sorted(monkeypatch):
    """On a CPU the top 256 are sorted when they hold every row's nucleus, else the whole vocabulary: a peaked and a
    flat row, alone and together (the flat one sends both to the full sort), beside a row without top-p whose
    scores stay whole, give the oracle's distribution."""
    from dflash_runtime.sampling import NUCLEUS_CANDIDATES

    vocab = 4 * NUCLEUS_CANDIDATES
    generator = torch.Generator().manual_seed(2)
    peaked, flat, plain = (torch.randn(vocab, generator=generator) * spread for spread in (4.0, 0.1, 1.0))
    params = {"peaked": SamplingParams(temperature=1.0, top_p=0.9, seed=1),
              "flat": SamplingParams(temperature=0.8, top_p=0.9, seed=1), "plain": SamplingParams(temperature=1.0, seed=1)}
    logits = {"peaked": peaked, "flat": flat, "plain": plain}
    sorts, full_sort = [], torch.Tensor.sort

    def counted_sort(self, *args, **kwargs):
        sorts.append(tuple(self.shape))
        return full_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counted_sort)
    for batch in (["peaked", "plain"], ["flat", "plain"], ["peaked", "flat", "plain"]):
        rows = RowParams.of([params[name] for name in batch], vocab, torch.device("cpu"))
        sorts.clear()
        probs = torch.softmax(sampling_scores(torch.stack([logits[name] for name in batch])[:, None], rows), -1)
        assert sorts == ([] if "flat" not in batch else [(len(batch), 1, vocab)]), batch
        for n, name in enumerate(batch):
            p = params[name]
            expected = reference_probabilities(logits[name], p.temperature, p.top_k, p.top_p)
            assert torch.equal(probs[n, 0] > 0, expected > 0), (batch, name)
            torch.testing.assert_close(probs[n, 0].double(), expected, rtol=1e-4, atol=1e-6)
    assert (reference_probabilities(flat, 0.8, 0, 0.9) > 0).sum() > NUCLEUS_CANDIDATES  # the flat row's needs all


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_rejection_sampling_follows_the_target_distribution(temperature, top_p):
    """Drafts drawn from a drafter's different distribution, then accepted by min(1, p/q) or resampled from
    the residual: the chosen token at the first block position follows the target's distribution."""
    torch.manual_seed(1)
    n, k = 20000, 3
    target_logits, draft_logits = torch.randn(VOCAB) * 2, torch.randn(VOCAB) * 2
    rows = RowParams.of([SamplingParams(temperature=temperature, top_p=top_p, seed=s) for s in range(n)], VOCAB,
                        torch.device("cpu"))
    positions = torch.arange(k).expand(n, k) + 10
    scores = sampling_scores(target_logits.expand(n, k, VOCAB), rows)
    draft_scores = sampling_scores(draft_logits.expand(n, k - 1, VOCAB), rows)
    drafts = GumbelNoise(rows.seeds, positions[:, :-1], VOCAB, DRAFT).argmax(draft_scores)
    samples = GumbelNoise(rows.seeds, positions, VOCAB).argmax(scores)
    chosen = rejection_choices(scores, draft_scores, drafts, rows.seeds, positions, samples)
    expected = reference_probabilities(target_logits, temperature, 0, top_p)
    assert_follows(chosen[:, 0], expected)
    accepted = (chosen[:, 0] == drafts[:, 0]).double().mean().item()
    q = reference_probabilities(draft_logits, temperature, 0, top_p)
    assert abs(accepted - torch.minimum(expected, q).sum().item()) < 0.02  # P(accept) = 1 - TV(p, q)


def the_issues_two_cases(n: int):
    """n positions of: equal spread distributions; the target sure of token 0 (p = A only) with the drafter unsure
    (q = 0.6 A / 0.4 B). Returns rows, noise and the logits (spread, sure, unsure) [n, 1, VOCAB]."""
    rows = RowParams.of([SamplingParams(temperature=1.0, seed=11)] * n, VOCAB, torch.device("cpu"))
    noise = GumbelNoise(rows.seeds, torch.arange(n)[:, None], VOCAB)
    spread = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)).expand(n, 1, VOCAB) * 0.5
    sure = torch.full((n, 1, VOCAB), -1e4)
    sure[..., 0] = 0
    unsure = torch.full((n, 1, VOCAB), -1e4)
    unsure[..., 0], unsure[..., 1] = torch.tensor(0.6).log(), torch.tensor(0.4).log()
    return rows, noise, (spread, sure, unsure)


def test_coupled_proposals_match_where_the_distributions_agree_and_argmax_where_the_target_is_sure():
    """The issue's two cases, over 4000 positions: equal distributions -> the coupled draft is always the
    target's sample (argmax drafts rarely are); p = A only, q = 0.6 A / 0.4 B -> argmax always matches,
    coupling about 60 % of the time."""
    n = 4000
    rows, noise, (spread, sure, unsure) = the_issues_two_cases(n)
    target = sample_tokens(spread, rows, noise)
    assert (propose_tokens(spread, sampling_scores(spread, rows), noise, 1.0) == target).all()
    assert (propose_tokens(spread, sampling_scores(spread, rows), noise, 0.0) == target).float().mean() < 0.05
    target = sample_tokens(sure, rows, noise)
    assert (target == 0).all()
    assert (propose_tokens(unsure, sampling_scores(unsure, rows), noise, 0.0) == target).all()
    coupled = (propose_tokens(unsure, sampling_scores(unsure, rows), noise, 1.0) == target).float().mean().item()
    assert abs(coupled - 0.6) < 0.04


def test_the_learned_proposal_rule_is_the_one_that_guesses_best():
    """proposal_hits judges every rule on the same positions; ProposalRule keeps the default until a rule guesses
    better, then drafts with the best: the coupling on equal spread distributions, the argmax where the target is
    sure and the drafter is not."""
    rows, noise, (spread, sure, unsure) = the_issues_two_cases(400)
    assert DRAFT_SHARPNESS_CHOICES == (0.0, 0.25, 0.5, 1.0)
    hits = proposal_hits(spread, sampling_scores(spread, rows), noise, sample_tokens(spread, rows, noise))
    assert hits[-1] == 400 and hits[0] < 40
    rule = ProposalRule()
    assert rule.sharpness() == DEFAULT_DRAFT_SHARPNESS
    rule.observe(hits)
    assert rule.sharpness() == 1.0
    hits = proposal_hits(unsure, sampling_scores(unsure, rows), noise, sample_tokens(sure, rows, noise))
    assert hits[0] == 400 and hits[-1] < 300
    rule = ProposalRule()
    rule.observe(hits)
    assert rule.sharpness() == 0.0
    assert ProposalRule(0.25).sharpness() == 0.25 and not ProposalRule(0.25).learning
    with pytest.raises(DFlashError, match="draft_sharpness must be >= 0, got -1"):
        ProposalRule(-1.0)


def test_an_engine_learns_to_couple_on_the_tiny_pairs(tiny):
    """The tiny targets' sampled distributions are flat: argmax drafts almost never survive there, while the
    coupling keeps many; an engine that learns its rule drafts with sharpness 1 and keeps more than the fixed
    default."""
    target, drafter = load_pair(tiny)
    params = SAMPLED[1]

    def tau(engine) -> float:
        lengths = [a for s in engine.generate(PROMPTS, params) for a in s.stats.acceptance_lengths]
        return sum(lengths) / len(lengths)

    learning = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4)
    fixed = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4,
                              draft_sharpness=DEFAULT_DRAFT_SHARPNESS)
    assert tau(learning) > tau(fixed)
    assert learning.proposal_rule.sharpness() == 1.0


def test_noise_depends_only_on_seed_position_and_token():
    seeds = torch.tensor([[1, 0], [1, 0], [2, 0], [1, 1]])
    positions = torch.tensor([[5, 6], [5, 7], [5, 6], [5, 6]])
    noise = gumbel_noise(seeds, positions, VOCAB)
    assert torch.equal(noise[0, 0], noise[1, 0])  # same seed and position, another row
    assert not torch.equal(noise[0, 1], noise[1, 1])  # another position
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[3])  # another seed (low, high)
    assert not torch.equal(noise[0], gumbel_noise(seeds, positions, VOCAB, DRAFT)[0])  # another stream
    assert torch.isfinite(noise).all()


def test_greedy_tokens_are_argmax_ties_and_masks_included():
    """torch.max's indices in place of argmax (faster on a CPU; float32 there on the GGUF kernels where they build):
    the same token everywhere, the first of equal logits included (a bfloat16 head ties often), rows masked to -inf
    but for a few tokens, a row's tail past its last 8 lanes, NaN."""
    from dflash_runtime.sampling import greedy_tokens

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        logits = torch.randint(-3, 4, (5, 8, 49152)).to(dtype)  # every row has thousands of ties at its maximum
        logits[0, :, ::2] = float("-inf")
        logits[1, 3] = float("-inf")
        logits[1, 3, [7, 9000]] = 2.0
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
        assert greedy_tokens(logits)[1, 3] == 7
        strided = torch.randn(6, 200).to(dtype)[:, ::3]
        assert torch.equal(greedy_tokens(strided), strided.argmax(-1))
        one_row = torch.zeros(1, 1, 49152, dtype=dtype)  # a single row: the reduction may split it across threads
        one_row[..., [30000, 100, 45000]] = 1
        assert greedy_tokens(one_row).item() == one_row.argmax(-1).item() == 100
        odd = torch.randn(3, 8 * 7 + 5).to(dtype)  # past the last whole 8 lanes, and a NaN: torch's first NaN
        odd[1, 60], odd[2, [9, 30]] = 100, float("nan")
        assert torch.equal(greedy_tokens(odd), odd.max(-1).indices) and greedy_tokens(odd)[2] == 9
