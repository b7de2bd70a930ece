"""The drafter's training texts: chat-formatted ShareGPT conversations or the target's own answers, as endless
batches with a data cursor that a checkpoint keeps; the held-out texts; the most frequent tokens (--train-vocab)."""
from __future__ import annotations

import itertools

import torch

from dflash_runtime.config import DFlashError
from dflash_runtime.pipeline import Pipeline
from dflash_tools.prompts import sharegpt_conversations
from dflash_training.drafter_data import read_responses, training_sequence


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


def heldout_texts(pipe: Pipeline, seq_len: int, n: int) -> list[list[int]]:
    """n held-out ShareGPT conversations of 64 to seq_len tokens: the same ones at every evaluation."""
    batch = []
    for prompt, reply in sharegpt_conversations("heldout"):
        ids = (pipe.encode(prompt) + pipe.tokenizer.encode(reply, add_special_tokens=False))[:seq_len]
        if len(ids) >= 64:
            batch.append(ids)
        if len(batch) == n:
            return batch
    raise DFlashError("not enough held-out ShareGPT conversations")

