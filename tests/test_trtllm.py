"""--runtime trtllm: the LLM API options, the Triton LLM-API model repository, GPU/quantization checks.

TensorRT-LLM cannot be installed on the project's machines, so the options are checked key by key
against the names read in the upstream source (recorded below with file and commit), and the
validation glue runs against a stand-in module; on a machine with tensorrt_llm, `validate_llm_args`
checks the same options against the real classes.
"""
from __future__ import annotations

import re
import string
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from builder import trtllm
from builder.trtllm import (GPUS, TrtllmOptions, check_gpu_support, llm_api_options,
                            model_yaml, recommended_quantization, render_trtllm_repository, resolve_gpu,
                            serve_command, template_values, validate_llm_args, write_extra_llm_api_options)
from deploy import serve
from dflash_contract import DFlashError
from dflash_contract.presets import PRESETS

# Upstream names, read in NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py
# @ 0004396720054fd8e205cbf616f21f0b57c6b412 (only the fields this project writes; the classes have more).
# BaseLlmArgs / TorchLlmArgs (`LlmArgs = TorchLlmArgs`; StrictBaseModel, extra="forbid").
TORCH_LLM_ARGS_FIELDS = {"model", "backend", "tensor_parallel_size", "pipeline_parallel_size", "max_batch_size",
                         "max_num_tokens", "max_seq_len", "kv_cache_config", "cuda_graph_config", "speculative_config"}
# KvCacheConfig: free_gpu_memory_fraction (0..1, default 0.9); dtype validated against these values
# (or a torch dtype name); "auto" keeps the checkpoint's kv_cache_quant_algo.
KV_CACHE_CONFIG_FIELDS = {"free_gpu_memory_fraction", "dtype"}
KV_CACHE_DTYPES = {"auto", "fp8", "fp8_ds_mla", "nvfp4"}
# CudaGraphConfig = DecodeCudaGraphConfig(BaseCudaGraphConfig): batch_sizes (sorted; max_batch_size is
# derived as max(batch_sizes) and must equal it when both are given), max_batch_size, enable_padding.
CUDA_GRAPH_CONFIG_FIELDS = {"batch_sizes", "max_batch_size", "enable_padding"}
# DFlashDecodingConfig(DecodingBaseConfig): selected by the discriminator decoding_type == "DFlash" in the
# SpeculativeConfig union; speculative_model (alias speculative_model_dir); mask_token_id and
# target_layer_ids default to the drafter's config.json dflash_config (TorchLlmArgs.validate_speculative_config);
# attention_backend Literal["VANILLA", "TRTLLM"], TRTLLM only on SM100/SM103; FA4 (SM90 only) from
# 1.3.0rc27 (API reference; upstream's validate_dflash_fa4_runtime).
# draft_len_schedule: DecodingBaseConfig's dict[int, int], batch-size tier -> draft length; its smallest key
# must map to max_draft_len (validate_draft_len_schedule_and_sort); DFlash supports it
# (SpeculativeDecodingMode.support_dynamic_draft_len).
DFLASH_DECODING_CONFIG_FIELDS = {"decoding_type", "max_draft_len", "speculative_model", "mask_token_id",
                                 "target_layer_ids", "attention_backend", "draft_len_schedule"}
DFLASH_DECODING_TYPE = "DFlash"
DFLASH_ATTENTION_BACKENDS = {"VANILLA", "TRTLLM", "FA4"}

