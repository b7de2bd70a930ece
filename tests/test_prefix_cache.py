"""Paged KV, the prefix cache, chunked prefill and preemption (#39): the block manager's bookkeeping, and the
engine's output through all of them token-identical to plain decoding, with the drafts a cold request gets."""
from __future__ import annotations

import pytest

from conftest import BLOCK, PROMPTS, load_pair
from dflash_runtime import DFlashError, SamplingParams, SpeculativeEngine
from dflash_runtime import block_manager as block_manager_module
from dflash_runtime.block_manager import BlockManager
from test_verify_length import mixed_requests

NEW = 40
SHARED = list(range(30, 70))  # a 40-token "system prompt" that several requests begin with
FAMILY = [SHARED + [3, 17, 99], SHARED + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], SHARED,
          SHARED[:20] + [88, 89]]


def plain(target, prompts, params) -> list[list[int]]:
    engine = SpeculativeEngine(target, block_size=1, max_batch_size=4, prefix_caching=False)
    return [s.output_ids for s in engine.generate(prompts, params)]


def test_blocks_are_found_by_their_chained_hash_and_their_tokens():
    blocks = BlockManager(num_blocks=1 + 6, block_size=4)
    table, hashes = [], []
    tokens = list(range(10))
    assert blocks.admit(table, hashes, tokens, reserve=12) == 0 and len(table) == 3
    blocks.cache_full_blocks(table, hashes, tokens, written=10)  # two full blocks
    assert len(hashes) == 2 and len(blocks.cached) == 2
    other, other_hashes = [], []
    assert blocks.admit(other, other_hashes, list(range(9)) + [50], reserve=12) == 8  # both blocks shared
    assert other[:2] == table[:2] and [blocks.blocks[b].ref_count for b in table[:2]] == [2, 2]
    # a different first block changes every later hash: nothing matches
    assert blocks._match([99] + list(range(1, 10))) == []
    blocks.release(other)
    blocks.release(table)
    assert blocks.num_free == 6 and len(blocks.cached) == 2  # freed, still findable
    assert len(blocks._match(tokens)) == 2
    assert blocks.queried_tokens == 20 and blocks.hit_tokens == 8


def test_a_hash_collision_is_never_a_hit(monkeypatch):
    monkeypatch.setattr(block_manager_module, "chain_hash", lambda previous, token_ids: 7)  # every block collides
    blocks = BlockManager(num_blocks=1 + 4, block_size=2)
    table, hashes = [], []
    blocks.admit(table, hashes, [1, 2, 3], reserve=4)
    blocks.cache_full_blocks(table, hashes, [1, 2, 3, 4], written=4)
    assert len(blocks._match([1, 2])) == 1 and blocks._match([5, 6]) == []  # same hash, other tokens


def test_freed_blocks_are_reused_least_recently_freed_first_and_evicted_then():
    blocks = BlockManager(num_blocks=1 + 4, block_size=2)
    first, first_hashes = [], []
    blocks.admit(first, first_hashes, [1, 2, 3, 4], reserve=4)
    blocks.cache_full_blocks(first, first_hashes, [1, 2, 3, 4], written=4)
    blocks.release(first)
    second, second_hashes = [], []
    assert blocks.admit(second, second_hashes, [9, 9, 9], reserve=6) == 0  # the 2 never-used blocks, then 1 cached
    assert len(blocks._match([1, 2, 3, 4])) == 1  # the evicted one was [3, 4]: the end goes first
    assert blocks.grow(second, 8) and not blocks.grow(second, 10)
    assert blocks._match([1, 2]) == [] and blocks.num_free == 0


@pytest.mark.parametrize("block_size", [1, BLOCK, "auto"])
def test_prefix_hits_are_lossless_and_keep_the_drafts(tiny, block_size):
    """Requests sharing a prefix, full and partial, greedy and sampled, in mixed batches: the output is plain
    decoding's, and a request served from a hit speculates exactly as it did cold (same acceptance lengths:
    the drafter's context came back with the target's keys)."""
    target, drafter = load_pair(tiny)
    params = mixed_requests()
    reference = plain(target, FAMILY, params)
    cold = SpeculativeEngine(target, drafter, block_size=block_size, max_batch_size=4, prefix_caching=False)
    cold_seqs = [cold.generate([p], [sp])[0] for p, sp in zip(FAMILY, params)]  # one at a time: no batching effect
    engine = SpeculativeEngine(target, drafter, block_size=block_size, max_batch_size=4)
    first = engine.generate(FAMILY[:1], params[:1])[0]
    hits = [engine.generate([p], [sp])[0] for p, sp in zip(FAMILY, params)]
    assert first.num_cached_tokens == 0
    assert [s.num_cached_tokens for s in hits] == [32, 32, 32, 16]  # 39 / 39 / 39 / 21 cacheable prompt tokens
    assert [s.output_ids for s in hits] == reference
    if block_size != "auto":  # auto's choices depend on what it has learnt, which the first request changed
        assert [s.stats.acceptance_lengths for s in hits] == [s.stats.acceptance_lengths for s in cold_seqs]
    together = engine.generate(FAMILY, params)  # hits inside one batch
    assert [s.output_ids for s in together] == reference


