"""Draft-free suffix drafts: the structure against a brute-force search, the policy's choice of source per row
and per step, and the engine using them losslessly where text repeats."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from conftest import BLOCK, PROMPTS, load_pair
from dflash_runtime import SamplingParams, SpeculativeEngine
from dflash_runtime.suffix_drafts import (MAX_MATCH, MAX_OCCURRENCES, MIN_PROBABILITY, MIN_SHARED_MATCH, SEPARATOR,
                                         SharedResponses, SuffixDraft, TokenHistory)
from dflash_runtime.sampling import SamplingStats
from dflash_runtime.verify_length import StepCosts, VerifyLengthPolicy, doubling, expected_tokens, match_bucket

LENGTHS = doubling(BLOCK)


def brute_force(text: list[int], max_tokens: int, corpus: list[int] | None = None) -> SuffixDraft | None:
    """The module's rule, written the slow way: every suffix length tried from the longest, every occurrence
    compared token by token; in the text itself before its newest token, or in `corpus` (responses each followed
    by SEPARATOR)."""
    n = len(text)
    own = corpus is None
    corpus = text if own else corpus
    for match in range(min(MAX_MATCH, n - 1 if own else n), 0, -1):
        ends = [i for i in range(match - 1, n - 1 if own else len(corpus))
                if corpus[i - match + 1:i + 1] == text[n - match:]]
        if ends:
            break
    else:
        return None
    tokens, probabilities, probability, follow = [], [], 1.0, [i + 1 for i in ends[-MAX_OCCURRENCES:]]
    while len(tokens) < max_tokens:
        follow = [i for i in follow if i < len(corpus) and corpus[i] != SEPARATOR]
        if not follow:
            break
        counts = Counter(corpus[i] for i in follow)
        best = max(counts.values())
        token = corpus[max(i for i in follow if counts[corpus[i]] == best)]  # ties: the most recent occurrence's
        probability *= best / len(follow)
        if probability < MIN_PROBABILITY:
            break
        tokens.append(token)
        probabilities.append(probability)
        follow = [i + 1 for i in follow if corpus[i] == token]
    return SuffixDraft(tokens, probabilities, match) if tokens else None


def test_drafts_from_earlier_responses_match_a_brute_force_search():
    """Responses in the shared ring (no wrap yet): the same rule over them, no match across two of them; the request
    takes the draft of the longer match (one of MIN_SHARED_MATCH tokens at least from earlier answers), then the
    surer one, its own on a tie."""
    rng = random.Random(7)
    for trial in range(300):
        alphabet = rng.choice([2, 3, 6, 50])
        responses = [[rng.randrange(alphabet) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 6))]
        shared = SharedResponses(1000)
        for response in responses:
            shared.add(response)
        corpus = [t for response in responses for t in (*response, SEPARATOR)]
        assert shared.tokens[:len(corpus)].tolist() == corpus and shared.held == len(corpus) - len(responses)
        text = [rng.randrange(alphabet) for _ in range(rng.randint(1, 30))]
        if trial % 2:  # the request is re-emitting part of an earlier response
            source = rng.choice(responses)
            start = rng.randrange(len(source))
            text += source[start:start + rng.randint(1, 12)]
        history = TokenHistory()
        history.sync(text, [])
        max_tokens = rng.randint(1, 16)
        theirs = brute_force(text, max_tokens, corpus)
        ours = shared.propose(history.tokens[:history.length], max_tokens)
        assert (ours is None) == (theirs is None), (text, responses)
        if ours is not None:
            assert (ours.tokens, ours.match_length) == (theirs.tokens, theirs.match_length), (text, responses)
            assert ours.probabilities == pytest.approx(theirs.probabilities)
        own = brute_force(text, max_tokens)
        strength = (lambda d: (d.match_length, sum(d.probabilities)))  # the longer match, then the surer draft
        expected = own if theirs is None or theirs.match_length < MIN_SHARED_MATCH or (
            own is not None and strength(own) >= strength(theirs)) else theirs
        chosen = history.propose(max_tokens, shared)
        assert (chosen and (chosen.tokens, chosen.match_length)) == (expected and (expected.tokens,
                                                                                   expected.match_length))


def test_the_shared_ring_keeps_the_newest_responses_within_its_capacity():
    shared = SharedResponses(64)
    responses = [[100 + i] * 10 + list(range(i, i + 5)) for i in range(20)]  # 15 tokens + a separator each
    for response in responses:
        shared.add(response)
        assert shared.held == int((shared.tokens != SEPARATOR).sum()) <= 63
    assert shared.tokens.nbytes == 64 * 4  # never grows
    newest = responses[-1]
    assert shared.propose(np.array(newest[:10]), 5).tokens == newest[10:15]  # held, drafted whole
    assert shared.propose(np.array(responses[0][:10]), 5) is None  # the oldest was overwritten
    shared.add(list(range(1000, 1200)))  # longer than the ring: its last 63 tokens
    assert shared.held == 63 and shared.propose(np.array([1150]), 4).tokens == [1151, 1152, 1153, 1154]
    with pytest.raises(ValueError, match="2 tokens at least"):
        SharedResponses(1)


@pytest.mark.parametrize("alphabet", [2, 3, 6, 50])
def test_drafts_match_a_brute_force_search(alphabet):
    rng = random.Random(alphabet)
    for trial in range(300):
        n = rng.randint(1, 120 if trial % 10 else 400)  # some past MAX_OCCURRENCES occurrences of a match
        text = [rng.randrange(alphabet) for _ in range(n)]
        if trial % 3 == 0:  # repeated passages, as in an edit: a copy of an earlier stretch, then a change
            start = rng.randrange(n)
            text += text[start:start + rng.randint(1, 40)] + [rng.randrange(alphabet)]
        history = TokenHistory()
        cut = rng.randint(0, len(text))  # synced in two parts, as a prompt and then its output
        history.sync(text[:cut], [])
        history.sync(text[:cut], text[cut:])
        max_tokens = rng.randint(1, 16)
        ours, theirs = history.propose(max_tokens), brute_force(text, max_tokens)
        assert (ours is None) == (theirs is None), text
        if ours is not None:
            assert (ours.tokens, ours.match_length) == (theirs.tokens, theirs.match_length), text
            assert ours.probabilities == pytest.approx(theirs.probabilities)


@pytest.mark.parametrize("text", [[1] * 200, [1, 2] * 150, [1, 2, 3] * 60 + [1, 2, 4] * 60 + [1, 2]])
def test_runs_of_repeats_are_counted_over_the_latest_occurrences(text):
    """More occurrences of the match than MAX_OCCURRENCES: the brute force's counts over the same latest ones."""
    history = TokenHistory()
    history.sync(text, [])
    ours, theirs = history.propose(15), brute_force(text, 15)
    assert (ours.tokens, ours.match_length, ours.probabilities) == (theirs.tokens, theirs.match_length,
                                                                   pytest.approx(theirs.probabilities))


