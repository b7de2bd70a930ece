"""Quantize a target with NVIDIA ModelOpt and export the unified HF checkpoint, with a quality report.

FP8 (W8A8, per-tensor) or NVFP4 (W4A4, blocks of 16) on the target's linear layers, optionally an
FP8 KV cache; the embedding and LM head stay unquantized (ModelOpt's defaults). Calibration runs on
ShareGPT's training split, quality is measured on its held-out split (dflash_tools.prompts); the
drafter is not touched. The export (`hf_quant_config.json` + safetensors + tokenizer) loads in
TensorRT-LLM, vLLM and SGLang, and in our runtime, which dequantizes it at load time.

What is measured, and with what:
- "fake_quant": the ModelOpt-quantized model itself (weights, activations and KV cache rounded as a
  GPU runtime would). On CPU only for FP8: NVFP4's fake-quantized forward needs CUDA.
- "dequantized": the exported checkpoint loaded by our runtime (weights dequantized, activations
  and KV cache in float32): what the CPU runtime serves, and what tau is measured with.
Both against the unquantized model: held-out perplexity, and greedy agreement along the unquantized
model's own greedy continuations of held-out prompts (the first divergence is where greedy
decoding with the quantized model would first differ).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from builder.options import check_quant_formats
from dflash_contract import DFlashError
from dflash_runtime.target import load_target
from dflash_runtime.text import load_tokenizer
from dflash_tools.prompts import sharegpt_conversations
from dflash_tools.quality import chat_text, heldout_set, measure, runtime_logits


@dataclass(frozen=True)
class QuantizeOptions:
    quant: str  # QUANT_FORMATS
    kv_cache: str = "fp8"  # KV_CACHE_FORMATS
    calib_samples: int = 128
    seed: int = 0
    calib_max_tokens: int = 512  # per calibration text
    eval_texts: int = 16  # held-out texts for perplexity ...
    eval_max_tokens: int = 256  # ... of at most this many tokens
    agreement_prompts: int = 8  # held-out prompts for greedy agreement ...
    agreement_tokens: int = 64  # ... and the unquantized model's greedy tokens compared on each
    export_dtype: torch.dtype = torch.bfloat16  # of the layers left unquantized (embedding, norms, LM head)
    device: str = "cpu"

    @property
    def model_dtype(self) -> torch.dtype:
        """What the target is calibrated and evaluated in: bfloat16 on CUDA (an 8B target in float32 needs 32 GB
        and runs at a fraction of the speed), float32 on a CPU (no fast bfloat16 there; the reference)."""
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    def __post_init__(self):
        check_quant_formats(self.quant, self.kv_cache)
        if self.quant == "none" and self.kv_cache == "none":
            raise DFlashError("nothing to quantize: --quant none with --kv-cache none uses the target as it is")
        if self.calib_samples < 1:
            raise DFlashError(f"--calib-samples must be at least 1 (got {self.calib_samples})")
        if self.eval_texts < 1 or self.eval_max_tokens < 2:
            raise DFlashError("perplexity needs at least one held-out text of at least two tokens")


def modelopt_config(quant: str, kv_cache: str) -> tuple[dict, str]:
    """The mtq.quantize config and its name, e.g. "FP8_DEFAULT_CFG + FP8_KV_CFG"."""
    import modelopt.torch.quantization as mtq

    names = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}
    config = getattr(mtq, names[quant]) if quant != "none" else {}  # {}: every quantizer off but the KV's
    if kv_cache == "fp8":
        with contextlib.redirect_stdout(sys.stderr):  # ModelOpt prints the merged config
            config = mtq.update_quant_cfg_with_kv_cache_quant(config, mtq.FP8_KV_CFG["quant_cfg"])
    parts = [names[quant]] if quant != "none" else []
    return config, " + ".join(parts + ["FP8_KV_CFG"] * (kv_cache == "fp8"))


def quantize_target(target_dir: str | Path, output_dir: str | Path, quant: str, kv_cache: str = "fp8",
                    calib_samples: int = 128, seed: int = 0, progress: bool = True, **options) -> dict:
    """Quantize the HF target in target_dir, export it to output_dir, and return the quality report.

    options: the other QuantizeOptions fields (evaluation sizes, export dtype, device). output_dir
    appears complete or not at all: it is written beside it and renamed at the end; an existing
    output_dir is replaced.
    """
    opts = QuantizeOptions(quant, kv_cache, calib_samples, seed, **options)
    target_dir, output_dir = Path(target_dir), Path(output_dir)
    started = time.perf_counter()
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise DFlashError(f"{target_dir} has no tokenizer: the calibration set is text")
    staging = _staging_dir(output_dir)  # fail on an unwritable destination before calibrating
    try:
        report = _quantize(target_dir, staging, tokenizer, opts, progress)
        _replace(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report["checkpoint"]["path"] = str(output_dir)
    report["seconds"]["total"] = round(time.perf_counter() - started, 1)
    return report


@dataclass(frozen=True)
class _Reference:
    """The unquantized model's measurements every quantized variant is compared with."""
    texts: list[list[int]]  # held-out texts for perplexity
    paths: list[tuple[list[int], int]]  # its greedy continuations of held-out prompts (path, prompt length)
    baseline: dict  # measure() of the unquantized model