# Triton LLM-API model, triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt
# @ 0a71057313ec0626527e164a8fc0205c5822e2f5: name -> (data_type, dims).
UPSTREAM_INPUTS = {
    "text_input": ("TYPE_STRING", "-1"), "image_url": ("TYPE_STRING", "-1"), "streaming": ("TYPE_BOOL", "1"),
    "sampling_param_best_of": ("TYPE_INT32", "1"), "sampling_param_temperature": ("TYPE_FP32", "1"),
    "sampling_param_top_k": ("TYPE_INT32", "1"), "sampling_param_top_p": ("TYPE_FP32", "1"),
    "sampling_param_frequency_penalty": ("TYPE_FP32", "1"), "sampling_param_presence_penalty": ("TYPE_FP32", "1"),
    "sampling_param_max_tokens": ("TYPE_INT32", "1"), "sampling_param_stop": ("TYPE_STRING", "-1"),
    "sampling_param_seed": ("TYPE_UINT64", "1"), "sampling_param_exclude_input_from_output": ("TYPE_BOOL", "1"),
    "sampling_param_return_perf_metrics": ("TYPE_BOOL", "1"), "return_finish_reason": ("TYPE_BOOL", "1"),
    "return_stop_reason": ("TYPE_BOOL", "1"), "return_cumulative_logprob": ("TYPE_BOOL", "1"),
    "stop": ("TYPE_BOOL", "1"), "lora_id": ("TYPE_UINT64", "1"), "lora_name": ("TYPE_STRING", "1"),
    "lora_path": ("TYPE_STRING", "1"), "lora_ckpt_source": ("TYPE_STRING", "1"),
}
UPSTREAM_OUTPUTS = {
    "text_output": ("TYPE_STRING", "-1"), "finish_reason": ("TYPE_STRING", "-1"), "stop_reason": ("TYPE_STRING", "-1"),
    "cumulative_logprob": ("TYPE_FP32", "-1"), "kv_cache_reused_block": ("TYPE_INT32", "-1"),
    "kv_cache_missed_block": ("TYPE_INT32", "-1"), "kv_cache_alloc_new_blocks": ("TYPE_INT32", "-1"),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", "-1"), "kv_cache_hit_rate": ("TYPE_FP32", "-1"),
    "arrival_time_ns": ("TYPE_INT64", "1"), "first_scheduled_time_ns": ("TYPE_INT64", "1"),
    "first_token_time_ns": ("TYPE_INT64", "1"), "last_token_time_ns": ("TYPE_INT64", "1"),
    "acceptance_rate": ("TYPE_FP32", "1"), "total_accepted_draft_tokens": ("TYPE_INT32", "1"),
    "total_draft_tokens": ("TYPE_INT32", "1"),
}
# Its model.py (1/model.py @ 044a90d209e380c95e23e8ae42f3583fa05ada78) reads model.yaml: every key except
# triton_config goes to LLM(**update_llm_args_with_extra_dict({}, ...)); triton_config.max_batch_size and
# triton_config.decoupled set the Triton config in auto_complete_config.
TRITON_CONFIG_FIELDS = {"max_batch_size", "decoupled"}

DRAFTER = "/models/Qwen3-8B-DFlash-b16"


def test_options_use_only_upstream_names():
    opts = llm_api_options(drafter=DRAFTER, block_size=16, mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33),
                           options=TrtllmOptions(dflash_attention_backend="VANILLA"), schedule={1: 7, 16: 3, 64: 1})
    assert set(opts) <= TORCH_LLM_ARGS_FIELDS
    assert set(opts["kv_cache_config"]) <= KV_CACHE_CONFIG_FIELDS
    assert set(opts["cuda_graph_config"]) <= CUDA_GRAPH_CONFIG_FIELDS
    assert set(opts["speculative_config"]) == DFLASH_DECODING_CONFIG_FIELDS
    spec = opts["speculative_config"]
    assert spec["decoding_type"] == DFLASH_DECODING_TYPE
    assert spec["attention_backend"] in DFLASH_ATTENTION_BACKENDS
    assert opts["kv_cache_config"]["dtype"] in KV_CACHE_DTYPES


