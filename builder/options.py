"""The build's options and its command line: plain Python, so the Helm chart's contract generator
(deploy/helm/contract.py) reads the builder's flags and choices from this parser without importing torch.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from builder.trtllm import DFLASH_ATTENTION_BACKEND_SMS
from dflash_contract import DFlashError
from dflash_contract.cli import ArgumentParser
from dflash_contract.presets import (AUTO_BLOCK_SIZE, CPU_WEIGHTS, DEFAULT_PREFILL_CHUNK, DEFAULT_PRESET,
                                     DEFAULT_SPECULATIVE_SAMPLING, PRESETS, REASONING_PARSERS, SPECULATIVE_SAMPLING,
                                     block_size_argument, check_speculative_sampling, preset_table)

RUNTIMES = ("torch", "trtllm")
QUANT_FORMATS = ("none", "fp8", "nvfp4")
KV_CACHE_FORMATS = ("none", "fp8")
PRESET_PARSER = "preset"  # --reasoning-parser: the target preset's
DEVICES = re.compile(r"auto|cpu|cuda(:\d+)?")  # what dflash_runtime.pipeline.resolve_device and torch take
# --max-context must hold a prompt and one whole draft block verified beside it, else speculation never runs a
# full step. The prompt's share is a short chat turn: SmolLM2's chat template alone makes 31 tokens of "Hi" (its
# default system prompt included); Qwen3's makes 9.
MIN_PROMPT_TOKENS = 32

BUILD_DESCRIPTION = """python builder/build.py: a target and its DFlash drafter -> a deployable, self-describing build.

    <output>/
      target/            the target checkpoint (a ModelOpt unified HF checkpoint with --quant)
      drafter/           the DFlash drafter (z-lab format)
      model_repository/  the Triton model repository rendered for this build
      manifest.json      inputs (ids, paths, file hashes), options, package versions, quantization
                         report, sanity run (tau, speed, token identity), time taken

