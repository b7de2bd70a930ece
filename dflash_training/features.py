"""The frozen target's side of training: its hidden states after the drafter's target layers (the context features)
and its final hidden states (the labels), one prefill per batch, or computed once into a cache (--feature-cache)
that batches are then drawn from; shared out across torchrun's ranks."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from dflash_runtime.config import DFlashError
from dflash_runtime.target import TargetModel
from dflash_training import distributed
from dflash_training.distributed import Ranks


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

