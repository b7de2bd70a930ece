"""What an engine holds and what it learns from: no autograd history (its memory stays flat engine after
engine), one clock for prefills and steps, no cost learnt from a step that stalled on a capture."""
from __future__ import annotations

import gc

import torch

from conftest import BLOCK, PROMPTS, load_pair
from dflash_runtime import SamplingParams, SpeculativeEngine
from dflash_runtime import engine as engine_module


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def cache_mib(engine: SpeculativeEngine) -> float:
    caches = [engine.target_cache, engine.draft_cache]
    return sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v)) / 2 ** 20


def test_an_auto_engine_holds_no_autograd_history(tiny):
    """Block size auto profiles its steps when it starts; nothing it runs may record autograd history (which
    kept every profiled pass's activations alive as long as the caches: ~6x the caches on this target)."""
    target, drafter = load_pair(tiny)
    assert not any(p.requires_grad for model in (target, drafter) for p in model.parameters())
    engine = SpeculativeEngine(target, drafter, max_batch_size=8)
    assert engine.policy is not None  # it did profile
    for cache in (engine.target_cache, engine.draft_cache):
        assert not cache.k.requires_grad and cache.k.grad_fn is None
        assert not cache.v.requires_grad and cache.v.grad_fn is None
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    assert engine.target_cache.k.grad_fn is None


def test_engines_built_one_after_another_add_only_their_caches(tiny):
    """Resident memory per engine kept alive (after a first one warms the allocator): its caches and a little
    more. Before the fix each auto engine held ~60 MB of profiled activations beside 10 MB of caches."""
    target, drafter = load_pair(tiny)
    engines = [SpeculativeEngine(target, drafter, max_batch_size=8)]
    gc.collect()
    before = resident_mib()
    for _ in range(4):
        engines.append(SpeculativeEngine(target, drafter, max_batch_size=8))
    gc.collect()
    per_engine = (resident_mib() - before) / 4
    assert per_engine < cache_mib(engines[0]) + 8, (per_engine, cache_mib(engines[0]))


class RecordingClock(engine_module.StepClock):
    """The engine's own clock, remembering every interval it gave."""

    intervals_given: list[float] = []

    def intervals(self):
        values = super().intervals()
        RecordingClock.intervals_given += values
        return values


def test_prefill_is_timed_by_the_step_clock(tiny, monkeypatch):
    """On CUDA a host timer around a prefill measures only the launch of its kernels; the step clock (device
    events there) measures the work. A prefill's seconds must be the clock's."""
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=1)
    monkeypatch.setattr(engine_module, "StepClock", RecordingClock)
    RecordingClock.intervals_given = []
    seq = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=4))
    engine.step()  # the prefill, then one step
    prefill = engine.last_step_seconds["prefill"]
    assert prefill > 0 and prefill == RecordingClock.intervals_given[0]
    draft, verify = RecordingClock.intervals_given[1:3]
    assert seq.stats.verify_seconds == prefill + verify and seq.stats.draft_seconds == draft


def test_a_step_that_stalled_on_a_capture_teaches_the_cost_model_nothing(tiny):
    """A step that captured a CUDA graph (or timed the KV-injection kernel) ran slow once; observing it would
    make its verify length look slow for good. Here every first run of a (pass, R, k, length) counts as a
    capture, as it does on CUDA when a shape was not captured at start-up."""
    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, max_batch_size=4, static_shapes=True)
    seen, run = set(), engine.graphs.run

    def run_capturing_new_shapes(key, fn, *inputs):
        if key not in seen:
            seen.add(key)
            engine.graphs.captures += 1
        return run(key, fn, *inputs)

    engine.graphs.run = run_capturing_new_shapes
    observed, observe = [], engine.policy.costs.observe
    engine.policy.costs.observe = lambda b, k, s, drafted: observed.append((b, k)) or observe(b, k, s, drafted)
    stalled, speculate = [], engine._speculate

    def speculate_noting_stalls(batch, plan, suffix):
        captures = engine.graphs.captures
        chosen = speculate(batch, plan, suffix)
        stalled.append(engine.graphs.captures > captures)
        return chosen

    engine._speculate = speculate_noting_stalls
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    assert any(stalled) and not all(stalled)
    assert len(observed) == stalled.count(False)


def test_the_kv_injection_op_is_timed_at_start_up_for_every_token_count_served(tiny):
    """On CUDA the op times its kernel against the reference once per token bucket, a stall; the engine makes
    those timings when it starts, for every bucket that prefills, steps and deferred context then bring. Two long
    prompts prefilled in one pass (2 x 190 positions, past the largest bucket timed: 256) are injected in parts."""
    from dflash_runtime.kv_injection.op import token_bucket
    from test_verify_length import mixed_requests

    from dflash_runtime import drafter as drafter_module

    target, drafter = load_pair(tiny)
    engine = SpeculativeEngine(target, drafter, max_batch_size=3, static_shapes=True, max_context=200)
    counts, op = [], drafter_module.inject
    drafter_module.inject = lambda context, *rest: counts.append(len(context)) or op(context, *rest)
    try:
        engine._time_kv_injection()
        timed = {token_bucket(n) for n in counts}
        counts.clear()
        long_prompts = [[t % 120 for t in range(190)], [t % 110 for t in range(190)]]
        engine.generate(long_prompts + PROMPTS * 2, [SamplingParams(max_new_tokens=8)] * 2 + mixed_requests() * 2)
    finally:
        drafter_module.inject = op
    assert counts and {token_bucket(n) for n in counts} <= timed and max(timed) == 256