def test_options_values_field_by_field():
    opts = llm_api_options(drafter=DRAFTER, block_size=16, options=TrtllmOptions(
        tensor_parallel_size=2, pipeline_parallel_size=1, free_gpu_memory_fraction=0.7, kv_cache_dtype="fp8",
        max_batch_size=48, max_num_tokens=4096, max_seq_len=16384))
    assert opts == {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "max_batch_size": 48,
        "max_num_tokens": 4096,
        "max_seq_len": 16384,
        "kv_cache_config": {"free_gpu_memory_fraction": 0.7, "dtype": "fp8"},
        "cuda_graph_config": {"batch_sizes": [1, 2, 4, 8, 16, 32, 48], "enable_padding": True},
        # block [last token, MASK x 15]: 15 drafts; mask id and layer ids come from the drafter's config.json
        "speculative_config": {"decoding_type": "DFlash", "max_draft_len": 15, "speculative_model": DRAFTER},
    }


def test_options_obey_upstream_validators():
    opts = llm_api_options(drafter=DRAFTER, block_size=8, options=TrtllmOptions(max_batch_size=20, max_seq_len=None,
                                                                                 cuda_graph_batch_sizes=(16, 1, 4, 4)))
    graphs = opts["cuda_graph_config"]
    assert graphs["batch_sizes"] == sorted(set(graphs["batch_sizes"])) == [1, 4, 16]
    assert "max_batch_size" not in graphs and max(graphs["batch_sizes"]) <= opts["max_batch_size"]
    assert 0 <= opts["kv_cache_config"]["free_gpu_memory_fraction"] <= 1
    assert "max_seq_len" not in opts
    assert opts["speculative_config"]["max_draft_len"] == 7 > 0  # upstream asserts max_draft_len > 0 for DFlash
    assert "attention_backend" not in opts["speculative_config"]  # upstream default VANILLA


@pytest.mark.parametrize("bad", [dict(tensor_parallel_size=0), dict(pipeline_parallel_size=-1),
                                 dict(free_gpu_memory_fraction=1.5), dict(free_gpu_memory_fraction="0.5"),
                                 dict(kv_cache_dtype="int8"),
                                 dict(max_batch_size=8, cuda_graph_batch_sizes=(1, 16)), dict(max_seq_len=0),
                                 dict(dflash_attention_backend="FLASH")])
def test_bad_options_are_refused(bad):
    with pytest.raises(DFlashError):
        TrtllmOptions(**bad)


def test_bad_block_size_and_token_budget():
    with pytest.raises(DFlashError, match="block_size"):
        llm_api_options(drafter=DRAFTER, block_size=1)
    with pytest.raises(DFlashError, match="max_num_tokens"):
        llm_api_options(drafter=DRAFTER, block_size=16, options=TrtllmOptions(max_num_tokens=8, max_batch_size=4))
    # upstream's config-time budget (UPSTREAM_DFLASH_BUDGET's case): 32 x (1 + 7) = 256 > 100, at most 12 fit
    with pytest.raises(DFlashError, match=r"= 256 tokens per step, above max_num_tokens 100: TensorRT-LLM needs "
                                          r"max_num_tokens >= 256; use --max-batch-size 12 at most"):
        llm_api_options(drafter=DRAFTER, block_size=8, options=TrtllmOptions(max_num_tokens=100, max_batch_size=32))
    llm_api_options(drafter=DRAFTER, block_size=8, options=TrtllmOptions(max_num_tokens=96, max_batch_size=12))
    # batch 1,024 at block 16 with 8,192 tokens passed here and failed there
    with pytest.raises(DFlashError, match="use --max-batch-size 512 at most"):
        llm_api_options(drafter=DRAFTER, block_size=16, options=TrtllmOptions(max_batch_size=1024))


def test_dflash_context_cache_estimate_is_upstreams():
    # UPSTREAM_DFLASH_BUDGET's drafter: 5 layers, 16 KV heads (4 per rank at tp 4), head_dim 64, bf16, 1M positions
    drafter = {"block_size": 8, "num_hidden_layers": 5, "num_attention_heads": 128, "num_key_value_heads": 16,
               "head_dim": 64, "hidden_size": 8192, "max_position_embeddings": 1048576, "torch_dtype": "bfloat16"}
    options = llm_api_options(drafter=DRAFTER, block_size=8, options=TrtllmOptions(
        tensor_parallel_size=4, max_batch_size=32, max_seq_len=8192))
    assert trtllm.dflash_context_buffer_bytes(options, drafter) == 33 * 2 * 5 * (8192 + 8) * 4 * 64 * 2
    trtllm_kernels = llm_api_options(drafter=DRAFTER, block_size=8, options=TrtllmOptions(
        max_seq_len=8192, dflash_attention_backend="TRTLLM"))
    assert trtllm.dflash_context_buffer_bytes(trtllm_kernels, drafter) is None  # in the KV-cache pool
    assert trtllm.dflash_context_buffer_bytes(options, {"block_size": 8}) is None  # shape unknown


