"""DFlash KV injection as one fused op.

For each new context token (of any sequence in the batch): K = RoPE(k_norm(W_k h)) at its absolute
position and V = W_v h, written into that sequence's draft KV-cache slot. Unfused, this is two GEMMs,
a normalization, RoPE and two scatters per draft layer per step.

- reference.py: the PyTorch definition of correct (CPU), and the differentiable K/V for training.
- triton_kernel.py: the OpenAI-Triton kernel (CUDA; checked on CPU under TRITON_INTERPRET=1).
- op.py: `torch.ops.dflash.kv_injection`, dispatching to the kernel on CUDA, the reference elsewhere; `inject`, the
  op as the engine calls it (on a CPU without the custom op's dispatch).

The TensorRT plugin built from the same kernel lives in plugins/kv_injection.
"""
from .op import inject, kv_injection
from .reference import injected_kv, kv_injection_reference

__all__ = ["inject", "kv_injection", "injected_kv", "kv_injection_reference"]
