"""GGUF blocks times float32 activations on an AVX2 CPU (gguf_kernels.c), and a Llama layer around them.

torch's int4 kernel reads the same 4-bit weights but is vectorized for bfloat16 activations only and ran a
decode step's linears 1.3-1.6x slower than these on an AVX2 host; it has no Q8_0 kernel, so the head was served
in float32, 113 MB read per token for SmolLM2. Here each activation row is quantized per block of 32 to int16
(llama.cpp quantizes to int8: on SmolLM2 that agreed with the float32 model's greedy answers on 94.1% of tokens,
perplexity +1.5%; it is the gguf-int4-a8 format. int16: 100.0%, +0.0%) and each block's dot product is taken in
integers; Q4_1's minimum times the block's float sum of x. Q4_1 weights are repacked at load, eight output rows
interleaved (repacked_q4_1), so that one vpmaddubsw serves 8 outputs and an int16 activation costs two of them
(its int8 halves). Float32 in and out, the output head included. A row's result depends on that row alone, summed
in one order whatever the rows or threads: a verify block's rows equal decoding its tokens one by one, so
speculation stays lossless, and a token's keys and values are the same whether a prompt or decoding computed them.

At decoding's few rows a layer's ~50 torch operations cost more than its arithmetic, and even a call per layer
costs (after a step has streamed the weights through the caches, each torch operation on a few rows took 25-80
us here): a Llama model whose layers' linears are all Q4_1 runs as one call per pass (LlamaKernels): the
embedding, rotary's tables, then per layer norms, q/k/v, rotary, the KV-cache write, attention over the paged
cache, the output projection, the MLP, the drafter's features copied out on the way, and the final norm. Its
attention sums each token's keys (those at its position and before) in position order, again whatever the pass's
shape, in float32. The greedy choice over the head's logits has a kernel too (first_max_indices).

The C source is compiled once per host and compiler (`cc`, or $CC) into cache_root()/kernels, and loaded with
ctypes: a second's build. Its libgomp.so.1 is torch's, loaded first under that soname, so the kernels run on
torch's OpenMP threads, as many as torch.set_num_threads says. Hosts without AVX2, FMA and F16C, or without a
compiler, get None from library() with the reason, and cpu_weights serves torch's kernel instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import nn

from .gguf_blocks import Q4_1_GROUP

SOURCE = Path(__file__).with_name("gguf_kernels.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
CPU_FLAGS = ("avx2", "fma", "f16c")


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded kernels, "") or (None, why not)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"no AVX2 kernels for {platform.machine()}"
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return None, "cannot read /proc/cpuinfo's CPU flags"
    missing = [f for f in CPU_FLAGS if f not in flags.split()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, f"no C compiler ({os.environ.get('CC', 'cc')}) to build {SOURCE.name}"
    try:
        path = build(compiler)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return None, f"{compiler} could not build {SOURCE.name}: {detail.strip()[-300:]}"
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.dflash_q4_1_matmul.argtypes = [pointer, pointer, pointer, size, size, pointer, size, ctypes.c_int32, pointer]
    lib.dflash_q8_0_matmul.argtypes = [pointer, pointer, size, size, pointer, size, pointer]
    lib.dflash_llama_model.argtypes = [ctypes.POINTER(LlamaModel), ctypes.POINTER(LlamaPass), pointer, pointer,
                                       pointer, pointer, size, pointer, ctypes.c_int32, pointer]
    lib.dflash_first_max.argtypes = [pointer, size, size, pointer]
    return lib, ""


def first_max_indices(x: torch.Tensor) -> torch.Tensor | None:
    """torch.max(x, -1).indices of a float32 CPU tensor (the first of equal values) on the kernels, several times
    faster over a vocabulary; None where they do not serve it."""
    lib = library()[0] if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] else None
    if lib is None:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[:-1], dtype=torch.long)
    lib.dflash_first_max(x.data_ptr(), out.numel(), x.shape[-1], out.data_ptr())
    return out


class Q4_1Weight(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p)]


def build(compiler: str) -> Path:
    """The shared library for this source, flags and compiler, built once (atomically: several processes may)."""
    from .checkpoint import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"gguf_kernels-{key}.so"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    subprocess.run([compiler, *FLAGS, str(SOURCE), "-lm", "-o", str(partial)], capture_output=True, text=True,
                   check=True)
    partial.replace(path)
    return path


def repacked_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_1 fields (q uint8 [N, K] in 0..15, d and m [N, K / 32]) in the kernel's layout: rows in groups of 8 (the
    last padded with zeros), q [groups, K / 32, 128] with byte 32 i + 4 c + j of a block holding element 4 i + j of
    the group's row c in its low nibble and element 16 + 4 i + j in its high one; d and m float32 [groups, K / 32,
    8]."""
    rows, k = q.shape
    pad = -rows % 8
    q, d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (q, d, m))
    groups, blocks = (rows + pad) // 8, k // Q4_1_GROUP
    q = q.view(groups, 8, blocks, 2, 4, 4)  # [g, c, b, half, i, j]: element 16 half + 4 i + j of row c
    nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [g, c, b, i, j]
    packed = nibbles.permute(0, 2, 3, 1, 4).reshape(groups, blocks, 128).contiguous()
    return (packed, *(t.float().view(groups, 8, blocks).transpose(1, 2).contiguous() for t in (d, m)))


