"""`--runtime trtllm`: TensorRT-LLM's PyTorch backend (>= 1.3) with `DFlashDecodingConfig`.

TensorRT-LLM runs DFlash only in its PyTorch backend, configured through the LLM API: a dict of
`TorchLlmArgs` fields, written as YAML for `trtllm-serve --config` (alias `--extra_llm_api_options`)
and, with `model` and a `triton_config` section added, as the `model.yaml` of Triton's LLM-API model
(`model_repository/trtllm/`). The legacy engine flow (`trtllm-build`, TensorRT engines) has no DFlash,
so there is nothing to compile: the "build" for this runtime is the quantized checkpoint (ModelOpt
writes `hf_quant_config.json`, which the LLM API reads by itself) plus these options.

Every key written here was read in the upstream source (the `UPSTREAM_*` constants name the file and
commit; tests/test_trtllm.py checks the options key by key against those names). Where
`tensorrt_llm` imports, `validate_llm_args` constructs the upstream args class from the options the
way the LLM API does; where it does not (any machine without the NVIDIA wheel), it says so and the
artifacts are still written.

GPU facts (compute capability -> quantization) live here, not in dflash_runtime: they only matter for
GPU runtimes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from dflash_contract import DFlashError
from dflash_contract.layout import TEMPLATES

TEMPLATE_DIR = TEMPLATES / "trtllm"

# Where each fact below was read (GitHub NVIDIA/TensorRT-LLM, path @ commit).
UPSTREAM_LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412"
UPSTREAM_DFLASH_WORKER = "tensorrt_llm/_torch/speculative/dflash.py @ 00679c66c3e38f6d2651ad0a5bef0f94d862e36c"
_LLMAPI = "triton_backend/all_models/llmapi/tensorrt_llm"
UPSTREAM_LLMAPI_MODEL = f"{_LLMAPI}/1/model.py @ 044a90d209e380c95e23e8ae42f3583fa05ada78"
UPSTREAM_LLMAPI_CONFIG = f"{_LLMAPI}/config.pbtxt @ 0a71057313ec0626527e164a8fc0205c5822e2f5"
# Newer rules, read in upstream's tests (their implementation was in open pull requests when read, 2026-12-01):
# the config-time DFlash budget (token budget, context-buffer estimate) and the floor of 1 on draft lengths
# in one-model modes, which turns a schedule's 0 tier from "speculation off" into "draft 1".
UPSTREAM_DFLASH_BUDGET = ("tests/unittest/_torch/speculative/hw_agnostic/test_dflash_config_budget.py @ "
                          "b874cd50f2e85065d6dcac8728590ca8f3e8ccb0")
UPSTREAM_DRAFT_LEN_FLOOR = ("tests/unittest/_torch/speculative/test_min_runtime_draft_len.py @ "
                            "011d0933dcb5e592f5fa2626beaf42a96324c578")

# --- GPU generations and what they can run -----------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    name: str
    sm: int  # compute capability major*10 + minor

    @property
    def generation(self) -> str:
        if self.sm >= 100:
            return "Blackwell"
        if self.sm >= 90:
            return "Hopper"
        if self.sm == 89:
            return "Ada"
        if self.sm >= 80:
            return "Ampere"
        return "pre-Ampere"

    def __str__(self) -> str:
        return f"{self.name} (SM{self.sm}, {self.generation})"


GPUS = {g.name: g for g in [
    Gpu("a100", 80), Gpu("a10g", 86), Gpu("l4", 89), Gpu("l40s", 89),
    Gpu("h100", 90), Gpu("h200", 90), Gpu("gh200", 90),
    Gpu("b200", 100), Gpu("gb200", 100), Gpu("b300", 103), Gpu("gb300", 103),
]}

# Weight quantization (builder/quantize.py's names; "none" keeps the checkpoint's bf16) -> lowest compute
# capability whose tensor cores run it: FP8 needs Ada/Hopper (SM89+), NVFP4 needs Blackwell (SM100+).
# Listed best first.
QUANTIZATION_MIN_SM = {"nvfp4": 100, "fp8": 89, "none": 80}
# kv_cache_config.dtype values we write (upstream also accepts fp8_ds_mla and torch dtype names). "auto"
# keeps what the checkpoint says: a ModelOpt export with an FP8 KV cache records kv_cache_quant_algo in
# hf_quant_config.json, which upstream applies by itself.
KV_CACHE_DTYPE_MIN_SM = {"auto": 0, "fp8": 89, "nvfp4": 100}
_KV_CHECK_MIN_SM = {**KV_CACHE_DTYPE_MIN_SM, "none": 0}  # check_gpu_support also takes quantize.py's --kv-cache names


def _quant_label(quantization: str) -> str:
    return "none (unquantized bf16)" if quantization == "none" else quantization
# DFlashDecodingConfig.attention_backend: TRTLLM "requires FlashInfer and an NVIDIA Blackwell GPU with
# SM100 or SM103" (upstream field description); FA4 (1.3.0rc27 and later) "is supported on SM90 only"
# (upstream's validate_dflash_fa4_runtime); VANILLA runs everywhere the PyTorch backend does.
DFLASH_ATTENTION_BACKEND_SMS = {"VANILLA": None, "TRTLLM": (100, 103), "FA4": (90,)}


def resolve_gpu(gpu: str | None = None, sm: int | None = None) -> Gpu:
    """A GPU from its name (`--gpu h100`), its compute capability as a name (`--gpu sm90`) or as a number."""
    if (gpu is None) == (sm is None):
        raise DFlashError("name the GPU either by its name (" + ", ".join(GPUS) + ") or by its compute "
                          "capability (e.g. 90), not both")
    if gpu is not None:
        key = gpu.lower()
        if key in GPUS:
            return GPUS[key]
        capability = re.fullmatch(r"sm_?(\d+)", key)
        if capability is None:
            raise DFlashError(f"unknown GPU {gpu!r} (--gpu): known are {', '.join(GPUS)}; for another GPU give "
                              "its compute capability, major*10+minor: --gpu sm90, sm89, sm100, ...")
        sm = int(capability.group(1))
    if not isinstance(sm, int) or isinstance(sm, bool) or not 10 <= sm <= 200:
        raise DFlashError(f"--gpu sm{sm!r} is not a compute capability: give major*10+minor, e.g. sm80, sm89, sm90, "
                          "sm100")
    return Gpu(f"sm{sm}", sm)


def supported_quantizations(gpu: Gpu) -> list[str]:
    return [q for q, min_sm in QUANTIZATION_MIN_SM.items() if gpu.sm >= min_sm]


def recommended_quantization(gpu: Gpu) -> str:
    """The most compact weight format the GPU's tensor cores run natively."""
    supported = supported_quantizations(gpu)
    if not supported:
        raise DFlashError(f"{gpu} is older than Ampere: TensorRT-LLM's PyTorch backend needs SM80 or newer")
    return supported[0]


