"""The format a CPU serves a target's linear weights in, chosen when the target loads.

Decoding on a CPU reads every weight once per step and is bound by memory, and by the arithmetic of unpacking
what it reads. Formats:
  gguf-int4  the GGUF's own blocks (gguf_blocks.py): its Q4_1 projections and, where the GGUF has one, its Q8_0
             head, on gguf_kernels.py's AVX2 kernels wherever they build (activations quantized to int16 per
             block of 32, float32 out; a Llama layer in one call): the shipped model, not a dequantized copy,
             its greedy answers the float32 model's on 99.97% of tokens for SmolLM2. Elsewhere
             the projections run on torch's `_weight_int4pack_mm_for_cpu` (groups of 32, bfloat16 activations:
             w = (q - 8) * scale + zero, scale = d, zero = m + 8d rounded to bfloat16) and the head in float32.
             A projection stored otherwise falls back to int8, named in the summary.
  gguf-int4-a8  gguf-int4 with the projections' activations quantized to int8, not int16, as llama.cpp does: on
             the AVX2 kernels, half the multiplications (a step at batch 8 or block 8 in ~0.7-0.8x gguf-int4's
             time; one row, bound by memory, much the same), but another model: perplexity +1.5%, greedy answers
             the float32 model's on 94.1% of tokens for SmolLM2. Where the kernels do not build, it is gguf-int4
             on torch's kernel.
  int8       `_weight_int8pack_mm`: int8 with a scale per output channel, quantized here from the float weights,
             on bfloat16 activations.
  float32    as loaded (cpu_linears may still split it across threads).
torch's kernels are vectorized for bfloat16 activations only (../shared/DESIGN.md §8), so a linear on them takes
float32 in, runs on bfloat16 and gives float32 back. Norms, softmax and sampling stay float32; attention on torch
runs in float64 for the low-bit formats (attention_dtype). A head on torch's kernels would return bfloat16, whose
resolution near the largest logits (0.125 at 25) rounded "The" and "L" after "What is the capital of France?" to
the same 25.25: without the GGUF kernels the head stays float32 (for the embedded default: its Q8_0 embedding,
dequantized, so still the shipped weights).
No bfloat16 F.linear format: on an AVX2 host it ran 2-8x slower than int8 at a verify block's rows, and a tiny
target in it was where speculation and plain decoding first parted (before attention ran in float64).
"auto" measures this host (a decode step's linears at one row and at a verify block's MANY_ROWS, weights read
from memory as in a whole pass) among the formats that serve the checkpoint as shipped: gguf-int4 where the
target has blocks, and float32; gguf-int4-a8 and int8 only when asked for, since they change the model. The choice
is cached per host signature (cache_root()/cpu_weights.json) and overridden by --cpu-weights or DFLASH_CPU_WEIGHTS.
"""
from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash_contract.presets import CPU_WEIGHTS

from .config import DFlashError
from .cpu_linears import host_signature, is_fused_part
from .gguf_kernels import GGUFLinear, LlamaKernels, library

AUTO, FORMATS = CPU_WEIGHTS[0], CPU_WEIGHTS[1:]
ENV = "DFLASH_CPU_WEIGHTS"
INT4_GROUP = 32  # GGUF Q4_1's block
MANY_ROWS = 8
GGUF_FORMATS = {"gguf-int4": 16, "gguf-int4-a8": 8}  # -> the projections' activation bits on the AVX2 kernels
COLD_BYTES = 64 << 20  # more than the last-level cache of the CPUs we serve on


