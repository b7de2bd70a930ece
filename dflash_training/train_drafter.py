"""dflash-train-drafter: train a DFlash drafter for a target: frozen target, online self-distillation, resumable.

Recipe (DFlash paper, adapted to CPU economics):
- Data: ShareGPT conversations (train split, see dflash_tools.prompts) rendered with the target's
  chat template, or (--responses) the target's own greedy responses made by dflash-drafter-data. The
  frozen target runs ONE prefill per batch; its next-token distribution at each position is the
  label (self-distillation: exact for block position 1, along the text's path for later ones; on
  the target's own responses the path is the one it takes when decoding, so every position is
  exact), and its hidden states after `target_layer_ids` are the context features.
- Blocks: random anchor positions per sequence; block = [token at anchor, MASK, ...]; the block
  sees the context features of positions before the anchor (KV injection) and itself (non-causal).
  Many anchors share one forward through an attention mask.
- Loss: KL divergence from the target's distribution to the draft's (through the target's frozen LM
  head) at block positions 1..S-1: logit distillation, ModelOpt's default (--hard-labels: cross-
  entropy against the target's argmax), weighted
  exp(-(k-1)/decay) (the paper's exponential position decay).
- Draft layers start as copies of the target's top layers (q_norm/k_norm at identity).

Devices: --device cuda runs the frozen target and the drafter on a GPU; --dtype bfloat16 keeps the target
(and so its features, computed once per batch) in bf16 and runs the drafter's forward under bf16 autocast,
with float32 master weights, optimizer and loss. Random draws (anchors, cached batches) come from a CPU
generator whatever the device, so a seed means the same blocks everywhere. A memory estimate by part is
printed before the first step (dflash_training.memory). The recipe knobs of ModelOpt's DFlash training are
options: --block-size 8 (decay 4, the default for 8) or 16 (decay 7), --anchors per sequence,
--answer-only, --draft-layers.

Checkpoints (model, optimizer, data cursor, RNG) are written every --save-every steps and training
resumes from them; --max-minutes bounds a session. A JSONL learning curve records every evaluation.

Under torchrun the ranks share each global batch with DistributedDataParallel over the drafter (a step is the one
process's step on the whole batch; checkpoints resume at any world size), and --shard-target shards the frozen
target's decoder layers across them (FSDP2) where it does not fit one device beside the drafter.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dflash_runtime.checkpoint import load_weights, read_safetensors
from dflash_runtime.config import DFlashError, DrafterConfig, TransformerShape
from dflash_runtime.drafter import DFlashDrafter, save_drafter
from dflash_runtime.engine import SpeculativeEngine
from dflash_runtime.layers import prepare_for_inference
from dflash_runtime.pipeline import Pipeline, load_pipeline
from dflash_runtime.sampling import SamplingParams
from dflash_runtime.target import TargetModel
from dflash_tools.prompts import sharegpt_conversations
from dflash_training import distributed, memory, options
from dflash_training.distributed import Ranks, ranks_from_env
from dflash_training.drafter_data import read_responses, training_sequence

EXAMPLES = """examples:
  dflash-train-drafter --output runs/my-drafter --max-minutes 60
  dflash-train-drafter --output runs/my-drafter --responses runs/responses --feature-cache 200000 \\
      --init models/smollm2-135m-dflash
  dflash-train-drafter --target /models/qwen3-8b --output runs/qwen3-8b-drafter --responses runs/qwen3-responses \\
      --device cuda --dtype bfloat16 --draft-layers 5 --block-size 8 --anchors 512 --seq-len 4096 --batch-size 4 \\
      --mask-token-id ID
  python -m dflash_training.train_drafter --help
