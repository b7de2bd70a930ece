"""Load a target, its drafter and its tokenizer from a preset or directories, and build engines on them."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DFlashError
from dflash_contract.presets import AUTO_BLOCK_SIZE, Preset

from .checkpoint import resolve_checkpoint, resolve_target
from .drafter import DFlashDrafter, load_drafter
from .engine import SpeculativeEngine
from .engine_sizes import default_kv_cache_tokens
from .grammar import GrammarCompiler
from .target import TargetModel, load_target
from .verify_length import StepCosts
from .text import decode_complete, encode_prompt, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"  # device: CUDA when there is one; dtype: bfloat16 on CUDA, float32 on a CPU


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" where torch sees a GPU, else "cpu"; a CUDA device asked for must exist."""
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError(f"device {device!r}: torch {torch.__version__} sees no CUDA GPU here "
                          f"(CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> bfloat16 on CUDA (what GPUs serve and calibrate in), float32 on a CPU (no fast bf16 GEMV)."""
    if dtype == AUTO:
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise DFlashError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)}, {AUTO})")
    return dtype


@dataclass
class Pipeline:
    target: TargetModel
    drafter: DFlashDrafter | None
    tokenizer: object | None  # a transformers tokenizer when the target directory has one
    preset: Preset | None
    target_dir: Path

    def engine(self, block_size: int | str | None = AUTO_BLOCK_SIZE, max_batch_size: int = 8,
               max_context: int | None = None, step_costs: StepCosts | None = None,
               kv_cache_tokens: int | None = None, **options) -> SpeculativeEngine:
        """options: SpeculativeEngine's, where not the defaults. Without kv_cache_tokens the KV pool is sized by the
        preset (Preset.kv_context per batch place)."""
        if kv_cache_tokens is None and self.preset is not None:
            context = max_context or self.target.config.max_position_embeddings
            widest = self.drafter.config.block_size if self.drafter else 1
            kv_cache_tokens = default_kv_cache_tokens(max_batch_size, context, widest, self.preset.kv_context)
        return SpeculativeEngine(self.target, self.drafter, block_size=block_size, max_batch_size=max_batch_size,
                                 max_context=max_context, decode=self.decode if self.tokenizer else None,
                                 step_costs=step_costs, grammars=self.grammars(), kv_cache_tokens=kv_cache_tokens,
                                 **options)

    def grammars(self) -> GrammarCompiler | None:
        """The compiler of guided requests' grammars: None without a tokenizer or without xgrammar (an engine
        then refuses guided requests, saying so)."""
        if self.tokenizer is None or importlib.util.find_spec("xgrammar") is None:
            return None
        return GrammarCompiler.for_tokenizer(self.tokenizer, self.target.config.shape.vocab_size,
                                             self.target.config.eos_token_ids)

    def encode(self, text: str, chat: bool = True, allow_special_tokens: bool = False) -> list[int]:
        """Token ids of a prompt; with chat, `text` is a user message wrapped in the chat template. Special-token
        text in it stays text unless allow_special_tokens (a trusted prompt: text.encode_prompt)."""
        if self.tokenizer is None:
            raise DFlashError(f"{self.target_dir} has no tokenizer: pass token ids instead of text")
        return encode_prompt(self.tokenizer, text, chat, allow_special_tokens=allow_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """The text of ids, as the server sends it: an unfinished character at the end is not text yet."""
        return decode_complete(self.tokenizer, ids)


def load_pipeline(target: str, drafter: str | None = "preset", dtype: str = "float32",
                  device: str = "cpu", prepare: bool = True, cpu_weights: str | None = None) -> Pipeline:
    """drafter: "preset" takes the preset's drafter (none for a plain directory), None runs without one.
    device and dtype may be "auto" (resolve_device, resolve_dtype); prepare, cpu_weights: load_target's."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    target_dir, preset = resolve_target(target)
    model = load_target(target_dir, DTYPES[dtype], device, prepare, cpu_weights)
    if drafter == "preset":
        drafter = preset.drafter if preset else None
    draft_model = load_drafter(resolve_checkpoint(drafter), model.config, DTYPES[dtype], device) if drafter else None
    return Pipeline(model, draft_model, load_tokenizer(target_dir), preset, target_dir)
