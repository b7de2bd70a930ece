"""dflash-bench: transformers `generate` vs this runtime's autoregressive mode vs DFlash, side by side.

All three run in one process on the same prompts, interleaved prompt by prompt, so machine noise hits
them alike; the ratios are the result. Also checks that the three outputs are token-identical.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from .config import DFlashError
from .presets import DEFAULT_PRESET
from .sampling import SamplingParams

CHAT_PROMPTS = [
    "Explain what a hash table is and when to use one.",
    "Write a short story about a robot learning to paint.",
    "What are three tips for staying focused while studying?",
    "How does photosynthesis work? Explain it simply.",
]


def benchmark_prompts(source: str, count: int) -> list[str]:
    from .prompts import humaneval_prompts, sharegpt_conversations

    if source == "chat":
        return (CHAT_PROMPTS * count)[:count]
    if source == "humaneval":
        return [f"Complete this Python function.\n\n{p}" for p in humaneval_prompts()[:count]]
    if source == "sharegpt":
        return [p for p, _ in itertools.islice(((p, r) for p, r in sharegpt_conversations("heldout") if len(p) < 400), count)]
    raise DFlashError(f"unknown prompt source {source!r}")


def run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from .pipeline import load_pipeline

    torch.manual_seed(0)
    pipe = load_pipeline(args.target, args.drafter)
    if pipe.drafter is None:
        raise DFlashError("the benchmark compares against DFlash: the target needs a drafter (--drafter DIR)")
    hf = AutoModelForCausalLM.from_pretrained(pipe.target_dir, dtype=torch.float32).eval()
    autoregressive = pipe.engine(block_size=1, max_batch_size=1)
    dflash = pipe.engine(block_size=args.block_size, max_batch_size=1)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    eos = list(pipe.target.config.eos_token_ids)
    modes = {"hf_generate": [0, 0.0], "autoregressive": [0, 0.0], "dflash": [0, 0.0]}  # tokens, seconds
    identical, acceptance, draft_s, verify_s = 0, [], 0.0, 0.0
    prompts = [pipe.encode(p) for p in benchmark_prompts(args.prompts, args.num_prompts)]
    with torch.inference_mode():
        for ids in prompts[:1]:  # warm-up: first-call allocations and lazy inits stay out of the numbers
            hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            autoregressive.generate([ids], SamplingParams(max_new_tokens=4))
            dflash.generate([ids], SamplingParams(max_new_tokens=4))
        for n, ids in enumerate(prompts, 1):
            t = time.perf_counter()
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
            _add(modes["hf_generate"], len(out), time.perf_counter() - t)
            t = time.perf_counter()
            ar = autoregressive.generate([ids], params)[0]
            _add(modes["autoregressive"], len(ar.output_ids), time.perf_counter() - t)
            t = time.perf_counter()
            sp = dflash.generate([ids], params)[0]
            _add(modes["dflash"], len(sp.output_ids), time.perf_counter() - t)
            identical += out == ar.output_ids == sp.output_ids
            acceptance += sp.stats.acceptance_lengths
            draft_s += sp.stats.draft_seconds
            verify_s += sp.stats.verify_seconds
            print(f"[{n}/{len(prompts)}] {len(ids)} prompt tokens, {len(sp.output_ids)} new, "
                  f"tau {sp.stats.mean_acceptance_length:.2f}, identical: {out == ar.output_ids == sp.output_ids}",
                  file=sys.stderr)
    rate = {m: tokens / seconds for m, (tokens, seconds) in modes.items()}
    # fused projections are views of one storage: count every storage once
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in pipe.target.parameters()}
    weight_bytes = sum(storages.values())
    return {
        "target": str(pipe.target_dir), "prompts": args.prompts, "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "block_size": dflash.block_size, "threads": torch.get_num_threads(),
        "tokens_per_second": {m: round(r, 2) for m, r in rate.items()},
        "ratio_autoregressive_vs_hf": round(rate["autoregressive"] / rate["hf_generate"], 3),
        "ratio_dflash_vs_autoregressive": round(rate["dflash"] / rate["autoregressive"], 3),
        "ratio_dflash_vs_hf": round(rate["dflash"] / rate["hf_generate"], 3),
        "mean_acceptance_length": round(sum(acceptance) / max(1, len(acceptance)), 3),
        "draft_to_verify_time": round(draft_s / max(verify_s, 1e-9), 3),
        # every autoregressive token streams all weights once: the figure to hold against memory bandwidth
        "autoregressive_weight_GBps": round(weight_bytes * rate["autoregressive"] / 1e9, 2),
        "token_identical_prompts": f"{identical}/{len(prompts)}",
    }


def _add(acc: list, tokens: int, seconds: float) -> None:
    acc[0] += tokens
    acc[1] += seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_PRESET, help="preset name or checkpoint directory")
    parser.add_argument("--drafter", default="preset", help="drafter directory (default: the preset's)")
    parser.add_argument("--prompts", default="chat", choices=["chat", "humaneval", "sharegpt"])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, help="default: the drafter's")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args(argv)
    try:
        summary = run(args)
    except DFlashError as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