def check_gpu_support(gpu: Gpu, quantization: str, kv_cache_dtype: str = "auto",
                      dflash_attention_backend: str | None = None) -> None:
    """Refuse combinations the GPU cannot run, naming the GPU, the choice and what would work."""
    if quantization not in QUANTIZATION_MIN_SM:
        raise DFlashError(f"unknown quantization {quantization!r} for --runtime trtllm "
                          f"(choose from {', '.join(QUANTIZATION_MIN_SM)})")
    if gpu.sm < QUANTIZATION_MIN_SM["none"]:
        raise DFlashError(f"{gpu} is older than Ampere: TensorRT-LLM's PyTorch backend needs SM80 or newer")
    if gpu.sm < QUANTIZATION_MIN_SM[quantization]:
        need = ("Blackwell (SM100+, e.g. b200, gb200, b300)" if quantization == "nvfp4"
                else "Ada or Hopper (SM89+, e.g. l40s, h100, h200)")
        raise DFlashError(
            f"quantization {quantization} does not run on {gpu}: it needs {need}. "
            f"On {gpu.name} use {' or '.join(_quant_label(q) for q in supported_quantizations(gpu))} "
            f"(recommended: {recommended_quantization(gpu)})")
    if kv_cache_dtype not in _KV_CHECK_MIN_SM:
        raise DFlashError(f"unknown KV cache dtype {kv_cache_dtype!r} (choose from {', '.join(_KV_CHECK_MIN_SM)})")
    if gpu.sm < _KV_CHECK_MIN_SM[kv_cache_dtype]:
        ok = [d for d, s in _KV_CHECK_MIN_SM.items() if gpu.sm >= s]
        raise DFlashError(f"KV cache dtype {kv_cache_dtype} does not run on {gpu}; use {' or '.join(ok)}")
    if dflash_attention_backend is not None:
        if dflash_attention_backend not in DFLASH_ATTENTION_BACKEND_SMS:
            raise DFlashError(f"unknown DFlash attention backend {dflash_attention_backend!r} "
                              f"(choose from {', '.join(DFLASH_ATTENTION_BACKEND_SMS)})")
        sms = DFLASH_ATTENTION_BACKEND_SMS[dflash_attention_backend]
        if sms is not None and gpu.sm not in sms:
            fits = [g.name for g in GPUS.values() if g.sm in sms]
            usable = [b for b, s in DFLASH_ATTENTION_BACKEND_SMS.items() if s is None or gpu.sm in s]
            raise DFlashError(f"DFlash attention backend {dflash_attention_backend} needs "
                              f"{' or '.join(f'SM{sm}' for sm in sms)} ({', '.join(fits)}); on {gpu} use "
                              + " or ".join(usable))