The build is written to a temporary folder beside <output> and renamed at the end: a failed or
interrupted build never looks complete (one killed hard leaves its folder, which the next build removes).
Re-running with the same inputs, options, model-repository templates and project version reuses the existing
build (compared by hash); --force rebuilds.
"""


def check_quant_formats(quant: str, kv_cache: str) -> None:
    """Refuse unknown formats before any expensive work (the build and quantize_target both call this)."""
    if quant not in QUANT_FORMATS:
        raise DFlashError(f"unknown quantization {quant!r} (known: {', '.join(QUANT_FORMATS)})")
    if kv_cache not in KV_CACHE_FORMATS:
        raise DFlashError(f"unknown KV-cache quantization {kv_cache!r} (known: {', '.join(KV_CACHE_FORMATS)})")


@dataclass(frozen=True)
class BuildOptions:
    target: str
    drafter: str  # "preset", a directory, or "none"
    runtime: str = "torch"
    quant: str = "none"
    kv_cache: str = "none"
    calib_samples: int = 128
    block_size: int | str = AUTO_BLOCK_SIZE
    max_batch_size: int = 8
    max_context: int | None = None
    max_queue_size: int = 64
    kv_cache_tokens: int | None = None  # None: max_batch_size contexts (engine_sizes.default_kv_cache_tokens)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # 0: a prompt's whole uncached part in one pass
    prefix_caching: bool = True
    suffix_drafts: bool = True  # block size auto: draft-free suffix drafts beside the drafter (suffix_drafts.py)
    shared_suffix_tokens: int = 0  # and from earlier requests' outputs, this many tokens of them (0: none)
    dtype: str = "auto"  # resolved by the build: bfloat16 on CUDA, float32 on a CPU
    cpu_weights: str = "auto"  # the torch runtime's linears on a CPU (dflash_runtime/cpu_weights.py)
    device: str = "auto"  # resolved by the build: CUDA when there is a GPU
    gpu: str | None = None  # trtllm: the serving GPU (h100, b200, ...), checked against the quantization
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    dflash_attention: str | None = None  # trtllm: DFlashDecodingConfig.attention_backend; None: upstream's (VANILLA)
    sanity_tokens: int = 32
    speculative_sampling: str = DEFAULT_SPECULATIVE_SAMPLING  # sampled requests that name no method
    reasoning_parser: str = PRESET_PARSER  # the gateway's (REASONING_PARSERS, or "none"); "preset": the preset's


def reasoning_parser(opts: BuildOptions) -> str | None:
    """The build's reasoning parser: the one named, the preset's for "preset", None for "none"."""
    if opts.reasoning_parser == PRESET_PARSER:
        preset = PRESETS.get(opts.target)
        return preset.reasoning_parser if preset is not None else None
    return None if opts.reasoning_parser == "none" else opts.reasoning_parser


def names_a_drafter(opts: BuildOptions) -> bool:
    """Whether the build has a drafter: --drafter names one, or is "preset" for a preset that has one."""
    if opts.drafter == "preset":
        preset = PRESETS.get(opts.target)
        return preset is not None and preset.drafter is not None
    return opts.drafter != "none"


def known_block_size(opts: BuildOptions) -> int:
    """The widest step the options alone tell of: 1 without a drafter, a fixed --block-size, a preset drafter's
    block; else 2, the narrowest a drafter has (resolve_inputs checks again with the drafter's config)."""
    if not names_a_drafter(opts):
        return 1
    if opts.block_size != AUTO_BLOCK_SIZE:
        return opts.block_size
    preset = PRESETS.get(opts.target)
    return preset.block_size if preset is not None and opts.drafter == "preset" else 2


def check_context_room(max_context: int, block_size: int) -> None:
    """Refuse a --max-context without room for a short chat prompt and a whole block (MIN_PROMPT_TOKENS)."""
    least = MIN_PROMPT_TOKENS + block_size
    if max_context < least:
        block = f"the drafter's block of {block_size} verified in one step" if block_size > 1 else "a new token"
        raise DFlashError(f"--max-context {max_context} leaves no room for a prompt and a block: use {least} or more "
                          f"({MIN_PROMPT_TOKENS} tokens for a short chat prompt, {block})")


def check_options(opts: BuildOptions) -> None:
    """Refuse what the options alone rule out (runtime, device, quantization, GPU, parallelism, the preset's
    runtimes, a context too short), without checkpoints or devices: resolve_inputs' first step, and what
    `--check` runs."""
    if opts.runtime not in RUNTIMES:
        raise DFlashError(f"unknown runtime {opts.runtime!r} (known: {', '.join(RUNTIMES)})")
    if not DEVICES.fullmatch(opts.device):
        raise DFlashError(f"--device {opts.device} is not a device of the torch runtime: use auto, cpu, cuda or "
                          "cuda:N")
    preset = PRESETS.get(opts.target)
    if preset is not None and opts.runtime not in preset.runtimes:
        raise DFlashError(f"preset {preset.name} runs on --runtime {' or '.join(preset.runtimes)} only, not "
                          f"{opts.runtime}: {preset.description}")
    check_quant_formats(opts.quant, opts.kv_cache)
    if opts.kv_cache == "fp8" and opts.quant == "none":
        raise DFlashError("--kv-cache fp8 needs --quant fp8 or nvfp4 (the KV scales are calibrated with the weights)")
    for flag, value, least in (("--max-batch-size", opts.max_batch_size, 1),
                               ("--max-queue-size", opts.max_queue_size, 0),
                               ("--prefill-chunk", opts.prefill_chunk, 0),
                               ("--shared-suffix-tokens", opts.shared_suffix_tokens, 0),
                               ("--calib-samples", opts.calib_samples, 1), ("--sanity-tokens", opts.sanity_tokens, 0),
                               ("--tensor-parallel-size", opts.tensor_parallel_size, 1),
                               ("--pipeline-parallel-size", opts.pipeline_parallel_size, 1)):
        if value < least:
            raise DFlashError(f"{flag} must be >= {least}, got {value}")
    if opts.max_context is not None:
        check_context_room(opts.max_context, known_block_size(opts))
    if opts.kv_cache_tokens is not None:
        check_context_room(opts.kv_cache_tokens - known_block_size(opts), known_block_size(opts))
    check_speculative_sampling(opts.speculative_sampling)
    shared = opts.shared_suffix_tokens
    if shared and (opts.runtime != "torch" or not opts.suffix_drafts or shared < 2):
        raise DFlashError(f"--shared-suffix-tokens {shared}: suffix drafts from earlier requests need --runtime torch, "
                          "suffix drafts on (no --no-suffix-drafts) and room for 2 tokens at least")
    if opts.runtime == "trtllm" and opts.speculative_sampling != DEFAULT_SPECULATIVE_SAMPLING:
        raise DFlashError(f"--speculative-sampling {opts.speculative_sampling} is for --runtime torch: TensorRT-LLM's "
                          "DFlash verifies its drafts by its own rule")
    if opts.runtime == "trtllm":
        from builder.trtllm import check_gpu_support, resolve_gpu

        if opts.gpu is None:
            raise DFlashError("--runtime trtllm needs --gpu (the serving GPU, e.g. h100, h200, b200)")
        if not names_a_drafter(opts):
            named = ("--drafter none" if opts.drafter == "none" else
                     f"--target {opts.target} has no preset drafter: name one with --drafter")
            raise DFlashError(f"--runtime trtllm serves DFlash (TensorRT-LLM's DFlashDecodingConfig) and needs a "
                              f"drafter ({named}); plain decoding builds with --runtime torch")
        check_gpu_support(resolve_gpu(opts.gpu), opts.quant, "fp8" if opts.kv_cache == "fp8" else "auto",
                          opts.dflash_attention)
    elif (opts.tensor_parallel_size, opts.pipeline_parallel_size) != (1, 1):
        raise DFlashError("tensor/pipeline parallelism needs --runtime trtllm (the torch runtime runs on one device)")
    elif opts.dflash_attention is not None:
        raise DFlashError("--dflash-attention picks TensorRT-LLM's DFlash kernels: it needs --runtime trtllm")
    elif opts.gpu is not None:
        from builder.trtllm import resolve_gpu

        resolve_gpu(opts.gpu)  # a misspelt GPU is refused whatever the runtime


def option_notes(opts: BuildOptions) -> list[str]:
    """What a user may expect of the flags that they do not do: said before the work, not refused (the Helm
    chart passes --gpu from server.gpuType to every build)."""
    if opts.gpu is not None and opts.runtime != "trtllm":
        dequantized = "" if opts.quant == "none" else f", dequantizing --quant {opts.quant} on load"
        return [f"--gpu {opts.gpu} matters only to --runtime trtllm, whose kernels differ per GPU; the torch runtime "
                f"runs on any device (--device picks it){dequantized}"]
    return []


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="build.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=BUILD_DESCRIPTION,
        epilog=f"presets:\n{preset_table()}\n\nexamples:\n"
               "  python builder/build.py                                   # embedded default -> builds/smollm2-135m\n"
               "  python builder/build.py --target smollm2-135m --quant fp8 --output builds/smollm2-fp8\n"
               "  python builder/build.py --target qwen3-8b --dry-run       # print the plan only\n"
               "  python builder/build.py --target ./my-llama --drafter ./my-drafter --output builds/mine\n"
               "  python builder/build.py --target ./my-llama --train-drafter='--max-minutes 600'  # train first\n\n"
               "runtimes: torch = this project's PyTorch engine (CPU or CUDA). TensorRT-LLM supports DFlash only in "
               "its PyTorch backend (>= 1.3, LLM API); the legacy trtllm-build engine flow has no DFlash.")
    parser.add_argument("--target", default=DEFAULT_PRESET,
                        help=f"preset, HF checkpoint directory, or hub id (org/name) in the local Hugging Face cache "
                             f"(default: {DEFAULT_PRESET})")
    parser.add_argument("--drafter", default="preset",
                        help="drafter directory or hub id; 'preset' (default): the preset's drafter, none for another "
                             "target; 'none': plain decoding (--runtime torch)")
    parser.add_argument("--train-drafter", metavar="ARGS",
                        help="first train a drafter for the target with dflash-train-drafter ARGS, then build "
                             "with it; write --train-drafter='ARGS' (see dflash-train-drafter --help); resumable in "
                             "runs/<target>-drafter unless ARGS name an --output")
    parser.add_argument("--output", type=Path, help="build folder (default: builds/<target name>)")
    parser.add_argument("--runtime", default="torch", choices=RUNTIMES,
                        help="torch: this project's engine (CPU/CUDA) behind Triton's Python backend; trtllm: "
                             "TensorRT-LLM >= 1.3 PyTorch backend, LLM-API options (no trtllm-build: no DFlash there)")
    for add in (_add_trtllm_options, _add_quantization_options, _add_decoding_options, _add_torch_runtime_options):
        add(parser)
    parser.add_argument("--device", default="auto",
                        help="device of the torch runtime, the quantization's calibration and the sanity run: auto "
                             "(default: CUDA when torch sees a GPU), cpu, cuda, cuda:N")
    parser.add_argument("--sanity-tokens", type=int, default=32,
                        help="tokens per sanity prompt; 0 skips the run (default: 32)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if an identical build exists, quantization included")
    only = parser.add_mutually_exclusive_group()  # --dry-run reads the checkpoints, --check must not
    only.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    only.add_argument("--check", action="store_true",
                      help="check the flags (runtime, device, GPU, quantization, the context length, the "
                           "preset's runtimes, the parallel sizes against the target's attention heads and layers "
                           "where its shape is known: a preset's, or a local checkpoint's config.json) without "
                           "reading weights or devices or writing the output, e.g. a build Job's command on a "
                           "machine without either: print what was checked and exit 0, or the error and exit 2. "
                           "Whether --device exists is left to the build machine; with --train-drafter its ARGS are "
                           "checked too")
    return parser


