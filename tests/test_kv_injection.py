"""The KV-injection op: reference vs the unfused drafter path, the Triton kernel under its CPU
interpreter vs the reference, and the torch.library registration."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dflash_runtime.config import DrafterConfig, RopeConfig, TransformerShape
from dflash_runtime.drafter import DFlashDrafter
from dflash_runtime.kv_cache import KVCache
from dflash_runtime.kv_injection import kv_injection, kv_injection_reference
from dflash_runtime.kv_injection.op import check_arguments
from dflash_runtime.layers import signed_sin

# (hidden, kv_heads, head_dim, rope base): the embedded default's drafter and Qwen3-8B's
SHAPES = {"smollm2-135m": (576, 3, 64, 100000.0), "qwen3-8b": (4096, 8, 128, 1000000.0)}
# three sequences with different lengths and cache offsets; the last token lands on the cache's last slot
RAGGED = [(0, 5, 0), (2, 3, 17), (1, 2, 30)]  # (slot, new tokens, first position); capacity 32


def ragged_batch(hidden, kv_heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(count for _, count, _ in RAGGED)
    weights = [torch.randn(kv_heads * head_dim, hidden, generator=g) / hidden ** 0.5 for _ in range(2)]
    return {
        "context": torch.randn(n, hidden, generator=g).to(dtype),
        "k_weight": weights[0].to(dtype), "v_weight": weights[1].to(dtype),
        "k_norm_weight": (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype),
        "positions": torch.cat([torch.arange(p, p + c) for _, c, p in RAGGED]),
        "slots": torch.cat([torch.full((c,), s) for s, c, _ in RAGGED]),
    }


def new_cache(kv_heads, head_dim, dtype=torch.float32):
    return (torch.zeros(3, kv_heads, 32, head_dim, dtype=dtype), torch.zeros(3, kv_heads, 32, head_dim, dtype=dtype))


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_the_unfused_drafter_layer(shape):
    hidden, kv_heads, head_dim, base = SHAPES[shape]
    rope = RopeConfig(base)
    config = DrafterConfig(TransformerShape(hidden, 64, 1, kv_heads * 2, kv_heads, head_dim, 1e-6, rope, 1000),
                           block_size=16, mask_token_id=0, target_layer_ids=(0,), num_target_layers=1)
    drafter = DFlashDrafter(config)
    batch = ragged_batch(hidden, kv_heads, head_dim)
    attn = drafter.layers[0].self_attn
    with torch.no_grad():
        attn.k_proj.weight.copy_(batch["k_weight"])
        attn.v_proj.weight.copy_(batch["v_weight"])
        attn.k_norm.weight.copy_(batch["k_norm_weight"])
        # unfused: projections, k_norm, RoPE, then a scatter per sequence
        unfused = KVCache(1, num_blocks=3, block_size=32, num_kv_heads=kv_heads, head_dim=head_dim,
                          dtype=torch.float32)  # a block per slot
        start = 0
        for slot, count, first in RAGGED:
            positions = torch.arange(first, first + count)[None]
            cos, sin = drafter.rotary(positions, torch.float32)
            k, v = attn.key_value(batch["context"][None, start:start + count], cos, signed_sin(sin))
            unfused.write(0, unfused.address(torch.tensor([[slot]]), first + count, positions), k, v)
            start += count
        cache_k, cache_v = new_cache(kv_heads, head_dim)
        kv_injection_reference(batch["context"], batch["k_weight"], batch["v_weight"], batch["k_norm_weight"],
                               rope.inverse_frequencies(head_dim), batch["positions"], batch["slots"], cache_k, cache_v,
                               1e-6)
    torch.testing.assert_close(cache_k, unfused.k[0].transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_v, unfused.v[0].transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert cache_k[1, :, 31].abs().sum() > 0  # the cache's last position was written


INTERPRETER_CHECK = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [{tests!r}, {repo!r}]
    from test_kv_injection import SHAPES, ragged_batch, new_cache
    from dflash_runtime.config import RopeConfig
    from dflash_runtime.kv_injection import kv_injection_reference
    from dflash_runtime.kv_injection.triton_kernel import kv_injection_triton
    for shape, (hidden, kv_heads, head_dim, base) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            batch = ragged_batch(hidden, kv_heads, head_dim, dtype)
            inv_freq = RopeConfig(base).inverse_frequencies(head_dim)
            outputs = []
            for op in (kv_injection_reference, kv_injection_triton):
                cache_k, cache_v = new_cache(kv_heads, head_dim, dtype)
                op(batch["context"], batch["k_weight"], batch["v_weight"], batch["k_norm_weight"], inv_freq,
                   batch["positions"], batch["slots"], cache_k, cache_v, 1e-6)
                outputs.append((cache_k.float(), cache_v.float()))
            (rk, rv), (tk, tv) = outputs
            relative = lambda r, t: ((r - t).abs().max() / r.abs().max()).item()
            print(shape, str(dtype).split(".")[-1], relative(rk, tk), relative(rv, tv))
""")


