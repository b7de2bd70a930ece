"""dflash-profile-step: where an engine step's time goes, by phase, at several batch sizes.

For each target, batch size and mode (plain decoding, and a forced draft + verify block), a full batch of random
prompts decodes without end; after warm-up steps the engine's own phase timer (dflash_runtime/step_clock.py) gives
each phase's median microseconds per step. The host's phases (scheduling, block tables and input tensors,
sampling, grammar, penalties, acceptance, commits, stats) are what a step costs besides the model; the passes
(prefill, context, draft, verify) are the model's work on a CPU and its launches on CUDA, where the wait for the
device shows in "copy". Then torch's profiler counts the operations a step dispatches (top-level aten calls; our
C kernels are one ctypes call each and not counted): each has a fixed cost, which dominates a small model's step.

Targets: "tiny" (hidden 64, 4 layers, random weights: a step that is almost all fixed cost) and the embedded
default with its shipped weights, served as `dflash-serve` would serve it (--cpu-weights, default auto).
`make gpu-check` prints the same table on a GPU (random weights at the GPU shapes).

--prefill-stall N measures what a decoding stream pays while another request's N-token prompt prefills beside it
in chunks (the server's --prefill-chunk, default 128) and once that request joins the batch: the stream's time
per token and its longest wait for one, as ratios to its own steps alone, on an engine as served (block size
auto, the drafter's context written), and the prefill's wall time (what a smaller chunk costs the long prompt).

Examples:
  dflash-profile-step --targets tiny smollm2-135m --batch-sizes 1 8 32 --json profile.json
  dflash-profile-step --targets smollm2-135m --prefill-stall 2048
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_contract.presets import AUTO_BLOCK_SIZE, CPU_WEIGHTS, DEFAULT_PREFILL_CHUNK, DEFAULT_PRESET
from dflash_runtime.engine import SpeculativeEngine
from dflash_runtime.sampling import SamplingParams
from dflash_runtime.step_clock import COPY, PASSES, host_seconds

PROMPT_TOKENS = 16
HOST_ORDER = ("schedule", "inputs", "sample", "propose", "grammar", "penalties", "accept", "copy", "stats",
              "logprobs", "commit")


def count_operations(engine: SpeculativeEngine, steps: int) -> float:
    """Top-level torch operations per engine step (an op's own nested calls not counted), over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")) / steps


def profile_engine(engine: SpeculativeEngine, batch: int, steps: int, label: str) -> dict:
    """Median wall microseconds per phase of `steps` steps over a full batch of random prompts; ops per step."""
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=10 ** 6, ignore_eos=True)
    seqs = [engine.add_request(random_prompt(engine, PROMPT_TOKENS, generator), params) for _ in range(batch)]
    for _ in range(3):  # the prefills, then warm-up
        engine.step()
    phases: dict[str, list[float]] = {}
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        for phase in set(phases) | set(engine.phases.seconds):
            phases.setdefault(phase, []).append(engine.phases.seconds.get(phase, 0.0))
    operations = count_operations(engine, min(steps, 5))
    for seq in seqs:
        engine.cancel(seq)
    median = {phase: statistics.median(values) * 1e6 for phase, values in phases.items()}
    layers = engine.target.config.shape.num_layers
    return {"target": label, "batch": batch, "block": engine.block_size,
            "step_ms": round(statistics.median(walls) * 1e3, 3),
            "passes_ms": round(sum(median.get(p, 0.0) for p in PASSES) / 1e3, 3),
            "host_us": round(host_seconds(median), 1), "copy_us": round(median.get(COPY, 0.0), 1),
            "phases_us": {phase: round(us, 1) for phase, us in sorted(median.items())},
            "ops_per_step": round(operations, 1), "ops_per_layer": round(operations / layers, 1)}


def random_prompt(engine: SpeculativeEngine, tokens: int, generator: torch.Generator) -> list[int]:
    return torch.randint(2, engine.target.config.shape.vocab_size, (tokens,), generator=generator).tolist()


