"""Losslessness and scheduling of the speculative engine on tiny targets (Qwen3 and Llama-3.1 style)."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import BLOCK, EOS, PROMPTS, VOCAB, hf_greedy, load_pair
from dflash_runtime import DFlashError, SamplingParams, SpeculativeEngine
from dflash_runtime.block_manager import BlockManager
from dflash_runtime.scheduler import Scheduler
from dflash_runtime.sequence import Sequence, Status

NEW = 48
_reference: dict = {}


def reference(pair) -> list[list[int]]:
    key = str(pair[0])
    if key not in _reference:
        _reference[key] = [hf_greedy(pair[0], p, NEW) for p in PROMPTS]
    return _reference[key]


@pytest.mark.parametrize("block_size", [1, 4, BLOCK])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_is_token_identical_to_transformers(tiny, block_size, batch_size):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=block_size, max_batch_size=batch_size)
    seqs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    assert [s.output_ids for s in seqs] == reference(tiny)
    lengths = [a for s in seqs for a in s.stats.acceptance_lengths]
    assert all(1 <= a <= block_size for a in lengths)
    if block_size == BLOCK:
        # the trained tiny drafter must really be accepted (and sometimes rejected), or this proves little
        assert max(lengths) >= 8 and min(lengths) < BLOCK, lengths


def test_stop_token_inside_an_accepted_block(tiny):
    target, drafter = load_pair(tiny)
    ref = reference(tiny)
    # a token the greedy output emits late: generation must end right after its first occurrence
    out, stop = next((r, r[len(r) // 2]) for r in ref if len(r) == NEW)
    cut = out.index(stop) + 1
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK)
    seq = engine.generate([PROMPTS[ref.index(out)]], SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,)))[0]
    assert seq.output_ids == out[:cut]
    assert seq.finish_reason == "stop"


@pytest.mark.parametrize("block_size", [BLOCK, "auto"])
def test_min_tokens_hold_stops_back_losslessly(tiny, block_size):
    """Before min_new_tokens, a stop token is never chosen (TensorRT-LLM's min_length) and stop strings wait: the
    output is the target's own decoding under that rule, so plain decoding and speculation agree."""
    target, drafter = load_pair(tiny)
    ref = reference(tiny)
    out = next(r for r in ref if len(r) == NEW)
    stop = out[1]  # emitted early: without min_new_tokens generation ends at index 1
    prompt = PROMPTS[ref.index(out)]
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW // 2, stop_token_ids=(stop,), ignore_eos=True)
    plain = SpeculativeEngine(target, block_size=1).generate([prompt], params)[0]
    speculative = SpeculativeEngine(target, drafter, block_size=block_size).generate([prompt], params)[0]
    assert speculative.output_ids == plain.output_ids
    assert len(plain.output_ids) > NEW // 2 and stop not in plain.output_ids[:NEW // 2]
    assert plain.output_ids[:2] != out[:2]  # the stop token was held back where greedy chose it
    if stop in plain.output_ids:  # once allowed, it stops as usual
        assert plain.finish_reason == "stop" and plain.output_ids[-1] == stop
    unbounded = SpeculativeEngine(target, drafter, block_size=block_size).generate(
        [prompt], SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert unbounded.output_ids == out[:out.index(stop) + 1]


def test_eos_stops_unless_ignored(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK)
    for prompt, ref in zip(PROMPTS, reference(tiny)):
        seq = engine.generate([prompt], SamplingParams(max_new_tokens=NEW))[0]
        assert seq.finish_reason == ("stop" if EOS in ref else "length")
        ignored = engine.generate([prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0]
        assert len(ignored.output_ids) == NEW and ignored.output_ids[:len(ref)] == ref


def test_continuous_batching_equals_solo_runs(tiny):
    """More requests than slots, different lengths and limits: requests join as others leave."""
    target, drafter = load_pair(tiny)
    prompts = PROMPTS + [[1, 2, 3], list(range(60, 90))]
    params = [SamplingParams(max_new_tokens=n) for n in (40, 7, 33, 48, 12, 25)]
    batched = SpeculativeEngine(target, drafter, block_size=8, max_batch_size=3).generate(prompts, params)
    solo = SpeculativeEngine(target, drafter, block_size=8, max_batch_size=1)
    for seq, prompt, p in zip(batched, prompts, params):
        assert seq.output_ids == solo.generate([prompt], p)[0].output_ids


def test_length_limits(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_context=20)
    seq = engine.generate([list(range(10, 22))], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert seq.num_tokens == 20 and seq.finish_reason == "length"
    seq = engine.generate([[4, 5]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert len(seq.output_ids) == 5 and seq.finish_reason == "length"


def test_a_step_that_prefills_and_finishes_a_sequence_finishes_it_once(tiny):
    # a step prefills (first token) and then verifies (second); only the second output ends the sequence, or a
    # caller that pops finished sequences pops it twice (drafter_data did, on an H200, after 3,205 answers)
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK)
    seq = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    outputs = engine.step()
    assert [(o.sequence, o.finished, len(o.new_token_ids)) for o in outputs] == [(seq, False, 1), (seq, True, 1)]


def test_cancel_frees_the_slot_and_spares_the_others(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=2)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    keep, drop = engine.add_request(PROMPTS[0], params), engine.add_request(PROMPTS[1], params)
    engine.step()
    engine.cancel(drop)
    assert drop.finish_reason == "cancelled" and engine.occupancy().free_slots == 1
    waiting = engine.add_request(PROMPTS[2], params)
    while engine.has_unfinished():
        engine.step()
    solo = SpeculativeEngine(target, drafter, block_size=BLOCK)
    assert keep.output_ids == solo.generate([PROMPTS[0]], params)[0].output_ids
    assert waiting.output_ids == solo.generate([PROMPTS[2]], params)[0].output_ids
    occupancy = engine.occupancy()
    assert (occupancy.running, occupancy.waiting, occupancy.free_slots, occupancy.used_blocks) == (0, 0, 2, 0)
    assert occupancy.free_blocks == engine.block_manager.num_blocks


def test_scheduler_admits_by_blocks_and_frees_them():
    """A sequence joins while the batch has room and free blocks cover its prompt and one draft block; finishing
    in "prefill" hands its blocks to the next in line at once; finishing or cancelling gives them back."""
    blocks = BlockManager(num_blocks=1 + 4, block_size=4, prefix_caching=False)
    scheduler = Scheduler(max_running=3, blocks=blocks, lookahead=2)
    first, second, third = (Sequence([1, 2, 3, 4, 5], SamplingParams()) for _ in range(3))  # 5 + 2 positions: 2 blocks
    for seq in (first, second, third):
        scheduler.add(seq)
    admitted = []
    for seq in scheduler.admit():
        admitted.append(seq)
        if seq is first:
            scheduler.finish(seq, "length")
    assert admitted == [first, second, third] and not first.block_table and first.finish_reason == "length"
    assert second.block_table == [3, 4] and third.block_table == [2, 1]  # then first's, its last block first
    occupancy = scheduler.occupancy()
    assert (occupancy.running, occupancy.free_slots, occupancy.used_blocks, occupancy.free_blocks) == (2, 1, 4, 0)
    assert occupancy.kv_cache_utilization == 1.0 and occupancy.token_capacity == 16
    waiting = Sequence([4], SamplingParams())
    scheduler.add(waiting)
    assert list(scheduler.admit()) == []  # no free block: it waits
    scheduler.finish(waiting, "cancelled")
    scheduler.finish(second, "cancelled")
    assert waiting.status is second.status is Status.FINISHED and blocks.num_free == 2
    assert scheduler.has_unfinished() and scheduler.occupancy().waiting == 0
    scheduler.finish(third, "stop")
    assert not scheduler.has_unfinished() and blocks.num_free == 4


def test_bad_requests_are_rejected_clearly(tiny):
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, max_context=16)
    cases = {
        "empty prompt": lambda: engine.add_request([], SamplingParams()),
        "context limit": lambda: engine.add_request(list(range(16)), SamplingParams()),
        "outside the vocabulary": lambda: engine.add_request([1, VOCAB + 5], SamplingParams()),
        "stop strings need a tokenizer": lambda: engine.add_request([1], SamplingParams(stop_strings=("x",))),
        "block size must be >= 1": lambda: SpeculativeEngine(target, drafter, block_size=0),
        "larger than the drafter supports": lambda: SpeculativeEngine(target, drafter, block_size=BLOCK + 1),
        "needs a drafter": lambda: SpeculativeEngine(target, None, block_size=4),
        "top_p": lambda: SamplingParams(top_p=0),
        "top_p must": lambda: SamplingParams(top_p=1.5),
        "temperature": lambda: SamplingParams(temperature=-0.1),
        "top_k": lambda: SamplingParams(top_k=-1),
        "max_new_tokens": lambda: SamplingParams(max_new_tokens=0),
    }
    for message, make in cases.items():
        with pytest.raises(DFlashError, match=message):
            make()
    assert not engine.has_unfinished()


def test_thread_split_linears_stay_token_identical(tiny, monkeypatch):
    """On a multi-core CPU a linear may run as a row-split batched GEMM: still the target's greedy output."""
    from dflash_runtime.cpu_linears import ThreadSplitLinear

    monkeypatch.setenv("DFLASH_CPU_LINEAR", "split")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        target, drafter = load_pair(tiny)
        assert isinstance(target.lm_head, ThreadSplitLinear)
        assert isinstance(drafter.layers[0].mlp.gate_up, ThreadSplitLinear)
        seqs = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4).generate(
            PROMPTS, SamplingParams(max_new_tokens=NEW))
    finally:
        torch.set_num_threads(threads)
    assert [s.output_ids for s in seqs] == reference(tiny)


def test_cpu_linear_paths_are_measured_once_per_host(tiny, monkeypatch, tmp_path):
    """By default each weight shape is timed both ways at one row and at several, on this host, and the choice
    cached under the host's signature: a second load measures nothing and takes the same paths."""
    from dflash_runtime import cpu_linears

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASH_CPU_LINEAR", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        target, _ = load_pair(tiny)
        cached = json.loads((tmp_path / "cpu_linears.json").read_text())
        assert list(cached) == [cpu_linears.host_signature()]
        linears = [m for m in target.modules() if isinstance(m, (torch.nn.Linear, cpu_linears.ThreadSplitLinear))]
        shapes = {f"{m.weight.shape[0]}x{m.weight.shape[1]} float32" for m in linears if not cpu_linears.is_fused_part(m)}
        assert shapes <= set(cached[cpu_linears.host_signature()])
        measured = []
        monkeypatch.setattr(cpu_linears, "measure_split", lambda *args: measured.append(args) or True)
        again, _ = load_pair(tiny)
        assert not measured and cpu_linears.describe(again) == cpu_linears.describe(target)
        monkeypatch.setenv("DFLASH_CPU_LINEAR", "plain")
        plain, _ = load_pair(tiny)
        assert "0/" in cpu_linears.describe(plain) and not any(
            isinstance(m, cpu_linears.ThreadSplitLinear) for m in plain.modules())
    finally:
        torch.set_num_threads(threads)
    assert "thread-split linears (2 threads)" in cpu_linears.describe(target)


def test_folded_query_groups_attend_as_grouped_query_attention():
    """CUDA's attention folds each K/V head's query group into the query axis (so a fused kernel takes the mask):
    the same attention as SDPA's enable_gqa for a prefill, a verify block and a draft block, here on a CPU."""
    from dflash_runtime import layers

    torch.manual_seed(0)
    heads, kv_heads, keys = 6, 2, 40
    k, v = torch.randn(3, kv_heads, keys, 16), torch.randn(3, kv_heads, keys, 16)
    starts = torch.tensor([0, 17, 30])
    block = starts[:, None] + torch.arange(5)
    verify = torch.arange(keys)[None, None, None, :] <= block[:, None, :, None]  # [3, 1, 5, L]
    draft = (torch.arange(keys)[None, :] < (starts + 5)[:, None])[:, None, None, :]  # [3, 1, 1, L]
    for visible in (verify, draft):
        q = torch.randn(3, heads, 5, 16)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        layers.FOLD_QUERY_GROUPS = True
        try:
            folded = layers.AttentionMask(visible, heads, kv_heads)
        finally:
            layers.FOLD_QUERY_GROUPS = None
        assert folded.fold and folded.visible.shape[2] == visible.shape[2] * (3 if visible.shape[2] > 1 else 1)
        torch.testing.assert_close(folded.attend(q, k, v), expected, rtol=1e-5, atol=1e-5)
    q, k, v = torch.randn(1, heads, keys, 16), torch.randn(1, kv_heads, keys, 16), torch.randn(1, kv_heads, keys, 16)
    causal = torch.ones(keys, keys, dtype=torch.bool).tril()[None, None]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    torch.testing.assert_close(layers.AttentionMask(None, heads, kv_heads).attend(q, k, v), expected)


@pytest.mark.parametrize("block_size", [BLOCK, "auto"])
def test_folded_query_groups_are_lossless(tiny, block_size, monkeypatch):
    """The engine with CUDA's folded attention, static shapes and padding rows, on a CPU: the target's own tokens."""
    from dflash_runtime import layers
    from test_verify_length import mixed_requests

    monkeypatch.setattr(layers, "FOLD_QUERY_GROUPS", True)
    target, drafter = load_pair(tiny)
    params = mixed_requests() * 2
    plain = SpeculativeEngine(target, block_size=1, max_batch_size=3, static_shapes=True).generate(PROMPTS * 2, params)
    engine = SpeculativeEngine(target, drafter, block_size=block_size, max_batch_size=3, static_shapes=True)
    seqs = engine.generate(PROMPTS * 2, params)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    monkeypatch.setattr(layers, "FOLD_QUERY_GROUPS", None)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in SpeculativeEngine(
        target, block_size=1, max_batch_size=3).generate(PROMPTS * 2, params)]
