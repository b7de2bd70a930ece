"""`torch.ops.dflash.kv_injection`: the fused op as a PyTorch custom op.

On CUDA the op runs the Triton kernel or the unfused reference, whichever is faster for the shape: the
first call of each (shape, dtype, token count rounded up to a power of two) times both, replayed as
CUDA graphs as the engine runs them, and keeps the winner (on an H200 the kernel was 4.2x faster at
SmolLM2's shapes and 0.78x at Qwen3-8B's, where cuBLAS GEMMs win). Elsewhere the reference runs.
Two switches, read once:
DFLASH_KV_INJECTION=reference|triton forces one implementation (the reference on a GPU to rule the
kernel out; the kernel on a CPU under TRITON_INTERPRET=1, as the tests do), and DFLASH_CHECK_BOUNDS=1
also checks every slot and position against the cache (a device-to-host copy per call, so off by
default). Shapes, dtypes and devices are always checked: a wrong index tensor must be an error here,
not a write outside the cache. The fake implementation lets the op trace (torch.compile, export): it
mutates the caches and returns nothing.
"""
from __future__ import annotations

import os
import time

import torch

from .reference import kv_injection_reference

IMPLEMENTATIONS = ("auto", "reference", "triton")
IMPLEMENTATION = os.environ.get("DFLASH_KV_INJECTION", "auto")
if IMPLEMENTATION not in IMPLEMENTATIONS:
    raise ValueError(f"DFLASH_KV_INJECTION={IMPLEMENTATION!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
CHECK_BOUNDS = os.environ.get("DFLASH_CHECK_BOUNDS", "") not in ("", "0")


@torch.library.custom_op("dflash::kv_injection", mutates_args=("cache_k", "cache_v"))
def kv_injection(context: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                 inv_freq: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, eps: float) -> None:
    _kv_injection(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v, eps)


def inject(*args) -> None:
    """kv_injection(*args) as the engine calls it: on a CPU, outside a compile, its body without the custom op's
    dispatch, which cost ~0.3 ms a call there (the math of 64 tokens on SmolLM2's shapes: ~0.7 ms)."""
    if args[0].is_cuda or torch.compiler.is_compiling():
        kv_injection(*args)
    else:
        _kv_injection(*args)


def _kv_injection(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v,
                  eps) -> None:
    check_arguments(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v)
    args = (context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v, eps)
    if IMPLEMENTATION == "triton" or (IMPLEMENTATION == "auto" and context.is_cuda and _kernel_is_faster(args)):
        from .triton_kernel import kv_injection_triton

        kv_injection_triton(*args)
    else:
        kv_injection_reference(*args)


KERNEL_IS_FASTER: dict[tuple, bool] = {}  # (device, dtype, hidden, KV heads, head dim, token bucket) -> winner


def token_bucket(tokens: int) -> int:
    """The token counts one timing decides for: the next power of two."""
    return 1 << max(0, tokens - 1).bit_length()


def _kernel_is_faster(args: tuple) -> bool:
    context, cache_k = args[0], args[7]
    key = (str(context.device), context.dtype, context.shape[1], *cache_k.shape[1::2], token_bucket(len(context)))
    if key not in KERNEL_IS_FASTER:
        if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: the kernel, undecided
            return True
        from .triton_kernel import kv_injection_triton

        # Both write the same K/V at the same places, so timing them on the real arguments is harmless.
        KERNEL_IS_FASTER[key] = graph_seconds(kv_injection_triton, args) < graph_seconds(kv_injection_reference, args)
    return KERNEL_IS_FASTER[key]


def graph_seconds(fn, args: tuple, repeat: int = 20) -> float:
    """Seconds per call of fn(*args) on the GPU, replayed as one CUDA graph (launch costs excluded, as in
    the engine's graphs)."""
    fn(*args)  # compiles a kernel, initialises cuBLAS
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn(*args)
    graph.replay()  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


@kv_injection.register_fake
def _(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v, eps) -> None:
    return None


def check_arguments(context, k_weight, v_weight, k_norm_weight, inv_freq, positions, slots, cache_k, cache_v) -> None:
    """The op's contract (see reference.kv_injection_reference); ValueError naming what breaks it."""
    n, hidden = context.shape if context.dim() == 2 else (-1, -1)
    num_slots, kv_heads, capacity, head_dim = cache_k.shape if cache_k.dim() == 4 else (-1, -1, -1, -1)
    expected = {"context": (context, (n, hidden)), "k_weight": (k_weight, (kv_heads * head_dim, hidden)),
                "v_weight": (v_weight, (kv_heads * head_dim, hidden)), "k_norm_weight": (k_norm_weight, (head_dim,)),
                "inv_freq": (inv_freq, (head_dim // 2,)), "positions": (positions, (n,)), "slots": (slots, (n,)),
                "cache_v": (cache_v, tuple(cache_k.shape))}
    if n < 0 or num_slots < 0:
        raise ValueError(f"kv_injection: context must be [N, hidden] and the caches [slots, KV, capacity, D], got "
                         f"{list(context.shape)} and {list(cache_k.shape)}")
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"kv_injection: {name} has shape {list(tensor.shape)}, expected {list(shape)}")
        if tensor.device != cache_k.device:
            raise ValueError(f"kv_injection: {name} is on {tensor.device}, the cache on {cache_k.device}")
    for name, index in (("positions", positions), ("slots", slots)):
        if index.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kv_injection: {name} must be int32 or int64, got {index.dtype}")
    if CHECK_BOUNDS and n:
        # positions are stored modulo the capacity (a paged cache's slot is a block): only a negative one is wrong
        if int(positions.min()) < 0:
            raise IndexError(f"kv_injection: negative position {int(positions.min())}")
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_slots:
            raise IndexError(f"kv_injection: slots span [{low}, {high}], outside [0, {num_slots})")
