"""dflash-drafter-data: distillation data for drafter training, the target's own greedy responses to ShareGPT prompts.

A drafter learns to predict what the target will say, so the best training text is the target's own
output: every block position is then labelled along the path the target really takes at decoding
time. Prompts are first user turns of the ShareGPT train split (dflash_tools.prompts; the held-out
split and HumanEval are never used), wrapped in the chat template; with --later-turns also the later
user turns, each sent alone. With --temperature, a second pass samples the same prompts at that
temperature: other paths the target takes when serving sampled requests.

Generation runs the project's batched engine in autoregressive mode with continuous batching (a finished
sequence's slot is refilled at once), on any device (--device, --dtype; on a GPU use batches of hundreds).
Or (--server URL) the answers come from an OpenAI-compatible server that serves the target (dflash-serve's
gateway, trtllm-serve, vLLM): a fleet that already generates fast. Its answers are text, re-tokenised with
the target's tokenizer (dflash_training.server_answers says when that can differ from the ids it sampled).

Under torchrun (--nproc-per-node N, on a GPU node --device cuda: rank r on cuda:r) each rank answers the
conversations whose index is r modulo N and writes its own responses.rank<r>.jsonl; one process writes
responses.jsonl. Lines are flushed as they finish: a stopped run resumes with the prompts no file of the
directory answers yet (at any number of ranks), and a trainer reading the directory (dflash-train-drafter
--responses) reads every file as one data set, and sees it grow between epochs.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from dflash_runtime.checkpoint import resolve_target
from dflash_runtime.config import DFlashError, TargetConfig
from dflash_runtime.pipeline import load_pipeline
from dflash_runtime.sampling import SamplingParams
from dflash_runtime.text import encode_prompt, load_tokenizer
from dflash_tools.prompts import sharegpt_dialogues
from dflash_training import options, server_answers
from dflash_training.distributed import Ranks, ranks_from_env
from dflash_training.options import RESPONSES_FILE

EXAMPLES = """examples:
  dflash-drafter-data --output runs/responses --max-minutes 60
  dflash-drafter-data --output runs/responses --num-prompts 1000 --batch-size 48
  dflash-drafter-data --output runs/responses --device cuda --dtype bfloat16 --batch-size 512 --later-turns \\
      --temperature 0.7 --max-new-tokens 384
  torchrun --nproc-per-node 8 -m dflash_training.drafter_data --output runs/responses --device cuda \\
      --dtype bfloat16 --batch-size 512
  dflash-drafter-data --target /models/qwen3-8b --output runs/responses --server http://fleet:9000/v1 --concurrency 64
  python -m dflash_training.drafter_data --help