def _quantize(target_dir: Path, staging: Path, tokenizer, opts: QuantizeOptions, progress: bool) -> dict:
    """Measure the unquantized target, calibrate, evaluate and export into staging; the report."""
    config, config_name = modelopt_config(opts.quant, opts.kv_cache)
    torch.manual_seed(opts.seed)
    seconds = {}
    calibration = calibration_set(tokenizer, opts.calib_samples, opts.calib_max_tokens, opts.seed)
    texts, prompts = heldout_set(tokenizer, opts.eval_texts, opts.eval_max_tokens, opts.agreement_prompts)
    model = _load_hf_model(target_dir, opts.device, opts.model_dtype)
    estimate = _Estimate.measure(model, calibration, texts, prompts, opts.agreement_tokens)
    if progress:
        print(f"quantize: {estimate.up_front()}", file=sys.stderr)
    with _timed(seconds, "reference"):
        reference = _measure_reference(model, tokenizer, texts, prompts, opts, progress)
    with _timed(seconds, "calibration"):
        _calibrate(model, config, calibration, opts, progress, estimate)
    evaluation = {}
    with _timed(seconds, "evaluation"):
        if opts.quant != "nvfp4" or opts.device != "cpu":  # NVFP4 fake quantization asserts CUDA tensors
            evaluation["fake_quant"] = _measure_against(_hf_logits(model), reference, "fake-quantized", progress)
    with _timed(seconds, "export"):
        export(model, tokenizer, staging, opts.export_dtype)
    del model
    with _timed(seconds, "evaluation"):
        runtime = load_target(staging, opts.model_dtype, opts.device)
        evaluation["dequantized"] = _measure_against(runtime_logits(runtime), reference, "dequantized", progress)
    return _report(target_dir, staging, opts, config_name, calibration, reference, evaluation, seconds)


@contextlib.contextmanager
def _timed(seconds: dict, key: str):
    """Add the block's wall time, rounded to 0.1 s, to seconds[key]."""
    t = time.perf_counter()
    yield
    seconds[key] = seconds.get(key, 0) + round(time.perf_counter() - t, 1)


def _load_hf_model(target_dir: Path, device: str, dtype: torch.dtype):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    if not getattr(model.config, "architectures", None):  # export_hf_checkpoint needs it
        model.config.architectures = [type(model).__name__]
    return model


def _measure_reference(model, tokenizer, texts: list[list[int]], prompts: list[list[int]], opts: QuantizeOptions,
                       progress: bool) -> _Reference:
    eos = _eos_id(model, tokenizer)
    paths = [greedy_path(model, ids, opts.agreement_tokens, eos) for ids in
             tqdm(prompts, desc="greedy reference", disable=not progress, file=sys.stderr)]
    return _Reference(texts, paths, measure(_hf_logits(model), texts, paths, None, "unquantized", progress))


def _measure_against(logits_fn, reference: _Reference, label: str, progress: bool) -> dict:
    return measure(logits_fn, reference.texts, reference.paths, reference.baseline, label, progress)


