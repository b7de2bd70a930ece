"""The building blocks' arithmetic against transformers' own, bitwise: our shortcuts (one fused RMSNorm op in float32,
RoPE's rotation as one roll) must give the very same floats, or greedy answers would drift from the reference."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from dflash_runtime.config import RopeConfig
from dflash_runtime.layers import RMSNorm, Rotary, apply_rope, signed_sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_transformers_bitwise(dtype):
    torch.manual_seed(0)
    for hidden, shape, scale in [(64, (1, 1), 1.0), (576, (4, 9), 30.0), (128, (32, 8), 1e-3), (4096, (2, 3), 4.0)]:
        ours, theirs = RMSNorm(hidden, 1e-6).to(dtype), LlamaRMSNorm(hidden, 1e-6).to(dtype)
        weight = torch.randn(hidden).to(dtype)
        ours.weight.data.copy_(weight)
        theirs.weight.data.copy_(weight)
        x = (torch.randn(*shape, hidden) * scale).to(dtype)
        with torch.no_grad():
            assert torch.equal(ours(x), theirs(x)), (hidden, shape)


def test_rope_by_roll_is_transformers_rotate_half_bitwise():
    torch.manual_seed(0)
    rotary = Rotary(RopeConfig(theta=100000.0), 64)
    positions = torch.tensor([[0, 1, 2, 3000], [7, 8, 9, 10]])
    cos, sin = rotary(positions, torch.float32)  # [B, T, 1, D]
    q, k = torch.randn(2, 4, 9, 64) * 5, torch.randn(2, 4, 3, 64)  # [B, T, H, D]
    # transformers takes [B, H, T, D] and cos/sin [B, T, D] unsqueezed at the head axis
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[:, :, 0], sin[:, :, 0])
    signed = signed_sin(sin)
    assert torch.equal(apply_rope(q, cos, signed), q_ref.transpose(1, 2))
    assert torch.equal(apply_rope(k, cos, signed), k_ref.transpose(1, 2))