"""



def responses_path(directory: Path, ranks: Ranks) -> Path:
    return directory / (RESPONSES_FILE if not ranks.distributed else f"responses.rank{ranks.rank}.jsonl")


def responses_files(directory: str | Path) -> list[Path]:
    """The directory's response files: responses.jsonl, then the ranks' in rank order."""
    ranked = {}
    for path in Path(directory).glob("responses.rank*.jsonl"):
        number = path.name.removeprefix("responses.rank").removesuffix(".jsonl")
        if number.isdigit():
            ranked[int(number)] = path
    single = Path(directory) / RESPONSES_FILE
    return ([single] if single.is_file() else []) + [ranked[r] for r in sorted(ranked)]


def read_responses(directory: str | Path, missing_ok: bool = False) -> list[dict]:
    """The records written so far, every file of the directory in responses_files' order ({"index", "turn",
    "temperature", "prompt_ids", "response_ids", "finish_reason"}; "turn" and "temperature" are absent from older
    files: first turns, greedy; answers from a server add "response_ids_from": "text" and
    "server_completion_tokens").

    A line cut short by a killed writer is skipped, so the files stay usable while they grow.
    """
    files = responses_files(directory)
    if not files and not missing_ok:
        raise DFlashError(f"no {RESPONSES_FILE} in {directory} (make it with dflash-drafter-data)")
    records = []
    for path in files:
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def training_sequence(record: dict) -> list[int]:
    """prompt + response (which ends with the target's EOS when it stopped on its own)."""
    return record["prompt_ids"] + record["response_ids"]


def prompt_stream(tokenizer, max_prompt_tokens: int, later_turns: bool, skip,
                  ranks: Ranks = Ranks()) -> Iterator[tuple[dict, str, list[int]]]:
    """({"index", "turn"}, user text, prompt ids in the chat template) for the train split's user turns of this
    rank's conversations (index modulo the world size); prompts over the limit are left out.

    index: the conversation's position in the train split; turn 0: its first user turn, turn t >= 1 (with
    later_turns): its t-th later user turn, sent alone as a one-turn chat. Alone rather than with the turns
    before it: the assistant turns before it are ShareGPT's (another model's) replies, not the target's, and
    whole conversations would mostly exceed the prompt limit. skip(key) -> True for a prompt already answered.
    """
    for index, (prompt, _, later) in enumerate(sharegpt_dialogues("train")):
        if index % ranks.world != ranks.rank:
            continue
        for turn, text in enumerate([prompt] + (later if later_turns else [])):
            key = {"index": index, "turn": turn}
            if not skip(key):
                ids = encode_prompt(tokenizer, text)
                if len(ids) <= max_prompt_tokens:
                    yield key, text, ids


def response_key(record: dict) -> tuple[int, int, float]:
    """What identifies a response: (conversation, turn, temperature); records from before turns and
    temperatures were recorded are first turns, greedy."""
    return record["index"], record.get("turn", 0), record.get("temperature", 0.0)


def generate(args: argparse.Namespace) -> dict:
    """One greedy pass over the prompts, and with --temperature a sampled pass over the same prompts."""
    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = ranks_from_env()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    done = read_responses(out, missing_ok=True)  # every rank's, of any earlier launch: exact resume at any size
    answered = {response_key(r) for r in done}
    target_dir, _ = resolve_target(args.target)
    if args.server:
        tokenizer = load_tokenizer(target_dir)
        answer = functools.partial(server_pass, tokenizer, TargetConfig.from_dir(target_dir).eos_token_ids[:1],
                                   ranks=ranks)
    else:
        pipe = load_pipeline(args.target, drafter=None, dtype=args.dtype, device=ranks.device(args.device))
        tokenizer, answer = pipe.tokenizer, functools.partial(run_pass, pipe.engine(
            block_size=1, max_batch_size=args.batch_size, max_context=args.max_prompt_tokens + args.max_new_tokens),
            ranks=ranks)
    if tokenizer is None:
        raise DFlashError(f"{target_dir} has no tokenizer; prompts are text")
    path = responses_path(out, ranks)
    started, passes = time.time(), []
    with path.open("a") as f:
        for temperature in [0.0] + ([args.temperature] if args.temperature else []):
            prompts = prompt_stream(tokenizer, args.max_prompt_tokens, args.later_turns,
                                    lambda key: (key["index"], key["turn"], temperature) in answered, ranks)
            written, tokens = answer(prompts, temperature, args, rank_share(args.num_prompts, ranks), started, f)
            passes.append({"temperature": temperature, "new_responses": written, "new_tokens": tokens})
    seconds = time.time() - started
    new_tokens = sum(p["new_tokens"] for p in passes)
    summary = {"output": str(path), "passes": passes, "new_responses": sum(p["new_responses"] for p in passes),
               "new_tokens": new_tokens, "seconds": round(seconds, 1),
               "tokens_per_second": round(new_tokens / max(seconds, 1e-9), 1),
               "total_responses": len(done) + sum(p["new_responses"] for p in passes),
               "total_tokens": sum(len(r["response_ids"]) for r in done) + new_tokens}
    if ranks.distributed:
        summary = {"rank": ranks.rank, "world_size": ranks.world, **summary}
    print(json.dumps(summary, indent=2))
    return summary


def rank_share(count: int, ranks: Ranks) -> int:
    """This rank's part of --num-prompts: the parts differ by one at most and add up to count."""
    return count // ranks.world + (ranks.rank < count % ranks.world)


def seed_of(key: dict, temperature: float) -> int | None:
    """A sampled request's seed follows from its prompt: reproducible, on any server and at any world size."""
    return key["index"] * 1000 + key["turn"] if temperature else None


def run_pass(engine, prompts, temperature: float, args: argparse.Namespace, budget: int, started: float,
             f, ranks: Ranks = Ranks()) -> tuple[int, int]:
    """Continuous batching: keep --batch-size requests in the engine, write each response as it finishes.

    -> (responses written, their tokens); budget: the most responses to write."""
    key_of, written, tokens = {}, 0, 0
    bar = progress(budget, temperature, ranks)
    while True:
        out_of_time = (time.time() - started) / 60 >= args.max_minutes
        # key_of holds the requests in flight
        while not out_of_time and written + len(key_of) < budget and len(key_of) < args.batch_size:
            item = next(prompts, None)
            if item is None:
                break
            key, _, ids = item
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature,
                                    seed=seed_of(key, temperature))
            key_of[engine.add_request(ids, params)] = key
        if not engine.has_unfinished():
            break
        for output in engine.step():
            if output.finished:
                seq = output.sequence
                write_record(f, {**key_of.pop(seq), "temperature": temperature, "prompt_ids": seq.prompt_ids,
                                 "response_ids": seq.output_ids, "finish_reason": seq.finish_reason})
                written += 1
                tokens += len(seq.output_ids)
                bar.update()
                bar.set_postfix(tok_s=f"{tokens / (time.time() - started):.0f}")
    bar.close()
    return written, tokens


