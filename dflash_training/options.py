"""The command lines of dflash-drafter-data and dflash-train-drafter, apart from the tools: without torch, so that
the Helm chart's contract (deploy/helm/contract.py) can read their flags where torch is not installed."""
from __future__ import annotations

import argparse
import os

from dflash_tools.options import at_least

RESPONSES_FILE = "responses.jsonl"  # one process's; rank r of a torchrun launch writes responses.rank<r>.jsonl


def data_parser(description: str | None = None, epilog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-drafter-data", description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="preset name or HF checkpoint directory")
    p.add_argument("--output", required=True, help=f"directory for {RESPONSES_FILE} (appended to; resumable)")
    p.add_argument("--num-prompts", type=at_least(1), default=100000,
                   help="stop after this many new responses (under torchrun: in all, shared by the ranks)")
    p.add_argument("--max-minutes", type=at_least(0, float), default=float("inf"),
                   help="stop taking new prompts after this long (running ones finish)")
    p.add_argument("--max-prompt-tokens", type=at_least(1), default=256,
                   help="skip longer prompts (chat template included)")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=at_least(1), default=256,
                   help="answer tokens per prompt at most (default: 256)")
    p.add_argument("--later-turns", action="store_true",
                   help="also the later user turns of each conversation, each sent alone as a one-turn chat")
    p.add_argument("--temperature", type=at_least(0, float), default=0.0,
                   help="after the greedy pass, a second pass over the same prompts sampled at this temperature")
    engine = p.add_argument_group("the target in this process (the default)")
    engine.add_argument("--batch-size", type=at_least(1), default=32, help="sequences decoded together")
    engine.add_argument("--threads", type=at_least(0), default=0, help="torch threads (0 = all cores)")
    engine.add_argument("--device", default="cpu",
                        help="where the target runs: cpu, cuda (under torchrun: each rank on its own GPU), cuda:1, ...")
    engine.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the target's weights and KV cache (bfloat16 on GPUs: twice the batch in the same memory)")
    server = p.add_argument_group("answers from an OpenAI-compatible server (--server)")
    server.add_argument("--server", metavar="URL",
                        help="the API's base URL (http://host:9000/v1): dflash-serve's gateway, trtllm-serve, vLLM, ... "
                        "serving --target; its answers are re-tokenised with --target's tokenizer")
    server.add_argument("--model", help="the model id to ask for (default: the first in the server's /models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                        help="bearer token (default: $OPENAI_API_KEY)")
    server.add_argument("--concurrency", type=at_least(1), default=32, help="requests in flight at most")
    server.add_argument("--retries", type=at_least(0), default=8,
                        help="tries after the first for a request refused with 429/502/503/504 or a broken connection, "
                        "with exponential backoff (never sooner than the server's Retry-After)")
    server.add_argument("--request-timeout", type=at_least(1, float), default=600.0, help="seconds per request")
    return p


def train_parser(description: str | None = None, epilog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-train-drafter", description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="preset name or HF checkpoint directory")
    p.add_argument("--output", required=True, help="directory for checkpoint.pt, learning_curve.jsonl and drafter/")
    p.add_argument("--responses", help="train on the target's own responses in this dflash-drafter-data directory "
                   "(default: ShareGPT replies)")
    p.add_argument("--feature-cache", type=at_least(0), default=0, metavar="TOKENS",
                   help="compute the target's features of this many training tokens (at most one epoch) once, "
                   "keep them in <output>/features.pt and draw every batch from them; a later run extends the cache "
                   "with responses added since (delete it to rebuild); 0 = a fresh prefill per step")
    p.add_argument("--hard-labels", action="store_true", help="the target's argmax as label, not its softmax")
    p.add_argument("--init", help="start from this exported drafter's weights (its config fixes the architecture)")
    p.add_argument("--draft-layers", type=at_least(1), default=2)
    p.add_argument("--block-size", type=at_least(2),
                   help="tokens per drafted block (default: 16, or the --init drafter's)")
    p.add_argument("--mask-token-id", type=at_least(0), default=16,
                   help="a real vocabulary id that prompts never use (SmolLM2: 16 = <empty_output>)")
    p.add_argument("--target-layer-ids", type=at_least(0), nargs="+",
                   help="default: --num-target-features spread evenly")
    p.add_argument("--num-target-features", type=at_least(1), default=5)
    p.add_argument("--steps", type=at_least(1), default=100000)
    p.add_argument("--max-minutes", type=at_least(0, float), default=float("inf"),
                   help="stop (and save) after this long")
    p.add_argument("--batch-size", type=at_least(1), default=4,
                   help="sequences per step (under torchrun: in all, shared by the ranks)")
    p.add_argument("--seq-len", type=at_least(32), default=256)
    p.add_argument("--anchors", type=at_least(1), default=16, help="blocks per sequence per step")
    p.add_argument("--answer-only", action="store_true",
                   help="ShareGPT data: blocks start in the reply only (--responses data always trains that way)")
    p.add_argument("--train-vocab", type=at_least(0), default=8192,
                   help="softmax over the N most frequent reply tokens plus the batch's labels (0 = whole vocabulary)")
    p.add_argument("--decay", type=at_least(1e-6, float), help="position weight exp(-(k-1)/decay) (default: "
                   "1 + 3 * block / 8, ModelOpt's recipe: 4 at block 8, 7 at block 16)")
    p.add_argument("--lr", type=at_least(0, float), default=6e-4)
    p.add_argument("--warmup", type=at_least(1), default=100)
    p.add_argument("--eval-every", type=at_least(1), default=100)
    p.add_argument("--tau-prompts", type=at_least(0), default=4,
                   help="held-out prompts decoded at each evaluation to measure tau (0: no measured tau, only the "
                   "estimate)")
    p.add_argument("--save-every", type=at_least(1), default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=at_least(0), default=0, help="torch threads (0 = all cores)")
    p.add_argument("--device", default="cpu", help="where the target and the drafter run: cpu, cuda (under "
                   "torchrun: each rank on its node's GPU LOCAL_RANK), cuda:1, ...")
    p.add_argument("--shard-target", action="store_true",
                   help="under torchrun: shard the frozen target's decoder layers across the ranks (FSDP2), each "
                   "rank holding 1/N of them and gathering one layer at a time, for a target that does not fit one "
                   "device beside the drafter (the memory estimate says when); needs --tau-prompts 0")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the frozen target's weights and features, and bf16 autocast of the drafter's forward "
                   "(its weights, optimizer and loss stay float32); bfloat16 is for GPUs")
    return p
