"""dflash-drafter-data: distillation data for drafter training, the target's own greedy responses to ShareGPT prompts.

A drafter learns to predict what the target will say, so the best training text is the target's own
output: every block position is then labelled along the path the target really takes at decoding
time. Prompts are first user turns of the ShareGPT train split (dflash_tools.prompts; the held-out
split and HumanEval are never used), wrapped in the chat template; with --later-turns also the later
user turns, each sent alone. With --temperature, a second pass samples the same prompts at that
temperature: other paths the target takes when serving sampled requests.

Generation runs the project's batched engine in autoregressive mode with continuous batching (a finished
sequence's slot is refilled at once), on any device (--device, --dtype; on a GPU use batches of hundreds).
Results are appended to `responses.jsonl` in the output directory, one line per response, flushed as they
finish: a stopped run resumes with the prompts not answered yet, and a trainer reading the directory
(dflash-train-drafter --responses) sees the data grow between epochs.
"""
from __future__ import annotations

import argparse
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
from dflash_tools.prompts import sharegpt_dialogues

EXAMPLES = """examples:
  dflash-drafter-data --output runs/responses --max-minutes 60
  dflash-drafter-data --output runs/responses --num-prompts 1000 --batch-size 48
  dflash-drafter-data --output runs/responses --device cuda --dtype bfloat16 --batch-size 512 --later-turns \
      --temperature 0.7 --max-new-tokens 384
  python -m dflash_training.drafter_data --help
"""

RESPONSES_FILE = "responses.jsonl"


def read_responses(directory: str | Path) -> list[dict]:
    """The records written so far ({"index", "turn", "temperature", "prompt_ids", "response_ids",
    "finish_reason"}; "turn" and "temperature" are absent from older files: first turns, greedy).

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


def prompt_stream(pipe: Pipeline, max_prompt_tokens: int, later_turns: bool, skip) -> Iterator[tuple[dict, list[int]]]:
    """({"index", "turn"}, prompt ids) for the train split's user turns; prompts over the limit are left out.

    index: the conversation's position in the train split; turn 0: its first user turn, turn t >= 1 (with
    later_turns): its t-th later user turn, sent alone as a one-turn chat. Alone rather than with the turns
    before it: the assistant turns before it are ShareGPT's (another model's) replies, not the target's, and
    whole conversations would mostly exceed the prompt limit. skip(key) -> True for a prompt already answered.
    """
    for index, (prompt, _, later) in enumerate(sharegpt_dialogues("train")):
        for turn, text in enumerate([prompt] + (later if later_turns else [])):
            key = {"index": index, "turn": turn}
            if not skip(key):
                ids = pipe.encode(text)
                if len(ids) <= max_prompt_tokens:
                    yield key, ids


def response_key(record: dict) -> tuple[int, int, float]:
    """What identifies a response: (conversation, turn, temperature); records from before turns and
    temperatures were recorded are first turns, greedy."""
    return record["index"], record.get("turn", 0), record.get("temperature", 0.0)


def generate(args: argparse.Namespace) -> dict:
    """One greedy pass over the prompts, and with --temperature a sampled pass over the same prompts."""
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESPONSES_FILE
    done = read_responses(out) if path.is_file() else []
    answered = {response_key(r) for r in done}
    pipe = load_pipeline(args.target, drafter=None, dtype=args.dtype, device=args.device)
    if pipe.tokenizer is None:
        raise DFlashError(f"{pipe.target_dir} has no tokenizer; prompts are text")
    engine = pipe.engine(block_size=1, max_batch_size=args.batch_size,
                         max_context=args.max_prompt_tokens + args.max_new_tokens)
    started, passes = time.time(), []
    with path.open("a") as f:
        for temperature in [0.0] + ([args.temperature] if args.temperature else []):
            prompts = prompt_stream(pipe, args.max_prompt_tokens, args.later_turns,
                                    lambda key: (key["index"], key["turn"], temperature) in answered)
            written, tokens = run_pass(engine, prompts, temperature, args, started, f)
            passes.append({"temperature": temperature, "new_responses": written, "new_tokens": tokens})
    seconds = time.time() - started
    new_tokens = sum(p["new_tokens"] for p in passes)
    summary = {"output": str(path), "passes": passes, "new_responses": sum(p["new_responses"] for p in passes),
               "new_tokens": new_tokens, "seconds": round(seconds, 1),
               "tokens_per_second": round(new_tokens / max(seconds, 1e-9), 1),
               "total_responses": len(done) + sum(p["new_responses"] for p in passes),
               "total_tokens": sum(len(r["response_ids"]) for r in done) + new_tokens}
    print(json.dumps(summary, indent=2))
    return summary


def run_pass(engine, prompts, temperature: float, args: argparse.Namespace, started: float, f) -> tuple[int, int]:
    """Continuous batching: keep --batch-size requests in the engine, write each response as it finishes.

    -> (responses written, their tokens). A sampled request's seed follows from its prompt: reproducible."""
    key_of, written, tokens = {}, 0, 0
    bar = tqdm(total=args.num_prompts, desc=f"target responses (temperature {temperature:g})", unit="prompt")
    while True:
        out_of_time = (time.time() - started) / 60 >= args.max_minutes
        # key_of holds the requests in flight
        while not out_of_time and written + len(key_of) < args.num_prompts and len(key_of) < args.batch_size:
            item = next(prompts, None)
            if item is None:
                break
            key, ids = item
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature,
                                    seed=key["index"] * 1000 + key["turn"] if temperature else None)
            key_of[engine.add_request(ids, params)] = key
        if not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                seq = output.sequence
                f.write(json.dumps({**key_of.pop(seq), "temperature": temperature, "prompt_ids": seq.prompt_ids,
                                    "response_ids": seq.output_ids, "finish_reason": seq.finish_reason}) + "\n")
                f.flush()
                written += 1
                tokens += len(seq.output_ids)
                bar.update()
                bar.set_postfix(tok_s=f"{tokens / (time.time() - started):.0f}")
    bar.close()
    return written, tokens


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-drafter-data", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="preset name or HF checkpoint directory")
    p.add_argument("--output", required=True, help=f"directory for {RESPONSES_FILE} (appended to; resumable)")
    p.add_argument("--num-prompts", type=int, default=100000, help="stop after this many new responses")
    p.add_argument("--max-minutes", type=float, default=float("inf"),
                   help="stop taking new prompts after this long (running ones finish)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (chat template included)")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=int, default=256,
                   help="answer tokens per prompt at most (default: 256)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoded together")
    p.add_argument("--later-turns", action="store_true",
                   help="also the later user turns of each conversation, each sent alone as a one-turn chat")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="after the greedy pass, a second pass over the same prompts sampled at this temperature")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--device", default="cpu", help="where the target runs: cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the target's weights and KV cache (bfloat16 on GPUs: twice the batch in the same memory)")
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