def prefill_stall(label: str, target, drafter, prompt_tokens: int, steps: int, chunk: int) -> dict:
    """What a decoding stream pays while a `prompt_tokens` prompt prefills beside it in chunks, and after that
    request joined the batch: its time per token and its longest wait for a token (the longest step), as ratios
    to its own steps alone."""
    engine = SpeculativeEngine(target, drafter, block_size=AUTO_BLOCK_SIZE, max_batch_size=2, prefill_chunk=chunk,
                               max_context=prompt_tokens + 64 * (2 * steps + prompt_tokens // chunk + 8))
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=10 ** 6, ignore_eos=True)
    stream = engine.add_request(random_prompt(engine, PROMPT_TOKENS, generator), params)

    def timed(more) -> tuple[list[float], int]:
        """Step times while more(steps so far), and the tokens the stream got in them."""
        times, tokens = [], len(stream.output_ids)
        while more(len(times)):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times, len(stream.output_ids) - tokens

    timed(lambda n: n < 3)  # its prefill, then warm-up
    alone, alone_tokens = timed(lambda n: n < steps)
    joining = engine.add_request(random_prompt(engine, prompt_tokens, generator), params)
    phases = {"during": timed(lambda n: joining.prefilling), "joined": timed(lambda n: n < steps)}
    for seq in (stream, joining):
        engine.cancel(seq)
    per_token, step = sum(alone) / alone_tokens, statistics.median(alone)
    row = {"target": label, "prompt_tokens": prompt_tokens, "chunk": chunk,
           "alone_ms_per_token": round(per_token * 1e3, 2), "prefill_steps": len(phases["during"][0]),
           "prefill_seconds": round(sum(phases["during"][0]), 2)}
    for name, (times, tokens) in phases.items():
        row[f"{name}_per_token_x"] = round(sum(times) / max(tokens, 1) / per_token, 2)
        row[f"{name}_longest_wait_x"] = round(max(times) / step, 2)
    return row


def stall_table(rows: list[dict]) -> str:
    head = ["target", "prompt", "chunk", "stream alone ms/token", "prefill steps", "prefill s", "during: per token",
            "longest wait", "joined: per token", "longest wait"]
    ratios = ("during_per_token_x", "during_longest_wait_x", "joined_per_token_x", "joined_longest_wait_x")
    return markdown(head, [[r["target"], r["prompt_tokens"], r["chunk"], f"{r['alone_ms_per_token']:.2f}",
                            r["prefill_steps"], r["prefill_seconds"], *(f"{r[key]:.2f}x" for key in ratios)]
                           for r in rows])


def markdown(head: list[str], rows: list[list]) -> str:
    """A markdown table: the header, its rule, a line per row of cells."""
    lines = ["| " + " | ".join(map(str, cells)) + " |" for cells in [head, *rows]]
    return "\n".join([lines[0], "|" + "---|" * len(head), *lines[1:]])


def profile_rows(label: str, target, drafter, batch_sizes: list[int], blocks: list[int], steps: int) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        for block in blocks:
            engine = SpeculativeEngine(target, drafter if block > 1 else None, block_size=block,
                                       max_batch_size=batch, max_context=PROMPT_TOKENS + (steps + 12) * block + 16)
            rows.append(profile_engine(engine, batch, steps, label))
            print(f"{label} batch {batch} block {block}: step {rows[-1]['step_ms']} ms, host {rows[-1]['host_us']} us",
                  file=sys.stderr)
            del engine
    return rows


def table(rows: list[dict]) -> str:
    """One line per (target, batch, block): the step, its passes, its host time and each host phase, its ops."""
    phases = [p for p in HOST_ORDER if any(p in r["phases_us"] for r in rows)]
    head = ["target", "batch", "block", "step ms", "passes ms", "host us", *phases, "ops/step", "ops/layer"]
    return markdown(head, [[r["target"], r["batch"], r["block"], f"{r['step_ms']:.2f}", f"{r['passes_ms']:.2f}",
                            f"{r['host_us']:.0f}", *(f"{r['phases_us'].get(p, 0.0):.0f}" for p in phases),
                            f"{r['ops_per_step']:.0f}", f"{r['ops_per_layer']:.0f}"] for r in rows])


def load_target(name: str, args: argparse.Namespace) -> tuple:
    """(target, drafter): random weights for "tiny", else a preset or checkpoint as dflash-serve loads it."""
    if name == "tiny":
        from .random_models import random_models

        with tempfile.TemporaryDirectory() as folder:
            _, target, drafter = random_models("tiny", torch.device(args.device), torch.float32, Path(folder))
    else:
        from dflash_runtime.pipeline import load_pipeline

        pipe = load_pipeline(name, device=args.device, cpu_weights=args.cpu_weights)
        target, drafter = pipe.target, pipe.drafter
        if target.served_weights is not None:
            print(f"{name}: cpu weights {target.served_weights.describe()}", file=sys.stderr)
    return target, drafter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-profile-step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=["tiny", DEFAULT_PRESET],
                        help=f"'tiny' (random weights) and/or presets or checkpoint directories (default: tiny "
                             f"{DEFAULT_PRESET})")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--blocks", nargs="+", type=int, default=[8],
                        help="draft + verify block sizes to profile beside plain decoding (default: 8)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row (the median counts)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpu-weights", choices=CPU_WEIGHTS, help="the format a CPU serves a preset's linears in "
                        "(default: DFLASH_CPU_WEIGHTS, else auto, as dflash-serve)")
    parser.add_argument("--prefill-stall", type=int, metavar="TOKENS",
                        help="instead: a decoding stream's time per token and longest wait while a prompt of TOKENS "
                             "prefills beside it and after it joined the batch, as ratios to its steps alone")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                        help=f"with --prefill-stall: prompt tokens a step prefills at most (default "
                             f"{DEFAULT_PREFILL_CHUNK}, as dflash-build --prefill-chunk)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.steps < 1 or min(args.blocks) < 2:
        parser.error("batch sizes and --steps must be >= 1, --blocks >= 2")
    if args.prefill_stall is not None and (args.prefill_stall < 1 or args.prefill_chunk < 1):
        parser.error("--prefill-stall and --prefill-chunk must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name in args.targets:
            target, drafter = load_target(name, args)
            if args.prefill_stall:
                rows.append(prefill_stall(name, target, drafter, args.prefill_stall, args.steps, args.prefill_chunk))
                continue
            blocks = [1] + [b for b in args.blocks if drafter is not None and b <= drafter.config.block_size]
            rows += profile_rows(name, target, drafter, args.batch_sizes, blocks, args.steps)
    print(stall_table(rows) if args.prefill_stall else table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "threads": torch.get_num_threads(),
                                               "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
