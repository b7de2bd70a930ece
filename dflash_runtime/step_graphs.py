"""Fixed-shape engine steps, captured as CUDA graphs on a GPU.

A decode step of a small batch is bound by kernel launches on a GPU: hundreds of small kernels per
pass, each waiting on the host (31 tok/s for a 135M model on an H200, where the weights stream in
0.1 ms). A CUDA graph replays a whole pass with one launch, but only for fixed shapes and addresses.

With static shapes the engine runs each step's passes over rows 0..R-1 of its caches, R the batch
bucket that covers the highest slot in use (free slots below it are padding rows: their writes land
in their own unused slot and their outputs are never read), and reads keys up to a length bucket (a
power of two). A pass is then a pure function of a few index tensors of fixed shape, and each (pass,
R, k, length) is one graph: captured the first time it runs, replayed after (nano-vllm's model
runner and gpt-fast do the same for decoding). Without CUDA the same fixed-shape functions run
eagerly, which is how the tests check them on a CPU (and torch.compile(fullgraph=True) proves there
that they hold no host synchronisation, which capture would break on).
"""
from __future__ import annotations

from typing import Callable

import torch

from .verify_length import doubling

MIN_LENGTH_BUCKET = 64


def batch_bucket(rows: int, max_batch_size: int) -> int:
    """The smallest of 1, 2, 4, ..., max_batch_size that holds `rows` rows."""
    return next(b for b in doubling(max_batch_size) if b >= rows)


def length_bucket(length: int, capacity: int) -> int:
    """The smallest power of two (at least MIN_LENGTH_BUCKET) that holds `length` keys, capped at the
    cache capacity: at most twice the keys a step needs, and a few graphs per pass."""
    bucket = MIN_LENGTH_BUCKET
    while bucket < length:
        bucket *= 2
    return min(bucket, capacity)


class StepGraphs:
    """Graphs of fixed-shape passes by key; with capture off (no CUDA), passes run eagerly.

    All graphs share one memory pool, so a graph's outputs are valid only until another graph runs:
    the engine consumes (or clones) each pass's outputs before the next pass, as it does anyway.
    """

    def __init__(self, capture: bool):
        self.capture = capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = {}
        self.pool = None

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor):
        """fn(*inputs), as the graph captured for `key` (the shapes and every non-tensor argument)."""
        if not self.capture:
            return fn(*inputs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(fn, inputs)
        graph, static_inputs, outputs = self.graphs[key]
        for static, value in zip(static_inputs, inputs):
            static.copy_(value, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, fn: Callable, inputs: tuple[torch.Tensor, ...]):
        # torch's recipe: warm up on a side stream (lazy initialisation, autotuning), then capture.
        # The passes write the KV cache at the given positions; writing the same values again when
        # the graph replays is harmless.
        static_inputs = [x.clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*static_inputs)
        self.pool = graph.pool()
        return graph, static_inputs, outputs
