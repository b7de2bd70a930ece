"""Checkpoint I/O: HF safetensors (single or sharded), strict loading, and GGUF converted once to HF."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from .config import DFlashError


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DFlashError(f"{path}: no *.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise DFlashError(f"{path}: shard {f.name} listed in the index is missing")
        state.update(load_file(str(f)))
    return state


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], where: str,
                 dtype: torch.dtype, device: str | torch.device) -> None:
    """Plain state-dict load, strict: any missing, unexpected or mis-shaped tensor is a user error."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: {tuple(state[k].shape)} != {tuple(s)}" for k, s in expected.items()
             if k in state and state[k].shape != s]
    problems = []
    if missing:
        problems.append(f"missing tensors {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_preview(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes {_preview(wrong)}")
    if problems:
        raise DFlashError(f"{where}: checkpoint does not match the model: " + "; ".join(problems))
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, assign=True)


def _preview(items: list[str], n: int = 5) -> str:
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash"))


def materialize_gguf(gguf_file: Path, name: str) -> Path:
    """Dequantize a GGUF checkpoint once into the HF layout (config, safetensors, tokenizer) and reuse it.

    transformers dequantizes GGUF on every load (~30 s for a 135M model on 2 cores); the cached
    float32 copy loads in about a second.
    """
    out = cache_root() / name
    stamp = f"{gguf_file.resolve()}:{gguf_file.stat().st_size}"
    if (out / ".source").is_file() and (out / ".source").read_text() == stamp:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_file.name} to {out} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".source").write_text(stamp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
