"""Fixed-shape engine steps, captured as CUDA graphs on a GPU.

A decode step of a small batch is bound by kernel launches on a GPU: hundreds of small kernels per
pass, each waiting on the host (31 tok/s for a 135M model on an H200, where the weights stream in
0.1 ms). A CUDA graph replays a whole pass with one launch, but only for fixed shapes and addresses.

With static shapes the engine runs each step's passes over R rows, R the batch bucket that covers the
batch (rows past it are padding rows: their block tables hold only the null block, where their writes
land, and their outputs are never read), and reads keys up to a length bucket through block tables as
wide as that bucket. A pass is then a pure function of a few index tensors of fixed shape (tokens,
positions, block tables), and each (pass, R, k, length) is one graph. The engine captures every graph it can need when it starts (nano-vllm captures its batch
sizes at start-up too), largest first, so that no request waits on a capture and the shared memory
pool is sized by the largest pass. Without CUDA the same fixed-shape functions run eagerly, which is
how the tests check them on a CPU (and torch.compile(fullgraph=True) proves there that they hold no
host synchronisation, which capture would break on).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .verify_length import doubling

MIN_LENGTH_BUCKET = 128
# Beyond this many graphs a new shape runs eagerly instead of being captured: graphs cost memory and capture
# time, and the count of (R, k, length) shapes grows with the batch, the block and the context
MAX_GRAPHS = 512


def cuda_graphs_by_default(device: torch.device) -> bool:
    """Whether an engine runs static shapes when not told: on CUDA, as graphs, unless DFLASH_CUDA_GRAPHS=0 (to debug
    a step eagerly)."""
    return device.type == "cuda" and os.environ.get("DFLASH_CUDA_GRAPHS", "1") != "0"


def batch_bucket(rows: int, max_batch_size: int) -> int:
    """The smallest of 1, 2, 4, ..., max_batch_size that holds `rows` rows."""
    return next(b for b in doubling(max_batch_size) if b >= rows)


def length_buckets(capacity: int) -> tuple[int, ...]:
    """The key lengths a pass reads: powers of two from MIN_LENGTH_BUCKET, then the cache capacity. A power
    within 25 % of the capacity is left out (the capacity covers it for little more): 5 buckets for a
    2,048-token context (128 ... 1,024, 2,064), one more per doubling, each at most twice the keys a step
    needs beyond the first."""
    buckets, bucket = [], MIN_LENGTH_BUCKET
    while bucket * 5 < capacity * 4:
        buckets.append(bucket)
        bucket *= 2
    return (*buckets, capacity)


def length_bucket(length: int, capacity: int) -> int:
    """The smallest length bucket that holds `length` keys."""
    return next(b for b in length_buckets(capacity) if b >= length)


@dataclass
class CaptureReport:
    graphs: int = 0
    seconds: float = 0.0
    pool_bytes: int = 0  # device memory reserved by capturing: the graphs' pool and the shared outputs

    def __str__(self) -> str:
        return f"{self.graphs} CUDA graphs, {self.pool_bytes / 2 ** 20:.0f} MiB, captured in {self.seconds:.1f} s"


class StepGraphs:
    """Graphs of fixed-shape passes by key; with capture off (no CUDA), passes run eagerly.

    All graphs share one memory pool for what they compute on the way, and all graphs of one pass write
    their outputs into the same buffers (the largest graph's size): a graph's outputs are valid only
    until the next graph of that pass runs, so the engine consumes (or clones) them before that, as it
    does anyway.
    """

    def __init__(self, capture: bool, max_graphs: int = MAX_GRAPHS):
        self.capture = capture
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple]] = {}
        self.pool = None
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}  # (pass, output index) -> flat output buffer
        self.captures = 0  # graphs captured so far: a step that captured one was slowed by it
        self.report = CaptureReport()

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor):
        """fn(*inputs), as the graph captured for `key` (the pass's name, then the shapes and every
        non-tensor argument), captured now if there is none yet and room for one."""
        if key not in self.graphs:
            if not self.capture or len(self.graphs) >= self.max_graphs:
                return fn(*inputs)
            self.capture_graph(key, fn, inputs)
        graph, static_inputs, outputs = self.graphs[key]
        for static, value in zip(static_inputs, inputs):
            static.copy_(value, non_blocking=True)
        graph.replay()
        return outputs

    def capture_graph(self, key: tuple, fn: Callable, inputs: tuple[torch.Tensor, ...]) -> None:
        # torch's recipe: warm up on a side stream (lazy initialisation, autotuning), then capture.
        # The passes write the KV cache at the given positions; writing the same values again when
        # the graph replays is harmless.
        start = time.perf_counter()
        static_inputs = [x.clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        views = self._output_views(key[0], warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            results = fn(*static_inputs)
            for view, result in zip(_as_tuple(views), _as_tuple(results)):
                if view is not None:
                    view.copy_(result)
        self.pool = graph.pool()
        self.graphs[key] = graph, static_inputs, views
        self.captures += 1
        torch.cuda.synchronize()
        self.report.graphs += 1
        self.report.seconds += time.perf_counter() - start

    def capture_all(self, graphs: Iterable[tuple[tuple, Callable, tuple[torch.Tensor, ...]]]) -> None:
        """Capture every (key, fn, inputs) and count the device memory they keep. Counted around all of them,
        not per graph: torch.cuda.graph empties the allocator's cache as it enters, which would make a
        per-capture difference of reserved memory meaningless (even negative)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        for key, fn, inputs in graphs:
            self.capture_graph(key, fn, inputs)
        torch.cuda.empty_cache()  # what is left reserved: the graphs' pool, their inputs and the shared outputs
        self.report.pool_bytes += torch.cuda.memory_reserved() - reserved

    def _output_views(self, name: str, outputs):
        """Views of the pass's shared output buffers shaped like `outputs` (a tensor, or a tuple with Nones);
        a buffer too small or of another dtype is replaced (graphs captured before keep the old one)."""
        views = []
        for i, out in enumerate(_as_tuple(outputs)):
            if out is None:
                views.append(None)
                continue
            buffer = self.buffers.get((name, i))
            if buffer is None or buffer.numel() < out.numel() or buffer.dtype != out.dtype:
                buffer = self.buffers[name, i] = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
            views.append(buffer[:out.numel()].view(out.shape))
        return views[0] if isinstance(outputs, torch.Tensor) else tuple(views)


def _as_tuple(x) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)
