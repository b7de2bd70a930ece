"""The block loss: many blocks drafted in one forward (the context's K/V computed in the graph, a mask per block),
and their distillation loss against the target at block positions 1..S-1 with the recipe's position decay."""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from dflash_runtime.drafter import DFlashDrafter
from dflash_runtime.target import TargetModel


def drafter_hidden(drafter: DFlashDrafter, target: TargetModel, tokens, features, anchors, block_size: int):
    """Draft hidden states for many blocks at once: the drafter's own forward, with the context K/V
    of every position computed in the graph instead of read from a cache. anchors: [B, A] -> [B, A*S, H]."""
    B, T = tokens.shape
    A, S, device = anchors.shape[1], block_size, tokens.device
    context = drafter.context(features).flatten(0, 1)  # [B * T, H]
    context_positions = torch.arange(T, device=device).repeat(B)
    block_positions = (anchors[:, :, None] + torch.arange(S, device=device)).flatten(1)
    block_tokens = torch.full((B, A, S), drafter.config.mask_token_id, device=device)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    query_anchor = anchors.repeat_interleave(S, dim=1)  # [B, A*S]
    sees_context = torch.arange(T, device=device)[None, None, :] < query_anchor[:, :, None]  # before the anchor
    block_id = torch.arange(A, device=device).repeat_interleave(S)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(B, A * S, A * S)
    mask = torch.cat([sees_context, sees_block], dim=2)[:, None]

    def keys_values(layer: int):  # the context's k, v, then the blocks': [B, KV, T + A*S, D]
        context_k, context_v = drafter.context_kv(layer, context, context_positions)  # [B * T, KV, D]
        context_k, context_v = (x.unflatten(0, (B, T)).transpose(1, 2) for x in (context_k, context_v))
        return lambda k, v: (torch.cat([context_k, k.transpose(1, 2)], dim=2),
                             torch.cat([context_v, v.transpose(1, 2)], dim=2))

    return drafter.draft(target.embed(block_tokens.flatten(1)), block_positions, keys_values, mask)


def block_loss(drafter, target, tokens, features, final, lengths, block_size, anchors_per_seq, decay, generator,
               vocab_subset: torch.Tensor | None = None, soft_labels: bool = False,
               first_anchors: list[int] | None = None, labels: torch.Tensor | None = None):
    """Weighted CE over block positions 1..S-1 and per-position accuracy (correct, counted).

    first_anchors: per sequence, the first position a block may start at (default 1: the block must
    have at least one context token); the anchors are drawn from generator (draw_anchors).
    vocab_subset, soft_labels, labels: block_loss_terms.
    """
    anchors = draw_anchors(first_anchors or [1] * len(lengths), lengths, anchors_per_seq, generator).to(tokens.device)
    hidden = drafter_hidden(drafter, target, tokens, features, anchors, block_size)
    weighted, weight, correct, counted = block_loss_terms(hidden, target, tokens, final, lengths, anchors, block_size,
                                                          decay, vocab_subset, soft_labels, labels)
    return weighted / weight, correct, counted


