"""The batched speculative engine: prefill, then per step {draft block -> verify block -> accept -> bonus}.

Sequences join and leave the running batch between steps (continuous batching). One step runs one
drafter pass and one target pass for the whole batch. Block size 1 (or no drafter) is plain
autoregressive decoding through the same code, which makes it the fair baseline.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from .config import DFlashError
from .drafter import DFlashDrafter
from .sampling import SamplingParams, choose_tokens
from .sequence import Sequence, Status
from .target import TargetModel


@dataclass
class StepOutput:
    sequence: Sequence
    new_token_ids: list[int]
    acceptance_length: int | None = None  # accepted drafts + 1 for a verify step; None for a prefill

    @property
    def finished(self) -> bool:
        return self.sequence.finished


class SpeculativeEngine:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None = None, *, block_size: int | None = None,
                 max_batch_size: int = 8, max_context: int | None = None,
                 decode: Callable[[list[int]], str] | None = None):
        """decode: token ids -> text, needed only for stop strings."""
        if block_size is None:
            block_size = drafter.config.block_size if drafter is not None else 1
        if block_size < 1:
            raise DFlashError(f"block size must be >= 1, got {block_size}")
        if block_size > 1 and drafter is None:
            raise DFlashError(f"block size {block_size} needs a drafter (use block size 1 without one)")
        if drafter is not None and block_size > drafter.config.block_size:
            raise DFlashError(f"block size {block_size} is larger than the drafter supports "
                              f"({drafter.config.block_size})")
        if max_batch_size < 1:
            raise DFlashError(f"max batch size must be >= 1, got {max_batch_size}")
        self.target = target
        self.device = target.device
        self.drafter = drafter if block_size > 1 else None
        self.block_size = block_size
        self.max_context = min(max_context or 2048, target.config.max_position_embeddings)
        self.decode = decode
        self.eos_token_ids = frozenset(target.config.eos_token_ids)
        # block positions run up to (max_context - 1) + (block_size - 1)
        capacity = self.max_context + block_size
        self.target_cache = target.new_cache(max_batch_size, capacity)
        self.draft_cache = self.drafter.new_cache(max_batch_size, capacity) if self.drafter else None
        self.feature_layers = self.drafter.config.target_layer_ids if self.drafter else ()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_batch_size))
        self.last_step_seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}  # for latency metrics

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int], params: SamplingParams) -> Sequence:
        prompt_ids = [int(t) for t in prompt_ids]
        vocab = self.target.config.shape.vocab_size
        if not prompt_ids:
            raise DFlashError("empty prompt")
        if len(prompt_ids) >= self.max_context:
            raise DFlashError(f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_context} "
                              "(including at least one generated token)")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise DFlashError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop_strings and self.decode is None:
            raise DFlashError("stop strings need a tokenizer")
        seq = Sequence(prompt_ids, params.with_seed())
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if not seq.finished:
            self._finish(seq, "cancelled")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        """Run requests to completion; results come back in the order of `prompts`."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return seqs

    # -- one scheduling step ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs = []
        self.last_step_seconds = dict.fromkeys(self.last_step_seconds, 0.0)
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = Status.RUNNING
            self.running.append(seq)
            outputs.append(StepOutput(seq, self._prefill(seq)))
        batch = sorted(self.running, key=lambda s: s.slot)  # a full batch in slot order reads its KV cache as a view
        if batch:
            new_tokens = self._speculate(batch)
            outputs += [StepOutput(s, new, s.stats.acceptance_lengths[-1]) for s, new in zip(batch, new_tokens)]
        return outputs

    def _prefill(self, seq: Sequence) -> list[int]:
        n = len(seq.prompt_ids)
        slots = self._tensor([seq.slot])
        tokens = self._tensor([seq.prompt_ids])
        positions = torch.arange(n, device=self.device)[None]
        t0 = time.perf_counter()
        logits, features = self.target(tokens, positions, self.target_cache, slots, self.feature_layers, last_only=True)
        self.target_cache.crop(slots, self._tensor([n]))
        if self.drafter is not None:
            self.drafter.inject_context(features, positions, self.draft_cache, slots)
            self.draft_cache.crop(slots, self._tensor([n]))
        seconds = time.perf_counter() - t0
        seq.stats.verify_seconds += seconds
        self.last_step_seconds["prefill"] += seconds
        return self._commit(seq, choose_tokens(logits[0], seq.params, n))

    def _speculate(self, batch: list[Sequence]) -> list[list[int]]:
        """One draft pass and one verify pass for the whole batch; returns each sequence's new tokens."""
        slots = self._tensor([s.slot for s in batch])
        starts = self._tensor([s.last_position for s in batch])
        positions = starts[:, None] + torch.arange(self.block_size, device=self.device)  # [B, S]
        block = self._tensor([[s.output_ids[-1]] for s in batch])  # [B, 1]
        t0 = time.perf_counter()
        if self.drafter is not None:
            masks = torch.full((len(batch), self.block_size - 1), self.drafter.config.mask_token_id, device=self.device)
            block = torch.cat([block, masks], dim=1)
            hidden = self.drafter(self.target.embed(block), positions, self.draft_cache, slots)
            block[:, 1:] = self.target.lm_head(hidden[:, 1:]).argmax(-1)
        t1 = time.perf_counter()
        logits, features = self.target(block, positions, self.target_cache, slots, self.feature_layers)
        drafts = block[:, 1:].tolist()
        chosen = [choose_tokens(logits[i], s.params, s.last_position + 1) for i, s in enumerate(batch)]
        accepted = []
        for seq, draft, target_tokens in zip(batch, drafts, chosen):
            a = 0
            while a < len(draft) and draft[a] == target_tokens[a]:
                a += 1
            seq.stats.record(a, self.block_size)
            accepted.append(a)
        # block[0..a] are now committed context; the bonus token's K/V comes with the next block
        committed = starts + self._tensor(accepted) + 1
        self.target_cache.crop(slots, committed)
        if self.drafter is not None:
            self.drafter.inject_context(features, positions, self.draft_cache, slots)
            self.draft_cache.crop(slots, committed)
        t2 = time.perf_counter()
        self.last_step_seconds["draft"] = t1 - t0
        self.last_step_seconds["verify"] = t2 - t1
        new_tokens = []
        for seq, a, target_tokens in zip(batch, accepted, chosen):
            seq.stats.draft_seconds += t1 - t0
            seq.stats.verify_seconds += t2 - t1
            new_tokens.append(self._commit(seq, target_tokens[:a + 1]))
        return new_tokens

    # -- bookkeeping ------------------------------------------------------------------------
    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    def _commit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append tokens up to the first stop condition; returns what was appended."""
        p = seq.params
        stop_ids = p.stop_token_ids if p.ignore_eos else self.eos_token_ids.union(p.stop_token_ids)
        appended = []
        for token in tokens:
            seq.output_ids.append(token)
            appended.append(token)
            if token in stop_ids:
                self._finish(seq, "stop")
            elif p.stop_strings and self._matches_stop_string(seq):
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.max_context:
                self._finish(seq, "length")
            if seq.finished:
                break
        return appended

    def _matches_stop_string(self, seq: Sequence) -> bool:
        # Only the tail can hold a new match: the longest stop string plus a few tokens of slack.
        window = max(map(len, seq.params.stop_strings)) + 8
        tail = self.decode(seq.output_ids[-window:])
        for stop in seq.params.stop_strings:
            if stop in tail:
                seq.matched_stop_string = stop
                return True
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None