# --- Parallelism against the model's shape ------------------------------------------------------------

# How TensorRT-LLM's PyTorch backend splits a model (read in the source): attention by heads, each rank taking
# num_heads / tp query heads (`assert self.num_heads % tp_size == 0`) and ceil(kv_heads / tp) KV heads
# (UPSTREAM_TP_HEADS); the KV weights are split where kv_heads >= tp (then kv_heads % tp == 0) and copied
# to tp / kv_heads ranks each where kv_heads < tp (then tp % kv_heads == 0: duplicate_kv_weight,
# UPSTREAM_TP_KV_HEADS); the pipeline by layers, at least one per stage (`num_hidden_layers >= pp_size`,
# DecoderModel.__pp_init__, same file). The drafter is such a model too (DFlashForCausalLM builds its architecture's
# model class, tensorrt_llm/_torch/models/modeling_dflash.py): its attention heads are split the same way.
UPSTREAM_TP_HEADS = "tensorrt_llm/_torch/modules/attention.py @ c6d3bb2aae305e0b5ac1b97b7954dcf87d653322"
UPSTREAM_TP_KV_HEADS = "tensorrt_llm/_torch/models/modeling_utils.py @ cb4c622cf5bb97009451f7f44609498a48a2b11d"


def splits_heads(tp: int, heads: int, kv_heads: int) -> bool:
    """Whether TensorRT-LLM can give `tp` GPUs equal shares of the attention (UPSTREAM_TP_HEADS)."""
    kv_split = kv_heads % tp == 0 if kv_heads >= tp else tp % kv_heads == 0
    return heads % tp == 0 and kv_split


def check_tensor_parallel(tp: int, heads: int, kv_heads: int, model: str) -> None:
    """Refuse a --tensor-parallel-size that `model`'s attention heads do not split by, naming those that do."""
    if not splits_heads(tp, heads, kv_heads):
        fits = [n for n in range(1, heads + 1) if splits_heads(n, heads, kv_heads)]
        raise DFlashError(f"--tensor-parallel-size {tp} does not split {model}'s {heads} attention heads "
                          f"({kv_heads} KV heads) evenly over {tp} GPUs, which TensorRT-LLM requires: use "
                          f"{', '.join(map(str, fits))}")


def check_pipeline_stages(pp: int, layers: int, model: str) -> None:
    if pp > layers:
        raise DFlashError(f"--pipeline-parallel-size {pp} is more stages than {model}'s {layers} layers: "
                          f"TensorRT-LLM needs a layer per stage at least; use {layers} at most")


# --- LLM API options --------------------------------------------------------------------------------

