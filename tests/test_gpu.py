"""Checks that need a CUDA GPU; skipped elsewhere. On a GPU machine: `pytest tests/test_gpu.py -v`."""
from __future__ import annotations

import pytest
import torch

from conftest import BLOCK, PROMPTS
from dflash_runtime import SamplingParams, SpeculativeEngine, load_drafter, load_target
from dflash_runtime.config import RopeConfig
from dflash_runtime.kv_injection import kv_injection_reference
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


def test_engine_on_cuda_is_lossless(tiny):
    """DFlash on the GPU (KV injection through the Triton kernel) = autoregressive decoding on the GPU."""
    target = load_target(tiny[0], device="cuda")
    drafter = load_drafter(tiny[1], target.config, device="cuda")
    params = SamplingParams(max_new_tokens=32)
    dflash = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4).generate(PROMPTS, params)
    plain = SpeculativeEngine(target, block_size=1, max_batch_size=4).generate(PROMPTS, params)
    assert [s.output_ids for s in dflash] == [s.output_ids for s in plain]
    assert max(a for s in dflash for a in s.stats.acceptance_lengths) > 1
