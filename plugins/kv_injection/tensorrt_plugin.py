"""TensorRT plugin `dflash::kv_injection` (tensorrt.plugin, TensorRT >= 10.9), ahead-of-time from PTX.

    from plugins.kv_injection.tensorrt_plugin import register
    register()   # before parsing an ONNX graph with a `kv_injection` node (plugin_namespace "dflash")

The plugin writes into the KV caches in place: its two outputs alias the cache inputs (TensorRT's
preview feature ALIASED_PLUGIN_IO_10_03 must be on in the builder config). At build time its
`aot_impl` compiles the OpenAI-Triton kernel to PTX for the build GPU, so the engine runs without
Python. TensorRT passes integer scalars only, so eps and head_dim are compiled into the PTX.

Nothing here imports TensorRT until register() is called; PTX compilation (`compile_ptx`) needs
only the `triton` package and runs on a CPU-only host.
"""
from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "dflash"
NAME = "kv_injection"
# tensor inputs, in the kernel's order; the ONNX node and the register() signature follow it
INPUTS = ("context", "k_weight", "v_weight", "k_norm_weight", "inv_freq", "positions", "slots", "cache_k", "cache_v")
OUTPUTS = ("cache_k_out", "cache_v_out")
TRITON_TYPES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT32": "i32", "INT64": "i64"}


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared_memory: int


