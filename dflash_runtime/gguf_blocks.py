"""A GGUF checkpoint's own 4-bit weights, kept beside its float32 conversion so that a CPU can serve them.

materialize_gguf (checkpoint.py) converts a GGUF to float32 through transformers; this module also keeps
each Q4_1 tensor's blocks, under its HF name, in `gguf_blocks/q4_1.safetensors` in the same folder:
  <name>.q  uint8 [N, K / 2]: the 4-bit values, two per byte, element k's in byte k // 2 (low nibble first)
  <name>.d, <name>.m  float16 [N, K / 32]: each block's scale and minimum; the weight is d * q + m (ggml Q4_1)
A tensor is kept only if its blocks, dequantized, equal the float32 weight transformers made from them (rows
permuted as transformers permutes Llama's q/k projections, where it did): what cpu_weights serves is then the
shipped model, whatever transformers' name mapping, and anything else (Q8_0, Q6_K, ...) stays float.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BLOCKS_FILE = Path("gguf_blocks") / "q4_1.safetensors"
Q4_1_GROUP = 32
Q4_1_BYTES = 20  # per block of 32: float16 d, float16 m, 16 bytes of nibbles (element j low, j + 16 high)


def q4_1_fields(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows, uint8 [N, K / 32 * 20], -> q uint8 [N, K] (0..15), d and m float16 [N, K / 32]."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(rows, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
    nibbles = blocks[..., 4:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [N, K / 32, 32]
    return q.reshape(rows, -1), d, m


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d * q + m per block of 32, in float32 (as gguf's dequantize computes it)."""
    rows, k = q.shape
    blocks = q.view(rows, k // Q4_1_GROUP, Q4_1_GROUP).float()
    return (blocks * d.float()[..., None] + m.float()[..., None]).reshape(rows, k)


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """The rows of a GGUF q/k projection in transformers' order (its reverse_permute_weights): GGUF interleaves
    each head's two rotary halves."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def hf_name(gguf_name: str) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; None for what has no 4-bit projection."""
    parts = gguf_name.split(".")
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight":
        return None
    module = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}.get(parts[2])
    return f"model.layers.{parts[1]}.{module}.weight" if module else None


def extract_q4_1(gguf_file: Path, weights: dict[str, torch.Tensor], heads: int, kv_heads: int) -> dict:
    """The GGUF's Q4_1 tensors that dequantize to `weights` (transformers' float32 conversion of the same file),
    as the fields the module docstring lists; the others are left out."""
    from gguf import GGMLQuantizationType, GGUFReader

    kept = {}
    for tensor in GGUFReader(gguf_file).tensors:
        name = hf_name(tensor.name)
        if name is None or name not in weights or tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        q, d, m = q4_1_fields(tensor.data)
        orders = [None] + [llama_row_order(len(q), h) for h in (heads, kv_heads) if len(q) % (2 * h) == 0]
        for order in orders:
            q_, d_, m_ = (q, d, m) if order is None else (q[order], d[order], m[order])
            if q_.shape == weights[name].shape and torch.equal(dequantize(q_, d_, m_), weights[name].float()):
                kept[f"{name}.q"] = (q_[:, 0::2] | (q_[:, 1::2] << 4)).contiguous()
                kept[f"{name}.d"], kept[f"{name}.m"] = d_.contiguous(), m_.contiguous()
                break
    return kept


def save_q4_1(folder: Path, blocks: dict) -> None:
    from safetensors.torch import save_file

    (folder / BLOCKS_FILE).parent.mkdir(parents=True, exist_ok=True)
    save_file(blocks, str(folder / BLOCKS_FILE))


def load_q4_1(folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """HF weight name -> (q uint8 [N, K] in 0..15, d, m float16 [N, K / 32]); empty without a blocks file."""
    from safetensors.torch import load_file

    if not (folder / BLOCKS_FILE).is_file():
        return {}
    stored = load_file(str(folder / BLOCKS_FILE))
    names = {key.rsplit(".", 1)[0] for key in stored}
    out = {}
    for name in names:
        packed = stored[f"{name}.q"]
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        out[name] = (q, stored[f"{name}.d"], stored[f"{name}.m"])
    return out