class WeightOnlyLinear(nn.Module):
    """A frozen linear run by one of torch's CPU kernels on bfloat16 activations: float32 in and out."""

    def __init__(self, fmt: str, tensors: tuple[torch.Tensor, ...], out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.format, self.tensors, self.out_features, self.bias = fmt, tensors, out_features, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.format == "gguf-int4":
            y = torch._weight_int4pack_mm_for_cpu(rows, self.tensors[0], INT4_GROUP, self.tensors[1])
        else:
            y = torch._weight_int8pack_mm(rows, *self.tensors)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def attention_dtype(fmt: str) -> torch.dtype | None:
    """float64 attention for the formats that round activations to bfloat16: attention's float32 sums depend on
    the pass's shape (a verify block's keys, a batch's padding), and a 1-ulp difference that crosses a bfloat16
    rounding boundary of the next linear's input changed a greedy answer (2 of 4 chat prompts, 64 tokens, DFlash
    against plain decoding); in float64 the order of the sums no longer shows in the float32 result."""
    return torch.float64 if fmt in (*GGUF_FORMATS, "int8") else None


def int4_tensors(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 fields (q uint8 [N, K] in 0..15, d, m [N, K / 32]) -> the int4 kernel's packed weight (its layout
    depends on this host's instruction set: packed at load, never stored) and scales_and_zeros [K / 32, N, 2]."""
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_zeros = torch.stack([d.float(), m.float() + 8 * d.float()], dim=-1).transpose(0, 1)
    return packed, scales_zeros.to(torch.bfloat16).contiguous()


def int8_tensors(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> int8 [N, K] and a bfloat16 scale per output channel (symmetric, max / 127)."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


def convert(linear: nn.Linear, fmt: str, blocks: tuple | None, head: bool = False) -> tuple[nn.Module, str]:
    """linear in `fmt` (blocks: its GGUF fields, if any; head: it is the output head) -> (module, the format it
    really got: fmt, or int8 or float32 where it could not be served in fmt, or q8_0 for a Q8_0 head)."""
    bias = linear.bias
    n = linear.weight.shape[0]
    if fmt in GGUF_FORMATS and blocks is not None and library()[0] is not None:
        return GGUFLinear(blocks, bias, GGUF_FORMATS[fmt]), fmt if len(blocks) == 3 else "q8_0"
    if head:
        return linear, "float32"
    if fmt in GGUF_FORMATS and blocks is not None and len(blocks) == 3 and n % 16 == 0:
        return WeightOnlyLinear("gguf-int4", int4_tensors(*blocks), n, bias), "gguf-int4"
    if fmt in (*GGUF_FORMATS, "int8"):
        return WeightOnlyLinear("int8", int8_tensors(linear.weight), n, bias), "int8"
    return linear, "float32"


def kernel(fmt: str) -> str:
    """What runs a format's low-bit linears on this host, for the summaries."""
    if fmt in GGUF_FORMATS:
        lib, why_not = library()
        return "AVX2 kernels (gguf_kernels.c)" if lib else f"torch's int4 kernel ({why_not})"
    return "torch's int8 kernel" if fmt == "int8" else "torch"


def model_blocks(model: nn.Module, blocks: dict) -> dict[nn.Linear, tuple]:
    """Each linear of the model -> its GGUF fields, where the blocks cover all its rows. A fused linear
    (layers.fuse_linears) is covered by its Q4_1 parts, whose weights are views of its rows."""
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    by_storage = {}
    for linear in linears.values():
        if linear.weight.storage_offset() == 0:
            by_storage.setdefault(linear.weight.untyped_storage().data_ptr(), []).append(linear)
    parts: dict[nn.Linear, list] = {}
    for name, linear in linears.items():
        fields = blocks.get(f"{name}.weight")
        if fields is None or len(fields) != 3:
            continue
        width = linear.weight.shape[1]
        for whole in by_storage.get(linear.weight.untyped_storage().data_ptr(), []):
            if whole.weight.shape[1] == width and whole.weight.shape[0] >= linear.weight.shape[0]:
                parts.setdefault(whole, []).append((linear.weight.storage_offset() // width, fields))
    covered = {}
    for whole, rows in parts.items():
        rows.sort(key=lambda r: r[0])
        if sum(len(f[0]) for _, f in rows) == whole.weight.shape[0] and rows[0][0] == 0:
            covered[whole] = tuple(torch.cat([f[i] for _, f in rows]) for i in range(3))
    if "lm_head.weight" in blocks:
        covered[model.lm_head] = blocks["lm_head.weight"]
    return covered


@dataclass
class ServedWeights:
    """What a model's linears were served in, for the start-up line, the bench and the build summary."""

    requested: str
    chosen: str
    why: str
    counts: dict[str, int] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)  # linears not in the chosen format, and theirs (the head)
    megabytes: float = 0.0
    kernel: str = "torch"
    fused_layers: int = 0  # layers run as one kernel call per pass (LlamaKernels)

    def describe(self) -> str:
        counts = ", ".join(f"{n} {fmt}" for fmt, n in self.counts.items())
        fallback = f"; not in {self.chosen}: {', '.join(self.fallbacks)}" if self.fallbacks else ""
        fused = f", {self.fused_layers} layers fused" if self.fused_layers else ""
        return (f"{self.chosen} ({self.why}) on {self.kernel}: linears {counts}, {self.megabytes:.0f} MB{fused}"
                f"{fallback}")


def serve(model: nn.Module, requested: str, fmt: str, why: str, blocks: dict) -> ServedWeights:
    """Convert the model's plain linears (after fusion) to `fmt` (chosen for `requested`, because `why`); returns
    what each got."""
    covered = model_blocks(model, blocks) if fmt in GGUF_FORMATS else {}
    served = ServedWeights(requested, fmt, why, kernel=kernel(fmt))
    named = [(parent, child_name, child, f"{parent_name}.{child_name}".lstrip("."))
             for parent_name, parent in list(model.named_modules()) for child_name, child in parent.named_children()
             if type(child) is nn.Linear and not is_fused_part(child)]
    for parent, child_name, linear, name in named:
        module, got = convert(linear, fmt, covered.get(linear), head=linear is model.lm_head)
        setattr(parent, child_name, module)
        served.counts[got] = served.counts.get(got, 0) + 1
        served.megabytes += nbytes(module) / 1e6
        if got != fmt:
            served.fallbacks.append(f"{name} ({got})")
    if hasattr(model, "kernels"):  # a TargetModel
        model.kernels = LlamaKernels.fit(model.model, model.rotary.inv_freq)
        served.fused_layers = len(model.model.layers) if model.kernels else 0
    return served


def candidates(blocks: dict) -> list[str]:
    """The formats `auto` measures: those that serve the checkpoint as shipped (module docstring)."""
    return (["gguf-int4"] if blocks else []) + ["float32"]


def requested_format(flag: str | None) -> str:
    """The flag, unless it is absent or "auto" (a build's default: the serving host decides), then
    DFLASH_CPU_WEIGHTS, then auto."""
    fmt = (flag if flag != AUTO else None) or os.environ.get(ENV) or AUTO
    if fmt != AUTO and fmt not in FORMATS:
        raise DFlashError(f"CPU weight format {fmt!r}: expected {AUTO} or one of {', '.join(FORMATS)}")
    return fmt


def choose(model: nn.Module, fmt: str, blocks: dict, why_asked: str) -> tuple[str, str]:
    """(format, why) for this model on this host: fmt (requested_format's) unless it is auto, else measured
    (cached). why_asked: who asked for fmt, "asked for" or DFLASH_CPU_WEIGHTS."""
    if fmt in GGUF_FORMATS and not blocks:
        raise DFlashError(f"--cpu-weights {fmt}: this target has no GGUF Q4_1 blocks (only a GGUF checkpoint "
                          "converted by this version has them); use int8 or float32")
    if fmt != AUTO:
        return fmt, why_asked
    options = candidates(blocks)
    if len(options) == 1:
        return options[0], "the checkpoint's own format"
    timings = measured_timings(model, options, blocks)
    best = min(options, key=lambda f: timings[f][0])
    return best, "measured on this host: " + ", ".join(f"{f} {timings[f][0]:.1f} ms/token" for f in options)


def measured_timings(model: nn.Module, options: list[str], blocks: dict) -> dict[str, list[float]]:
    """format -> [ms at one row, ms at MANY_ROWS] for all the model's linears, cached per host and model shape."""
    from .checkpoint import cache_root

    path = cache_root() / "cpu_weights.json"
    try:
        hosts = json.loads(path.read_text())
    except (OSError, ValueError):
        hosts = {}
    known = hosts.setdefault(host_signature(), {})
    key = model_key(model)
    if not all(f in known.get(key, {}) for f in options):
        known[key] = {**known.get(key, {}), **{f: time_format(model, f, blocks) for f in options}}
        try:  # a read-only cache only costs a new measurement next time
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.{os.getpid()}")
            partial.write_text(json.dumps(hosts, indent=1) + "\n")
            partial.replace(path)
        except OSError:
            pass
    return known[key]


def model_key(model: nn.Module) -> str:
    """The model's shapes and the kernels that would serve it: timings made with other kernels are stale."""
    shapes = [f"{m.weight.shape[0]}x{m.weight.shape[1]}" for m in model.modules()
              if type(m) is nn.Linear and not is_fused_part(m)]
    lib = library()[0]
    kernels = Path(lib._name).stem if lib is not None else "torch kernels"
    return (f"{len(shapes)} linears {' '.join(sorted(set(shapes)))} {model.lm_head.weight.dtype} "
            f"{kernels}").replace("torch.", "")


def time_format(model: nn.Module, fmt: str, blocks: dict, rounds: int = 3) -> list[float]:
    """ms for one pass over every linear of the model in `fmt`, at one row and at MANY_ROWS: converted copies of
    each distinct shape (a layer's linears, the head), COLD_BYTES of them, so that the weights come from memory
    as in a whole pass and not from a cache that one small weight timed again and again would stay in."""
    covered = model_blocks(model, blocks) if fmt in GGUF_FORMATS else {}
    plain = [m for m in model.modules() if type(m) is nn.Linear and not is_fused_part(m)]
    counts = Counter(tuple(m.weight.shape) for m in plain)
    first = {tuple(m.weight.shape): m for m in reversed(plain)}  # one linear of each shape
    result = []
    with torch.inference_mode():
        converted = []
        for shape, count in counts.items():
            linear = first[shape]
            copies = [served_copy(linear, fmt, covered.get(linear), linear is model.lm_head)]
            while len(copies) < min(256, COLD_BYTES // nbytes(copies[0])):  # weights from memory, not the cache
                copies.append(served_copy(linear, fmt, covered.get(linear), linear is model.lm_head))
            converted.append((copies, count, linear.weight.shape[1]))
        for rows in (1, MANY_ROWS):
            total = sum(min(_seconds(copies, torch.randn(rows, width)) for _ in range(rounds)) * count
                        for copies, count, width in converted)
            result.append(round(total * 1e3, 3))
    return result


def served_copy(linear: nn.Linear, fmt: str, blocks: tuple | None, head: bool) -> nn.Module:
    """A module computing `linear` as serve would in `fmt`, on weights of its own (a float32 linear's copied)."""
    module = convert(linear, fmt, blocks, head)[0]
    if module is not linear:
        return module
    with torch.device("meta"):
        copy = nn.Linear(linear.in_features, linear.out_features, bias=False)
    copy.weight = nn.Parameter(linear.weight.clone(), requires_grad=False)
    return copy


def nbytes(module: nn.Module) -> int:
    return module.nbytes() if isinstance(module, (WeightOnlyLinear, GGUFLinear)) else module.weight.nbytes


def _seconds(modules: list[nn.Module], x: torch.Tensor) -> float:
    modules[0](x)
    start = time.perf_counter()
    for module in modules:
        module(x)
    return (time.perf_counter() - start) / len(modules)