def test_draft_len_schedule_from_a_profile():
    # a GPU: a pass costs the same up to 64 tokens, then grows with them; acceptance 0.8 per position
    profile = {b: {k: max(1.0, b * k / 64) for k in (1, 2, 4, 8, 16)} for b in (1, 4, 16, 64)}
    schedule = trtllm.draft_len_schedule(profile, [0.8] * 15)
    # the whole block while it is free; at batch 64 speculation does not pay, and the tier says 1, not 0: a 0
    # tier is "off" in older releases and raised to 1 in newer ones (UPSTREAM_DRAFT_LEN_FLOOR)
    assert schedule == {1: 15, 4: 15, 16: 3, 64: 1}
    drafts = list(schedule.values())
    options = llm_api_options(drafter=DRAFTER, block_size=16, schedule=schedule)
    spec = options["speculative_config"]
    assert spec["draft_len_schedule"] == schedule and spec["max_draft_len"] == drafts[0]  # upstream's rule
    # a drafter that does not pay at batch 1: no schedule (the build keeps the whole block)
    assert trtllm.draft_len_schedule({1: {1: 1.0, 2: 1.5}}, [0.1]) == {}
    with pytest.raises(DFlashError, match="draft_len_schedule"):
        llm_api_options(drafter=DRAFTER, block_size=8, schedule={1: 3, 8: 5})  # longer than its first
    with pytest.raises(DFlashError, match="a 0 tier means 'off' in older releases and 1 in newer ones"):
        llm_api_options(drafter=DRAFTER, block_size=8, schedule={1: 7, 8: 0})


def test_extra_llm_api_options_yaml_round_trip(tmp_path):
    opts = llm_api_options(drafter=DRAFTER, block_size=16, target_layer_ids=[1, 9, 17])
    path = write_extra_llm_api_options(opts, tmp_path / "out" / "extra_llm_api_options.yaml")
    text = path.read_text()
    assert text.startswith("# TensorRT-LLM LLM API options") and "--config" in text
    assert yaml.safe_load(text) == opts
    # --backend pytorch is trtllm-serve's default and a deprecated field; --config the flag's current name
    assert serve_command("/models/Qwen3-8B", path) == ["trtllm-serve", "/models/Qwen3-8B", "--config", str(path)]


def _render(text: str, values: dict) -> str:
    # Same ${name} syntax as builder/render.py; substitute() raises on any unfilled placeholder.
    return string.Template(text).substitute(values)


def test_model_yaml_template_renders_to_the_options(tmp_path):
    opts = llm_api_options(drafter=DRAFTER, block_size=16, options=TrtllmOptions(kv_cache_dtype="fp8"))
    template = (trtllm.TEMPLATE_DIR / "tensorrt_llm" / "1" / "model.yaml").read_text()
    placeholders = set(re.findall(r"\$\{(\w+)\}", template))
    for decoupled in (True, False):
        values = template_values(opts, model="/models/Qwen3 8B: fp8", decoupled=decoupled)
        assert set(values) == placeholders
        rendered = yaml.safe_load(_render(template, values))
        assert rendered == model_yaml(opts, model="/models/Qwen3 8B: fp8", decoupled=decoupled)
        assert set(rendered["triton_config"]) == TRITON_CONFIG_FIELDS
        assert set(rendered) - {"triton_config"} <= TORCH_LLM_ARGS_FIELDS
    assert rendered["triton_config"] == {"max_batch_size": 0, "decoupled": False}