def test_a_repeated_passage_is_drafted_in_full():
    passage = list(range(100, 140))
    history = TokenHistory()
    history.sync([1, 2] + passage + [3, 4], passage[:5])  # the answer starts quoting the passage
    draft = history.propose(15)
    assert draft.tokens == passage[5:20] and draft.match_length == 5 and draft.probabilities == [1.0] * 15
    assert TokenHistory().propose(4) is None  # nothing yet
    history = TokenHistory()
    history.sync([5, 6, 7], [8])
    assert history.propose(4) is None  # the newest token never occurred before


def test_a_large_history_grows_in_place():
    history = TokenHistory()
    text = [i % 1000 for i in range(20_000)]
    for end in range(0, len(text), 777):
        history.sync(text[:50], text[50:end])
    history.sync(text[:50], text[50:])
    assert history.length == len(text) and history.tokens[:history.length].tolist() == text
    assert history.propose(7).tokens == [0, 1, 2, 3, 4, 5, 6]


# -- the choice of source, on synthetic figures ----------------------------------------------------

def costs_where_the_drafter_costs(draft_seconds: float) -> StepCosts:
    """A verify of k costs 1 + 0.5 k (a CPU's: rows cost); the drafter's pass adds draft_seconds."""
    verify = {k: 1 + 0.5 * k for k in LENGTHS}
    return StepCosts("test", {1: {k: v + (draft_seconds if k > 1 else 0) for k, v in verify.items()}}, {1: verify})


def trusted_policy() -> VerifyLengthPolicy:
    """A policy whose greedy suffix drafts from long matches (16-31 tokens) were always accepted."""
    policy = VerifyLengthPolicy(BLOCK, costs_where_the_drafter_costs(0.5))
    for _ in range(300):
        policy.suffix["greedy", match_bucket(20)].observe(accepted=15, reached=15)
    return policy


