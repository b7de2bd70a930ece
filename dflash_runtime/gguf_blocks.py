"""A GGUF checkpoint's own quantized weights, kept beside its float32 conversion so that a CPU can serve them.

materialize_gguf (checkpoint.py) converts a GGUF to float32 through transformers; this module also keeps the
blocks of each Q4_1 projection and of a Q8_0 output head, under their HF names, in
`gguf_blocks/blocks.safetensors` in the same folder:
  Q4_1  <name>.q  uint8 [N, K / 2]: the 4-bit values, two per byte, element k's in byte k // 2 (low nibble first)
        <name>.d, <name>.m  float16 [N, K / 32]: each block's scale and minimum; the weight is d * q + m
  Q8_0  <name>.q  int8 [N, K], <name>.d  float16 [N, K / 32]; the weight is d * q (a tied head: the embedding's)
A tensor is kept only if its blocks, dequantized, equal the float32 weight transformers made from them (rows
permuted as transformers permutes Llama's q/k projections, where it did): what cpu_weights serves is then the
shipped model, whatever transformers' name mapping, and anything else (Q6_K, ...) stays float.
In memory (load_blocks) a tensor's fields are (q, d, m) for Q4_1 with q uint8 [N, K] in 0..15, (q, d) for Q8_0.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BLOCKS_FILE = Path("gguf_blocks") / "blocks.safetensors"
Q4_1_GROUP = 32  # Q8_0's too
Q4_1_BYTES = 20  # per block of 32: float16 d, float16 m, 16 bytes of nibbles (element j low, j + 16 high)
Q8_0_BYTES = 34  # per block of 32: float16 d, 32 int8


def q4_1_fields(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows, uint8 [N, K / 32 * 20], -> q uint8 [N, K] (0..15), d and m float16 [N, K / 32]."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(rows, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N, K / 32, 32]
    return q.reshape(rows, -1), d, m


def q8_0_fields(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows, uint8 [N, K / 32 * 34], -> q int8 [N, K], d float16 [N, K / 32]."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(rows, -1, Q8_0_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1), d


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """d * q (+ m) per block of 32, in float32 (as gguf's dequantize computes it): Q4_1's fields, or Q8_0's."""
    rows, k = q.shape
    blocks = q.view(rows, k // Q4_1_GROUP, Q4_1_GROUP).float() * d.float()[..., None]
    return (blocks if m is None else blocks + m.float()[..., None]).reshape(rows, k)


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """The rows of a GGUF q/k projection in transformers' order (its reverse_permute_weights): GGUF interleaves
    each head's two rotary halves."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def hf_name(gguf_name: str) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for what is no projection. The
    embedding is named as the head: kept only where it equals the head, as a tied one does."""
    parts = gguf_name.split(".")
    if gguf_name in ("output.weight", "token_embd.weight"):
        return "lm_head.weight"
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
        return None
    module = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}.get(parts[2])
    return f"model.layers.{parts[1]}.{module}.weight" if module else None


def extract_blocks(gguf_file: Path, weights: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict:
    """The GGUF's Q4_1 projections and Q8_0 head that dequantize to `weights` (transformers' float32 conversion
    of the same file), as the fields the module docstring lists; the others are left out."""
    from gguf import GGMLQuantizationType, GGUFReader

    kept = {}
    for tensor in GGUFReader(gguf_file).tensors:
        name = hf_name(tensor.name)
        if name is None or name not in weights or name in kept:
            continue
        if tensor.tensor_type == GGMLQuantizationType.Q8_0 and name == "lm_head.weight":
            q, d = q8_0_fields(tensor.data)
            if q.shape == weights[name].shape and torch.equal(dequantize(q, d), weights[name].float()):
                kept[name] = (q, d)
            continue
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        q, d, m = q4_1_fields(tensor.data)
        orders = [None] + [llama_row_order(len(q), h) for h in (heads, kv_heads) if len(q) % (2 * h) == 0]
        for order in orders:
            q_, d_, m_ = (q, d, m) if order is None else (q[order], d[order], m[order])
            if q_.shape == weights[name].shape and torch.equal(dequantize(q_, d_, m_), weights[name].float()):
                kept[name] = (q_, d_, m_)
                break
    return kept


def save_blocks(folder: Path, blocks: dict) -> None:
    """Fields as load_blocks returns them -> the blocks file (Q4_1's q two per byte)."""
    from safetensors.torch import save_file

    stored = {}
    for name, fields in blocks.items():
        q = fields[0]
        stored[f"{name}.q"] = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if len(fields) == 3 else q.contiguous()
        stored[f"{name}.d"] = fields[1].contiguous()
        if len(fields) == 3:
            stored[f"{name}.m"] = fields[2].contiguous()
    (folder / BLOCKS_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(folder / BLOCKS_FILE))


def load_blocks(folder: Path) -> dict[str, tuple[torch.Tensor, ...]]:
    """HF weight name -> its fields (module docstring); empty without a blocks file."""
    from safetensors.torch import load_file

    if not (folder / BLOCKS_FILE).is_file():
        return {}
    stored = load_file(str(folder / BLOCKS_FILE))
    out = {}
    for name in {key.rsplit(".", 1)[0] for key in stored}:
        q, d = stored[f"{name}.q"], stored[f"{name}.d"]
        if f"{name}.m" not in stored:
            out[name] = (q, d)
            continue
        out[name] = (torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1), d, stored[f"{name}.m"])
    return out