def test_render_with_the_builders_renderer(tmp_path):
    opts = llm_api_options(drafter=DRAFTER, block_size=16)
    model_dir = render_trtllm_repository(tmp_path / "repo", opts, model="/models/Qwen3-8B")  # parses config.pbtxt
    assert model_dir == tmp_path / "repo" / "tensorrt_llm"
    assert sorted(p.name for p in model_dir.rglob("*") if p.is_file()) == ["config.pbtxt", "model.yaml"]
    assert yaml.safe_load((model_dir / "1" / "model.yaml").read_text()) == model_yaml(opts, model="/models/Qwen3-8B")


def test_quantization_names_match_the_quantizer():
    from builder.options import KV_CACHE_FORMATS, QUANT_FORMATS

    assert set(trtllm.QUANTIZATION_MIN_SM) == set(QUANT_FORMATS)
    for kv in KV_CACHE_FORMATS:
        check_gpu_support(resolve_gpu("h100"), "fp8", kv_cache_dtype=kv)


def _tensors(pbtxt: str, section: str) -> dict:
    body = pbtxt.split(f"\n{section} [", 1)[1].split("\n]", 1)[0]
    found = re.findall(r'name:\s*"(\w+)"\s*data_type:\s*(\w+)\s*dims:\s*\[\s*([-\d]+)\s*\]', body)
    return {name: (dtype, dims) for name, dtype, dims in found}