def _default_cuda_graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    sizes = [1 << i for i in range(max_batch_size.bit_length()) if (1 << i) <= max_batch_size]
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return tuple(sizes)


@dataclass(frozen=True)
class TrtllmOptions:
    """Serving knobs for the TensorRT-LLM PyTorch backend, validated once at the door.

    max_batch_size and max_seq_len also size DFlash's per-request context cache, which upstream
    allocates for (max_batch_size + 1) slots x max_seq_len positions x draft layers: keep them at
    what the deployment serves, not at upstream's defaults (2048 requests, the model's full context).
    """
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    free_gpu_memory_fraction: float = 0.8  # of the memory left after weights; DFlash buffers come later
    kv_cache_dtype: str = "auto"  # "auto" keeps the checkpoint's own KV quantization (hf_quant_config.json)
    max_batch_size: int = 32
    max_num_tokens: int = 8192
    max_seq_len: int | None = 8192  # None: upstream derives it from the target's config
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: powers of two up to max_batch_size
    cuda_graph_padding: bool = True
    dflash_attention_backend: str | None = None  # None: upstream default (VANILLA)

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_batch_size", "max_num_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DFlashError(f"{name} must be a positive integer, got {value!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise DFlashError(f"max_seq_len must be a positive integer or unset, got {self.max_seq_len!r}")
        fraction = self.free_gpu_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise DFlashError(f"free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_MIN_SM:
            raise DFlashError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_MIN_SM)}, "
                              f"got {self.kv_cache_dtype!r}")
        backend = self.dflash_attention_backend
        if backend is not None and backend not in DFLASH_ATTENTION_BACKEND_SMS:
            raise DFlashError(f"dflash_attention_backend must be one of {', '.join(DFLASH_ATTENTION_BACKEND_SMS)}, "
                              f"got {self.dflash_attention_backend!r}")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
                raise DFlashError(f"cuda_graph_batch_sizes must be positive integers, got {sizes!r}")
            if max(sizes) > self.max_batch_size:
                raise DFlashError(f"cuda_graph_batch_sizes {list(sizes)} exceed max_batch_size {self.max_batch_size}")

    @property
    def graph_batch_sizes(self) -> list[int]:
        sizes = self.cuda_graph_batch_sizes or _default_cuda_graph_batch_sizes(self.max_batch_size)
        return sorted(set(sizes))


def max_draft_len_for(block_size: int) -> int:
    """A block is [last accepted token, MASK x (block_size - 1)]: each mask position drafts one token.

    Upstream (UPSTREAM_DFLASH_WORKER) takes the block width from the drafter checkpoint and refuses a
    max_draft_len above block_size - 1, so block_size - 1 is both the natural and the largest value.
    """
    if not isinstance(block_size, int) or block_size < 2:
        raise DFlashError(f"DFlash block_size must be an integer >= 2, got {block_size!r}")
    return block_size - 1


def check_token_budget(max_batch_size: int, max_draft_len: int, max_num_tokens: int) -> None:
    """Upstream's config-time token budget (UPSTREAM_DFLASH_BUDGET): every request of a full batch verifies
    its draft in one step. Upstream clamps a max_batch_size left at its default and refuses an explicit one
    that breaks it; we always write one, so the build refuses it first."""
    needed = max_batch_size * (1 + max_draft_len)
    if needed > max_num_tokens:
        raise DFlashError(f"--max-batch-size {max_batch_size} x (1 + max_draft_len {max_draft_len}) = {needed} "
                          f"tokens per step, above max_num_tokens {max_num_tokens}: TensorRT-LLM needs max_num_tokens "
                          f">= {needed}; use --max-batch-size {max_num_tokens // (1 + max_draft_len)} at most")