def test_triton_kernel_matches_the_reference_under_the_interpreter():
    """Errors relative to the largest output. fp32: both accumulate in fp32, so only summation order
    differs (1e-5). bf16/fp16: the kernel also accumulates in fp32, so the only difference is the final
    rounding to the cache dtype: at most one ulp of the largest value (2^-7 for bf16, 2^-10 for fp16).
    Measured: fp32 ~5e-7, bf16 <= 2^-8 .. 2^-7, fp16 <= 2^-11."""
    here = os.path.dirname(__file__)
    code = INTERPRETER_CHECK.format(tests=here, repo=os.path.dirname(here))
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines()]
    assert len(rows) == 6
    tolerance = {"float32": 1e-5, "bfloat16": 2 ** -7, "float16": 2 ** -10}
    for shape, dtype, k_error, v_error in rows:
        within = float(k_error) <= tolerance[dtype] and float(v_error) <= tolerance[dtype]
        assert within, (shape, dtype, k_error, v_error)


INDEX_VIEWS_CHECK = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [{tests!r}, {repo!r}]
    from test_kv_injection import SHAPES, ragged_batch, new_cache
    from dflash_runtime.config import RopeConfig
    from dflash_runtime.kv_injection import kv_injection_reference
    from dflash_runtime.kv_injection.triton_kernel import kv_injection_triton
    hidden, kv_heads, head_dim, base = SHAPES["smollm2-135m"]
    batch = ragged_batch(hidden, kv_heads, head_dim)
    n = len(batch["positions"])
    views = {{
        # one sequence's slot broadcast to its tokens: how the drafter once built it (stride 0)
        "stride-0 slots": (batch["positions"], torch.tensor([1]).expand(n)),
        "strided positions": (torch.stack([batch["positions"], batch["positions"]], 1)[:, 0], batch["slots"]),
    }}
    inv_freq = RopeConfig(base).inverse_frequencies(head_dim)
    for name, (positions, slots) in views.items():
        assert not positions.is_contiguous() or not slots.is_contiguous(), name
        caches = []
        for op in (kv_injection_reference, kv_injection_triton):
            cache_k, cache_v = new_cache(kv_heads, head_dim)
            op(batch["context"], batch["k_weight"], batch["v_weight"], batch["k_norm_weight"], inv_freq, positions,
               slots, cache_k, cache_v, 1e-6)
            caches.append(torch.cat([cache_k, cache_v]))
        print(name, ((caches[0] - caches[1]).abs().max() / caches[0].abs().max()).item())
