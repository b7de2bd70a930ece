"""Which path each linear takes on a CPU, chosen on the host that runs it, by measurement.

F.linear on a few rows (decode, verify) is an MKL GEMV, which runs on one core; a batched GEMM over
one slice of rows per thread (ThreadSplitLinear) streams the weights on every core. Which is faster
depends on the host: with the split everywhere the embedded default decoded at 1.9x transformers
`generate` on one host of our machine kind and at 0.52x on another (on a third, 21 tokens/s against
15 with F.linear everywhere). So when a model loads, each weight shape is timed both ways, at one row
(a decode step) and at MANY_ROWS rows (a verify block), on weights read from memory as in a whole
pass, and each linear takes the faster path for each. The choices are cached per host signature
(cache_root()/cpu_linears.json): a host measures a shape once (~7 s for the embedded default's six).

DFLASH_CPU_LINEAR=measure (default) | split | plain forces the split everywhere or nowhere instead.
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

MANY_ROWS = 8
COLD_BYTES = 64 << 20  # more than the last-level cache of the CPUs we serve on
CHOICES = ("measure", "split", "plain")


class ThreadSplitLinear(nn.Module):
    """A frozen linear whose rows are split into one slice per thread and run as one batched GEMM, for the
    row counts where that measured faster (`split_one_row`: one input row; `split_rows`: more); F.linear
    otherwise. Each output is still one dot product over the full input, in float32."""

    def __init__(self, linear: nn.Linear, parts: int, split_one_row: bool = True, split_rows: bool = True):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.slices = linear.weight.detach().view(parts, -1, linear.weight.shape[1])  # a view: no copy
        self.split_one_row, self.split_rows = split_one_row, split_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.split_one_row if x.numel() == x.shape[-1] else self.split_rows):
            return F.linear(x, self.weight, self.bias)
        return split_linear(self.slices, x, self.bias)


def split_linear(slices: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).T  # [K, M]
    y = torch.bmm(slices, rows.expand(len(slices), *rows.shape))  # [P, N/P, M]
    # row-major, as F.linear's: a strided view would reach attention with its head dim strided (SDPA's
    # flash kernel refuses that, and the math kernel ran instead)
    y = y.permute(2, 0, 1).reshape(*x.shape[:-1], -1).contiguous()
    return y if bias is None else y + bias


def is_fused_part(linear: nn.Module) -> bool:
    """Whether the linear's weight is rows of a larger one (layers.fuse_linears): the fused linear runs instead."""
    return linear.weight.untyped_storage().nbytes() > linear.weight.nbytes


def host_signature() -> str:
    """What a measurement is valid for: this host, its CPU, the threads torch uses and torch's build."""
    return (f"{platform.node()} | {platform.processor() or platform.machine()} | {torch.get_num_threads()} threads "
            f"| torch {torch.__version__}")


def split_where_faster(model: nn.Module) -> None:
    """Replace each plain linear of a CPU model by a ThreadSplitLinear taking the path measured faster
    (see the module docstring); nothing changes where the split is never faster or on one thread."""
    parts = torch.get_num_threads()
    mode = os.environ.get("DFLASH_CPU_LINEAR", "measure")
    if mode not in CHOICES:
        raise ValueError(f"DFLASH_CPU_LINEAR={mode!r}: expected one of {', '.join(CHOICES)}")
    if parts < 2 or mode == "plain":
        return
    linears = [(parent, name, child) for parent in list(model.modules()) for name, child in parent.named_children()
               if type(child) is nn.Linear and not is_fused_part(child) and child.weight.shape[0] % parts == 0]
    choices = MeasuredChoices() if mode == "measure" else None
    for parent, name, linear in linears:
        split = choices.split(linear, parts) if choices else (True, True)
        if any(split):
            setattr(parent, name, ThreadSplitLinear(linear, parts, *split))
    if choices:
        choices.save()


class MeasuredChoices:
    """The cache of this host's measurements: weight shape and dtype -> (split at one row, split at many)."""

    def __init__(self):
        from .checkpoint import cache_root

        self.path = cache_root() / "cpu_linears.json"
        try:
            self.hosts = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.hosts = {}
        self.signature = host_signature()
        self.known = self.hosts.setdefault(self.signature, {})
        self.changed = False

    def split(self, linear: nn.Linear, parts: int) -> tuple[bool, bool]:
        weight = linear.weight
        key = f"{weight.shape[0]}x{weight.shape[1]} {weight.dtype}".replace("torch.", "")
        if key not in self.known:
            self.known[key] = [measure_split(weight, parts, rows) for rows in (1, MANY_ROWS)]
            self.changed = True
        return tuple(self.known[key])

    def save(self) -> None:
        if not self.changed:
            return
        try:  # a read-only cache only costs a new measurement next time
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            partial.write_text(json.dumps(self.hosts, indent=1) + "\n")
            partial.replace(self.path)
        except OSError:
            pass


def measure_split(weight: torch.Tensor, parts: int, rows: int, rounds: int = 5) -> bool:
    """Whether the split ran faster than F.linear over `rows` rows: the best of `rounds` alternating rounds
    (noise from a shared host only adds time). Each call reads another copy of the weight, COLD_BYTES of
    copies in all, so the weights come from memory as in a whole pass, not from a cache that one small
    weight called again and again would stay in (which made the one-core GEMV look faster than it is)."""
    copies = [weight.detach().clone() for _ in range(max(1, COLD_BYTES // weight.nbytes))]
    slices = [w.view(parts, -1, w.shape[1]) for w in copies]
    x = torch.randn(1, rows, weight.shape[1], dtype=weight.dtype)
    paths = (lambda i: F.linear(x, copies[i % len(copies)]), lambda i: split_linear(slices[i % len(copies)], x, None))
    best = [float("inf")] * 2
    with torch.inference_mode():
        for path in paths:
            path(0)  # warm up
        for _ in range(rounds):
            best = [min(b, _seconds(path, len(copies))) for b, path in zip(best, paths)]
    return best[1] < best[0]


def _seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls


def describe(model: nn.Module) -> str:
    """Which path the model's linears take, for benchmarks and logs: e.g. "split 5/7 at one row, 3/7 at 8"."""
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, ThreadSplitLinear)) and not is_fused_part(m)]
    one = sum(isinstance(m, ThreadSplitLinear) and m.split_one_row for m in linears)
    many = sum(isinstance(m, ThreadSplitLinear) and m.split_rows for m in linears)
    return (f"thread-split linears ({torch.get_num_threads()} threads): {one}/{len(linears)} at one row, "
            f"{many}/{len(linears)} at {MANY_ROWS} rows ({os.environ.get('DFLASH_CPU_LINEAR', 'measure')})")
