"""Repetition, frequency and presence penalties, as vLLM applies them, at every position of a verify block.

vLLM's rules (its sampler's apply_penalties): the repetition penalty divides a positive logit and multiplies a
negative one of every token seen in the prompt or the output; the frequency penalty subtracts its value times the
token's count in the output; the presence penalty subtracts its value once from every token in the output.

A verify block's position j chooses the token after the newest token and drafts 1..j, so it counts those drafts as
output: the target's logits at j are penalised exactly as plain decoding would penalise them had the drafts been
generated, which keeps speculation lossless. The drafter's logits are not penalised (a draft only has to be guessed
right; what is chosen is the target's).
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams


def penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.frequency_penalty != 0 or params.presence_penalty != 0


def apply_penalties(logits: torch.Tensor, block: torch.Tensor | None, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> None:
    """Penalise one sequence's logits [k, V] in place: position j after output_ids + block[1..j] (block [k]: the
    newest token, then the drafts; None for a prefill's first token, k = 1)."""
    k, vocab = logits.shape
    device = logits.device
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab).to(device)[None]
    if block is not None and k > 1:  # drafts 1..j counted at position j
        drafted = torch.zeros((k, vocab), dtype=counts.dtype, device=device)
        drafted[torch.arange(1, k, device=device), block[1:k]] = 1
        counts = counts + drafted.cumsum(0)
    seen = counts > 0
    if params.repetition_penalty != 1:
        prompt = torch.zeros(vocab, dtype=torch.bool)
        prompt[torch.tensor(prompt_ids, dtype=torch.long)] = True
        hit = seen | prompt.to(device)
        scaled = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits.copy_(torch.where(hit, scaled, logits))
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts.to(logits.dtype)
    if params.presence_penalty:
        logits -= params.presence_penalty * seen.to(logits.dtype)