def test_config_pbtxt_matches_the_upstream_llmapi_model():
    pbtxt = (trtllm.TEMPLATE_DIR / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "$" not in pbtxt
    code = "\n".join(line.split("#", 1)[0] for line in pbtxt.splitlines())
    assert re.search(r'^name: "tensorrt_llm"$', code, re.M) and re.search(r'^backend: "python"$', code, re.M)
    # model.py sets these from model.yaml's triton_config; set here they could not be changed there
    assert "max_batch_size" not in code and "decoupled" not in code
    inputs, outputs = _tensors(pbtxt, "input"), _tensors(pbtxt, "output")
    assert "text_input" in inputs and "text_output" in outputs
    assert all(UPSTREAM_INPUTS[name] == spec for name, spec in inputs.items())
    assert outputs == UPSTREAM_OUTPUTS
    assert code.count("name:") == 1 + len(inputs) + len(outputs)  # every tensor line was parsed


def test_template_directory_holds_no_nvidia_code():
    files = {p.relative_to(trtllm.TEMPLATE_DIR).as_posix() for p in trtllm.TEMPLATE_DIR.rglob("*") if p.is_file()}
    assert files == {"README.md", "tensorrt_llm/config.pbtxt", "tensorrt_llm/1/model.yaml"}
    assert "$" not in (trtllm.TEMPLATE_DIR / "README.md").read_text()


def test_dflash_serve_adds_the_image_model_code_to_a_trtllm_repository(tmp_path):
    # Before: nothing added the LLM-API model.py to a --runtime trtllm repository, so it never loaded.
    image = tmp_path / "app" / "all_models" / "llmapi" / "tensorrt_llm" / "1"
    image.mkdir(parents=True)
    (image / "model.py").write_text("# model\n")
    (image / "helpers.py").write_text("# helpers\n")
    (image / "model.yaml").write_text("model: upstream-example\n")
    repository = tmp_path / "build" / "model_repository"
    trtllm.render_trtllm_repository(repository, llm_api_options(drafter="/d", block_size=16), model="/t")
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    staged = serve.stage_trtllm_repository(repository, runtime, image)
    version = staged / "tensorrt_llm" / "1"
    assert sorted(p.name for p in version.iterdir()) == ["helpers.py", "model.py", "model.yaml"]
    assert (version / "model.py").read_text() == "# model\n"
    # absolute paths (/t, /d) are served as they are (the build's own ./ paths: tests/test_build.py)
    assert yaml.safe_load((version / "model.yaml").read_text()) == yaml.safe_load(
        (repository / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert not (repository / "tensorrt_llm" / "1" / "model.py").exists()  # the build stays as it was
    assert serve.stage_trtllm_repository(staged, runtime, image) == staged  # code present: served as it is
    with pytest.raises(serve.ServeError, match="tritonserver:<yy.mm>-trtllm-python-py3"):
        serve.stage_trtllm_repository(repository, tmp_path, tmp_path / "nowhere")
    assert serve.TRTLLM_MODEL_CODE == Path("/app/all_models/llmapi/tensorrt_llm/1")
    usage = subprocess.run([sys.executable, "-m", "deploy.serve", "--help"], capture_output=True, text=True, check=True,
                           cwd=trtllm.TEMPLATE_DIR.parents[1]).stdout
    assert "--trtllm-model-code" in usage


# --- GPU generation x quantization ------------------------------------------------------------------

@pytest.mark.parametrize("gpu,quant", [("a100", "none"), ("l40s", "fp8"), ("h100", "fp8"), ("h200", "none"),
                                       ("b200", "nvfp4"), ("gb300", "fp8")])
def test_supported_combinations(gpu, quant):
    check_gpu_support(resolve_gpu(gpu), quant)


def test_nvfp4_before_blackwell_is_refused_with_what_works():
    with pytest.raises(DFlashError) as e:
        check_gpu_support(resolve_gpu("h100"), "nvfp4")
    msg = str(e.value)
    assert "h100" in msg and "SM90" in msg and "nvfp4" in msg and "Blackwell" in msg and "fp8" in msg


def test_fp8_on_ampere_is_refused_with_what_works():
    with pytest.raises(DFlashError) as e:
        check_gpu_support(resolve_gpu("a100"), "fp8")
    assert "a100" in str(e.value) and "SM89" in str(e.value) and "use none (unquantized bf16)" in str(e.value)


def test_kv_cache_dtype_and_attention_backend_need_the_right_gpu():
    with pytest.raises(DFlashError, match="KV cache dtype fp8"):
        check_gpu_support(resolve_gpu("a100"), "none", kv_cache_dtype="fp8")
    check_gpu_support(resolve_gpu("a100"), "none", kv_cache_dtype="none")
    check_gpu_support(resolve_gpu("h100"), "fp8", kv_cache_dtype="fp8", dflash_attention_backend="VANILLA")
    with pytest.raises(DFlashError, match=r"needs SM100 or SM103 \(b200, gb200, b300, gb300\); on h200 \(SM90, Hopper\) use "
                                          "VANILLA or FA4"):
        check_gpu_support(resolve_gpu("h200"), "fp8", dflash_attention_backend="TRTLLM")
    check_gpu_support(resolve_gpu("h100"), "fp8", dflash_attention_backend="FA4")
    with pytest.raises(DFlashError, match=r"FA4 needs SM90 \(h100, h200, gh200\); on b200 .* use VANILLA or TRTLLM"):
        check_gpu_support(resolve_gpu("b200"), "fp8", dflash_attention_backend="FA4")
    check_gpu_support(resolve_gpu(sm=103), "nvfp4", kv_cache_dtype="nvfp4", dflash_attention_backend="TRTLLM")


def test_gpu_resolution_and_recommendations():
    assert resolve_gpu(sm=89).generation == "Ada" and resolve_gpu("H200").sm == 90
    assert resolve_gpu("sm90") == resolve_gpu("SM_90") == resolve_gpu(sm=90)  # --gpu by compute capability
    with pytest.raises(DFlashError, match="--gpu sm900 is not a compute capability"):
        resolve_gpu("sm900")
    recommended = {name: recommended_quantization(GPUS[name]) for name in ("a100", "l40s", "h100", "b200")}
    assert recommended == {"a100": "none", "l40s": "fp8", "h100": "fp8", "b200": "nvfp4"}
    for bad in (dict(gpu="v100"), dict(gpu="h100", sm=90), dict(), dict(sm=9.0)):
        with pytest.raises(DFlashError):
            resolve_gpu(**bad)
    with pytest.raises(DFlashError, match="Ampere"):
        check_gpu_support(resolve_gpu(sm=75), "none")
    with pytest.raises(DFlashError, match="unknown quantization"):
        check_gpu_support(resolve_gpu("h100"), "int4")


def test_every_gpu_preset_gets_options():
    for name, preset in PRESETS.items():
        if preset.gguf is not None:  # the embedded CPU default has no TensorRT-LLM deployment
            continue
        opts = llm_api_options(drafter=preset.drafter, block_size=preset.block_size)
        assert opts["speculative_config"]["speculative_model"] == preset.drafter
        assert opts["speculative_config"]["max_draft_len"] == preset.block_size - 1


# --- Validation against tensorrt_llm ----------------------------------------------------------------

def test_validation_reports_not_importable_here(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as on the project's machines: import fails
    result = validate_llm_args(llm_api_options(drafter=DRAFTER, block_size=16), model="/models/Qwen3-8B")
    assert result.validated is False
    assert "tensorrt_llm not importable here" in result.message
    assert "artifacts written, not validated" in str(result)


def _stand_in_tensorrt_llm(monkeypatch, seen: dict):
    """A tensorrt_llm with the two entry points the LLM API uses, checking what upstream's classes check."""

    class TorchLlmArgs:
        model_fields = dict.fromkeys(TORCH_LLM_ARGS_FIELDS | {"tokenizer", "gpus_per_node"})

        def __init__(self, **kwargs):
            seen.update(kwargs)
            spec = kwargs["speculative_config"]
            if spec["decoding_type"] != "DFlash" or not set(spec) <= DFLASH_DECODING_CONFIG_FIELDS:
                raise ValueError("1 validation error for TorchLlmArgs: speculative_config")
            self.speculative_config = types.SimpleNamespace(**spec)

    def update_llm_args_with_extra_dict(llm_args, llm_args_dict, extra_llm_api_options=None):
        return llm_args | llm_args_dict

    root = types.ModuleType("tensorrt_llm")
    root.__version__ = "1.3.0-stand-in"
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llm_args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    llm_args.TorchLlmArgs = TorchLlmArgs
    llm_utils = types.ModuleType("tensorrt_llm.llmapi.llm_utils")
    llm_utils.update_llm_args_with_extra_dict = update_llm_args_with_extra_dict
    for name, module in [("tensorrt_llm", root), ("tensorrt_llm.llmapi", llmapi),
                         ("tensorrt_llm.llmapi.llm_args", llm_args), ("tensorrt_llm.llmapi.llm_utils", llm_utils)]:
        monkeypatch.setitem(sys.modules, name, module)


def test_validation_builds_the_upstream_args_with_local_paths(monkeypatch):
    seen = {}
    _stand_in_tensorrt_llm(monkeypatch, seen)
    opts = model_yaml(llm_api_options(drafter=DRAFTER, block_size=16), model="/models/Qwen3-8B")
    result = validate_llm_args(opts, model="/local/qwen3-8b", speculative_model="/local/drafter")
    assert result.validated and "1.3.0-stand-in" in result.message
    assert seen["model"] == "/local/qwen3-8b" and seen["speculative_config"]["speculative_model"] == "/local/drafter"
    assert seen["backend"] == "pytorch" and "triton_config" not in seen
    assert opts["speculative_config"]["speculative_model"] == DRAFTER  # the written options are not modified


def test_validation_surfaces_upstream_errors(monkeypatch):
    _stand_in_tensorrt_llm(monkeypatch, {})
    opts = llm_api_options(drafter=DRAFTER, block_size=16)
    with pytest.raises(DFlashError, match="invalid argument.*no_such_field"):
        validate_llm_args({**opts, "no_such_field": 1}, model="/local/qwen3-8b")
    bad = {**opts, "speculative_config": {**opts["speculative_config"], "decoding_type": "Eagle3"}}
    with pytest.raises(DFlashError, match="TensorRT-LLM refused.*speculative_config"):
        validate_llm_args(bad, model="/local/qwen3-8b")