def test_a_second_turn_hits_the_first_turns_answer(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    first = engine.generate([PROMPTS[2]], params)[0]
    history = first.prompt_ids + first.output_ids
    second = engine.generate([history + [5, 6, 7]], params)[0]
    # the whole answer but its newest token at least (a step cut by max_tokens wrote that one's K/V too)
    assert second.num_cached_tokens >= (len(history) - 1) // 16 * 16
    assert second.output_ids == plain(target, [history + [5, 6, 7]], [params])[0]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_is_lossless_beside_decoding_sequences(tiny, chunk):
    """A long prompt that arrives while others decode prefills chunk by chunk beside them (the first prompts, with
    nobody decoding yet, prefill whole)."""
    target, drafter = load_pair(tiny)
    params = mixed_requests()
    prompts = FAMILY[:3] + [list(range(1, 120))]
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4, prefill_chunk=chunk)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], params)]
    engine.step()
    assert all(s.output_ids for s in seqs)
    long = engine.add_request(prompts[3], params[3])
    beside = []  # the long prompt's progress in each step that also decoded another sequence
    while engine.has_unfinished():
        before = long.num_computed
        others = any(s is not long and not s.prefilling for s in engine.scheduler.running)
        engine.step()
        if others and long.prefilling and long.num_computed > before:
            beside.append(long.num_computed - before)
    assert [s.output_ids for s in seqs + [long]] == plain(target, prompts, params)
    assert beside and max(beside) <= chunk
    if chunk < 64:  # several chunks beside the decoding sequences
        assert len(beside) >= 2


def test_a_burst_fills_the_batch_while_prompts_longer_than_a_chunk_prefill(tiny):
    """Twelve requests at once on four places, prompts of 40 tokens, 16 prefilled per step while others decode: the
    places fill as they free (admission by places and blocks, not by the step's prefill budget) and, with nobody
    decoding, a step prefills whole prompts, so the batch decodes full while requests wait. Outputs: plain
    decoding's."""
    target, drafter = load_pair(tiny)
    prompts = [[(5 * i + j) % 120 for j in range(40)] for i in range(12)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 12
    engine = SpeculativeEngine(target, drafter, block_size=1, max_batch_size=4, prefill_chunk=16)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    decoding = []
    while engine.has_unfinished():
        waiting = engine.occupancy().waiting
        engine.step()
        if waiting:
            decoding.append(engine.last_verify_length is not None and
                            sum(not s.prefilling for s in engine.scheduler.running))
    assert [s.output_ids for s in seqs] == plain(target, prompts, params)
    assert sum(decoding) / len(decoding) >= 3.5, decoding  # of 4 places; 2.7 when admission waited for the budget


def test_preemption_under_a_small_budget_loses_and_changes_nothing(tiny):
    """Eight requests on KV memory for about three: sequences are preempted and recomputed (their cached blocks
    hit when they come back), and every output is plain decoding's."""
    target, drafter = load_pair(tiny)
    params = mixed_requests() * 2
    prompts = FAMILY + PROMPTS
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=8, kv_cache_tokens=16 * 16)
    seqs = engine.generate(prompts, params)
    assert [s.output_ids for s in seqs] == plain(target, prompts, params)
    assert engine.occupancy().preemptions > 0 and sum(s.preemptions for s in seqs) == engine.occupancy().preemptions
    assert engine.occupancy().used_blocks == 0


def test_sixty_four_streams_on_a_small_budget_queue_or_are_preempted_and_lose_nothing(tiny):
    """64 requests at once, 16 in the batch, KV memory for about 5 of them: the pool is exhausted all along; every
    request finishes with plain decoding's tokens, the waiting ones queued, the growing ones preempted."""
    target, drafter = load_pair(tiny)
    prompts = [[(7 * i + j) % 120 for j in range(5 + i % 30)] for i in range(64)]
    params = [SamplingParams(max_new_tokens=8 + i % 5, ignore_eos=True, temperature=0.9 * (i % 2), seed=i)
              for i in range(64)]
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=16, kv_cache_tokens=24 * 16)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    waiting = []
    while engine.has_unfinished():
        engine.step()
        waiting.append(engine.occupancy().waiting)
    assert [s.output_ids for s in seqs] == plain(target, prompts, params)
    assert all(s.finish_reason == "length" for s in seqs) and max(waiting) > 48
    assert engine.occupancy().preemptions > 0 and engine.occupancy().used_blocks == 0


def test_the_budget_bounds_the_context_and_refuses_what_never_fits(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_context=4096, kv_cache_tokens=160)
    assert engine.max_context == 160 - BLOCK
    with pytest.raises(DFlashError, match="prompt has 150 tokens; the context limit is 144 .*KV cache holds 160 tokens"):
        engine.add_request(list(range(150)), SamplingParams())
    with pytest.raises(DFlashError, match="cannot hold a sequence"):
        SpeculativeEngine(target, drafter, block_size=BLOCK, kv_cache_tokens=16)
    with pytest.raises(DFlashError, match="prefill chunk"):
        SpeculativeEngine(target, drafter, block_size=BLOCK, prefill_chunk=0)


def test_a_cancelled_sequence_frees_its_blocks_and_keeps_its_full_ones_cached(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    seq = engine.add_request(PROMPTS[2], params)
    engine.step()
    engine.step()
    engine.cancel(seq)
    assert engine.occupancy().used_blocks == 0 and not seq.block_table
    again = engine.generate([PROMPTS[2]], params)[0]
    assert again.num_cached_tokens == 32 and again.output_ids == plain(target, [PROMPTS[2]], [params])[0]