def test_each_row_takes_the_source_expected_to_pay_most():
    policy = trusted_policy()
    weak_drafter = expected_tokens([0.1] * 15, LENGTHS, 100)
    sure = policy.suffix_expected("greedy", SamplingStats(), SuffixDraft(list(range(15)), [1.0] * 15, 20), 100)
    unsure = policy.suffix_expected("greedy", SamplingStats(), SuffixDraft([7], [0.2], 1), 100)
    # a sure suffix draft and a weak drafter: no drafter pass, the full block of the suffix draft
    plan = policy.choose([weak_drafter, weak_drafter], [sure, None])
    assert (plan.k, plan.drafted, plan.suffix_rows) == (16, False, frozenset({0}))
    # nothing worth verifying: plain decoding
    plan = policy.choose([weak_drafter], [unsure])
    assert (plan.k, plan.drafted, plan.suffix_rows) == (1, False, frozenset())
    # a good drafter for one row, a sure suffix draft for the other: both sources in one step
    good_drafter = expected_tokens([0.95] * 15, LENGTHS, 100)
    plan = policy.choose([weak_drafter, good_drafter], [sure, None])
    assert plan.drafted and plan.k == 16 and plan.suffix_rows == frozenset({0})
    # a request about to end gets no more drafts than it may emit
    short = policy.suffix_expected("greedy", SamplingStats(), SuffixDraft(list(range(15)), [1.0] * 15, 20), 3)
    assert short[16] == short[4] == pytest.approx(3, abs=0.05)


def test_suffix_estimates_are_learned_by_match_length_and_request():
    policy = VerifyLengthPolicy(BLOCK, costs_where_the_drafter_costs(0.5))
    draft = SuffixDraft(list(range(15)), [1.0] * 15, 1)  # a one-token match sure of itself: often wrong
    long_match = SuffixDraft(list(range(15)), [1.0] * 15, 24)
    fresh = policy.suffix_expected("greedy", SamplingStats(), draft, 100)[16]
    assert fresh > 5  # no data yet: the benefit of the doubt
    for _ in range(200):
        policy.suffix["greedy", match_bucket(1)].observe(accepted=0, reached=1)
    assert policy.suffix_expected("greedy", SamplingStats(), draft, 100)[16] < 1.1
    assert policy.suffix_expected("greedy", SamplingStats(), long_match, 100)[16] == fresh  # other lengths untouched
    assert policy.suffix_expected("exact", SamplingStats(), draft, 100)[16] == fresh  # other acceptance kinds too
    # a request whose own suffix drafts were all accepted trusts them again
    trusting = SamplingStats(suffix_accepted_by_position=[40] * 15, suffix_reached_by_position=[40] * 15)
    assert policy.suffix_expected("greedy", trusting, draft, 100)[16] > 5
    # where the earlier occurrences disagree, the draft's own estimate lowers it
    split = SuffixDraft(list(range(15)), [0.5 ** (j + 1) for j in range(15)], 24)
    assert policy.suffix_expected("greedy", SamplingStats(), split, 100)[16] < 2


# -- the engine ------------------------------------------------------------------------------------

def test_repeating_text_is_drafted_without_the_drafter_and_stays_lossless(tiny):
    """A prompt that holds the answer's text: the target's greedy answer quotes itself (a random tiny model
    falls into loops) and the engine verifies suffix drafts, token-identical to plain decoding, greedy and
    seeded; with suffix drafts off it never does."""
    target, drafter = load_pair(tiny)
    params = [SamplingParams(max_new_tokens=60), SamplingParams(max_new_tokens=60, temperature=0.8, seed=5)]
    prompts = [PROMPTS[0] * 3, PROMPTS[1] * 3]
    plain = [s.output_ids for s in SpeculativeEngine(target, block_size=1, max_batch_size=2).generate(prompts, params)]
    engine = SpeculativeEngine(target, drafter, max_batch_size=2)
    seqs = engine.generate(prompts, params)
    assert [s.output_ids for s in seqs] == plain
    assert seqs[0].stats.sources.steps["suffix"] > 0 and seqs[0].stats.sources.accepted["suffix"] > 0
    off = SpeculativeEngine(target, drafter, max_batch_size=2, suffix_drafts=False).generate(prompts, params)
    assert [s.output_ids for s in off] == plain and not any(s.stats.sources.steps["suffix"] for s in off)


def test_an_earlier_answer_is_drafted_for_a_later_request_only_where_asked(tiny):
    """The same question twice: with a shared store, the second answer is drafted from the first (it is the same
    text) and verified, token-identical to plain decoding; without one (the default), nothing crosses requests."""
    target, drafter = load_pair(tiny)
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True)]
    plain = SpeculativeEngine(target, block_size=1).generate([PROMPTS[2]], params)[0].output_ids
    again = {}
    for shared in (0, 4096):
        engine = SpeculativeEngine(target, drafter, max_batch_size=2, shared_suffix_tokens=shared)
        first, again[shared] = (engine.generate([PROMPTS[2]], params)[0] for _ in range(2))
        assert first.output_ids == again[shared].output_ids == plain
    assert engine.shared_responses.held == 2 * len(plain)
    own, across = (again[shared].stats.sources.accepted["suffix"] for shared in (0, 4096))
    assert across >= len(plain) // 2 > own, (own, across)  # 42 and 3 of 60 when written
    assert SpeculativeEngine(target, drafter, max_batch_size=2).shared_responses is None