class GGUFLinear(nn.Module):
    """A frozen linear on its GGUF blocks: Q4_1 fields (q, d, m) or Q8_0 fields (q, d), as load_blocks gives
    them; float32 in and out. activation_bits: 16, or 8 for Q4_1 (half the multiplications, answers further from
    the float32 model's: cpu_weights' gguf-int4-a8)."""

    def __init__(self, fields: tuple[torch.Tensor, ...], bias: torch.Tensor | None, activation_bits: int = 16):
        super().__init__()
        self.kind = "q4_1" if len(fields) == 3 else "q8_0"
        self.activation_bits = activation_bits if self.kind == "q4_1" else 16
        self.tensors = (repacked_q4_1(*fields) if self.kind == "q4_1"
                        else (fields[0].contiguous(), fields[1].float().contiguous()))
        self.out_features, self.in_features = fields[0].shape
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib, _ = library()
        rows = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(len(rows), self.out_features)
        pointers = (t.data_ptr() for t in self.tensors)
        if self.kind == "q4_1":
            failed = lib.dflash_q4_1_matmul(*pointers, self.out_features, self.in_features, rows.data_ptr(),
                                            len(rows), self.activation_bits, y.data_ptr())
        else:
            failed = lib.dflash_q8_0_matmul(*pointers, self.out_features, self.in_features, rows.data_ptr(),
                                            len(rows), y.data_ptr())
        if failed:
            raise RuntimeError(f"gguf_kernels' {self.kind} matmul: out of memory")
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class LlamaLayer(ctypes.Structure):
    """gguf_kernels.c's llama_layer: a layer's weights and shape."""
    _fields_ = [("qkv", Q4_1Weight), ("o", Q4_1Weight), ("gate_up", Q4_1Weight), ("down", Q4_1Weight),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("heads", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("activation_bits", ctypes.c_int32)]


class LlamaModel(ctypes.Structure):
    """gguf_kernels.c's llama_model: the embedding, the layers, the final norm and rotary's frequencies."""
    _fields_ = [("layers", ctypes.POINTER(LlamaLayer)), ("num_layers", ctypes.c_int32), ("vocab", ctypes.c_int64),
                ("embedding", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("inv_freq", ctypes.c_void_p)]


class LlamaPass(ctypes.Structure):
    """gguf_kernels.c's llama_pass: what every layer of one forward pass shares (rotary's tables: the C side's)."""
    _fields_ = [("batch", ctypes.c_int64), ("tokens", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("table_width", ctypes.c_int64), ("positions", ctypes.c_void_p), ("table", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


class LlamaKernels:
    """A Llama model in one kernel call per pass (gguf_kernels.c's dflash_llama_model), for a model whose every
    layer fits and whose embedding and norm are float32. The pointers address the model's own tensors, which it
    keeps (inv_freq: rotary's, on the CPU)."""

    def __init__(self, backbone: nn.Module, inv_freq: torch.Tensor):
        self.layers = (LlamaLayer * len(backbone.layers))(*map(llama_layer, backbone.layers))
        embedding, norm = backbone.embed_tokens.weight, backbone.norm
        self.inv_freq = inv_freq.float().contiguous()
        self.model = LlamaModel(self.layers, len(backbone.layers), embedding.shape[0], embedding.data_ptr(),
                                norm.weight.data_ptr(), norm.eps, self.inv_freq.data_ptr())
        self.slots = {}  # feature layers -> the slot of each layer's output in the features, -1: none

    @classmethod
    def fit(cls, backbone: nn.Module, inv_freq: torch.Tensor) -> "LlamaKernels | None":
        """The model's kernels, or None where some part does not fit them."""
        embedding, norm = backbone.embed_tokens.weight, backbone.norm.weight
        fits = (all(map(cls.layer_fits, backbone.layers)) and len(backbone.layers) > 0 and embedding.is_contiguous()
                and embedding.dtype == norm.dtype == torch.float32)
        return cls(backbone, inv_freq) if fits else None

    @staticmethod
    def layer_fits(layer: nn.Module) -> bool:
        """Its linears all Q4_1 GGUFLinears without bias, no per-head norms, float32 (its KV cache's dtype)."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)
        return (attn.q_norm is None and attn.head_dim % 8 == 0 and layer.input_layernorm.weight.dtype == torch.float32
                and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
                and all(isinstance(l, GGUFLinear) and l.kind == "q4_1" and l.bias is None for l in linears)
                and len({l.activation_bits for l in linears}) == 1)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, block_size: int,
                 feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions [B, T], table [B, W] (each row's blocks) -> the final-normed hidden states [B, T,
        hidden] and, if feature_layers, those layers' outputs [B, T, len * hidden] side by side; the pass's keys
        and values written to the caches ([layers, blocks, block_size, KV, D] each, float32, contiguous)."""
        tokens, positions, table = (t.long().contiguous() for t in (tokens, positions, table))
        batch, length = tokens.shape
        h = torch.empty(batch, length, self.layers[0].hidden)
        features = h.new_empty(batch, length, len(feature_layers) * h.shape[-1]) if feature_layers else None
        llama_pass = LlamaPass(batch, length, block_size, table.shape[1], positions.data_ptr(), table.data_ptr())
        status = library()[0].dflash_llama_model(
            ctypes.byref(self.model), ctypes.byref(llama_pass), tokens.data_ptr(), h.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.stride(0), self._slots(tuple(feature_layers)) if feature_layers else None,
            len(feature_layers), features.data_ptr() if features is not None else None)
        if status == 3:
            raise IndexError(f"KV cache access beyond the table's {table.shape[1] * block_size} positions")
        if status == 4:
            raise IndexError(f"token ids outside the vocabulary [0, {self.model.vocab})")
        if status:
            raise RuntimeError("dflash_llama_model: out of memory")
        return h, features

    def _slots(self, feature_layers: tuple[int, ...]):
        if feature_layers not in self.slots:
            if len(set(feature_layers)) < len(feature_layers) or not all(0 <= i < len(self.layers)
                                                                          for i in feature_layers):
                raise ValueError(f"feature layers {feature_layers}: each once, of the model's {len(self.layers)}")
            slots = [-1] * len(self.layers)
            for slot, layer in enumerate(feature_layers):
                slots[layer] = slot
            self.slots[feature_layers] = (ctypes.c_int32 * len(slots))(*slots)
        return self.slots[feature_layers]


def llama_layer(layer: nn.Module) -> LlamaLayer:
    """gguf_kernels.c's llama_layer of a decoder layer that fits (LlamaKernels.layer_fits)."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = layer.input_layernorm, layer.post_attention_layernorm
    return LlamaLayer(weight(attn.qkv), weight(attn.o_proj), weight(mlp.gate_up), weight(mlp.down_proj),
                      norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].eps, attn.o_proj.out_features,
                      mlp.down_proj.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                      mlp.down_proj.activation_bits)


def weight(linear: GGUFLinear) -> Q4_1Weight:
    return Q4_1Weight(*(t.data_ptr() for t in linear.tensors))