@dataclass
class _Estimate:
    """How long quantizing takes on this machine, from timed forward passes of the unquantized model: the
    stages' token counts times the seconds per token. ModelOpt's quantizers slow every pass by a factor only
    their first calibration sample tells, so the calibration and the fake-quantized evaluation are estimated
    again then."""
    per_token: float  # seconds per token of a full-length forward pass
    per_step: float  # seconds of a one-token forward pass (a greedy decoding step)
    calibration_tokens: int
    evaluation_tokens: int  # perplexity texts + greedy paths, for each evaluated variant
    reference_steps: int  # greedy decoding steps of the unquantized reference paths

    @classmethod
    def measure(cls, model, calibration: list[list[int]], texts: list[list[int]], prompts: list[list[int]],
                agreement_tokens: int):
        """`prompts` are decoded agreement_tokens further for the reference paths, each then read once per
        evaluation."""
        logits = _hf_logits(model)
        longest = max(calibration, key=len)
        logits(longest)  # the first pass pays for allocations
        t = time.perf_counter()
        logits(longest)[-1, 0].item()  # .item(): waits for a GPU
        per_token = (time.perf_counter() - t) / len(longest)
        t = time.perf_counter()
        logits(longest[:1])[-1, 0].item()
        per_step = time.perf_counter() - t
        steps = len(prompts) * agreement_tokens
        return cls(per_token, per_step, sum(map(len, calibration)),
                   sum(map(len, texts)) + sum(map(len, prompts)) + steps, steps)

    def up_front(self) -> str:
        reference = self.reference_steps * self.per_step + self.evaluation_tokens * self.per_token
        plain = self.calibration_tokens * self.per_token
        return (f"about {_minutes(reference)} for the unquantized reference, then calibration: at least "
                f"{_minutes(plain)} (ModelOpt's quantizers add a factor measured on its first sample), then "
                f"evaluation and export (from a timed forward pass: {self.per_token * 1e3:.2f} ms/token)")

    def after_first_sample(self, seconds: float, tokens: int) -> str:
        factor = seconds / (tokens * self.per_token)
        calibration = seconds * (self.calibration_tokens - tokens) / tokens
        evaluation = self.evaluation_tokens * self.per_token * (factor + 1)  # fake-quantized, then dequantized
        return (f"calibration's first sample took {seconds:.1f} s ({factor:.1f}x a plain pass): about "
                f"{_minutes(calibration)} more to calibrate, then about {_minutes(evaluation)} to evaluate")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _calibrate(model, config: dict, calibration: list[list[int]], opts: QuantizeOptions, progress: bool,
               estimate: _Estimate) -> None:
    """ModelOpt's max calibration over the calibration texts: the model is quantized in place."""
    import modelopt.torch.quantization as mtq

    def forward_loop(m):
        for n, ids in enumerate(tqdm(calibration, desc=f"calibrating {opts.quant}", disable=not progress,
                                     file=sys.stderr)):
            t = time.perf_counter()
            m(torch.tensor([ids], device=opts.device))
            if n == 0 and progress and len(calibration) > 1:
                tqdm.write(f"quantize: {estimate.after_first_sample(time.perf_counter() - t, len(ids))}",
                           file=sys.stderr)

    with torch.no_grad(), contextlib.redirect_stdout(sys.stderr):
        mtq.quantize(model, config, forward_loop)


def _report(target_dir: Path, staging: Path, opts: QuantizeOptions, config_name: str, calibration: list[list[int]],
            reference: _Reference, evaluation: dict, seconds: dict) -> dict:
    """What was done and measured; quantize_target adds the checkpoint's final path and the total time."""
    import modelopt

    hf_quant = json.loads((staging / "hf_quant_config.json").read_text())["quantization"]
    primary = evaluation.get("fake_quant", evaluation["dequantized"])
    texts = reference.texts
    return {
        "quant": opts.quant,
        "kv_cache": opts.kv_cache,
        "method": f"ModelOpt {modelopt.__version__} PTQ, {config_name} (max calibration)",
        "quant_algo": hf_quant.get("quant_algo"),
        "kv_cache_quant_algo": hf_quant.get("kv_cache_quant_algo"),
        "excluded_modules": hf_quant.get("exclude_modules", []),
        "calibration": {"dataset": "ShareGPT V3, training split", "samples": len(calibration),
                        "max_tokens": opts.calib_max_tokens, "tokens": sum(map(len, calibration)), "seed": opts.seed},
        "heldout": {"dataset": "ShareGPT V3, held-out split", "texts": len(texts), "tokens": sum(map(len, texts)),
                    "agreement_prompts": len(reference.paths), "agreement_tokens": opts.agreement_tokens},
        "unquantized": {"perplexity": reference.baseline["perplexity"]},
        # the headline numbers: the GPU's arithmetic where this machine can emulate it, else the dequantized weights
        "perplexity": primary["perplexity"],
        "greedy_agreement": primary["greedy_agreement"],
        "measured_with": "fake_quant" if "fake_quant" in evaluation else "dequantized",
        "evaluation": evaluation,
        "checkpoint": {"bytes": _size(staging), "unquantized_bytes": _size(target_dir, "*.safetensors"),
                       "export_dtype": str(opts.export_dtype).removeprefix("torch.")},
        "seconds": seconds,
    }


