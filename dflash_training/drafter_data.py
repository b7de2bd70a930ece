"""dflash-drafter-data: distillation data for drafter training, the target's own greedy responses to ShareGPT prompts.

A drafter learns to predict what the target will say, so the best training text is the target's own
output: every block position is then labelled along the path the target really takes at decoding
time. Prompts are first user turns of the ShareGPT train split (dflash_tools.prompts; the held-out
split and HumanEval are never used), wrapped in the chat template.

Generation runs the batched engine in autoregressive mode with continuous batching (a finished
sequence's slot is refilled at once). Results are appended to `responses.jsonl` in the output
directory, one line per prompt, flushed as they finish: a stopped run resumes where it left off, and
a trainer reading the directory (dflash-train-drafter --responses) sees the data grow between epochs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from dflash_runtime.config import DFlashError
from dflash_runtime.pipeline import Pipeline, load_pipeline
from dflash_runtime.sampling import SamplingParams
from dflash_tools.prompts import sharegpt_conversations

EXAMPLES = """examples:
  dflash-drafter-data --output runs/responses --max-minutes 60
  dflash-drafter-data --output runs/responses --num-prompts 1000 --batch-size 48
  python -m dflash_training.drafter_data --help
"""

RESPONSES_FILE = "responses.jsonl"


def read_responses(directory: str | Path) -> list[dict]:
    """The records written so far ({"index", "prompt_ids", "response_ids", "finish_reason"}).

    A line cut short by a killed writer is skipped, so the file stays usable while it grows.
    """
    path = Path(directory) / RESPONSES_FILE
    if not path.is_file():
        raise DFlashError(f"no {RESPONSES_FILE} in {directory} (make it with dflash-drafter-data)")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def training_sequence(record: dict) -> list[int]:
    """prompt + response (which ends with the target's EOS when it stopped on its own)."""
    return record["prompt_ids"] + record["response_ids"]


def _prompts(pipe: Pipeline, max_prompt_tokens: int, start: int) -> Iterator[tuple[int, list[int]]]:
    """(index in the train split, prompt ids) from `start` on; prompts over the limit are skipped."""
    for index, (prompt, _) in enumerate(itertools.islice(sharegpt_conversations("train"), start, None), start):
        ids = pipe.encode(prompt)
        if len(ids) <= max_prompt_tokens:
            yield index, ids


def generate(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESPONSES_FILE
    done = read_responses(out) if path.is_file() else []
    start = max((r["index"] for r in done), default=-1) + 1
    pipe = load_pipeline(args.target, drafter=None)
    if pipe.tokenizer is None:
        raise DFlashError(f"{pipe.target_dir} has no tokenizer; prompts are text")
    engine = pipe.engine(block_size=1, max_batch_size=args.batch_size,
                         max_context=args.max_prompt_tokens + args.max_new_tokens)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompts = _prompts(pipe, args.max_prompt_tokens, start)
    index_of, written, tokens, started = {}, 0, 0, time.time()
    bar = tqdm(total=args.num_prompts, desc="target responses", unit="prompt")
    with path.open("a") as f:
        while True:
            out_of_time = (time.time() - started) / 60 >= args.max_minutes
            # index_of holds the requests in flight: keep batch_size of them in the engine
            while not out_of_time and written + len(index_of) < args.num_prompts and len(index_of) < args.batch_size:
                item = next(prompts, None)
                if item is None:
                    break
                index_of[engine.add_request(item[1], params)] = item[0]
            if not engine.has_unfinished():
                break
            for output in engine.step():
                if output.finished:
                    seq = output.sequence
                    f.write(json.dumps({"index": index_of.pop(seq), "prompt_ids": seq.prompt_ids,
                                        "response_ids": seq.output_ids, "finish_reason": seq.finish_reason}) + "\n")
                    f.flush()
                    written += 1
                    tokens += len(seq.output_ids)
                    bar.update()
                    bar.set_postfix(tok_s=f"{tokens / (time.time() - started):.0f}")
    bar.close()
    seconds = time.time() - started
    summary = {"output": str(path), "new_responses": written, "new_tokens": tokens, "seconds": round(seconds, 1),
               "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
               "total_responses": len(done) + written,
               "total_tokens": sum(len(r["response_ids"]) for r in done) + tokens}
    print(json.dumps(summary, indent=2))
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-drafter-data", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="preset name or HF checkpoint directory")
    p.add_argument("--output", required=True, help=f"directory for {RESPONSES_FILE} (appended to; resumable)")
    p.add_argument("--num-prompts", type=int, default=100000, help="stop after this many new responses")
    p.add_argument("--max-minutes", type=float, default=float("inf"),
                   help="stop taking new prompts after this long (running ones finish)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (chat template included)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoded together")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        generate(args)
    except DFlashError as e:
        print(f"dflash-drafter-data: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
