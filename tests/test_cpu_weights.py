"""The CPU weight formats (cpu_weights.py): the GGUF's own blocks on our AVX2 kernels (gguf_kernels.py) or
torch's, int8, float32; lossless speculation on each, what `auto` measures and caches, and clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import BLOCK, PROMPTS, load_pair
from dflash_runtime import DFlashError, SamplingParams, SpeculativeEngine, load_drafter, load_target
from dflash_runtime import cpu_weights, gguf_blocks, gguf_kernels
from dflash_runtime.checkpoint import read_safetensors

FORMATS = ["gguf-int4", "int8"]
KERNELS, WHY_NO_KERNELS = gguf_kernels.library()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"gguf_kernels: {WHY_NO_KERNELS}")


def q4_1_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight rounded to Q4_1 the way llama.cpp's quantize does it: per block of 32, m = min, d = range / 15."""
    blocks = weight.float().view(weight.shape[0], -1, gguf_blocks.Q4_1_GROUP)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / 15).clamp(min=1e-8).half()
    m = low.half()
    q = torch.round((blocks - m.float()[..., None]) / d.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(weight.shape), d, m


@pytest.fixture(scope="module")
def tiny_with_blocks(tiny, tmp_path_factory):
    """The tiny target with Q4_1 blocks for its projections, as a GGUF conversion keeps them."""
    target_dir = tmp_path_factory.mktemp("blocks") / "target"
    shutil.copytree(tiny[0], target_dir)
    blocks = {name: q4_1_of(weight) for name, weight in read_safetensors(target_dir).items()
              if ".layers." in name and name.endswith("proj.weight")}
    gguf_blocks.save_blocks(target_dir, blocks)
    return target_dir, tiny[1]


def test_the_embedded_defaults_blocks_are_its_shipped_weights():
    from dflash_runtime.checkpoint import resolve_target

    target_dir, _ = resolve_target("smollm2-135m")
    blocks = gguf_blocks.load_blocks(target_dir)
    weights = read_safetensors(target_dir)
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied
    assert len(blocks) == 211  # 30 layers x 7 Q4_1 projections, and the Q8_0 embedding as the tied head
    assert len(blocks["lm_head.weight"]) == 2 and blocks["lm_head.weight"][0].dtype == torch.int8
    for name, fields in blocks.items():  # q/k rows in transformers' order, not the GGUF's
        assert torch.equal(gguf_blocks.dequantize(*fields), weights[name]), name


def integer_arithmetic(x: torch.Tensor, fields: tuple, bits: int = 16) -> torch.Tensor:
    """What gguf_kernels computes, in torch: x [rows, K] quantized per block of 32 to int16 (scale max / 32639) or
    int8 (max / 127), rounded half to even, each block's integer dot product scaled by both scales, plus Q4_1's
    minimum times the block's float sum of x."""
    rows, k = x.shape
    q, d = fields[0].double(), fields[1].double()
    blocks = x.view(rows, k // 32, 32)
    scale = blocks.abs().amax(-1) / (32639 if bits == 16 else 127)
    xq = torch.round(blocks * torch.where(scale > 0, 1 / scale, 0)[..., None]).double()
    dots = torch.einsum("rbi,nbi->rnb", xq, q.view(len(q), k // 32, 32))
    y = (dots * scale.double()[:, None, :] * d[None]).sum(-1)
    if len(fields) == 3:
        y += blocks.double().sum(-1) @ fields[2].double().T
    return y.float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_computes_its_own_weights(fmt, monkeypatch):
    """gguf-int4 on torch's kernel (a host where ours do not build) and int8: bfloat16 activations."""
    monkeypatch.setattr(cpu_weights, "library", lambda: (None, "as on a host without AVX2"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).requires_grad_(False)
    q4_1 = q4_1_of(linear.weight)
    module, got = cpu_weights.convert(linear, fmt, q4_1)
    assert got == fmt and module.bias is linear.bias and isinstance(module, cpu_weights.WeightOnlyLinear)
    assert "as on a host without AVX2" in cpu_weights.kernel("gguf-int4")
    if fmt == "gguf-int4":  # w = (q - 8) * scale + zero, scale = d, zero = m + 8d, both rounded to bfloat16
        q, d, m = (t.float() for t in q4_1)
        scale = d.bfloat16().float().repeat_interleave(32, dim=1)
        zero = (m + 8 * d).bfloat16().float().repeat_interleave(32, dim=1)
        weight = (q - 8) * scale + zero
    else:
        weight = module.tensors[0].float() * module.tensors[1].float()[:, None]
    x = torch.randn(3, 5, 64)
    expected = F.linear(x.bfloat16().float(), weight, linear.bias)
    out = module(x)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 48)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("kind,outputs,fmt", [("q4_1", 80, "gguf-int4"), ("q4_1", 83, "gguf-int4"),
                                              ("q4_1", 83, "gguf-int4-a8"), ("q8_0", 80, "gguf-int4")])
def test_the_gguf_kernels_compute_their_blocks_one_row_as_in_any_batch(kind, outputs, fmt):
    """Our AVX2 kernels: the integer arithmetic of integer_arithmetic, close to the dequantized float32 weight;
    each row's result bitwise the same alone or among others (what keeps speculation lossless), any thread count.
    Q4_1's outputs go in groups of 8: 83 leaves a partial group. gguf-int4-a8: int8 activations."""
    torch.manual_seed(0)
    weight = torch.randn(outputs, 96) * 0.05
    if kind == "q4_1":
        fields = q4_1_of(weight)
    else:
        d = (weight.view(outputs, 3, 32).abs().amax(-1) / 127).half()
        fields = (torch.round(weight.view(outputs, 3, 32) / d.float()[..., None]).to(torch.int8).view(outputs, 96), d)
    linear = torch.nn.Linear(96, outputs).requires_grad_(False)
    bias = linear.bias
    module, got = cpu_weights.convert(linear, fmt, fields)
    assert isinstance(module, gguf_kernels.GGUFLinear) and got == (fmt if kind == "q4_1" else "q8_0")
    x = torch.randn(9, 96) * 3
    x[4, 32:64] = 0  # a block of zeros: scale 0
    out = module(x)
    bits = 8 if fmt == "gguf-int4-a8" else 16
    torch.testing.assert_close(out, integer_arithmetic(x, fields, bits) + bias, rtol=1e-5, atol=1e-5)
    tolerance = 1e-3 if bits == 16 else 6e-2  # int8: within ~1% of x's block maximum
    torch.testing.assert_close(out, F.linear(x, gguf_blocks.dequantize(*fields), bias), rtol=tolerance,
                               atol=tolerance)
    alone = torch.cat([module(x[i:i + 1]) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = module(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out, alone) and torch.equal(out, one_thread)
    assert module(x.view(3, 3, 96)).shape == (3, 3, outputs)


@pytest.mark.parametrize("fmt", [*FORMATS, "gguf-int4-a8"])
def test_speculation_is_lossless_on_each_format(tiny_with_blocks, fmt):
    """DFlash against plain decoding on the same served weights: token-identical, greedy, batch 1 and 4."""
    if fmt == "gguf-int4-a8" and KERNELS is None:
        pytest.skip(f"gguf-int4-a8 is gguf-int4 on torch's kernel without ours: {WHY_NO_KERNELS}")
    target = load_target(tiny_with_blocks[0], cpu_weights=fmt)
    drafter = load_drafter(tiny_with_blocks[1], target.config)
    served = target.served_weights
    assert served.chosen == fmt and served.why == "asked for"
    assert served.counts == {fmt: 16, "float32": 1} and served.fallbacks == ["lm_head (float32)"]  # every projection
    on_kernels = fmt != "int8" and KERNELS is not None and target.config.arch == "llama"  # qwen3: head norms
    assert served.fused_layers == (4 if on_kernels else 0)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = SpeculativeEngine(target, None, block_size=1, max_batch_size=4).generate(PROMPTS, params)
    fast = SpeculativeEngine(target, drafter, block_size=BLOCK, max_batch_size=4).generate(PROMPTS, params)
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert sum(len(s.stats.acceptance_lengths) for s in fast) < sum(len(s.output_ids) for s in fast)


@needs_kernels
def test_a_llama_layer_in_one_call_is_that_layer_on_torch(tiny_with_blocks):
    """LlamaKernels against the same layers' modules on the same kernels (attention in float64 there): the
    logits and the drafter's features of a prompt; and a position beyond the block table is an IndexError, not a
    write out of bounds."""
    target = load_target(tiny_with_blocks[0], cpu_weights="gguf-int4")
    if target.config.arch != "llama":
        pytest.skip("qwen3's per-head norms keep its layers on torch (test_speculation_is_lossless_on_each_format)")
    tokens, kernels, feature_layers = torch.tensor([PROMPTS[2]]), target.kernels, (3, 0, 2)
    with torch.inference_mode():
        fused = target.whole_pass(tokens, feature_layers)
        target.kernels = None
        on_torch = target.whole_pass(tokens, feature_layers)
        target.kernels = kernels
        torch.testing.assert_close(fused[0], on_torch[0], rtol=1e-3, atol=1e-3)  # logits
        # features: hidden states, whose int16 activations may round one step apart where attention's float32 and
        # float64 differ in the last bits; a feature in another's slot would differ by far more
        torch.testing.assert_close(fused[1], on_torch[1], rtol=1e-3, atol=3e-3)
        with pytest.raises(ValueError, match="each once"):
            target.whole_pass(tokens, (1, 1))
        cache = target.new_cache(2)
        table = cache.sequential_table(1, cache.block_size)
        with pytest.raises(IndexError, match="beyond the table"):
            target(tokens[:, :1], torch.tensor([[cache.block_size]]), cache, table)


@needs_kernels
def test_gguf_int4_a8_layers_in_one_call_run_on_int8_activations(tiny_with_blocks):
    """gguf-int4-a8's layers in one call against the same layers on torch on the same int8 kernels. An int8
    rounding that the last bits of C's and torch's norms tip one way or the other moves a value by 1/127 of its
    block's largest, and such moves spread through the layers, so the first layer's output (a feature slot) is
    compared: its int8 arithmetic matches torch's but for rare roundings, far closer than int16's is."""
    tokens, fused = torch.tensor([PROMPTS[2]]), {}
    for fmt in ("gguf-int4", "gguf-int4-a8"):
        target = load_target(tiny_with_blocks[0], cpu_weights=fmt)
        if target.config.arch != "llama":
            pytest.skip("qwen3's per-head norms keep its layers on torch")
        assert target.served_weights.fused_layers == 4
        with torch.inference_mode():
            fused[fmt] = target.whole_pass(tokens, (0,))[1]
    target.kernels = None  # gguf-int4-a8's layers on torch
    with torch.inference_mode():
        on_torch = target.whole_pass(tokens, (0,))[1]
    a8 = fused["gguf-int4-a8"]
    assert (a8 - on_torch).abs().mean() < 0.005 < (a8 - fused["gguf-int4"]).abs().mean()


@needs_kernels
def test_the_layer_kernels_attention_reads_scattered_blocks_and_ragged_rows_as_torch_does(tiny_with_blocks):
    """The kernels' attention walks each row's block table block by block and its keys four at a time: two rows of
    different lengths (the shorter one's last keys masked) in blocks out of order, a prompt and then a block of 3,
    give torch's logits."""
    target = load_target(tiny_with_blocks[0], cpu_weights="gguf-int4")
    if target.config.arch != "llama":
        pytest.skip("qwen3's per-head norms keep its layers on torch")
    lengths, block = [37, 22], 3
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, target.config.shape.vocab_size, (2, max(lengths)), generator=generator)
    kernels = target.kernels

    def logits(on_kernels: bool) -> list[torch.Tensor]:
        target.kernels = kernels if on_kernels else None
        cache = target.new_cache(12)
        table = torch.tensor([[9, 2, 7, 4], [1, 11, 5, 8]])  # neither in order nor contiguous
        out = []
        with torch.inference_mode():
            for row, length in enumerate(lengths):
                positions = torch.arange(length)[None]
                out.append(target(prompts[row:row + 1, :length], positions, cache, table[row:row + 1])[0])
            starts = torch.tensor(lengths)[:, None]
            out.append(target(prompts[:, :block], starts + torch.arange(block), cache, table)[0])
        return out

    for fused, on_torch in zip(logits(True), logits(False)):
        torch.testing.assert_close(fused, on_torch, rtol=1e-3, atol=1e-3)
    target.kernels = kernels


def test_the_embedded_default_in_its_own_4_bit_weights_is_lossless():
    from dflash_runtime.pipeline import load_pipeline

    pipe = load_pipeline("smollm2-135m", cpu_weights="gguf-int4")
    served = pipe.target.served_weights
    if KERNELS is not None:  # the GGUF's Q8_0 head on our kernels too, every layer in one call
        assert served.counts == {"gguf-int4": 120, "q8_0": 1} and served.fallbacks == ["lm_head (q8_0)"]
        assert served.megabytes < 120 and served.fused_layers == 30
    else:
        assert served.counts == {"gguf-int4": 120, "float32": 1} and served.fallbacks == ["lm_head (float32)"]
    assert served.megabytes < 200  # against 538 MB in float32 (the head: 113 MB of it, the embedding's own)
    prompts = [pipe.encode(q) for q in ("What is the capital of France?", "Write a Python function that adds.")]
    params = SamplingParams(max_new_tokens=32)
    plain = pipe.engine(block_size=1, max_batch_size=2).generate(prompts, params)
    fast = pipe.engine(block_size=8, max_batch_size=2).generate(prompts, params)
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert "Paris" in pipe.decode(plain[0].output_ids)


def test_auto_measures_once_per_host_and_keeps_float32_without_blocks(tiny, tiny_with_blocks, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_weights.ENV, raising=False)
    assert load_target(tiny[0]).served_weights.why == "the checkpoint's own format"  # nothing to measure
    first = load_target(tiny_with_blocks[0]).served_weights
    assert first.requested == "auto" and first.why.startswith("measured on this host: gguf-int4 ")
    cached = json.loads((tmp_path / "cpu_weights.json").read_text())
    from dflash_runtime.cpu_linears import host_signature

    [timings] = cached[host_signature()].values()
    assert set(timings) == {"gguf-int4", "float32"} and all(len(t) == 2 and t[0] > 0 for t in timings.values())
    monkeypatch.setattr(cpu_weights, "time_format", lambda *a: pytest.fail("measured again"))
    assert load_target(tiny_with_blocks[0]).served_weights.chosen == first.chosen
    monkeypatch.setenv(cpu_weights.ENV, "int8")
    assert load_target(tiny_with_blocks[0]).served_weights.describe().startswith(f"int8 ({cpu_weights.ENV})")


def test_formats_it_cannot_serve_are_refused_clearly(tiny):
    for fmt in ("gguf-int4", "gguf-int4-a8"):
        with pytest.raises(DFlashError, match=f"--cpu-weights {fmt}: this target has no GGUF Q4_1 blocks"):
            load_target(tiny[0], cpu_weights=fmt)
    with pytest.raises(DFlashError, match="expected auto or one of gguf-int4, gguf-int4-a8, int8, float32"):
        load_target(tiny[0], cpu_weights="int3")


def test_the_quality_line_says_how_far_a_format_is_from_float32():
    from dflash_runtime.checkpoint import resolve_target
    from dflash_tools.weights_quality import in_words, weights_quality

    quality = weights_quality(resolve_target("smollm2-135m")[0], "gguf-int4", prompts=2, tokens=8, texts=1,
                              progress=False)
    assert quality["served"].startswith("gguf-int4 (asked for)") and quality["greedy_agreement"]["tokens_compared"]
    assert abs(quality["perplexity_change"]) < 0.1  # the shipped 4-bit weights, not a broken copy
    assert in_words(quality).startswith("gguf-int4 ") and "vs" in in_words(quality)


@pytest.mark.llama_cpp
def test_the_bench_runs_llama_cpp_on_the_same_gguf(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python: the optional `llama` extra (pip install -e '.[llama]')")
    from dflash_tools.benchmark import main

    out = tmp_path / "bench.json"
    assert main(["--vs-llama-cpp", "--cpu-weights", "gguf-int4", "--num-prompts", "2", "--max-new-tokens", "16",
                 "--block-size", "8", "--no-hf", "--batch", "2", "--json", str(out)]) == 0
    chat = json.loads(out.read_text())["prompt_sets"]["chat"]
    for mode in ("llama.cpp", "llama.cpp lookup"):  # plain, and its prompt-lookup speculative decoding
        assert chat["tokens_per_second"][mode] > 0 and chat["llama_cpp"][mode]["ratio_autoregressive_vs"] > 0
    assert chat["autoregressive_batch2_tokens_per_second"] > 0 and chat["token_identical_prompts"] == "2/2"