""")


def test_triton_kernel_reads_index_views_as_the_reference_does():
    # Before: the kernel read slots with unit stride, so the stride-0 view the drafter made for a single
    # sequence was read past its end and K/V went outside the cache (an H200 crashed on it).
    here = os.path.dirname(__file__)
    run = subprocess.run([sys.executable, "-c", INDEX_VIEWS_CHECK.format(tests=here, repo=os.path.dirname(here))],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.rsplit(None, 1) for line in run.stdout.splitlines()]
    assert [name for name, _ in rows] == ["stride-0 slots", "strided positions"]
    assert all(float(error) <= 1e-5 for _, error in rows), rows


ENGINE_RUNS = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [{tests!r}, {repo!r}]
    from conftest import BLOCK, PROMPTS
    from dflash_runtime import SamplingParams, SpeculativeEngine, load_drafter, load_target
    target = load_target({target!r})
    drafter = load_drafter({drafter!r}, target.config)
    params = SamplingParams(max_new_tokens=24)
    runs = {{"batch 1": (PROMPTS[:1], 1), "ragged batch": (PROMPTS, 4), "continuous batching": (PROMPTS, 2)}}
    for name, (prompts, slots) in runs.items():
        seqs = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=slots).generate(prompts, params)
        print(json.dumps([name, [s.output_ids for s in seqs], [s.stats.acceptance_lengths for s in seqs]]))
""")


def test_engine_with_the_kernel_under_the_interpreter_equals_the_reference(tiny):
    # The engine's real calls (a prefill of one sequence, ragged batches, slots reused as requests come
    # and go) through the Triton kernel: the arguments no kernel-only test had, on any machine.
    here = os.path.dirname(__file__)
    code = ENGINE_RUNS.format(tests=here, repo=os.path.dirname(here), target=str(tiny[0]), drafter=str(tiny[1]))
    results = {}
    for implementation, extra in (("triton", {"TRITON_INTERPRET": "1"}), ("reference", {})):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "DFLASH_KV_INJECTION": implementation, **extra})
        assert run.returncode == 0, run.stderr[-3000:]
        results[implementation] = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r[0] for r in results["triton"]] == ["batch 1", "ragged batch", "continuous batching"]
    assert results["triton"] == results["reference"]  # the same tokens and the same accepted drafts
    assert any(length > 1 for run in results["triton"] for lengths in run[2] for length in lengths)


