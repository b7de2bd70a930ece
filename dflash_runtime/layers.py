"""Building blocks shared by the target and the drafter. Module names equal HF checkpoint keys."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeConfig, TransformerShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as HF does, so low-precision runs match the reference.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One linear for several that read the same input: one GEMM instead of several.

    Decoding is bandwidth-bound on CPU: one larger GEMV streams better and costs fewer dispatches.
    Each original linear's weight becomes a view of its rows, so checkpoint keys and state dicts are
    unchanged and no memory is duplicated. For inference only (the views are frozen).
    """
    weight = torch.cat([l.weight.detach() for l in linears])
    bias = torch.cat([l.bias.detach() for l in linears]) if linears[0].bias is not None else None
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    fused.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    row = 0
    for l in linears:
        n = l.weight.shape[0]
        l.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            l.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return fused


class ThreadSplitLinear(nn.Module):
    """A frozen linear whose rows are split into one slice per thread and run as one batched GEMM.

    On CPU, F.linear on a few rows (decode, verify) becomes an MKL GEMV that runs on ONE core:
    ~10 GB/s here against ~21 GB/s that two cores stream. A bmm over row slices is threaded across
    the slices. Measured on SmolLM2-135M, 2 cores: 51 -> 39 ms per decoded token. Each output is
    still one dot product over the full input, in float32.
    """

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.slices = linear.weight.detach().view(parts, -1, linear.weight.shape[1])  # a view: no copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).T  # [K, M]
        y = torch.bmm(self.slices, rows.expand(len(self.slices), *rows.shape))  # [P, N/P, M]
        y = y.permute(2, 0, 1).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = None

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Rotary:
    """cos/sin for absolute positions, computed per call from the batch's positions.

    Not a module: models are built on the meta device and loaded with assign, which would leave a
    buffer empty; the frequencies are not weights anyway.
    """

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.inv_freq = rope.inverse_frequencies(head_dim)

    def inverse_frequencies(self, device: torch.device) -> torch.Tensor:
        # [head_dim / 2], moved to the model's device once and kept there
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, T] -> cos, sin: [B, 1, T, head_dim]
        freqs = positions[..., None].float() * self.inverse_frequencies(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; HF's rotate-half convention (not interleaved pairs).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class AttentionProjections(nn.Module):
    """q/k/v/o projections plus Qwen3's per-head q_norm/k_norm; the attention pattern is the caller's."""

    def __init__(self, shape: TransformerShape, bias: bool, head_norms: bool):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=bias)
        if head_norms:
            self.q_norm = RMSNorm(d, shape.rms_norm_eps)
            self.k_norm = RMSNorm(d, shape.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv = None

    def fuse(self) -> None:
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._query(self.q_proj(x), cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._key_value(self.k_proj(x), self.v_proj(x), cos, sin)

    def query_key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, H, T, D] and k, v [B, T, KV, D] of the same input (one GEMM once fused)."""
        if self.qkv is None:
            return (self.query(x, cos, sin), *self.key_value(x, cos, sin))
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        return (self._query(q, cos, sin), *self._key_value(k, v, cos, sin))

    def _query(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # [B, T, H * D] -> [B, H, T, D]
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def _key_value(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # [B, T, KV * D] each -> k, v: [B, T, KV, D] (cache layout: tokens before heads)
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
        return k, v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # q: [B, H, T, D]; k, v: [B, KV, L, D]; mask: [B, 1, T, L] (True = visible)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def prepare_for_inference(model: nn.Module) -> None:
    """Fuse q/k/v and gate/up in every layer; on a multi-core CPU, split every linear across threads."""
    for module in list(model.modules()):
        if isinstance(module, (AttentionProjections, MLP)):
            module.fuse()
    parts = torch.get_num_threads()
    if next(model.parameters()).device.type != "cpu" or parts < 2:
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # views are the parts of a fused linear, which is split instead
            if type(child) is nn.Linear and child.weight._base is None and child.weight.shape[0] % parts == 0:
                setattr(parent, name, ThreadSplitLinear(child, parts))
