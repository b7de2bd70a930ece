"""Building blocks shared by the target and the drafter. Module names equal HF checkpoint keys."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeConfig, TransformerShape
from .cpu_linears import split_where_faster


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # one op for the six below, bitwise the same (tested)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
        # positions: [B, T] -> cos, sin: [B, T, 1, head_dim], to broadcast over the heads of [B, T, H, D]
        freqs = positions[..., None].float() * self.inverse_frequencies(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """Rotary's sin with the first half of each head negated, what apply_rope takes (made once per pass)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D], as the projection made it; sin: signed_sin's. HF's rotate-half convention (not interleaved
    # pairs): x * cos + cat(-x2, x1) * sin, here x2 * -sin for -x2 * sin (the same rounding, bitwise) so that the
    # rotation is one roll: 4 ops instead of 7 per call. On a transposed x the result came out with its head dim
    # strided, which SDPA's fused kernels refuse.
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


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
        """q [B, H, T, D] and k, v [B, T, KV, D] of the same input (one GEMM once fused); cos and sin: the pass's
        Rotary angles, sin as signed_sin made it."""
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
        return apply_rope(q, cos, sin).transpose(1, 2)

    def _key_value(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # [B, T, KV * D] each -> k, v: [B, T, KV, D] (cache layout: tokens before heads)
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v.unflatten(-1, (self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "AttentionMask") -> torch.Tensor:
        # q: [B, H, T, D]; k, v: [B, KV, L, D]
        return self.o_proj(mask.attend(q, k, v).transpose(1, 2).flatten(2))


# What a layer does with its new keys and values k, v [B, T, KV, D]: returns every key and value its
# queries attend to, [B, KV, L, D] each (written to a cache and read back, or joined to a context)
KeysValues = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

# None: fold on CUDA only (see AttentionMask); the tests set True to run the folded path on a CPU
FOLD_QUERY_GROUPS: bool | None = None


class AttentionMask:
    """Which keys each query sees, prepared once per pass for the scaled_dot_product_attention of every layer.

    On CUDA, SDPA's fused kernels refuse what a masked GQA pass asks for: flash attention takes no explicit
    mask and memory-efficient attention no `enable_gqa`, so both fell to the math kernel (bf16 upcast to
    float32, K/V expanded to every query head). Here the G query heads that share a K/V head are folded into
    the query axis ([B, H, T, D] -> [B, KV, G * T, D], the mask's rows repeated per group), so the heads match
    and memory-efficient attention takes the mask, as an additive float mask made once per pass rather than
    converted in every layer. A causal pass over a whole prompt needs no mask at all: flash attention with
    `is_causal` and `enable_gqa`. On a CPU, SDPA's flash kernel takes the boolean mask and GQA as they are
    (folding measured no faster there: 106 against 70 us for a block of 8 at SmolLM2's shapes).
    """

    def __init__(self, visible: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                 compute_dtype: torch.dtype | None = None):
        """visible: [B, 1, T or 1, L] (True = visible), or None for a causal pass of T == L tokens from position 0.
        compute_dtype: attend in this dtype (the target's attention_dtype), back in the queries' after."""
        self.groups = num_heads // num_kv_heads
        self.compute_dtype = compute_dtype
        fold = FOLD_QUERY_GROUPS if FOLD_QUERY_GROUPS is not None else (visible is not None and visible.is_cuda)
        self.fold = fold and visible is not None and self.groups > 1
        if self.fold and visible.shape[2] > 1:  # query rows g * T + t see what query t sees
            visible = visible.repeat(1, 1, self.groups, 1)
        self.visible = visible
        self.additive = None  # the folded mask as 0 / -inf, in the queries' dtype (made by the first layer)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v over the visible keys: q [B, H, T, D], k, v [B, KV, L, D] -> [B, H, T, D]."""
        if self.compute_dtype is not None and self.compute_dtype != q.dtype:
            out = self.attend(q.to(self.compute_dtype), k.to(self.compute_dtype), v.to(self.compute_dtype))
            return out.to(q.dtype)
        query, options = self._sdpa_arguments(q, k)
        return F.scaled_dot_product_attention(query, k, v, **options).reshape(q.shape)

    def backend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
        """The SDPA backend `attend` runs for these inputs (FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION
        or MATH), as torch's own dispatcher chooses it."""
        from torch.nn.attention import SDPBackend

        query, options = self._sdpa_arguments(q, k)
        return SDPBackend(torch._fused_sdp_choice(query, k, v, **options)).name

    def _sdpa_arguments(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, dict]:
        gqa = self.groups > 1
        if self.visible is None:
            return q, {"is_causal": True, "enable_gqa": gqa}
        if not self.fold:
            return q, {"attn_mask": self.visible, "enable_gqa": gqa}
        if self.additive is None or self.additive.dtype != q.dtype:
            self.additive = torch.zeros(self.visible.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~self.visible, float("-inf"))
        b, _, t, d = q.shape
        return q.reshape(b, k.shape[1], self.groups * t, d), {"attn_mask": self.additive}


def prepare_for_inference(model: nn.Module, on_cpu: Callable[[nn.Module], None] | None = None) -> None:
    """Freeze the weights (nothing run for inference may record autograd history), fuse q/k/v and gate/up in
    every layer; on a CPU, run on_cpu (the target's weight format: cpu_weights), then, on several cores, split
    the float32 linears left across threads where that measured faster."""
    model.requires_grad_(False)
    for module in list(model.modules()):
        if isinstance(module, (AttentionProjections, MLP)):
            module.fuse()
    if next(model.parameters()).device.type == "cpu":
        if on_cpu is not None:
            on_cpu(model)
        split_where_faster(model)