def _add_trtllm_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--runtime trtllm")
    group.add_argument("--gpu", help="trtllm: serving GPU (a100, l40s, h100, h200, b200, ...; another by its compute "
                                     "capability: sm90); checks the quantization")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="trtllm: GPUs per pipeline stage")
    group.add_argument("--pipeline-parallel-size", type=int, default=1, help="trtllm: pipeline stages")
    group.add_argument("--dflash-attention", choices=tuple(DFLASH_ATTENTION_BACKEND_SMS),
                       help="trtllm: the drafter's attention kernels: VANILLA (upstream's default, any GPU), TRTLLM "
                            "(SM100/SM103), FA4 (SM90, TensorRT-LLM >= 1.3.0rc27)")


def _add_quantization_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("quantization (NVIDIA ModelOpt)")
    group.add_argument("--quant", default="none", choices=QUANT_FORMATS, help="ModelOpt quantization of the target")
    group.add_argument("--kv-cache", default="none", choices=KV_CACHE_FORMATS,
                       help="KV-cache quantization (with --quant)")
    group.add_argument("--calib-samples", type=int, default=128,
                       help="ShareGPT calibration prompts for --quant (default: 128)")


def _add_decoding_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding and serving")
    group.add_argument("--block-size", type=block_size_argument, default=AUTO_BLOCK_SIZE,
                       help=f"{AUTO_BLOCK_SIZE!r} (default): the engine picks each step's verify length up to the "
                            "drafter's block, from a profile of step times the sanity run records; a number fixes it")
    group.add_argument("--speculative-sampling", default=DEFAULT_SPECULATIVE_SAMPLING, choices=SPECULATIVE_SAMPLING,
                       help="how sampled requests verify drafts where they name no method (a request may): exact "
                            "(default; the output is the target's own sample, the same as without speculation at "
                            "any block size) or rejection (min(1, p/q): the same distribution, but the sample "
                            "depends on the drafter and the verify lengths: a seed repeats it only at a fixed block "
                            "size)")
    group.add_argument("--max-batch-size", type=int, default=8,
                       help="sequences decoded together (KV-cache slots; default: 8)")
    group.add_argument("--max-context", type=int,
                       help="a sequence's tokens at most, prompt and output (default: the target's own limit, "
                            "max_position_embeddings, cut to what the KV memory holds; with --runtime trtllm, the "
                            "preset's context per batch place); at least "
                            f"{MIN_PROMPT_TOKENS} for a prompt + the drafter's block")
    group.add_argument("--max-queue-size", type=int, default=64,
                       help="requests that may wait for a slot (default: 64)")
    group.add_argument("--kv-cache-tokens", type=int,
                       help="KV memory of the torch runtime, in tokens for all sequences together (target and "
                            "drafter caches, in blocks of 16 a sequence takes as it grows; default: --max-batch-size "
                            "x the preset's context per place, 2048 for smollm2-135m, else 4096, and at least one "
                            "whole --max-context). A sequence waits, or the newest is preempted and recomputed, when "
                            "none is free; the context is cut to what it holds for one sequence")
    group.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                       help="prompt tokens the torch runtime prefills per step while some stream decodes, so that "
                            "running streams keep decoding while a long prompt comes in, and fewer where a step's "
                            "prefill would take more than twice its decoding, as on a CPU (with none decoding, up to a "
                            f"whole context's worth); 0: a whole prompt in one pass (default: "
                            f"{DEFAULT_PREFILL_CHUNK})")
    group.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                       help="turn the torch runtime's prefix cache off (for A/B runs): every prompt is computed "
                            "whole, even one that repeats a conversation's history")
    group.add_argument("--no-suffix-drafts", dest="suffix_drafts", action="store_false",
                       help="turn off the torch runtime's draft-free suffix drafts (block size auto: a step may "
                            "verify the continuation of an earlier occurrence of a request's own text instead of the "
                            "drafter's block; only ever a request's own prompt and output), for A/B runs")
    group.add_argument("--shared-suffix-tokens", type=int, default=0, metavar="N",
                       help="suffix drafts also from earlier requests' outputs, the last N tokens of them (4 bytes "
                            "each, the oldest overwritten): an agent re-emitting a file, a retried request. Across "
                            "tenants a timing side channel: how fast an answer comes tells whether similar text was "
                            "generated before (answers never change). Default: 0, none (a request's own text only)")
    group.add_argument("--reasoning-parser", default=PRESET_PARSER,
                       choices=(PRESET_PARSER, "none", *REASONING_PARSERS),
                       help="how the OpenAI gateway splits a thinking model's reasoning into reasoning_content: "
                            "qwen3 (<think>...</think>); preset (default): the preset's (qwen3 for the Qwen3 presets, "
                            "none for the others)")