def draft_len_schedule(profile: dict[int, dict[int, float]], rates: list[float]) -> dict[int, int]:
    """TensorRT-LLM's `draft_len_schedule` from a profile of step seconds (batch size -> verify length ->
    seconds) and the per-position acceptance rates: per profiled batch size, the draft length whose
    expected tokens per second is highest. Upstream reads {B: d} as "batch sizes above the previous key,
    up to B, draft d" and requires the smallest key's d to be max_draft_len; longer drafts at larger
    batches (timing noise) are capped to it. An empty schedule: speculation does not pay at batch 1.

    A tier of 0 meant "speculation off"; newer releases raise it to 1 in one-model modes such as DFlash
    (UPSTREAM_DRAFT_LEN_FLOOR), as they do for batches above the largest key. So tiers are written at 1
    or more, and the keys reach the largest profiled batch (the build's max batch): the schedule means
    the same under either rule."""
    from dflash_runtime.verify_length import expected_tokens

    schedule = {}
    for batch_size in sorted(profile):
        seconds = profile[batch_size]
        expected = expected_tokens(rates, tuple(seconds), len(rates) + 1)
        schedule[batch_size] = max(seconds, key=lambda k: expected[k] / seconds[k]) - 1
    first = schedule[min(schedule)]
    return {b: max(1, min(d, first)) for b, d in schedule.items()} if first > 0 else {}


def llm_api_options(*, drafter: str | Path, block_size: int, options: TrtllmOptions = TrtllmOptions(),
                    mask_token_id: int | None = None, target_layer_ids: list[int] | tuple[int, ...] | None = None,
                    schedule: dict[int, int] | None = None) -> dict:
    """The `TorchLlmArgs` fields for DFlash (no `model`: trtllm-serve takes it on its command line).

    `drafter` is the drafter checkpoint as the serving machine sees it (a path or a HF repo id).
    `mask_token_id` / `target_layer_ids` may be left out: upstream then reads them from the drafter's
    `dflash_config` in config.json. Pass them to pin what the builder checked. `schedule`: a
    draft_len_schedule (draft_len_schedule()); its batch-1 draft length becomes max_draft_len.
    """
    max_draft_len = max_draft_len_for(block_size)
    if schedule:
        if not all(b >= 1 and 1 <= d <= schedule[min(schedule)] <= max_draft_len for b, d in schedule.items()):
            raise DFlashError(f"draft_len_schedule {schedule} must map batch sizes >= 1 to draft lengths from 1 (a 0 "
                              "tier means 'off' in older releases and 1 in newer ones) up to its first (the batch-1 "
                              f"draft length, at most {max_draft_len})")
        max_draft_len = schedule[min(schedule)]
    check_token_budget(options.max_batch_size, max_draft_len, options.max_num_tokens)
    speculative = {"decoding_type": "DFlash", "max_draft_len": max_draft_len, "speculative_model": str(drafter)}
    if mask_token_id is not None:
        speculative["mask_token_id"] = int(mask_token_id)
    if target_layer_ids is not None:
        speculative["target_layer_ids"] = [int(i) for i in target_layer_ids]
    if options.dflash_attention_backend is not None:
        speculative["attention_backend"] = options.dflash_attention_backend
    if schedule:
        speculative["draft_len_schedule"] = {int(b): int(d) for b, d in sorted(schedule.items())}
    out = {
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "max_batch_size": options.max_batch_size,
        "max_num_tokens": options.max_num_tokens,
    }
    if options.max_seq_len is not None:
        out["max_seq_len"] = options.max_seq_len
    # KV-cache block reuse stays at upstream's default (on): a prefix hit skips the prefill of the reused blocks,
    # so the drafter lacks the target's hidden states there until newer releases' context_recompute_tail (0 =
    # off) recomputes a tail. Not written: the pinned llm_args.py has no such field and LLM() refuses unknown
    # keys. A prefix hit makes drafts poorer for a while, never the output different (the target verifies).
    out["kv_cache_config"] = {"free_gpu_memory_fraction": float(options.free_gpu_memory_fraction),
                              "dtype": options.kv_cache_dtype}
    # max_batch_size is left out on purpose: upstream derives it as max(batch_sizes) and refuses a mismatch.
    out["cuda_graph_config"] = {"batch_sizes": options.graph_batch_sizes,
                                "enable_padding": bool(options.cuda_graph_padding)}
    out["speculative_config"] = speculative
    return out