def server_pass(tokenizer, eos: tuple[int, ...], prompts, temperature: float, args: argparse.Namespace, budget: int,
                started: float, f, ranks: Ranks = Ranks()) -> tuple[int, int]:
    """The pass's prompts sent to --server, --concurrency in flight; each answer written as it comes.

    -> (responses written, their tokens). The records' ids are the target tokenizer's, of the answer's text, and
    eos (the target's first end-of-sequence id) where the answer stopped on its own."""
    server = server_answers.Server(args.server.rstrip("/"), args.model, args.api_key, args.concurrency,
                                   args.retries, args.request_timeout)
    taken = 0
    bar = progress(budget, temperature, ranks)

    def requests():  # the prompts, until the budget or the time is spent
        nonlocal taken
        while taken < budget and (time.time() - started) / 60 < args.max_minutes:
            item = next(prompts, None)
            if item is None:
                return
            taken += 1
            key, text, ids = item
            yield (key, ids), text, seed_of(key, temperature)

    async def collect() -> tuple[int, int]:
        written, tokens, warned = 0, 0, False
        async for (key, prompt_ids), answer in server_answers.answers(server, requests(), args.max_new_tokens,
                                                                      temperature):
            if answer.prompt_tokens not in (None, len(prompt_ids)) and not warned:
                tqdm.write(f"dflash-drafter-data: warning: {server.url} counted {answer.prompt_tokens} prompt tokens "
                           f"where the target's chat template gives {len(prompt_ids)} (conversation {key['index']}): "
                           "the server's template or tokenizer differs from the target's")
                warned = True
            response = tokenizer.encode(answer.text, add_special_tokens=False, split_special_tokens=True)
            response += list(eos) if answer.finish_reason == "stop" else []
            write_record(f, {**key, "temperature": temperature, "prompt_ids": prompt_ids, "response_ids": response,
                             "finish_reason": answer.finish_reason, "response_ids_from": "text",
                             "server_completion_tokens": answer.completion_tokens})
            written += 1
            tokens += len(response)
            bar.update()
            bar.set_postfix(tok_s=f"{tokens / (time.time() - started):.0f}")
        return written, tokens

    try:
        return asyncio.run(collect())
    finally:
        bar.close()


def progress(total: int, temperature: float, ranks: Ranks) -> tqdm:
    where = f" rank {ranks.rank}" if ranks.distributed else ""
    return tqdm(total=total, desc=f"target responses{where} (temperature {temperature:g})", unit="prompt")


def write_record(f, record: dict) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()


def build_parser() -> argparse.ArgumentParser:
    return options.data_parser(__doc__, EXAMPLES)


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