def calibration_set(tokenizer, samples: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Chat-formatted (prompt, reply) pairs from ShareGPT's training split, a seeded draw of the first few hundred."""
    pool = list(itertools.islice(sharegpt_conversations("train"), max(4 * samples, 256)))
    if len(pool) < samples:
        raise DFlashError(f"--calib-samples {samples}: ShareGPT's training split has only {len(pool)} conversations")
    chosen = random.Random(seed).sample(pool, samples)
    return [chat_text(tokenizer, prompt, reply, max_tokens) for prompt, reply in chosen]


def _eos_id(model, tokenizer) -> int | None:
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    return eos if eos is not None else tokenizer.eos_token_id


@torch.no_grad()
def greedy_path(model, prompt: list[int], new_tokens: int, eos: int | None) -> tuple[list[int], int]:
    """(prompt + the model's greedy continuation, prompt length)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    return out[0].tolist(), len(prompt)


def _hf_logits(model):
    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids], device=model.device)).logits[0].float()
    return logits


def export(model, tokenizer, out: Path, dtype: torch.dtype) -> None:
    """ModelOpt's unified HF checkpoint plus the tokenizer: a complete target directory."""
    from modelopt.torch.export import export_hf_checkpoint
    from safetensors import SafetensorError

    try:
        config_log = logging.getLogger("transformers.configuration_utils")
        level = config_log.level
        with torch.inference_mode(), contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            # calibrating in float32 and exporting the unquantized layers in bfloat16 is intended
            warnings.filterwarnings("ignore", message="Model's original dtype")
            # ModelOpt's own ways, nothing a user can act on: it copies scales with torch.tensor(tensor), and it
            # reads model.config.torch_dtype, which transformers answers with "`torch_dtype` is deprecated"
            warnings.filterwarnings("ignore", message="To copy construct from a tensor", module="modelopt")
            config_log.setLevel(logging.ERROR)
            try:
                export_hf_checkpoint(model, dtype=dtype, export_dir=out)
            finally:
                config_log.setLevel(level)
        tokenizer.save_pretrained(out)
        _write_both_rope_spellings(out / "config.json")
    except (OSError, SafetensorError) as e:
        full = "No space left" in str(e) or getattr(e, "errno", None) == 28
        raise DFlashError(f"writing the quantized checkpoint in {out.parent} failed"
                          f"{' (disk full)' if full else ''}: {e}") from None


def _write_both_rope_spellings(config_file: Path) -> None:
    """transformers 5.x writes only rope_parameters; 4.x readers (some serving stacks) fall back to base
    10000 without rope_theta, which silently breaks targets such as SmolLM2 (base 100000)."""
    config = json.loads(config_file.read_text())
    params = config.get("rope_parameters") or {}
    if "rope_theta" in params and "rope_theta" not in config:
        config["rope_theta"] = params["rope_theta"]
        if params.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
            config["rope_scaling"] = params
        config_file.write_text(json.dumps(config, indent=2) + "\n")


def _staging_dir(output_dir: Path) -> Path:
    staging = output_dir.with_name(f".{output_dir.name}.partial-{os.getpid()}")
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    except OSError as e:
        raise DFlashError(f"cannot write the quantized checkpoint beside {output_dir}: {e}") from None
    return staging


def _replace(staging: Path, output_dir: Path) -> None:
    """Swap the finished checkpoint into place: output_dir never holds a partial checkpoint."""
    old = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}")
    try:
        if output_dir.exists():
            output_dir.rename(old)
        staging.rename(output_dir)
    except OSError as e:
        if old.exists() and not output_dir.exists():
            old.rename(output_dir)
        raise DFlashError(f"cannot move the quantized checkpoint into {output_dir}: {e}") from None
    shutil.rmtree(old, ignore_errors=True)


def _size(path: Path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in path.glob(pattern) if f.is_file())