def dflash_context_buffer_bytes(options: dict, drafter_config: dict) -> int | None:
    """Upstream's estimate of DFlash's private context cache per GPU (UPSTREAM_DFLASH_BUDGET), which its
    config check compares with what is left of the GPU beside the weights and the KV-cache pool: K and V
    for (max_batch_size + 1) slots x the drafter's layers x (max_seq_len + max_draft_len + 1) positions x
    its KV heads per tensor-parallel rank x head_dim. None where upstream charges nothing (TRTLLM borrows
    the KV-cache pool) or cannot tell (no max_seq_len, a drafter config without the shape)."""
    speculative = options["speculative_config"]
    if speculative.get("attention_backend") == "TRTLLM" or options.get("max_seq_len") is None:
        return None
    dflash = drafter_config.get("dflash_config", {})
    try:
        layers = int(drafter_config["num_hidden_layers"])
        kv_heads = int(drafter_config.get("num_key_value_heads") or drafter_config["num_attention_heads"])
        head_dim = int(drafter_config.get("head_dim")
                       or drafter_config["hidden_size"] // drafter_config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    positions = options["max_seq_len"]
    if drafter_config.get("max_position_embeddings"):
        positions = min(positions, int(drafter_config["max_position_embeddings"]))
    dtype = drafter_config.get("torch_dtype") or drafter_config.get("dtype") or dflash.get("dtype") or "bfloat16"
    dtype_bytes = 4 if str(dtype).removeprefix("torch.") == "float32" else 2
    per_rank_heads = max(1, kv_heads // options["tensor_parallel_size"])
    return (2 * (options["max_batch_size"] + 1) * layers * (positions + speculative["max_draft_len"] + 1)
            * per_rank_heads * head_dim * dtype_bytes)


# --- Writing ----------------------------------------------------------------------------------------

def _yaml(data: dict) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def write_extra_llm_api_options(options: dict, path: Path) -> Path:
    """extra_llm_api_options.yaml: `trtllm-serve <target> --config <path>` (older: --extra_llm_api_options)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = ("# TensorRT-LLM LLM API options (TorchLlmArgs) for DFlash speculative decoding, PyTorch backend.\n"
              "# Serve, in the build folder (paths starting ./ are the build's own): trtllm-serve ./target --config\n"
              "# <this file> (older releases: --extra_llm_api_options). Written by builder/trtllm.py.\n")
    path.write_text(header + _yaml(options))
    return path


def serve_command(model: str | Path, options_path: str | Path) -> list[str]:
    """argv for trtllm-serve's OpenAI-compatible server (an alternative to Triton). No `--backend pytorch`:
    it is trtllm-serve's default and the LLM API marks the `backend` field deprecated. `--config` is the
    current name of `--extra_llm_api_options` (an alias since before 1.3, the first release with DFlash)."""
    return ["trtllm-serve", str(model), "--config", str(options_path)]


def model_yaml(options: dict, *, model: str | Path, decoupled: bool = True) -> dict:
    """What Triton's LLM-API model reads from 1/model.yaml: LLM() kwargs plus a `triton_config` section.

    Upstream's model.py (UPSTREAM_LLMAPI_MODEL) passes every key except `triton_config` through
    `update_llm_args_with_extra_dict({}, ...)` into `LLM(**args)`, and takes `max_batch_size` (0: one
    prompt per request; the LLM batches in flight itself) and `decoupled` (True: streaming) from
    `triton_config` in its auto_complete_config. `backend: pytorch` stays, although the field is marked
    deprecated upstream: NVIDIA's own model.yaml for this model.py still writes it.
    """
    return {"model": str(model), "backend": "pytorch", **options,
            "triton_config": {"max_batch_size": 0, "decoupled": bool(decoupled)}}


def template_values(options: dict, *, model: str | Path, decoupled: bool = True) -> dict[str, str]:
    """Values for the `${name}` placeholders in model_repository/trtllm/ (see its README.md).

    Every value is YAML text: `model` a JSON-quoted scalar (valid YAML), `llm_api_options` a block of
    top-level keys, `decoupled` true/false.
    """
    return {
        "model": json.dumps(str(model)),
        "llm_api_options": _yaml(options).rstrip("\n"),
        "decoupled": "true" if decoupled else "false",
    }


def render_trtllm_repository(output: Path, options: dict, *, model: str | Path, decoupled: bool = True) -> Path:
    """Render model_repository/trtllm into `output` (the Triton --model-repository); returns the model dir.

    Uses builder/render.py: config.pbtxt is parsed with Triton's ModelConfig protobuf, 1/model.yaml is
    filled with `template_values` and read back to check it is the YAML `model_yaml` describes.
    model.py / helpers.py are NVIDIA's, added at launch by dflash-serve from the serving image
    (deploy/serve.py, `stage_trtllm_repository`), so they always match the installed tensorrt_llm.
    """
    from builder.render import fill, render_repository

    output = Path(output)
    render_repository(output, {}, models=("tensorrt_llm",), templates=TEMPLATE_DIR)
    model_dir = output / "tensorrt_llm"
    path = model_dir / "1" / "model.yaml"
    path.write_text(fill(path.read_text(), template_values(options, model=model, decoupled=decoupled),
                         str(TEMPLATE_DIR / "tensorrt_llm" / "1" / "model.yaml")))
    if yaml.safe_load(path.read_text()) != model_yaml(options, model=model, decoupled=decoupled):
        raise DFlashError(f"{path}: rendered model.yaml does not read back as the LLM API options")
    return model_dir


# --- Validation against the installed tensorrt_llm ---------------------------------------------------

@dataclass(frozen=True)
class Validation:
    validated: bool
    message: str
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


def validate_llm_args(options: dict, *, model: str | Path, speculative_model: str | Path | None = None) -> Validation:
    """Construct upstream's `TorchLlmArgs` from the options exactly as the LLM API would.

    Follows Triton's LLM-API model.py and trtllm-serve: `update_llm_args_with_extra_dict` merges the
    YAML dict, then `LLM(**args)` checks every key against `TorchLlmArgs.model_fields` (+ `backend`)
    and builds the args (`from_kwargs` in older releases, the constructor in newer ones).
    `model` / `speculative_model` are local paths for this check (the YAML may name paths inside the
    serving container); the target's tokenizer and the drafter's config.json are read from them.

    Returns a not-validated result, with the reason, where tensorrt_llm does not import; raises
    DFlashError with upstream's message where it imports and refuses the options.
    """
    try:
        from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict
    except (ImportError, OSError) as e:  # OSError: the wheel is there but a CUDA/TensorRT library is not
        return Validation(False, f"tensorrt_llm not importable here ({type(e).__name__}: {e}): "
                                 "artifacts written, not validated")
    args = {k: v for k, v in options.items() if k != "triton_config"}
    args["model"] = str(model)
    if speculative_model is not None and isinstance(args.get("speculative_config"), dict):
        args["speculative_config"] = {**args["speculative_config"], "speculative_model": str(speculative_model)}
    args.setdefault("backend", "pytorch")
    try:
        merged = update_llm_args_with_extra_dict({}, args)
        unknown = sorted(set(merged) - set(TorchLlmArgs.model_fields) - {"backend", "_mpi_session"})
        if unknown:
            raise ValueError(f"LLM got invalid argument(s): {', '.join(unknown)}")
        build = getattr(TorchLlmArgs, "from_kwargs", None) or TorchLlmArgs
        llm_args = build(**merged)
    except Exception as e:  # pydantic.ValidationError is a ValueError; upstream validators also assert
        raise DFlashError(f"TensorRT-LLM refused the LLM API options: {e}") from None
    spec = llm_args.speculative_config
    try:
        import tensorrt_llm
        version = getattr(tensorrt_llm, "__version__", "?")
    except Exception:
        version = "?"
    return Validation(True, f"validated with tensorrt_llm {version}: {type(llm_args).__name__} + {type(spec).__name__}",
                      {"tensorrt_llm": version, "mask_token_id": getattr(spec, "mask_token_id", None),
                       "target_layer_ids": getattr(spec, "target_layer_ids", None)})
