"""Guided decoding's cost and acceptance, side by side: the same prompts free, and under a JSON schema.

    python -m dflash_tools.guided_bench [--target smollm2-135m] [--batch-sizes 1 8] [--num-prompts 16]

For each batch size, one engine per mode (autoregressive, DFlash at the drafter's block and "auto") runs the
prompts unguided, then guided by a JSON schema (each prompt asks for the object), one run right after the other in
one process. Prints tokens/s, the mean acceptance length tau, and the host time the grammar masks took per engine
step (filling xgrammar's bitmasks for the drafts and the verify positions, and applying them) and its share of
the run.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_contract.guided_decoding import Guide
from dflash_contract.presets import AUTO_BLOCK_SIZE, DEFAULT_PRESET
from dflash_runtime.sampling import SamplingParams

from .prompts import prompt_set

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "maxLength": 200},
    "confidence": {"enum": ["low", "medium", "high"]}, "keywords": {"type": "array", "items": {
        "type": "string", "maxLength": 20}, "maxItems": 4}}, "required": ["topic", "answer", "confidence", "keywords"]}
INSTRUCTION = ("\nAnswer as a JSON object with the fields topic, answer, confidence (low, medium or high) and "
               "keywords (a list).")


def run_mode(engine, prompts, params) -> dict:
    engine.choices.mask_seconds = 0.0
    seqs = [engine.add_request(p, params) for p in prompts]
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    verifies = sum(len(s.stats.acceptance_lengths) for s in seqs)
    return {"tokens": sum(len(s.output_ids) for s in seqs), "seconds": seconds, "steps": steps,
            "mask": engine.choices.mask_seconds, "tau": sum(sum(s.stats.acceptance_lengths) for s in seqs) / max(1, verifies)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="guided_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_PRESET, help="preset name or checkpoint directory")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--num-prompts", type=int, default=16, help="chat prompts (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    from dflash_runtime.pipeline import load_pipeline

    pipe = load_pipeline(args.target)
    texts = prompt_set("chat", args.num_prompts)
    guide = Guide("json_schema", json.dumps(SCHEMA))
    rows = []
    with torch.inference_mode():
        for batch in args.batch_sizes:
            engines = {label: pipe.engine(block_size=b, max_batch_size=batch)
                       for label, b in (("autoregressive", 1), (str(pipe.drafter.config.block_size),
                                                                pipe.drafter.config.block_size),
                                        (AUTO_BLOCK_SIZE, AUTO_BLOCK_SIZE))}
            for label, engine in engines.items():
                for guided in (False, True):
                    prompts = [pipe.encode(t + INSTRUCTION) for t in texts]
                    params = SamplingParams(max_new_tokens=args.max_tokens, guide=guide if guided else None)
                    engine.block_manager.forget()
                    r = run_mode(engine, prompts, params)
                    rows.append({"batch": batch, "mode": label, "guided": guided, "tokens_per_second":
                                 round(r["tokens"] / r["seconds"], 1), "tau": round(r["tau"], 3),
                                 "mask_ms_per_step": round(1e3 * r["mask"] / max(1, r["steps"]), 3),
                                 "mask_share": round(r["mask"] / r["seconds"], 4)})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"{'B':>3} {'mode':15s} {'guided':6s} {'tok/s':>8s} {'tau':>6s} {'mask ms/step':>13s} {'mask share':>10s}")
    for r in rows:
        print(f"{r['batch']:3d} {r['mode']:15s} {str(r['guided']):6s} {r['tokens_per_second']:8.1f} {r['tau']:6.2f} "
              f"{r['mask_ms_per_step']:13.3f} {r['mask_share']:10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
