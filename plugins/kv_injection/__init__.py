"""The KV-injection op packaged for TensorRT, and its micro-benchmark.

The op itself (reference, OpenAI-Triton kernel, `torch.ops.dflash.kv_injection`) is part of the core
runtime: `dflash_runtime.kv_injection`. Here:

- tensorrt_plugin.py: the TensorRT plugin (AOT from the kernel's PTX; ONNX export of a drafter layer).
- benchmark.py: the fused op against the unfused reference, side by side.
"""