def _add_torch_runtime_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--runtime torch")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="torch runtime dtype; auto (default): bfloat16 on CUDA, float32 on a CPU")
    group.add_argument("--cpu-weights", default="auto", choices=CPU_WEIGHTS,
                       help="the format the torch runtime serves the target's linears in on a CPU: gguf-int4 (a "
                            "GGUF target's own 4-bit blocks), gguf-int4-a8 (the same on int8 activations: faster "
                            "at a verify's rows, another model), int8 (weight-only, quantized at load: another "
                            "model), float32; auto (default): measured on the serving host among the checkpoint's "
                            "own formats (gguf-int4 and float32 for a GGUF target), cached per host")


def options_from_args(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(target=args.target, drafter=args.drafter, runtime=args.runtime, quant=args.quant,
                        kv_cache=args.kv_cache, calib_samples=args.calib_samples, block_size=args.block_size,
                        max_batch_size=args.max_batch_size, max_context=args.max_context,
                        max_queue_size=args.max_queue_size, kv_cache_tokens=args.kv_cache_tokens,
                        prefill_chunk=args.prefill_chunk, prefix_caching=args.prefix_caching,
                        suffix_drafts=args.suffix_drafts, shared_suffix_tokens=args.shared_suffix_tokens,
                        dtype=args.dtype, device=args.device, gpu=args.gpu,
                        cpu_weights=args.cpu_weights,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size, dflash_attention=args.dflash_attention,
                        sanity_tokens=args.sanity_tokens, speculative_sampling=args.speculative_sampling,
                        reasoning_parser=args.reasoning_parser)
