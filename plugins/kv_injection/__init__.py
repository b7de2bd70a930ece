"""DFlash KV injection as one fused op.

For each new context token (of any sequence in the batch): K = RoPE(k_norm(W_k h)) at its absolute
position and V = W_v h, written into that sequence's draft KV-cache slot. Unfused, this is two GEMMs,
a normalization, RoPE and two scatters per draft layer per step.

- reference.py: the PyTorch definition of correct (CPU).
- triton_kernel.py: the OpenAI-Triton kernel (CUDA; checked on CPU under TRITON_INTERPRET=1).
- torch_op.py: `torch.ops.dflash.kv_injection`, dispatching to the kernel on CUDA, the reference elsewhere.
"""
from .reference import kv_injection_reference

__all__ = ["kv_injection_reference"]
