"""ModelOpt quantization of a target (builder/quantize.py) and loading its exports in our runtime.

A tiny random Qwen3 target with a character-level tokenizer goes through the real path: ShareGPT
calibration, ModelOpt PTQ, unified HF export, quality report. The exports are checked against the
original weights and against ModelOpt's own arithmetic.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from conftest import EOS, VOCAB, edited_copy, make_target
from builder.quantize import quantize_target
from dflash_runtime import DFlashError, load_target
from dflash_runtime.checkpoint import read_safetensors

SMALL = dict(calib_samples=8, progress=False, eval_texts=4, agreement_prompts=2, agreement_tokens=16,
             export_dtype=torch.float32)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_char_tokenizer(path):
    """One token per ASCII character (ids = code points), the target's EOS as </s>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {i: f"<{i}>" for i in range(VOCAB)} | {i: chr(i) for i in range(32, 126)}
    names |= {0: "<unk>", 1: "<s>", 10: "\n", EOS: "</s>"}
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in names.items()}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_target(tmp_path_factory.mktemp("quant") / "target", "qwen3")
    add_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def exports(target):
    """{"fp8": (dir, report), "nvfp4": (dir, report)}, both with an FP8 KV cache."""
    out = {}
    for quant in ("fp8", "nvfp4"):
        path = target.parent / quant
        out[quant] = path, quantize_target(target, path, quant, "fp8", **SMALL)
    return out


def hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def runtime_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits, _ = model.whole_pass(ids)
    return logits[0]