def test_bad_arguments_are_refused_at_the_op():
    hidden, kv_heads, head_dim, base = SHAPES["smollm2-135m"]
    batch = ragged_batch(hidden, kv_heads, head_dim)
    inv_freq = RopeConfig(base).inverse_frequencies(head_dim)
    good = dict(context=batch["context"], k_weight=batch["k_weight"], v_weight=batch["v_weight"],
                k_norm_weight=batch["k_norm_weight"], inv_freq=inv_freq, positions=batch["positions"],
                slots=batch["slots"], cache_k=new_cache(kv_heads, head_dim)[0],
                cache_v=new_cache(kv_heads, head_dim)[1])
    check_arguments(**good)
    bad = {
        "slots has shape": dict(slots=batch["slots"][:-1]),
        "positions must be int32 or int64": dict(positions=batch["positions"].float()),
        "k_weight has shape": dict(k_weight=batch["k_weight"][:, :-1]),
        "inv_freq has shape": dict(inv_freq=inv_freq[:-1]),
        "cache_v has shape": dict(cache_v=torch.zeros(3, kv_heads, 16, head_dim)),
        "context must be": dict(context=batch["context"][None]),
        "is on meta": dict(slots=batch["slots"].to("meta")),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            check_arguments(**{**good, **change})
    with pytest.raises(ValueError, match="slots has shape"):  # through the op itself
        kv_injection(*{**good, "slots": batch["slots"][:-1]}.values(), 1e-6)


def test_bounds_are_checked_when_asked():
    code = textwrap.dedent("""
        import sys, torch
        sys.path[:0] = [{tests!r}, {repo!r}]
        from test_kv_injection import SHAPES, ragged_batch, new_cache
        from dflash_runtime.config import RopeConfig
        from dflash_runtime.kv_injection import kv_injection
        hidden, kv_heads, head_dim, base = SHAPES["smollm2-135m"]
        batch = ragged_batch(hidden, kv_heads, head_dim)
        try:
            kv_injection(batch["context"], batch["k_weight"], batch["v_weight"], batch["k_norm_weight"],
                         RopeConfig(base).inverse_frequencies(head_dim), batch["positions"], batch["slots"] + 1,
                         *new_cache(kv_heads, head_dim), 1e-6)
        except IndexError as e:
            print(e)
    """)
    here = os.path.dirname(__file__)
    code = code.format(tests=here, repo=os.path.dirname(here))
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "DFLASH_CHECK_BOUNDS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert "slots span [1, 3], outside [0, 3)" in run.stdout, run.stderr[-2000:]


def test_custom_op_registration_and_fake_kernel():
    hidden, kv_heads, head_dim, base = SHAPES["smollm2-135m"]
    batch = ragged_batch(hidden, kv_heads, head_dim)
    cache_k, cache_v = new_cache(kv_heads, head_dim)
    args = (batch["context"], batch["k_weight"], batch["v_weight"], batch["k_norm_weight"],
            RopeConfig(base).inverse_frequencies(head_dim), batch["positions"], batch["slots"], cache_k, cache_v, 1e-6)
    torch.library.opcheck(kv_injection, args, test_utils=("test_schema", "test_faketensor"))
    assert torch.ops.dflash.kv_injection.default is not None
    kv_injection(*args)
    reference_k, reference_v = new_cache(kv_heads, head_dim)
    kv_injection_reference(*args[:7], reference_k, reference_v, 1e-6)
    assert torch.equal(cache_k, reference_k) and torch.equal(cache_v, reference_v)


@pytest.mark.parametrize("arch,float_type", [(90, "fp32"), (90, "bf16"), (100, "fp16")])
def test_ptx_is_compiled_ahead_of_time_for_hopper_and_blackwell(arch, float_type):
    from plugins.kv_injection.tensorrt_plugin import compile_ptx

    kernel = compile_ptx(arch, float_type, "i64", head_dim=128, eps=1e-6)
    assert f".target sm_{arch}a" in kernel.ptx and f".visible .entry {kernel.name}(" in kernel.ptx
    entry = kernel.ptx[kernel.ptx.index(".visible .entry"):kernel.ptx.index(")", kernel.ptx.index(".visible .entry"))]
    params = [line.split()[1] for line in entry.splitlines() if line.strip().startswith(".param")]
    # TensorRT's AOT order: 9 input pointers, 5 int32 scalars, 2 output pointers (then Triton's two
    # scratch pointers, unused: compile_ptx checks their sizes are 0)
    assert params == [".u64"] * 9 + [".u32"] * 6 + [".u64"] * 2 + [".u64"] * 2
    assert kernel.num_warps * 32 == 128 and kernel.shared_memory < 48 * 1024


def test_onnx_export_of_a_drafter_layer_carries_the_plugin_node(tiny, tmp_path):
    import onnx

    from conftest import load_pair
    from plugins.kv_injection.tensorrt_plugin import INPUTS, OUTPUTS, export_layer_onnx

    _, drafter = load_pair(tiny)
    export_layer_onnx(drafter, 0, str(tmp_path / "layer0.onnx"), num_slots=8, capacity=1040)
    model = onnx.load(str(tmp_path / "layer0.onnx"))
    onnx.checker.check_model(model)
    (node,) = model.graph.node
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "kv_injection" and node.domain == "dflash"
    assert attributes["plugin_namespace"] == b"dflash" and attributes["plugin_version"] == b"1"
    assert attributes["aot"] == 1 and attributes["eps"] == pytest.approx(drafter.layers[0].self_attn.k_norm.eps)
    assert list(node.input) == list(INPUTS) and list(node.output) == list(OUTPUTS)
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    assert torch.equal(torch.from_numpy(weights["k_weight"]), drafter.layers[0].self_attn.k_proj.weight.detach())
    assert weights["inv_freq"].dtype.name == "float32"
    context = model.graph.input[0].type.tensor_type.shape.dim
    assert context[0].dim_param == "tokens" and context[1].dim_value == drafter.config.shape.hidden_size


def test_tensorrt_registration_explains_what_is_missing():
    pytest.importorskip("onnx")
    from plugins.kv_injection import tensorrt_plugin

    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"TensorRT >= 10.9 with its Python plugin module"):
            tensorrt_plugin.register()
    else:
        tensorrt_plugin.register()  # where TensorRT exists, registration itself must succeed
