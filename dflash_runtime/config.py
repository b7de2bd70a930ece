"""Model configurations read from HF-style config.json files, validated once at the door."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dflash_contract import DFlashError


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    # Llama-3.1 frequency scaling; None means plain RoPE.
    llama3_scaling: tuple[float, float, float, int] | None = None  # factor, low_freq, high_freq, original_max

    def inverse_frequencies(self, head_dim: int):
        import torch

        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        if self.llama3_scaling is None:
            return inv_freq.float()
        factor, low_freq_factor, high_freq_factor, original_max = self.llama3_scaling
        low_freq_wavelen = original_max / low_freq_factor
        high_freq_wavelen = original_max / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled).float()


def read_rope(cfg: dict, where: str) -> RopeConfig:
    """transformers 5.x writes `rope_parameters`, 4.x `rope_theta` + `rope_scaling`; accept both, guess neither.

    A silent fallback to the default base (10000) corrupts models such as SmolLM2 (base 100000).
    """
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise DFlashError(f"{where}: no RoPE base (neither rope_parameters.rope_theta nor rope_theta)")
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return RopeConfig(float(theta))
    if rope_type == "llama3":
        return RopeConfig(
            float(theta),
            (
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            ),
        )
    raise DFlashError(f"{where}: unsupported rope_type {rope_type!r} (supported: default, llama3)")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise DFlashError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: not valid JSON ({e})") from None


def _required(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise DFlashError(f"{where}: missing {key!r}")
    return cfg[key]


@dataclass(frozen=True)
class TransformerShape:
    """The sizes shared by target and drafter decoder stacks."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int

    @classmethod
    def from_dict(cls, cfg: dict, where: str) -> "TransformerShape":
        hidden = int(_required(cfg, "hidden_size", where))
        heads = int(_required(cfg, "num_attention_heads", where))
        return cls(
            hidden_size=hidden,
            intermediate_size=int(_required(cfg, "intermediate_size", where)),
            num_layers=int(_required(cfg, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=read_rope(cfg, where),
            vocab_size=int(_required(cfg, "vocab_size", where)),
        )


    def to_dict(self) -> dict:
        """HF config fields; RoPE is written in both the 4.x and 5.x spellings so either reader agrees."""
        rope = {"rope_type": "default", "rope_theta": self.rope.theta}
        if self.rope.llama3_scaling is not None:
            factor, low, high, original = self.rope.llama3_scaling
            rope = {"rope_type": "llama3", "rope_theta": self.rope.theta, "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope if self.rope.llama3_scaling is not None else None,
            "rope_parameters": rope,
        }


SUPPORTED_TARGETS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class TargetConfig:
    arch: str  # "llama" or "qwen3": Qwen3 adds per-head q_norm/k_norm
    shape: TransformerShape
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: Path) -> "TargetConfig":
        cfg = read_json(path / "config.json")
        where = str(path / "config.json")
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_TARGETS:
            raise DFlashError(f"{where}: model_type {arch!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_TARGETS)})")
        eos = _eos_ids(cfg)
        generation = path / "generation_config.json"
        if generation.is_file():
            eos = tuple(dict.fromkeys(eos + _eos_ids(read_json(generation))))
        return cls(
            arch=arch,
            shape=TransformerShape.from_dict(cfg, where),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos,
        )

    def check_max_context(self, max_context: int) -> None:
        """A --max-context beyond the target's positions is refused, not cut down to them unsaid."""
        if max_context > self.max_position_embeddings:
            raise DFlashError(f"--max-context {max_context} is beyond this target's {self.max_position_embeddings} "
                              "positions (max_position_embeddings in its config.json)")


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


@dataclass(frozen=True)
class DrafterConfig:
    shape: TransformerShape
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int

    @classmethod
    def from_dir(cls, path: Path) -> "DrafterConfig":
        cfg = read_json(path / "config.json")
        where = str(path / "config.json")
        if "DFlashDraftModel" not in (cfg.get("architectures") or []):
            raise DFlashError(f"{where}: architectures must contain 'DFlashDraftModel'")
        dflash = cfg.get("dflash_config") or {}
        layer_ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        mask_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if not layer_ids:
            raise DFlashError(f"{where}: missing dflash_config.target_layer_ids")
        if mask_id is None:
            raise DFlashError(f"{where}: missing dflash_config.mask_token_id")
        return cls(
            shape=TransformerShape.from_dict(cfg, where),
            block_size=int(cfg.get("block_size", dflash.get("block_size", 16))),
            mask_token_id=int(mask_id),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=int(_required(cfg, "num_target_layers", where)),
        )

    def to_dict(self) -> dict:
        """config.json in the z-lab / ModelOpt DFlash format."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **self.shape.to_dict(),
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        }

    def check_against(self, target: TargetConfig, where: str) -> None:
        """A drafter only works with the target it was trained on; catch mismatches before any tensor math."""
        t = target.shape
        problems = []
        if self.shape.hidden_size != t.hidden_size:
            problems.append(f"hidden_size {self.shape.hidden_size} != target's {t.hidden_size}")
        if self.shape.vocab_size != t.vocab_size:
            problems.append(f"vocab_size {self.shape.vocab_size} != target's {t.vocab_size}")
        if self.num_target_layers != t.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target's {t.num_layers} layers")
        bad = [i for i in self.target_layer_ids if not 0 <= i < t.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} out of range [0, {t.num_layers})")
        if not 0 <= self.mask_token_id < t.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {t.vocab_size})")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} < 2")
        if problems:
            raise DFlashError(f"{where}: drafter does not fit the target: " + "; ".join(problems))
