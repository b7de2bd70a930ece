"""Chunked prefill paced by time (prefill_pacing.py): a step's prefill at most twice its decoding, within the chunk."""
from __future__ import annotations

from conftest import load_pair
from dflash_runtime import SamplingParams, SpeculativeEngine
from dflash_runtime.prefill_pacing import LEAST_TOKENS, PrefillPacing

LONG = [(7 * i) % 120 + 1 for i in range(150)]


def test_the_pace_keeps_a_steps_prefill_within_twice_its_decoding_and_the_chunk():
    """A prefill pass costs about a decoding step plus its tokens' share: the share may take one more step's time."""
    pacing = PrefillPacing(128)
    assert pacing.tokens() == 128  # nothing measured yet: the chunk
    pacing.decoded(0.010)  # a 10 ms decoding step
    assert pacing.tokens() == 128  # no prefill measured yet
    pacing.prefilled(16, 0.026)  # 16 prompt tokens in 26 ms: 1 ms each beyond the 10 of a pass (a CPU)
    assert pacing.tokens() == 10
    pacing.decoded(0.030)  # steps grow slowly (smoothed): 10 + 0.25 * 20 ms
    assert pacing.tokens() in (14, 15)
    gpu = PrefillPacing(128)
    gpu.decoded(0.003)
    gpu.prefilled(10, 0.0031)  # a short prompt costs a GPU about a decoding step: the chunk stays the cap
    assert gpu.tokens() == 128
    slow = PrefillPacing(128)
    slow.decoded(0.001)
    slow.prefilled(10, 1.0)
    assert slow.tokens() == LEAST_TOKENS  # a long prompt always gets in
    small = PrefillPacing(4)
    small.decoded(0.001)
    small.prefilled(10, 1.0)
    assert small.tokens() == 4  # a chunk below the least stays the chunk


def test_the_engine_prefills_what_the_pace_allows_beside_a_decoding_stream(tiny):
    """With a stream decoding, a long prompt's chunk is the pace's (set here: 10 ms / 0.5 ms = 20 tokens), not the
    engine's prefill_chunk of 64; outputs stay plain decoding's."""
    target, drafter = load_pair(tiny)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine = SpeculativeEngine(target, drafter, block_size=4, max_batch_size=2, prefill_chunk=64)
    stream = engine.add_request([5, 6, 7], params)
    engine.step()
    long = engine.add_request(LONG, params)
    engine.pacing.decode_seconds, engine.pacing.prefill_seconds_per_token = 0.010, 0.0005
    engine.step()
    assert long.num_computed == 20 and long.prefilling
    while engine.has_unfinished():
        engine.step()
    plain = SpeculativeEngine(target, None, block_size=1, max_batch_size=2).generate([[5, 6, 7], LONG],
                                                                                       [params, params])
    assert [stream.output_ids, long.output_ids] == [s.output_ids for s in plain]