def block_loss_terms(hidden, target, tokens, final, lengths, anchors, block_size, decay,
                     vocab_subset: torch.Tensor | None = None, soft_labels: bool = False,
                     labels: torch.Tensor | None = None, vocab_union=lambda ids: ids):
    """The block loss's parts for draft hidden states [B, A*S, H] at anchors [B, A]: (the weighted sum of the
    per-token losses, the sum of their weights, correct and counted per block position); the loss is their ratio.

    Apart, so that ranks that share a batch add up their sums before dividing (train_step).
    vocab_subset: train the softmax over these ids plus the batch's labels instead of the whole
    vocabulary (the head is frozen and shared; evaluation always uses the whole vocabulary); vocab_union(ids)
    -> the batch's label ids of every rank (under torchrun), so that every rank's softmax runs over the same ids.
    soft_labels: match the target's distribution (over the same ids, KL divergence) instead of its
    argmax; the accuracy still counts argmax agreement, which is what greedy acceptance needs.
    labels: the target's argmax at every position [B, T], if known (cached): saves the full head.
    """
    S, device = block_size, tokens.device
    hidden = hidden.unflatten(1, (anchors.shape[1], S))
    k = torch.arange(1, S, device=device)
    label_pos = anchors[:, :, None] + k - 1  # the target's prediction for block position k
    valid = label_pos < torch.tensor(lengths, device=device)[:, None, None] - 1
    rows = torch.arange(len(lengths), device=device)[:, None, None].expand_as(label_pos)[valid]
    label_final = final[rows, label_pos[valid]]
    if labels is not None:
        target_ids = labels[rows, label_pos[valid]]
    else:
        with torch.no_grad():
            target_ids = target.lm_head(label_final).argmax(-1)
    head = target.lm_head.weight
    if vocab_subset is not None:
        ids = torch.unique(torch.cat([vocab_subset, vocab_union(target_ids)]))
        head = head[ids]
        target_ids = torch.searchsorted(ids, target_ids)
    # the softmax and the loss in float32 whatever the matmuls ran in (bf16 autocast, a bf16 target)
    logits = (hidden[:, :, 1:][valid] @ head.T).float()
    weights = torch.exp(-(k - 1) / decay).expand_as(label_pos)[valid]
    if soft_labels:  # KL(target || draft): the soft cross-entropy's gradient, 0 when the draft matches
        with torch.no_grad():
            target_log_probs = (label_final @ head.T).float().log_softmax(-1)
        per_token = F.kl_div(logits.log_softmax(-1), target_log_probs, reduction="none", log_target=True).sum(-1)
    else:
        per_token = F.cross_entropy(logits, target_ids, reduction="none")
    hits = (logits.argmax(-1) == target_ids)
    position = k.expand_as(label_pos)[valid] - 1
    correct = torch.zeros(S - 1, device=device).index_add_(0, position, hits.float())
    counted = torch.zeros(S - 1, device=device).index_add_(0, position, torch.ones_like(hits, dtype=torch.float))
    return (per_token * weights).sum(), weights.sum(), correct.cpu(), counted.cpu()


def draw_anchors(first_anchors: list[int], lengths: list[int], count: int, generator: torch.Generator):
    """[B, count] block start positions, first_anchor <= a < length - 1 per sequence.

    Drawn on the host from a CPU generator whatever device trains: the same seed gives the same blocks
    on any device, and a checkpoint's generator state resumes anywhere.
    """
    return torch.stack([
        torch.randint(first, max(first + 1, n - 1), (count,), generator=generator, device="cpu")
        for first, n in zip(first_anchors, lengths)
    ])


def estimated_acceptance(correct: torch.Tensor, counted: torch.Tensor) -> float:
    """tau estimated from per-position accuracies, treating them as conditional acceptance rates."""
    acc = (correct / counted.clamp_min(1)).tolist()
    tau, survive = 1.0, 1.0
    for a in acc:
        survive *= a
        tau += survive
    return tau


class BlockDrafting(torch.nn.Module):
    """drafter_hidden as one module call, which DistributedDataParallel wraps under torchrun: its backward
    all-reduces the drafter's gradients. The frozen target is held outside the module's tree, so that DDP neither
    broadcasts nor watches its weights."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel):
        super().__init__()
        self.drafter, self.frozen = drafter, (target,)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        return drafter_hidden(self.drafter, self.frozen[0], tokens, features, anchors, self.drafter.config.block_size)


def recipe_decay(block_size: int) -> float:
    """The position decay of ModelOpt's DFlash recipe (4 at block 8, 7 at block 16), on the line through both."""
    return 1 + 3 * block_size / 8


def autocast(args: argparse.Namespace):
    """bf16 autocast of the drafter's forward with --dtype bfloat16 (the loss itself stays float32)."""
    return torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

