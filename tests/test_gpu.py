"""Checks that need a CUDA GPU; skipped elsewhere. On a GPU machine: `pytest tests/test_gpu.py -v`."""
from __future__ import annotations

import pytest
import torch

from conftest import BLOCK, PROMPTS
from dflash_runtime import SamplingParams, SpeculativeEngine, load_drafter, load_target
from dflash_runtime.config import RopeConfig
from dflash_runtime.kv_injection import kv_injection_reference
from dflash_runtime.kv_injection.op import KERNEL_IS_FASTER
from test_kv_injection import SHAPES, new_cache, ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
def test_triton_kernel_on_the_gpu_matches_the_reference(shape, dtype, tolerance):
    from dflash_runtime.kv_injection.triton_kernel import kv_injection_triton

    hidden, kv_heads, head_dim, base = SHAPES[shape]
    batch = ragged_batch(hidden, kv_heads, head_dim, dtype)
    inv_freq = RopeConfig(base).inverse_frequencies(head_dim)
    reference = new_cache(kv_heads, head_dim, dtype)
    kv_injection_reference(batch["context"], batch["k_weight"], batch["v_weight"], batch["k_norm_weight"], inv_freq,
                           batch["positions"], batch["slots"], *reference, 1e-6)
    cuda = {k: v.cuda() for k, v in batch.items()}
    cache = [c.cuda() for c in new_cache(kv_heads, head_dim, dtype)]
    kv_injection_triton(cuda["context"], cuda["k_weight"], cuda["v_weight"], cuda["k_norm_weight"], inv_freq.cuda(),
                        cuda["positions"], cuda["slots"], *cache, 1e-6)
    for ours, ref in zip(cache, reference):
        assert ((ours.cpu().float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= tolerance


@pytest.mark.parametrize("batch_size", [1, 4])
def test_engine_on_cuda_is_lossless(tiny, batch_size):
    """DFlash on the GPU (CUDA graphs, KV injection through the Triton kernel) = autoregressive decoding on
    the GPU, greedy and sampled requests side by side; the graphs were really captured. In float32: in
    bfloat16 a verify pass of k tokens and k single-token steps round differently, so a near-tie may go
    either way (for any speculative decoder); bfloat16 runs in gpu_check's timings."""
    from test_verify_length import mixed_requests

    target = load_target(tiny[0], device="cuda")
    drafter = load_drafter(tiny[1], target.config, device="cuda")
    params = mixed_requests()
    engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=batch_size)
    dflash = engine.generate(PROMPTS, params)
    plain = SpeculativeEngine(target, block_size=1, max_batch_size=batch_size).generate(PROMPTS, params)
    assert [s.output_ids for s in dflash] == [s.output_ids for s in plain]
    assert max(a for s in dflash for a in s.stats.acceptance_lengths) > 1
    assert engine.static_shapes and engine.graphs.capture and engine.graphs.graphs
    assert KERNEL_IS_FASTER  # the op timed the kernel against the reference for the shapes it saw


def test_cuda_graphs_equal_eager_steps_and_auto(tiny):
    """The same requests through captured graphs, eager compact steps and block size auto: one output."""
    from test_verify_length import mixed_requests

    target = load_target(tiny[0], device="cuda")
    drafter = load_drafter(tiny[1], target.config, device="cuda")
    runs = [SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=3, static_shapes=False),
            SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=3),
            SpeculativeEngine(target, drafter, max_batch_size=3)]
    outputs = [[s.output_ids for s in engine.generate(PROMPTS * 2, mixed_requests() * 2)] for engine in runs]
    assert outputs[0] == outputs[1] == outputs[2]
    assert not runs[0].graphs.graphs and runs[1].graphs.graphs