def compile_ptx(arch: int, float_type: str = "fp32", index_type: str = "i64", head_dim: int = 128,
                eps: float = 1e-6) -> CompiledKernel:
    """Compile the kernel for one GPU architecture (90 = Hopper, 100 = Blackwell) without a GPU.

    float_type: the element type of context, weights and caches; index_type: positions and slots.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dflash_runtime.kv_injection.triton_kernel import BLOCK_H, NUM_WARPS, kv_injection_kernel

    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"head_dim {head_dim}: the kernel needs head_dim / 2 to be a power of two")
    pointer = f"*{float_type}"
    signature = {name: pointer for name in ("context", "k_weight", "v_weight", "k_norm_weight",
                                            "cache_k_in", "cache_v_in", "cache_k", "cache_v")}
    # RoPE frequencies stay float32 whatever the model's dtype: angles at large positions need it
    signature.update({"inv_freq": "*fp32", "positions": f"*{index_type}", "slots": f"*{index_type}"})
    signature.update({name: "i32" for name in ("hidden", "context_stride", "cache_slot_stride", "cache_head_stride",
                                                "cache_pos_stride", "cache_capacity")})
    signature.update({name: "constexpr" for name in ("EPS", "HALF", "BLOCK_H")})
    signature = {name: signature[name] for name in kv_injection_kernel.arg_names}
    source = ASTSource(kv_injection_kernel, signature,
                       constexprs={"EPS": float(eps), "HALF": head_dim // 2, "BLOCK_H": BLOCK_H})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})
    # TensorRT passes no scratch buffers: the kernel must not need Triton's global/profile scratch
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(compiled.metadata, scratch, 0):
            raise RuntimeError(f"the compiled kernel needs {scratch}={getattr(compiled.metadata, scratch)}; "
                               "TensorRT cannot provide it")
    return CompiledKernel(compiled.metadata.name, compiled.asm["ptx"], compiled.metadata.num_warps,
                          compiled.metadata.shared)


def _tensorrt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except ImportError as e:
        raise ImportError(
            "the dflash::kv_injection TensorRT plugin needs TensorRT >= 10.9 with its Python plugin module "
            "(tensorrt.plugin): use the NGC TensorRT-LLM container or `pip install tensorrt` from NVIDIA's index "
            f"({e})") from e
    if not hasattr(trtp, "aot_impl"):
        raise ImportError(f"TensorRT {trt.__version__} has no tensorrt.plugin.aot_impl (needs >= 10.9)")
    return trt, trtp


_registered = False


def register() -> None:
    """Register dflash::kv_injection with TensorRT's plugin registry (idempotent)."""
    global _registered
    if _registered:
        return
    trt, trtp = _tensorrt()
    from typing import Tuple, Union

    TensorDesc = trtp.TensorDesc

    @trtp.register(f"{NAMESPACE}::{NAME}")
    def kv_injection_desc(context: TensorDesc, k_weight: TensorDesc, v_weight: TensorDesc, k_norm_weight: TensorDesc,
                          inv_freq: TensorDesc, positions: TensorDesc, slots: TensorDesc, cache_k: TensorDesc,
                          cache_v: TensorDesc, eps: float) -> Tuple[TensorDesc, TensorDesc]:
        return cache_k.aliased(), cache_v.aliased()  # written in place

    @trtp.aot_impl(f"{NAMESPACE}::{NAME}")
    def kv_injection_aot(context: TensorDesc, k_weight: TensorDesc, v_weight: TensorDesc, k_norm_weight: TensorDesc,
                         inv_freq: TensorDesc, positions: TensorDesc, slots: TensorDesc, cache_k: TensorDesc,
                         cache_v: TensorDesc, eps: float, outputs: Tuple[TensorDesc], tactic: int
                         ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        import torch

        if inv_freq.dtype != trt.float32:
            raise TypeError("dflash::kv_injection needs inv_freq in float32")
        head_dim_expr = cache_k.shape_expr[3]
        if not head_dim_expr.is_constant:
            raise ValueError("dflash::kv_injection needs a static head_dim (cache dimension 3)")
        major, minor = torch.cuda.get_device_capability()
        kernel = compile_ptx(major * 10 + minor, TRITON_TYPES[context.dtype.name], TRITON_TYPES[positions.dtype.name],
                             head_dim_expr.constant_value(), eps)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = context.shape_expr[0]  # one program per (token, KV head)
        launch.grid_y = cache_k.shape_expr[1]
        launch.block_x = kernel.num_warps * 32
        launch.shared_mem = kernel.shared_memory
        hidden, cache = context.shape_expr[1], cache_k.shape_expr
        # hidden, context row stride, cache slot / head / position strides (contiguous tensors), capacity
        scalars = (hidden, hidden, cache[1] * cache[2] * cache[3], cache[2] * cache[3], cache[3], cache[2])
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
        return kernel.name.encode(), kernel.ptx.encode(), launch, extra

    _registered = True


def export_layer_onnx(drafter, layer_index: int, path: str, num_slots: int, capacity: int) -> None:
    """Write one drafter layer's KV-injection step as an ONNX graph for TensorRT.

    The layer's k_proj / v_proj / k_norm weights and the RoPE frequencies are initializers; the graph
    takes the context features of N new tokens (N dynamic) with their positions and cache slots, and
    the caches, and returns the caches (aliased in TensorRT). The node is what the TensorRT ONNX
    parser maps to the plugin: op_type = plugin name, attribute plugin_namespace, aot=1 to pick the
    PTX implementation, and eps, the plugin's one attribute.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    attn = drafter.layers[layer_index].self_attn
    s = drafter.config.shape
    float_type = {"torch.float32": TensorProto.FLOAT, "torch.float16": TensorProto.FLOAT16,
                  "torch.bfloat16": TensorProto.BFLOAT16}[str(drafter.dtype)]
    cache_shape = [num_slots, s.num_kv_heads, capacity, s.head_dim]

    def initializer(name, tensor, dtype):
        array = tensor.detach().float().contiguous().numpy()
        if dtype == TensorProto.FLOAT:
            return numpy_helper.from_array(array, name)
        return helper.make_tensor(name, dtype, array.shape, array.flatten().tolist())  # rounds to fp16 / bf16

    initializers = [initializer("k_weight", attn.k_proj.weight, float_type),
                    initializer("v_weight", attn.v_proj.weight, float_type),
                    initializer("k_norm_weight", attn.k_norm.weight, float_type),
                    initializer("inv_freq", drafter.rotary.inv_freq, TensorProto.FLOAT)]
    graph = helper.make_graph(
        [helper.make_node(NAME, list(INPUTS), list(OUTPUTS), name=f"layers.{layer_index}.kv_injection",
                          domain=NAMESPACE, plugin_namespace=NAMESPACE, plugin_version="1", aot=1,
                          eps=float(attn.k_norm.eps))],
        f"dflash_layer{layer_index}_kv_injection",
        inputs=[helper.make_tensor_value_info("context", float_type, ["tokens", s.hidden_size]),
                helper.make_tensor_value_info("positions", TensorProto.INT64, ["tokens"]),
                helper.make_tensor_value_info("slots", TensorProto.INT64, ["tokens"]),
                helper.make_tensor_value_info("cache_k", float_type, cache_shape),
                helper.make_tensor_value_info("cache_v", float_type, cache_shape)],
        outputs=[helper.make_tensor_value_info(name, float_type, cache_shape) for name in OUTPUTS],
        initializer=initializers,
    )
    # The node's domain names the namespace too: the ONNX checker only accepts unknown ops outside the
    # default domain, and the TensorRT parser falls back to the domain when plugin_namespace is absent.
    model = helper.make_model(graph, producer_name="dflash",
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(NAMESPACE, 1)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