"""
# The frozen target's CPU format, whatever DFLASH_CPU_WEIGHTS or a host's measurement would serve it in: the loss
# reaches the drafter back through the target's head, which the GGUF kernels cannot differentiate, and new draft
# layers start as copies of the target's float weights. For the embedded default this is the GGUF's own blocks
# dequantized exactly, so the drafter learns the served model's features up to the kernels' int16 rounding of
# activations (greedy answers agree on 99.97% of tokens: dflash-weights-quality).
TRAINING_CPU_WEIGHTS = "float32"


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """Evenly spaced target layers from the second to the last (z-lab's choice for Qwen3-8B: 1, 9, 17, 25, 33)."""
    if count == 1:
        return (num_target_layers - 1,)
    step = (num_target_layers - 2) / (count - 1)
    return tuple(round(1 + i * step) for i in range(count))


def new_drafter(target: TargetModel, num_layers: int, block_size: int, mask_token_id: int,
                target_layer_ids: tuple[int, ...]) -> DFlashDrafter:
    s = target.config.shape
    if num_layers > s.num_layers:
        raise DFlashError(f"{num_layers} draft layers > the target's {s.num_layers}")
    shape = TransformerShape(**{**s.__dict__, "num_layers": num_layers})
    config = DrafterConfig(shape, block_size, mask_token_id, target_layer_ids, s.num_layers)
    config.check_against(target.config, "new drafter")
    drafter = DFlashDrafter(config)
    # Start from the target's top layers: same shapes, and a far better start than random.
    top = target.model.layers[s.num_layers - num_layers:]
    with torch.no_grad():
        for layer, source in zip(drafter.layers, top):
            state = {k: v.float().cpu() for k, v in source.state_dict().items()}
            missing = [k for k in layer.load_state_dict(state, strict=False).missing_keys
                       if not k.endswith(("q_norm.weight", "k_norm.weight"))]  # a Llama target has none
            if missing:
                served = target.served_weights.describe() if target.served_weights else "not float"
                raise DFlashError(f"new draft layers copy the target's top layers, but this target's {missing} are "
                                  f"not float weights (served as {served}): load it with "
                                  f"cpu_weights={TRAINING_CPU_WEIGHTS!r}")
        drafter.norm.weight.copy_(target.model.norm.weight.float().cpu())
    return drafter


def training_texts(pipe: Pipeline, seq_len: int, skip: int = 0, responses: str | None = None,
                   answer_only: bool = False):
    """(token ids, first anchor) of at most seq_len tokens: chat-formatted ShareGPT (prompt, reply)
    pairs, or the target's own responses from a dflash-drafter-data directory (re-read every epoch: it
    may grow). None for a text too short to train on. answer_only: ShareGPT blocks start in the reply
    (ModelOpt's answer-only loss; the target's responses are always trained that way).

    On the target's responses blocks start in the response only, as they do when decoding: the first
    block's anchor is the first generated token. There every label lies on the target's greedy path;
    a block anchored in the prompt would be labelled along the user's text instead.
    """
    if responses:
        for record in read_responses(responses)[skip:]:
            ids, first = training_sequence(record)[:seq_len], max(1, len(record["prompt_ids"]))
            yield (ids, first) if len(ids) >= 32 and len(ids) - first >= 2 else None
        return
    for prompt, reply in itertools.islice(sharegpt_conversations("train"), skip, None):
        ids = pipe.encode(prompt)
        first = len(ids) if answer_only else 1
        reply_ids = pipe.tokenizer.encode(reply, add_special_tokens=False)
        eos = pipe.target.config.eos_token_ids[:1]
        ids = (ids + reply_ids + list(eos))[:seq_len]
        yield (ids, first) if len(ids) >= 32 and len(ids) - first >= 2 else None


_END = object()


def training_batches(texts_from, batch_size: int, skip: int = 0):
    """Endless batches of (token ids, first anchor), each with the data cursor (texts read in this epoch).

    texts_from(skip): the training texts after the first `skip` (training_texts)."""
    cursor, texts, batch, used = skip, texts_from(skip), [], 0
    while True:
        text = next(texts, _END)
        if text is _END:  # next epoch
            if not used and skip == 0:  # a whole epoch gave nothing
                raise DFlashError("no training sequences of at least 32 tokens")
            cursor, skip, used, texts = 0, 0, 0, texts_from(0)
            continue
        cursor += 1
        if text is not None:
            batch.append(text)
            used += 1
        if len(batch) == batch_size:
            yield batch, cursor
            batch = []


def initial_drafter(args: argparse.Namespace, target: TargetModel) -> DFlashDrafter:
    """A new drafter from the target's top layers, or (--init) an exported drafter to train further.

    --block-size may change an --init drafter's block size: no weight depends on it.
    """
    if not args.init:
        s = target.config.shape
        layer_ids = tuple(args.target_layer_ids or spread_layer_ids(s.num_layers, args.num_target_features))
        drafter = new_drafter(target, args.draft_layers, args.block_size or 16, args.mask_token_id, layer_ids)
        return drafter.to(args.device)  # float32 master weights whatever the target's dtype
    config = DrafterConfig.from_dir(Path(args.init))  # its config fixes the architecture
    drafter = DFlashDrafter(dataclasses.replace(config, block_size=args.block_size or config.block_size))
    drafter.config.check_against(target.config, args.init)
    load_weights(drafter, read_safetensors(Path(args.init)), args.init, torch.float32, args.device)
    return drafter


def frequent_tokens(pipe: Pipeline, count: int, responses: str | None = None, sample: int = 3000) -> torch.Tensor:
    """The `count` most frequent token ids in the target's responses (--responses) or else in the
    replies of the first `sample` training conversations."""
    if responses:
        replies = (r["response_ids"] for r in read_responses(responses))
    else:
        replies = (pipe.tokenizer.encode(reply, add_special_tokens=False)[:1024]
                   for _, reply in itertools.islice(sharegpt_conversations("train"), sample))
    counts = torch.zeros(pipe.target.config.shape.vocab_size)
    for ids in replies:
        counts.index_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))
    counts[list(pipe.target.config.eos_token_ids)] += counts.max()
    return torch.topk(counts, min(count, len(counts))).indices.sort().values


