"""dflash-weights-quality: how far a CPU weight format (dflash_runtime/cpu_weights.py) takes a target from its
float32 weights, measured as builder/quantize.py measures a ModelOpt checkpoint.

The reference is the target loaded in float32 (for a GGUF target: the float32 model transformers dequantized
from the file). Along the reference's own greedy answers to held-out ShareGPT prompts, teacher-forced, the
first position where the format's argmax differs is where its greedy decoding would first differ; perplexity
on held-out ShareGPT conversations. A format that changes answers serves another model, and the build summary
says so.

Example (the note's figures):  python -m dflash_tools.weights_quality --cpu-weights gguf-int4 --prompts 64
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from dflash_contract import DFlashError
from dflash_contract.presets import CPU_WEIGHTS, DEFAULT_PRESET


def weights_quality(target_dir, fmt: str, prompts: int, tokens: int, texts: int, progress: bool = True,
                    served=None) -> dict:
    """{format, served, float32 and format perplexity, greedy agreement} for the target at target_dir; served:
    that target already loaded in fmt (a build's sanity run has it), else loaded here."""
    from dflash_runtime import SamplingParams, SpeculativeEngine, load_target
    from dflash_runtime.text import load_tokenizer
    from dflash_tools.quality import heldout_set, measure, runtime_logits

    reference = load_target(target_dir, cpu_weights="float32")
    if served is None:
        served = load_target(target_dir, cpu_weights=fmt)
    held_texts, held_prompts = heldout_set(load_tokenizer(target_dir), texts, 512, prompts)
    engine = SpeculativeEngine(reference, None, block_size=1, max_batch_size=8)
    answers = engine.generate(held_prompts, SamplingParams(max_new_tokens=tokens))
    paths = [(ids + seq.output_ids, len(ids)) for ids, seq in zip(held_prompts, answers)]
    with torch.inference_mode():
        baseline = measure(runtime_logits(reference), held_texts, paths, None, "float32", progress)
        result = measure(runtime_logits(served), held_texts, paths, baseline, fmt, progress)
    return {"format": fmt, "served": served.served_weights.describe(), "float32_perplexity": baseline["perplexity"],
            **result}


def in_words(quality: dict) -> str:
    """The quality line: e.g. "gguf-int4 against float32 here: perplexity 9.1 vs 8.9 (+2.2%); greedy answers agree
    on 93.1% of 4096 tokens; ..." (quality.agreement_in_words)."""
    from dflash_tools.quality import agreement_in_words

    ppl, base = quality["perplexity"], quality["float32_perplexity"]
    return (f"{quality['format']} against float32 here: perplexity {ppl:.2f} vs {base:.2f} "
            f"({quality['perplexity_change']:+.1%}); {agreement_in_words(quality['greedy_agreement'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-weights-quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_PRESET, help="preset name or checkpoint directory")
    parser.add_argument("--cpu-weights", default="gguf-int4", choices=CPU_WEIGHTS[1:],
                        help="the format to hold against float32 (default: gguf-int4)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts for greedy agreement (default: 64)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens compared per prompt (default: 64)")
    parser.add_argument("--texts", type=int, default=16, help="held-out conversations for perplexity (default: 16)")
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv)
    from dflash_runtime.checkpoint import resolve_target

    try:
        quality = weights_quality(resolve_target(args.target)[0], args.cpu_weights, args.prompts, args.tokens,
                                  args.texts)
    except DFlashError as e:
        print(f"dflash-weights-quality: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(quality, indent=2)
    print(text)
    print(in_words(quality), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
