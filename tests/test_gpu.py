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


def test_gumbel_kernel_on_the_gpu_takes_the_cpu_argmax():
    """The Gumbel-max kernel on CUDA picks the token the eager path picks on the CPU, over a Qwen3-sized
    vocabulary (an ulp of difference in the logs could move only a near-tie, unlikely in 64 random rows)."""
    from dflash_runtime.gumbel_kernel import gumbel_argmax_triton
    from dflash_runtime.counter_noise import position_keys
    from dflash_runtime.sampling import GumbelNoise

    torch.manual_seed(0)
    rows, vocab = 64, 151936
    scores = torch.randn(rows, 1, vocab) * 3
    seeds = torch.randint(0, 2 ** 32, (rows, 2))
    positions = torch.arange(rows)[:, None] + 500
    eager = GumbelNoise(seeds, positions, vocab).argmax(scores, 2.0)[:, 0]
    kernel = gumbel_argmax_triton(scores[:, 0].cuda(), position_keys(seeds, positions).cuda()[:, 0], 2.0)
    assert torch.equal(kernel.cpu(), eager)


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



def test_graphs_are_captured_at_start_up_and_only_then(tiny):
    """Every graph a step can need exists when the engine is built (the count its graph_keys plans, outputs
    shared per pass), and serving mixed requests under block size auto captures nothing more."""
    from test_verify_length import mixed_requests

    target = load_target(tiny[0], device="cuda")
    drafter = load_drafter(tiny[1], target.config, device="cuda")
    engine = SpeculativeEngine(target, drafter, max_batch_size=4)
    planned = engine.graph_keys()
    assert set(engine.graphs.graphs) == set(planned) and engine.graphs.report.graphs == len(planned)
    assert engine.graphs.report.pool_bytes > 0 and engine.graphs.report.seconds > 0
    assert {name for name, _ in engine.graphs.buffers} == {"draft", "verify"}  # one set of outputs per pass
    captures, timings = engine.graphs.captures, len(KERNEL_IS_FASTER)
    engine.generate(PROMPTS * 3, mixed_requests() * 3)
    assert engine.graphs.captures == captures and len(KERNEL_IS_FASTER) == timings


def test_attention_runs_on_a_fused_sdpa_kernel_in_bfloat16(tiny):
    """Prefill, decode, verify and draft attention each dispatch to flash, memory-efficient or cuDNN attention,
    never the math kernel (bf16 upcast to float32, K/V expanded per head)."""
    from dflash_runtime.layers import AttentionMask

    target = load_target(tiny[0], dtype=torch.bfloat16, device="cuda")
    drafter = load_drafter(tiny[1], target.config, dtype=torch.bfloat16, device="cuda")
    found, attend = {}, AttentionMask.attend

    def recording(mask, q, k, v):
        kind = "prefill" if mask.visible is None else "decode" if q.shape[2] == 1 else "block"
        found.setdefault(kind, set()).add(mask.backend(q, k, v))
        return attend(mask, q, k, v)

    AttentionMask.attend = recording
    try:
        engine = SpeculativeEngine(target, drafter, max_batch_size=4)
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=16))
    finally:
        AttentionMask.attend = attend
    assert set(found) == {"prefill", "decode", "block"}
    assert all("MATH" not in names for names in found.values()), found


def test_bounds_checks_run_inside_captured_graphs(tiny):
    """DFLASH_CHECK_BOUNDS=1 on CUDA: the engine captures its graphs (the check asserts on the device there)
    and stays lossless."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.dirname(__file__)!r}, {os.path.dirname(os.path.dirname(__file__))!r}]
        from conftest import BLOCK, PROMPTS
        from dflash_runtime import SamplingParams, SpeculativeEngine, load_drafter, load_target
        target = load_target({str(tiny[0])!r}, device="cuda")
        drafter = load_drafter({str(tiny[1])!r}, target.config, device="cuda")
        params = SamplingParams(max_new_tokens=24)
        engine = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=2)
        dflash = [s.output_ids for s in engine.generate(PROMPTS, params)]
        plain = SpeculativeEngine(target, block_size=1, max_batch_size=2).generate(PROMPTS, params)
        plain = [s.output_ids for s in plain]
        print("graphs", len(engine.graphs.graphs), "identical", dflash == plain)
    """)
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DFLASH_CHECK_BOUNDS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert "identical True" in run.stdout and "graphs 0" not in run.stdout, run.stderr[-2000:]


def test_guided_decoding_on_cuda_is_lossless(tiny):
    """Grammar masks applied on the GPU (xgrammar's CUDA path), CUDA graphs on: guided DFlash = guided plain
    decoding on CUDA, greedy and seeded (float32), and every answer that stopped matches its guide."""
    pytest.importorskip("xgrammar")
    from test_guided_decoding import EOS, GUIDES, compiler, decode, matches, requests

    target = load_target(tiny[0], device="cuda")
    drafter = load_drafter(tiny[1], target.config, device="cuda")
    for guide in GUIDES:
        runs = [[(s.output_ids, s.finish_reason) for s in SpeculativeEngine(
            target, drafter, block_size=block_size, max_batch_size=4, grammars=compiler()).generate(
            PROMPTS + PROMPTS[:1], requests(guide))[:3]] for block_size in (1, BLOCK)]
        assert runs[0] == runs[1]
        for output, reason in runs[1]:
            assert reason == "length" or (output[-1] == EOS and matches(guide, decode(output[:-1])))