@torch.no_grad()
def target_features(target: TargetModel, batch: list[list[int]], layer_ids: tuple[int, ...]):
    """One prefill: tokens [B, T], features [B, T, N*H] and final hidden states [B, T, H] (right-padded).

    Labels come from the final hidden states only where a block needs them: the 49K-way head over
    every position would cost more than the prefill itself.
    """
    T, device = max(map(len, batch)), target.device
    tokens = torch.tensor([ids + [0] * (T - len(ids)) for ids in batch], dtype=torch.long, device=device)
    final, features = target.whole_pass(tokens, layer_ids, apply_head=False)
    return tokens, features, final


class CachedSequence(NamedTuple):
    tokens: torch.Tensor  # [T] token ids
    features: torch.Tensor  # [T, N*H] bf16: the target's hidden states after target_layer_ids
    final: torch.Tensor  # [T, H] bf16: its final-normed hidden states (soft labels go through the head)
    labels: torch.Tensor  # [T] its argmax at each position
    first_anchor: int


CACHE_FORMAT = 2


def cached_features(target: TargetModel, texts_from, layer_ids: tuple[int, ...], num_tokens: int,
                    path: Path, source: dict, ranks: Ranks = Ranks()) -> list[CachedSequence]:
    """Target features of the first `num_tokens` training tokens (or all of them, one epoch, if
    fewer), computed once and kept in `path` (~7 KB per token). texts_from(skip) yields the training
    texts after the first `skip`; a cache made when there were fewer (the responses grew, or a larger
    `num_tokens`) is extended with the new ones.

    Training then draws batches from them. On SmolLM2-135M, 2 threads, the prefill was more than half
    of an online step (~4.5 s for 8 x 256 tokens), and the target's argmax labels through the
    49K-way head another large part: both are paid once per token here instead of once per visit.
    Under torchrun each rank computes every world-th new text's features, and every rank then holds them all
    (any rank may draw any sequence); rank 0 writes the file.
    """
    sequences, read = [], 0
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        if not isinstance(saved, dict) or saved.get("format") != CACHE_FORMAT or saved.get("source") != source:
            raise DFlashError(f"{path} was made by another trainer version or from other data or options "
                              f"(this run: {source}); delete it to rebuild")
        sequences, read = [CachedSequence(*fields) for fields in saved["sequences"]], saved["texts_read"]
    cached, pending = sum(len(c.tokens) for c in sequences), []
    if cached < num_tokens:
        for text in texts_from(read):
            read += 1
            if text is not None:
                pending.append(text)
                cached += len(text[0])
            if cached >= num_tokens:
                break
    if not pending and not sequences:
        raise DFlashError("no training sequences of at least 32 tokens to cache")
    if not pending:
        return sequences
    pending.sort(key=lambda text: len(text[0]))  # batches of similar lengths: little padding
    prefills = -(-len(pending[::ranks.world]) // 8)  # the largest share's: rank 0's
    computed = features_of(target, ranks.share(pending), layer_ids, ranks, prefills, spare=pending[0][0])
    if ranks.distributed:
        computed = gathered(computed, len(pending), path, ranks)
    sequences += computed
    if ranks.main:
        # plain tuples: a pickled class would tie the file to the module that ran the trainer
        torch.save({"format": CACHE_FORMAT, "source": source, "texts_read": read,
                    "sequences": [tuple(c) for c in sequences]}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return sequences


def features_of(target: TargetModel, texts: list[tuple[list[int], int]], layer_ids: tuple[int, ...],
                ranks: Ranks, prefills: int, spare: list[int]) -> list[CachedSequence]:
    """The cache entries of texts, in their order: prefills of 8 texts at a time.

    Every rank runs `prefills` of them, its share's or more (a sharded target's prefill is a collective that every
    rank must join): past its own texts a rank prefills `spare` and keeps nothing of it."""
    entries = []
    bar = tqdm(total=sum(len(ids) for ids, _ in texts), desc="cache target features", unit="tok",
               disable=not ranks.main)
    for start in range(0, 8 * prefills, 8):
        batch = texts[start:start + 8]
        if not batch:
            target_features(target, [spare], layer_ids)
            continue
        tokens, features, final = target_features(target, [ids for ids, _ in batch], layer_ids)
        for i, (ids, first) in enumerate(batch):
            n = len(ids)
            with torch.no_grad():
                labels = target.lm_head(final[i, :n]).argmax(-1).cpu()
            entries.append(CachedSequence(tokens[i, :n].cpu(), features[i, :n].bfloat16().cpu(),
                                          final[i, :n].bfloat16().cpu(), labels, first))
            bar.update(n)
    bar.close()
    return entries


def gathered(mine: list[CachedSequence], count: int, path: Path, ranks: Ranks) -> list[CachedSequence]:
    """Every rank's share (Ranks.share of `count` entries) back in one list in the order of the whole, through
    part files beside the cache (the output directory is shared by the ranks: it holds the checkpoints too)."""
    part = path.with_name(f"{path.stem}.rank{ranks.rank}.tmp")
    torch.save([tuple(c) for c in mine], part)
    distributed.barrier()
    shares = [[CachedSequence(*fields) for fields in torch.load(path.with_name(f"{path.stem}.rank{r}.tmp"),
                                                                  weights_only=False)] for r in range(ranks.world)]
    distributed.barrier()  # everyone has read every part
    part.unlink()
    return [shares[i % ranks.world][i // ranks.world] for i in range(count)]


def sample_batch(sequences: list[CachedSequence], batch_size: int, generator: torch.Generator,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", ranks: Ranks = Ranks()):
    """A random batch from cached features: the texts of the whole batch, and this rank's share of it right-padded
    like target_features' output, plus labels.

    Assembled on the host (the cache lives there), then moved to `device` in one copy per tensor."""
    drawn = [sequences[i] for i in torch.randint(len(sequences), (batch_size,), generator=generator).tolist()]
    picked = ranks.share(drawn)
    T = max(len(c.tokens) for c in picked)
    tokens = torch.zeros(len(picked), T, dtype=torch.long, device="cpu")
    labels = torch.zeros(len(picked), T, dtype=torch.long, device="cpu")
    features = torch.zeros(len(picked), T, picked[0].features.shape[-1], dtype=dtype, device="cpu")
    final = torch.zeros(len(picked), T, picked[0].final.shape[-1], dtype=dtype, device="cpu")
    for i, c in enumerate(picked):
        n = len(c.tokens)
        tokens[i, :n], features[i, :n], final[i, :n], labels[i, :n] = c.tokens, c.features, c.final, c.labels
    tensors = tuple(t.to(device, non_blocking=True) for t in (tokens, features, final, labels))
    return [(c.tokens.tolist(), c.first_anchor) for c in drawn], tensors


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


@dataclasses.dataclass
class TrainingRun:
    """A training session: the models, the optimizer, and where training stands (what checkpoint.pt keeps).

    Under torchrun every rank holds one: the same drafter, optimizer and generator (the generator draws for the
    whole global batch on every rank, so that the ranks agree on anchors and cached draws without talking, and a
    checkpoint resumes at any world size), and its own share of each batch's sequences."""
    args: argparse.Namespace
    out: Path
    pipe: Pipeline
    target: TargetModel
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    rng: torch.Generator
    ranks: Ranks
    forward: torch.nn.Module  # BlockDrafting, in DistributedDataParallel under torchrun
    step: int = 0
    seen_texts: int = 0  # the data cursor: texts read in the current epoch
    seen_tokens: int = 0
    cpu_seconds: float = 0.0  # spent training in earlier sessions
    session_cpu: float = 0.0  # time.process_time() when this session's training began
    session_wall: float = 0.0  # time.time() when this session's training began
    last_loss: float | None = None  # the last step's training loss (over the whole batch)

    @property
    def sharded_target(self) -> bool:
        return self.args.shard_target and self.ranks.distributed

    @property
    def checkpoint_path(self) -> Path:
        return self.out / "checkpoint.pt"

    def total_cpu_seconds(self) -> float:
        return self.cpu_seconds + time.process_time() - self.session_cpu


class HeldOut(NamedTuple):
    texts: list[list[int]]  # held-out ShareGPT conversations: loss and per-position accuracy
    features: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # target_features(texts)
    prompts: list[list[int]]  # held-out prompts decoded to measure tau


def train(args: argparse.Namespace) -> None:
    """Train the drafter args describe, or resume it, until --steps or --max-minutes; export it to <output>/drafter.

    Under torchrun: rank 0 evaluates, writes the learning curve and the checkpoints; every rank trains."""
    run = start_run(args)
    try:
        # a sharded target's prefill needs every rank; rank 0 alone evaluates the drafter on the features
        heldout = heldout_data(run) if run.ranks.main or run.sharded_target else None
        vocab_subset = frequent_tokens(run.pipe, args.train_vocab, args.responses) if args.train_vocab else None
        if vocab_subset is not None:
            vocab_subset = vocab_subset.to(args.device)
        next_batch = batch_source(run)
        if run.ranks.main:
            print(memory.describe(estimated_memory(run, vocab_subset), free_device_memory(args.device),
                                  run.sharded_target), file=sys.stderr)
        with (run.out / "learning_curve.jsonl").open("a") if run.ranks.main else contextlib.nullcontext() as curve:
            run.session_cpu, run.session_wall = time.process_time(), time.time()
            if run.ranks.main and run.step == 0 and args.init and curve.tell() == 0:
                evaluate_and_record(run, heldout, curve)  # where a continued drafter starts, as this run measures
            training_loop(run, next_batch, vocab_subset, heldout, curve)
        if run.ranks.main:
            save_checkpoint(run)
            print(f"exported drafter to {run.out / 'drafter'} after {run.step} steps ({run.seen_tokens} tokens)",
                  file=sys.stderr)
    finally:
        distributed.leave()


def start_run(args: argparse.Namespace) -> TrainingRun:
    """The frozen target, the drafter and its optimizer, resumed from <output>/checkpoint.pt if there is one."""
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    ranks = ranks_from_env()
    check_options(args, ranks)
    args.device = ranks.device(args.device)
    check_device(args.device)
    distributed.join(ranks, args.device)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    sharded = args.shard_target and ranks.distributed
    # a target to shard is read on the host, and only its shards (and the small rest) go to the device.
    # On a CPU the target trains in float32 whatever format would serve it (TRAINING_CPU_WEIGHTS).
    pipe = load_pipeline(args.target, drafter=None, dtype=args.dtype, device="cpu" if sharded else args.device,
                         prepare=not sharded, cpu_weights=TRAINING_CPU_WEIGHTS)
    target = pipe.target.requires_grad_(False)
    if pipe.tokenizer is None:
        raise DFlashError(f"{pipe.target_dir} has no tokenizer; the trainer needs one")
    drafter = initial_drafter(args, target)  # from the target's whole layers: before they are sharded
    if sharded:
        shard_target(target, args.device)
    args.decay = args.decay or recipe_decay(drafter.config.block_size)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    forward = BlockDrafting(drafter, target)
    run = TrainingRun(args, out, pipe, target, drafter, optimizer, torch.Generator().manual_seed(args.seed), ranks,
                      forward)
    if run.checkpoint_path.is_file():
        resume(run)
    if ranks.distributed:  # after resuming: DDP starts every rank from rank 0's weights
        run.forward = DistributedDataParallel(
            forward, device_ids=[torch.device(args.device).index] if torch.device(args.device).type == "cuda" else None)
    return run


def check_options(args: argparse.Namespace, ranks: Ranks) -> None:
    """What argparse's types cannot see alone, refused before the target loads (and before any step is lost)."""
    if args.batch_size < ranks.world:
        raise DFlashError(f"--batch-size {args.batch_size} (the global batch) is smaller than the {ranks.world} "
                          "ranks: every rank needs at least one sequence per step")
    if args.shard_target and ranks.distributed and args.tau_prompts:
        raise DFlashError(f"--shard-target with --tau-prompts {args.tau_prompts}: the measured tau decodes on rank 0 "
                          "alone, which a sharded target cannot do; pass --tau-prompts 0 (the estimated tau is still "
                          "recorded) and measure the exported drafter with dflash-bench")


def shard_target(target: TargetModel, device: str) -> None:
    """The frozen target's decoder layers sharded across the ranks (distributed.shard); the embedding, the final norm
    and the head stay whole on every rank: the drafter and the loss use them outside the target's forward."""
    distributed.shard(target.model.layers, device)
    for whole in (target.model.embed_tokens, target.model.norm, target.lm_head):
        whole.to(device)


def estimated_memory(run: TrainingRun, vocab_subset: torch.Tensor | None) -> dict[str, float]:
    """dflash_training.memory's estimate for this run's options (GiB by part), on one rank."""
    args, target, config = run.args, run.target, run.drafter.config
    weights = target_weight_bytes(target)
    softmax = len(vocab_subset) + args.batch_size * args.anchors if vocab_subset is not None else \
        target.config.shape.vocab_size
    per_rank = -(-args.batch_size // run.ranks.world)  # the largest share of the batch
    sizes = memory.StepSizes(per_rank, args.seq_len, args.anchors, config.block_size, config.shape.num_layers,
                             len(config.target_layer_ids), softmax, 2 if args.dtype == "bfloat16" else 4)
    return memory.step_memory(target.config.shape, weights, sizes)


def target_weight_bytes(target: TargetModel) -> int:
    """The target's weights held on this rank, by storage (a tied embedding and head are one tensor); with sharded
    layers, this rank's shards plus two whole layers: FSDP gathers the next layer while one runs."""
    state = target.state_dict()
    local = [t.to_local() if isinstance(t, DTensor) else t for t in state.values()]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())
    if not any(isinstance(t, DTensor) for t in state.values()):
        return held
    layer = sum(t.numel() * t.element_size() for t in target.model.layers[0].state_dict().values())
    return held + 2 * layer


def free_device_memory(device: str) -> float | None:
    """Free GiB on a CUDA device (None elsewhere: a CPU's RAM is shared with everything else)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.mem_get_info(torch.device(device))[0] / memory.GIB


def recipe_decay(block_size: int) -> float:
    """The position decay of ModelOpt's DFlash recipe (4 at block 8, 7 at block 16), on the line through both."""
    return 1 + 3 * block_size / 8


def check_device(device: str) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise DFlashError(f"--device {device}: torch sees no CUDA device (torch {torch.__version__})")
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 GEMMs on tensor cores, as the H200 run did


def autocast(args: argparse.Namespace):
    """bf16 autocast of the drafter's forward with --dtype bfloat16 (the loss itself stays float32)."""
    return torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")


def resume(run: TrainingRun) -> None:
    # on the host first: a checkpoint written on a GPU resumes on a CPU and the other way round
    state = torch.load(run.checkpoint_path, weights_only=False, map_location="cpu")
    config = run.drafter.config.to_dict()
    if state.get("config", config) != config:
        raise DFlashError(f"{run.checkpoint_path} holds a drafter of another shape ({state['config']}); pass the "
                          "options it was started with (e.g. --block-size), or another --output")
    run.drafter.load_state_dict(state["drafter"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.step, run.seen_texts, run.seen_tokens = state["step"], state["seen_texts"], state["seen_tokens"]
    run.cpu_seconds = state["cpu_seconds"]
    run.rng.set_state(state["rng"])
    print(f"resumed at step {run.step} ({run.seen_tokens} tokens seen)", file=sys.stderr)


def save_checkpoint(run: TrainingRun) -> None:
    """checkpoint.pt (written beside and renamed: never half-written) and the exported drafter/."""
    tmp = run.checkpoint_path.with_suffix(".tmp")
    torch.save({"drafter": run.drafter.state_dict(), "config": run.drafter.config.to_dict(),
                "optimizer": run.optimizer.state_dict(), "rng": run.rng.get_state(),
                "step": run.step, "seen_texts": run.seen_texts, "seen_tokens": run.seen_tokens,
                "cpu_seconds": run.total_cpu_seconds()}, tmp)
    tmp.replace(run.checkpoint_path)
    save_drafter(run.drafter, run.out / "drafter")


def heldout_data(run: TrainingRun) -> HeldOut:
    """The same held-out texts and prompts at every evaluation, and the target's features of the texts."""
    args = run.args
    texts = _heldout_batch(run.pipe, args.seq_len, args.batch_size * 2)
    prompts = [run.pipe.encode(p) for p, _ in itertools.islice(
        ((p, r) for p, r in sharegpt_conversations("heldout") if len(p) < 300), args.tau_prompts)]
    return HeldOut(texts, target_features(run.target, texts, run.drafter.config.target_layer_ids), prompts)


def batch_source(run: TrainingRun):
    """A function returning the next batch: (the whole batch's texts, this rank's share of them as (tokens,
    features, final, labels), data cursor).

    Without a feature cache: the next texts and one target prefill (labels None: computed in the
    loss). With --feature-cache: a random draw from the cached features (the cursor stays).
    """
    args, layer_ids = run.args, run.drafter.config.target_layer_ids

    def texts_from(skip: int):
        return training_texts(run.pipe, args.seq_len, skip, args.responses, args.answer_only)
    if not args.feature_cache:
        batches = training_batches(texts_from, args.batch_size, run.seen_texts)

        def next_texts():  # every rank reads the whole batch's texts, and runs the target on its share only
            batch, cursor = next(batches)
            tokens, features, final = target_features(run.target, [ids for ids, _ in run.ranks.share(batch)],
                                                      layer_ids)
            return batch, (tokens, features, final, None), cursor
        return next_texts
    source = {"data": str(Path(args.responses).resolve()) if args.responses else "sharegpt", "seq_len": args.seq_len,
              "target_layer_ids": list(layer_ids)}
    if args.answer_only and not args.responses:  # the key only where it changes the cache: older caches stay valid
        source["answer_only"] = True
    cache = cached_features(run.target, texts_from, layer_ids, args.feature_cache, run.out / "features.pt", source,
                            run.ranks)
    return lambda: (*sample_batch(cache, args.batch_size, run.rng, run.target.dtype, args.device, run.ranks),
                    run.seen_texts)


def training_loop(run: TrainingRun, next_batch, vocab_subset: torch.Tensor | None, heldout: HeldOut | None,
                  curve) -> None:
    """Steps until --steps or --max-minutes, saving every --save-every and evaluating every --eval-every (rank 0;
    the checkpoint first: an evaluation that fails loses no training)."""
    args, main = run.args, run.ranks.main
    bar = tqdm(total=args.steps, initial=run.step, desc="train drafter", unit="step", disable=not main)
    while run.step < args.steps and not out_of_time(run):
        batch, tensors, run.seen_texts = next_batch()
        loss, correct, counted = train_step(run, batch, tensors, vocab_subset)
        acc = (correct / counted.clamp_min(1))
        bar.set_postfix(loss=f"{loss:.3f}", acc1=f"{acc[0]:.2f}", acc4=f"{acc[3]:.2f}" if len(acc) > 3 else "-")
        bar.update()
        if main and (run.step % args.save_every == 0 or run.step == args.steps):
            save_checkpoint(run)
        if main and (run.step % args.eval_every == 0 or run.step == args.steps):
            evaluate_and_record(run, heldout, curve)
    bar.close()


def out_of_time(run: TrainingRun) -> bool:
    """--max-minutes spent, as rank 0's clock says: every rank stops after the same step."""
    spent = (time.time() - run.session_wall) / 60 >= run.args.max_minutes
    if not run.ranks.distributed:
        return spent
    return bool(distributed.all_sum(torch.tensor([float(spent and run.ranks.main)])).item())


def train_step(run: TrainingRun, batch: list[tuple[list[int], int]], tensors, vocab_subset: torch.Tensor | None):
    """One optimizer step (warmup learning rate, block loss, clipped gradient) -> (loss, correct, counted), each over
    the whole batch.

    batch: the whole batch's texts; tensors: this rank's share of them. The anchors are drawn for the whole batch
    on every rank (the same generator everywhere) and each rank takes its share's. Each rank's loss is its weighted
    sum over the whole batch's weight, times the world size: DDP averages the gradients over the ranks, so the
    step is the one a single process would take on the whole batch."""
    args, drafter, ranks = run.args, run.drafter, run.ranks
    tokens, features, final, labels = tensors
    lr = args.lr * min(1.0, (run.step + 1) / args.warmup)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    anchors = ranks.share(draw_anchors([first for _, first in batch], [len(ids) for ids, _ in batch], args.anchors,
                                       run.rng)).to(tokens.device)
    lengths = [len(ids) for ids, _ in ranks.share(batch)]
    drafter.train()
    vocab_size = run.target.lm_head.weight.shape[0]  # the ids the head can predict
    with autocast(args):
        hidden = run.forward(tokens, features, anchors)
        weighted, weight, correct, counted = block_loss_terms(
            hidden, run.target, tokens, final, lengths, anchors, drafter.config.block_size, args.decay,
            vocab_subset, soft_labels=not args.hard_labels, labels=labels,
            vocab_union=lambda ids: label_union(ids, vocab_size, ranks))
    total_weight = distributed.all_sum(weight.detach())
    run.optimizer.zero_grad(set_to_none=True)
    (weighted * ranks.world / total_weight).backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    run.optimizer.step()
    run.step += 1
    run.seen_tokens += sum(len(ids) for ids, _ in batch)
    run.last_loss = (distributed.all_sum(weighted.detach()) / total_weight).item()
    return run.last_loss, distributed.all_sum(correct), distributed.all_sum(counted)


def label_union(ids: torch.Tensor, vocab_size: int, ranks: Ranks) -> torch.Tensor:
    """The label ids of every rank's share (ids itself for one process), through a vocabulary-sized count."""
    if not ranks.distributed:
        return ids
    present = torch.zeros(vocab_size, dtype=torch.int32, device=ids.device)
    present[ids] = 1
    return distributed.all_sum(present).nonzero().flatten()


def _heldout_batch(pipe: Pipeline, seq_len: int, n: int) -> list[list[int]]:
    batch = []
    for prompt, reply in sharegpt_conversations("heldout"):
        ids = (pipe.encode(prompt) + pipe.tokenizer.encode(reply, add_special_tokens=False))[:seq_len]
        if len(ids) >= 64:
            batch.append(ids)
        if len(batch) == n:
            return batch
    raise DFlashError("not enough held-out ShareGPT conversations")


@torch.no_grad()
def measured_acceptance(drafter: DFlashDrafter, target: TargetModel, prompts: list[list[int]], block_size: int,
                        max_new_tokens: int = 48) -> float:
    """Real tau: greedy DFlash decoding of held-out prompts with a frozen copy of the drafter."""
    frozen = copy.deepcopy(drafter).requires_grad_(False).to(target.dtype)  # the engine runs one dtype
    prepare_for_inference(frozen)
    engine = SpeculativeEngine(target, frozen, block_size=block_size, max_batch_size=len(prompts))
    seqs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    lengths = [a for s in seqs for a in s.stats.acceptance_lengths]
    return sum(lengths) / len(lengths)


def evaluate(run: TrainingRun, heldout: HeldOut) -> dict:
    """A learning-curve record: the last step's training loss, held-out loss, accuracy by block position, tau
    estimated and (with --tau-prompts) measured. cpu_hours are rank 0's under torchrun (world_size says how many
    ranks trained the last step)."""
    drafter, args = run.drafter, run.args
    drafter.eval()
    tokens, features, final = heldout.features
    generator = torch.Generator().manual_seed(1234)  # the same anchors every time: comparable points
    with torch.no_grad(), autocast(args):
        loss, correct, counted = block_loss(drafter, run.target, tokens, features, final,
                                            [len(b) for b in heldout.texts], drafter.config.block_size, args.anchors,
                                            args.decay, generator)
    record = {
        "step": run.step,
        "tokens_seen": run.seen_tokens,
        "cpu_hours": round(run.total_cpu_seconds() / 3600, 4),
        "world_size": run.ranks.world,
        **({"train_loss": round(run.last_loss, 4)} if run.last_loss is not None else {}),
        "heldout_loss": round(loss.item(), 4),
        "heldout_accuracy_by_position": [round(x, 4) for x in (correct / counted.clamp_min(1)).tolist()],
        "heldout_estimated_tau": round(estimated_acceptance(correct, counted), 3),
    }
    if heldout.prompts:
        record["heldout_measured_tau"] = round(measured_acceptance(drafter, run.target, heldout.prompts,
                                                                   drafter.config.block_size), 3)
    return record


def evaluate_and_record(run: TrainingRun, heldout: HeldOut, curve) -> None:
    """Evaluate, append the record to learning_curve.jsonl and redraw learning_curve.png."""
    record = evaluate(run, heldout)
    curve.write(json.dumps(record) + "\n")
    curve.flush()
    plot_learning_curve(run.out / "learning_curve.jsonl", run.out / "learning_curve.png")
    measured = f", measured {record['heldout_measured_tau']:.2f}" if "heldout_measured_tau" in record else ""
    tqdm.write(f"step {run.step}: held-out loss {record['heldout_loss']:.3f}, "
               f"acc@1 {record['heldout_accuracy_by_position'][0]:.3f}, tau estimated "
               f"{record['heldout_estimated_tau']:.2f}{measured}")


def plot_learning_curve(curve_path: Path, png_path: Path) -> None:
    """tau (measured and estimated) and held-out block-position-1 accuracy against training tokens.

    Skipped where matplotlib is not installed (a lent GPU machine): learning_curve.jsonl is the record."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in curve_path.read_text().splitlines() if line.strip()]
    tokens = [r["tokens_seen"] / 1e6 for r in records]
    fig, (tau, acc) = plt.subplots(1, 2, figsize=(11, 4))
    measured = [(t, r["heldout_measured_tau"]) for t, r in zip(tokens, records) if "heldout_measured_tau" in r]
    if measured:
        tau.plot(*zip(*measured), marker="o", label="measured (greedy decoding, held-out prompts)")
    tau.plot(tokens, [r["heldout_estimated_tau"] for r in records], marker=".", label="estimated from accuracies")
    tau.set(xlabel="training tokens (millions)", ylabel="mean acceptance length tau", title="tau vs training tokens")
    tau.legend()
    acc.plot(tokens, [r["heldout_accuracy_by_position"][0] for r in records], marker=".", label="block position 1")
    acc.plot(tokens, [r["heldout_accuracy_by_position"][-1] for r in records], marker=".", label="last position")
    if records[-1]["cpu_hours"] > records[0]["cpu_hours"]:
        top = acc.twiny()
        top.set_xlim(records[0]["cpu_hours"], records[-1]["cpu_hours"])
        top.set_xlabel("CPU hours")
    acc.set(xlabel="training tokens (millions)", ylabel="held-out accuracy", ylim=(0, 1))
    acc.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    return options.train_parser(__doc__, EXAMPLES)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except DFlashError as e:
        print(f"dflash-train-drafter: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
