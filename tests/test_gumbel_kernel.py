"""The Gumbel-max Triton kernel (dflash_runtime/gumbel_kernel.py) against the eager path, under Triton's CPU
interpreter (TRITON_INTERPRET must be set before triton is imported: each check runs in a subprocess), and
compiled ahead of time for Hopper and Blackwell without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(HERE)

KERNEL_CHECK = textwrap.dedent("""
    import json, sys, torch
    sys.path[:0] = [{repo!r}]
    from dflash_runtime.gumbel_kernel import BLOCK_V, gumbel_argmax_triton
    from dflash_runtime.counter_noise import position_keys
    from dflash_runtime.sampling import GumbelNoise
    torch.manual_seed(0)
    n, t, vocab = 6, 4, 2 * BLOCK_V + 452  # a vocabulary of three blocks, the last one partial
    scores = torch.randn(n, t, vocab) * 3
    scores[scores < -4] = float("-inf")  # filtered tokens (top-k, top-p)
    seeds = torch.randint(0, 2 ** 32, (n, 2))
    positions = torch.arange(t).expand(n, t) + 100
    noise = GumbelNoise(seeds, positions, vocab)
    keys = position_keys(seeds, positions).reshape(-1)
    out = {{}}
    for scale in (1.0, 2.0, 4.0):
        kernel = gumbel_argmax_triton(scores.reshape(-1, vocab), keys, scale).view(n, t)
        out[str(scale)] = (kernel == (scores * scale + noise.values).argmax(-1)).all().item()
    out["all -inf"] = gumbel_argmax_triton(torch.full((2, vocab), float("-inf")), keys[:2], 1.0).tolist()
    out["no rows"] = gumbel_argmax_triton(torch.zeros(0, vocab), keys[:0], 1.0).tolist()
    print(json.dumps(out))
""")


def interpreted(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TRITON_INTERPRET": "1", **env})


def test_kernel_takes_the_eager_argmax_under_the_interpreter():
    """The same token as argmax(scores * scale + the eager noise) at every scale the engine uses (1 for samples,
    1/sharpness for proposals), with filtered tokens and a partial last block; all -inf rows give token 0 as
    torch.argmax does (rejection sampling's empty residual, replaced by the caller)."""
    run = interpreted(KERNEL_CHECK.format(repo=REPO))
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == {"1.0": True, "2.0": True, "4.0": True, "all -inf": [0, 0], "no rows": []}


ENGINE_RUNS = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{tests!r}, {repo!r}]
    from conftest import PROMPTS
    from dflash_runtime import SamplingParams, SpeculativeEngine, load_drafter, load_target
    target = load_target({target!r})
    drafter = load_drafter({drafter!r}, target.config)
    exact = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=3, ignore_eos=True)
    rejection = SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, seed=4, ignore_eos=True,
                               speculative_sampling="rejection")
    mixed = [exact, rejection, SamplingParams(max_new_tokens=24, ignore_eos=True), exact]
    for block_size in (1, 16):
        seqs = SpeculativeEngine(target, drafter if block_size > 1 else None, block_size=block_size,
                                 max_batch_size=4).generate(PROMPTS, mixed if block_size > 1 else exact)
        print(json.dumps([s.output_ids for s in seqs]))
""")


def test_engine_samples_through_the_kernel_as_it_does_eager(tiny):
    """Sampled decoding with every Gumbel-max in the kernel (the target's samples, the proposals and the rule
    they are judged by, the drafter's own samples and the residual draws of rejection sampling): the tokens of
    the eager path, and exact sampling's output is still plain decoding's at block 16 in a mixed batch."""
    code = ENGINE_RUNS.format(tests=HERE, repo=REPO, target=str(tiny[0]), drafter=str(tiny[1]))
    outputs = {}
    for implementation in ("triton", "eager"):
        run = interpreted(code, DFLASH_GUMBEL=implementation)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs[implementation] = [json.loads(line) for line in run.stdout.splitlines()]
    assert outputs["triton"] == outputs["eager"]
    plain, speculative = outputs["triton"]
    assert speculative[0] == plain[0] and speculative[3] == plain[3]


@pytest.mark.parametrize("arch", [90, 100])
def test_kernel_compiles_ahead_of_time_for_hopper_and_blackwell(arch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_runtime.gumbel_kernel import BLOCK_V, NUM_WARPS, gumbel_argmax_kernel
    from dflash_runtime.counter_noise import UNIFORM_BITS

    signature = {"scores": "*fp32", "keys": "*i64", "out": "*i32", "vocab": "i32", "scale": "fp32",
                 "BITS": "constexpr", "BLOCK_V": "constexpr"}
    source = ASTSource(gumbel_argmax_kernel, signature, constexprs={"BITS": UNIFORM_BITS, "BLOCK_V": BLOCK_V})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})
    ptx = compiled.asm["ptx"]
    assert f".target sm_{arch}a" in ptx and f".visible .entry {compiled.metadata.name}(" in ptx
    assert "mul.lo.s32" in ptx or "mul.lo.u32" in ptx  # the hash's products stay 32-bit
