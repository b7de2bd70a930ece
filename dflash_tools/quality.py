"""Quality of a model against a reference: held-out perplexity and greedy agreement along the reference's own greedy
continuations, from ShareGPT's held-out split. Shared by the builder's quantization report (builder/quantize.py)
and dflash-weights-quality (the CPU weight formats against float32).
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dflash_runtime.text import encode_prompt
from dflash_tools.prompts import sharegpt_conversations


def heldout_set(tokenizer, texts: int, max_tokens: int, prompts: int,
                max_prompt_tokens: int = 128) -> tuple[list[list[int]], list[list[int]]]:
    """Texts for perplexity and short prompts for greedy agreement, from ShareGPT's held-out split."""
    chosen, short = [], []
    for prompt, reply in sharegpt_conversations("heldout"):
        if len(chosen) < texts:
            chosen.append(chat_text(tokenizer, prompt, reply, max_tokens))
        ids = encode_prompt(tokenizer, prompt)
        if len(short) < prompts and len(ids) <= max_prompt_tokens:
            short.append(ids)
        if len(chosen) == texts and len(short) == prompts:
            break
    return chosen, short


def chat_text(tokenizer, prompt: str, reply: str, max_tokens: int) -> list[int]:
    """A (prompt, reply) pair as the target reads it: the chat-formatted prompt, then the reply, cut to max_tokens."""
    ids = encode_prompt(tokenizer, prompt) + tokenizer.encode(reply, add_special_tokens=False)
    return ids[:max_tokens]


def runtime_logits(target):
    """token ids -> the logits [T, vocab] (float32) of our runtime's target (a TargetModel) over them."""
    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        out, _ = target.whole_pass(torch.tensor([ids], device=target.device))
        return out[0].float()
    return logits


def measure(logits_fn, texts: list[list[int]], paths: list[tuple[list[int], int]], baseline: dict | None,
            label: str, progress: bool) -> dict:
    """Held-out perplexity and, against a baseline, greedy agreement along the baseline's greedy paths.

    Teacher-forced along the unquantized model's greedy continuation: the first position where this
    model's argmax differs is where its own greedy decoding would leave that continuation.
    """
    nll, count = 0.0, 0
    for ids in tqdm(texts, desc=f"perplexity ({label})", disable=not progress, file=sys.stderr):
        logits = logits_fn(ids)
        nll += F.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device), reduction="sum").item()
        count += len(ids) - 1
    argmax = [logits_fn(path)[start - 1:len(path) - 1].argmax(-1).tolist() for path, start in paths]
    result = {"perplexity": round(math.exp(nll / count), 4), "argmax": argmax}
    if baseline is None:
        return result
    result.pop("argmax")
    matches = [[a == b for a, b in zip(mine, ref)] for mine, ref in zip(argmax, baseline["argmax"])]
    first = [m.index(False) if False in m else len(m) for m in matches]
    result["perplexity_change"] = round(result["perplexity"] / baseline["perplexity"] - 1, 4)
    result["greedy_agreement"] = {
        "matching_fraction": round(sum(map(sum, matches)) / max(1, sum(map(len, matches))), 4),
        "first_divergence": first,  # per prompt; == tokens compared when greedy decoding never diverged
        "mean_first_divergence": round(sum(first) / max(1, len(first)), 2),
        "tokens_compared": [len(m) for m in matches],
    }
    return result


def agreement_in_words(agreement: dict) -> str:
    """measure()'s greedy agreement as a clause: "greedy answers identical on all 128 tokens of 4 prompts", or
    "greedy answers agree on 96.9% of 4096 tokens; 12 of 64 prompts leave the reference's path, after 28 tokens on
    average" (the mean over the prompts that leave it: one that never does has no divergence to count)."""
    compared, first = agreement["tokens_compared"], agreement["first_divergence"]
    if agreement["matching_fraction"] == 1.0:
        return f"greedy answers identical on all {sum(compared)} tokens of {len(compared)} prompts"
    left = [f for f, n in zip(first, compared) if f < n]
    return (f"greedy answers agree on {agreement['matching_fraction']:.1%} of {sum(compared)} tokens; {len(left)} of "
            f"{len(compared)} prompts leave the reference's path, after {sum(left) / len(left):.0f} tokens on average")