def test_nvfp4_export_dequantizes_close_to_the_original_weights(target, exports):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    path, _ = exports["nvfp4"]
    quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16 and quant["kv_cache_quant_algo"] == "FP8"
    assert set(quant["exclude_modules"]) == {"lm_head", "model.embed_tokens"}
    original, packed, ours = load_file(str(target / "model.safetensors")), load_file(str(path / "model.safetensors")), \
        read_safetensors(path)
    linears = [k for k in original if k.endswith(tuple(f"{n}.weight" for n in LINEARS))]
    assert len(linears) == 4 * len(LINEARS)
    for key in linears:
        module, w = key.removesuffix(".weight"), original[key]
        assert packed[key].dtype == torch.uint8 and packed[key].shape == (w.shape[0], w.shape[1] // 2)
        assert packed[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        # our loader's arithmetic is ModelOpt's own
        reference = NVFP4QTensor(w.shape, torch.float32, packed[key]).dequantize(
            scale=packed[f"{module}.weight_scale"], double_scale=packed[f"{module}.weight_scale_2"],
            block_sizes={-1: 16})
        assert torch.equal(ours[key], reference), key
        # 4-bit E2M1 in blocks of 16: each weight within one grid step of the block's scale (amax / 6,
        # FP8-rounded up to 1/16), ~9.5 % relative Frobenius error on Gaussian weights
        block_amax = w.abs().unflatten(-1, (-1, 16)).amax(-1, keepdim=True)
        error = (ours[key] - w).unflatten(-1, (-1, 16)).abs()
        assert (error <= block_amax / 6 * 17 / 16 + 1e-6).all(), key
        assert (ours[key] - w).norm() / w.norm() < 0.12, key
    for key in set(original) - set(linears):  # norms and embeddings are exported as they were
        assert torch.equal(ours[key], original[key]), key


def test_runtime_logits_are_those_of_the_dequantized_weights(target, exports):
    ids = torch.randint(0, EOS, (1, 40), generator=torch.Generator().manual_seed(0))
    for quant, (path, _) in exports.items():
        model = hf_model(target)
        model.load_state_dict(read_safetensors(path))
        with torch.no_grad():
            expected = model(ids).logits[0]
        torch.testing.assert_close(runtime_logits(load_target(path), ids), expected, rtol=1e-5, atol=1e-5,
                                   msg=quant)


def test_fp8_export_matches_the_fake_quantized_model(target, exports):
    """Our runtime = ModelOpt's fake-quantized weights exactly; + activation/KV rounding (GPU only) stays close."""
    import modelopt.torch.quantization as mtq

    path, _ = exports["fp8"]
    config = mtq.update_quant_cfg_with_kv_cache_quant(mtq.FP8_DEFAULT_CFG, mtq.FP8_KV_CFG["quant_cfg"])
    ids = torch.randint(0, EOS, (1, 40), generator=torch.Generator().manual_seed(1))
    model = hf_model(target)
    with torch.no_grad():
        unquantized = model(ids).logits[0]
        mtq.quantize(model, config, lambda m: m(ids))
        full = model(ids).logits[0]
        mtq.disable_quantizer(model, "*input_quantizer")
        mtq.disable_quantizer(model, "*bmm_quantizer")
        weights_only = model(ids).logits[0]
    ours = runtime_logits(load_target(path), ids)
    torch.testing.assert_close(ours, weights_only, rtol=1e-5, atol=1e-5)
    quantization_error = (full - unquantized).norm()
    assert quantization_error > 0
    assert (ours - full).norm() < 2 * quantization_error  # same order as the quantization itself


def test_report_is_consistent(target, exports):
    for quant, (path, report) in exports.items():
        hf_quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
        assert report["quant"] == quant and report["kv_cache"] == "fp8"
        assert report["quant_algo"] == hf_quant["quant_algo"] == quant.upper()
        assert report["kv_cache_quant_algo"] == "FP8"
        assert report["calibration"]["samples"] == SMALL["calib_samples"] and report["calibration"]["tokens"] > 0
        assert report["heldout"]["texts"] == SMALL["eval_texts"]
        assert report["checkpoint"]["path"] == str(path)
        assert report["checkpoint"]["bytes"] == sum(f.stat().st_size for f in path.iterdir())
        assert report["checkpoint"]["bytes"] < report["checkpoint"]["unquantized_bytes"]
        # measured how the CPU can: NVFP4's fake-quantized forward needs CUDA
        assert set(report["evaluation"]) == ({"fake_quant", "dequantized"} if quant == "fp8" else {"dequantized"})
        assert report["measured_with"] == ("fake_quant" if quant == "fp8" else "dequantized")
        headline = report["evaluation"][report["measured_with"]]
        assert report["perplexity"] == headline["perplexity"]
        assert report["greedy_agreement"] == headline["greedy_agreement"]
        base = report["unquantized"]["perplexity"]
        assert 1 < base < VOCAB * 4 and math.isfinite(base)
        for measured in report["evaluation"].values():
            assert measured["perplexity_change"] == pytest.approx(measured["perplexity"] / base - 1, abs=1e-3)
            agreement = measured["greedy_agreement"]
            assert 0 <= agreement["matching_fraction"] <= 1
            assert len(agreement["first_divergence"]) == SMALL["agreement_prompts"]
            assert all(0 <= f <= n <= SMALL["agreement_tokens"]
                       for f, n in zip(agreement["first_divergence"], agreement["tokens_compared"]))
            if agreement["matching_fraction"] == 1:
                assert agreement["first_divergence"] == agreement["tokens_compared"]
        assert report["seconds"]["total"] >= report["seconds"]["calibration"]
        json.dumps(report)  # goes into the build manifest as it is
        # a complete target directory, and nothing else left beside it
        assert {"config.json", "hf_quant_config.json", "tokenizer.json", "model.safetensors"} <= \
            {f.name for f in path.iterdir()}
        assert json.loads((path / "config.json").read_text())["rope_theta"] == 50000.0
    assert sorted(p.name for p in target.parent.iterdir()) == ["fp8", "nvfp4", "target"]


def test_kv_cache_only_export_keeps_the_weights(target, tmp_path):
    report = quantize_target(target, tmp_path / "kv", "none", "fp8", **SMALL)
    assert report["quant_algo"] is None and report["kv_cache_quant_algo"] == "FP8"
    assert report["measured_with"] == "fake_quant"  # the KV cache's rounding, emulated on CPU
    original, exported = load_file(str(target / "model.safetensors")), read_safetensors(tmp_path / "kv")
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    dequantized, unquantized = report["evaluation"]["dequantized"], report["unquantized"]
    assert dequantized["perplexity"] == pytest.approx(unquantized["perplexity"], rel=1e-5)


@pytest.mark.parametrize("quant,kv_cache,kwargs,message", [
    ("int3", "fp8", {}, "unknown quantization 'int3'"),
    ("fp8", "int4", {}, "unknown KV-cache quantization 'int4'"),
    ("none", "none", {}, "nothing to quantize"),
    ("fp8", "fp8", {"calib_samples": 0}, "at least 1"),
])
def test_bad_options_are_refused_before_any_work(target, tmp_path, quant, kv_cache, kwargs, message):
    with pytest.raises(DFlashError, match=message):
        quantize_target(target, tmp_path / "out", quant, kv_cache, **{**SMALL, **kwargs})
    assert not (tmp_path / "out").exists()


def test_unwritable_output_is_a_clear_error(target, tmp_path):
    (tmp_path / "file").write_text("")  # a file where a directory is needed: fails even for root
    with pytest.raises(DFlashError, match="cannot write the quantized checkpoint"):
        quantize_target(target, tmp_path / "file" / "out", "fp8", "fp8", **SMALL)


def test_disk_full_during_export_leaves_no_half_written_checkpoint(target, tmp_path, monkeypatch):
    import modelopt.torch.export

    def full_disk(model, dtype=None, export_dir=None, **kwargs):
        (export_dir / "model.safetensors").write_bytes(b"\0" * 100)  # a partial shard
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    previous = tmp_path / "out"
    previous.mkdir()
    (previous / "config.json").write_text("{}")
    monkeypatch.setattr(modelopt.torch.export, "export_hf_checkpoint", full_disk)
    message = re.escape(f"writing the quantized checkpoint in {tmp_path} failed (disk full)")
    with pytest.raises(DFlashError, match=message):
        quantize_target(target, previous, "fp8", "fp8", **SMALL)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory left
    assert [p.name for p in previous.iterdir()] == ["config.json"]  # the previous build untouched


def _edited_copy(src, dst, quant_config=None, edit_state=None):
    """A copy whose quantization is described by `quant_config` in config.json alone, if given."""
    def edit(config):
        config.update(quant_config)

    dst = edited_copy(src, dst, edit if quant_config is not None else None, edit_state)
    if quant_config is not None:
        (dst / "hf_quant_config.json").unlink()
    return dst


def _set_algo(path, algo):
    config = json.loads((path / "hf_quant_config.json").read_text())
    config["quantization"]["quant_algo"] = algo
    (path / "hf_quant_config.json").write_text(json.dumps(config))


def test_quantized_checkpoints_load_strictly(exports, tmp_path):
    fp8, _ = exports["fp8"]
    algo = _edited_copy(fp8, tmp_path / "algo")
    _set_algo(algo, "W4A8_AWQ")
    with pytest.raises(DFlashError, match="quantization 'W4A8_AWQ' is not supported"):
        load_target(algo)
    extra = _edited_copy(fp8, tmp_path / "extra",
                         edit_state=lambda s: s.update({"model.layers.0.mlp.up_proj.weight_scale_2": torch.ones(())}))
    with pytest.raises(DFlashError, match="does not explain: model.layers.0.mlp.up_proj.weight_scale_2"):
        load_target(extra)
    missing = _edited_copy(fp8, tmp_path / "missing", quant_config={"quantization_config": None})
    with pytest.raises(DFlashError, match=r"no quantization config \(hf_quant_config.json\) does not explain"):
        load_target(missing)
    other = _edited_copy(fp8, tmp_path / "other", quant_config={"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(DFlashError, match="quantization method 'gptq' is not supported"):
        load_target(other)
    # config.json's quantization_config alone (ModelOpt writes both) is enough
    embedded = _edited_copy(fp8, tmp_path / "embedded", quant_config={})
    assert torch.equal(load_target(embedded).lm_head.weight, load_target(fp8).lm_head.weight)


def test_greedy_agreement_in_words_averages_the_divergence_of_the_prompts_that_diverge():
    """A prompt that never leaves the reference's path has no divergence: the demo once said "agree on 100.0% of
    128 tokens, first divergence after 32 on average" (32: the tokens compared)."""
    from dflash_tools.quality import agreement_in_words

    same = {"matching_fraction": 1.0, "tokens_compared": [32] * 4, "first_divergence": [32] * 4}
    assert agreement_in_words(same) == "greedy answers identical on all 128 tokens of 4 prompts"
    some = {"matching_fraction": 0.75, "tokens_compared": [32] * 4, "first_divergence": [32, 8, 32, 16]}
    assert agreement_in_words(some) == ("greedy answers agree on 75.0% of 128 tokens; 2 of 4 prompts leave the "
                                        "reference's path, after 12 tokens on average")
