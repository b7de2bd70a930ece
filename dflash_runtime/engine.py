"""The batched speculative engine: prefill, then per step {draft block -> verify block -> accept -> bonus}.

Sequences join and leave the running batch between steps (continuous batching, see scheduler.py).
One step runs one drafter pass and one target pass for the whole batch. Block size 1 (or no
drafter) is plain autoregressive decoding through the same code, which makes it the fair baseline.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from .config import DFlashError
from .drafter import DFlashDrafter
from .sampling import SamplingParams, choose_tokens
from .scheduler import Occupancy, Scheduler
from .sequence import Sequence
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
        _check_sizes(drafter, block_size, max_batch_size)
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
        self.scheduler = Scheduler(max_batch_size, self.max_context)
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
        self.scheduler.add(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        if not seq.finished:
            self.scheduler.finish(seq, "cancelled")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def occupancy(self) -> Occupancy:
        """Counts of running and waiting sequences, free slots and committed tokens; a snapshot."""
        return self.scheduler.occupancy()

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
        """Admit and prefill waiting sequences, then one draft + verify pass for the running batch."""
        self.last_step_seconds = dict.fromkeys(self.last_step_seconds, 0.0)
        outputs = [StepOutput(seq, self._commit(seq, self._prefill(seq))) for seq in self.scheduler.admit()]
        batch = self.scheduler.batch()
        if batch:
            chosen = self._speculate(batch)
            outputs += [StepOutput(seq, self._commit(seq, tokens), seq.stats.acceptance_lengths[-1])
                        for seq, tokens in zip(batch, chosen)]
        return outputs

    def _prefill(self, seq: Sequence) -> list[int]:
        """The prompt's pass through the target; returns the first output token (as a list)."""
        n = len(seq.prompt_ids)
        slots = self._tensor([seq.slot])
        tokens = self._tensor([seq.prompt_ids])
        positions = torch.arange(n, device=self.device)[None]
        t0 = time.perf_counter()
        logits, features = self.target(tokens, positions, self.target_cache, slots, self.feature_layers, last_only=True)
        self._keep_context(features, positions, slots, self._tensor([n]))
        seconds = time.perf_counter() - t0
        seq.stats.verify_seconds += seconds
        self.last_step_seconds["prefill"] += seconds
        return choose_tokens(logits[0], seq.params, n)

    def _speculate(self, batch: list[Sequence]) -> list[list[int]]:
        """One draft pass and one verify pass for the whole batch; returns each sequence's accepted
        drafts plus the target's token after them (the bonus), before any stop condition."""
        slots = self._tensor([s.slot for s in batch])
        starts = self._tensor([s.last_position for s in batch])
        positions = starts[:, None] + torch.arange(self.block_size, device=self.device)  # [B, S]
        t0 = time.perf_counter()
        block = self._draft(batch, positions, slots)  # [B, S]
        t1 = time.perf_counter()
        logits, features = self.target(block, positions, self.target_cache, slots, self.feature_layers)
        chosen = [choose_tokens(logits[i], s.params, s.last_position + 1) for i, s in enumerate(batch)]
        accepted = [self._accept(s, draft, tokens) for s, draft, tokens in zip(batch, block[:, 1:].tolist(), chosen)]
        # block[0..a] are now committed context; the bonus token's K/V comes with the next block
        self._keep_context(features, positions, slots, starts + self._tensor(accepted) + 1)
        t2 = time.perf_counter()
        self.last_step_seconds["draft"] = t1 - t0
        self.last_step_seconds["verify"] = t2 - t1
        for seq in batch:
            seq.stats.draft_seconds += t1 - t0
            seq.stats.verify_seconds += t2 - t1
        return [tokens[:a + 1] for tokens, a in zip(chosen, accepted)]

    def _draft(self, batch: list[Sequence], positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The block to verify: each sequence's newest token, then the drafter's guesses for the rest."""
        block = self._tensor([[s.output_ids[-1]] for s in batch])  # [B, 1]
        if self.drafter is not None:
            masks = torch.full((len(batch), self.block_size - 1), self.drafter.config.mask_token_id, device=self.device)
            block = torch.cat([block, masks], dim=1)
            hidden = self.drafter(self.target.embed(block), positions, self.draft_cache, slots)
            block[:, 1:] = self.target.lm_head(hidden[:, 1:]).argmax(-1)
        return block

    def _accept(self, seq: Sequence, draft: list[int], target_tokens: list[int]) -> int:
        """How many drafts match the target's own choices (the longest matching prefix); recorded in seq.stats."""
        a = 0
        while a < len(draft) and draft[a] == target_tokens[a]:
            a += 1
        seq.stats.record(a, self.block_size - 1)
        return a

    def _keep_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      lengths: torch.Tensor) -> None:
        """Commit `lengths` tokens per slot; the drafter conditions on the target's features of the same tokens."""
        self.target_cache.crop(slots, lengths)
        if self.drafter is not None:
            self.drafter.inject_context(features, positions, self.draft_cache, slots)
            self.draft_cache.crop(slots, lengths)

    def _tensor(self, data) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long, device=self.device)

    # -- postprocessing -----------------------------------------------------------------------
    def _commit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append tokens up to the first stop condition, finishing `seq` there; returns what was appended."""
        p = seq.params
        stop_ids = p.stop_token_ids if p.ignore_eos else self.eos_token_ids.union(p.stop_token_ids)
        for n, token in enumerate(tokens, 1):
            seq.output_ids.append(token)
            if token in stop_ids or (p.stop_strings and self._matches_stop_string(seq)):
                self.scheduler.finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.max_context:
                self.scheduler.finish(seq, "length")
            if seq.finished:
                return tokens[:n]
        return tokens

    def _matches_stop_string(self, seq: Sequence) -> bool:
        # Only the tail can hold a new match: the longest stop string plus a few tokens of slack.
        window = max(map(len, seq.params.stop_strings)) + 8
        tail = self.decode(seq.output_ids[-window:])
        return any(stop in tail for stop in seq.params.stop_strings)


def _check_sizes(drafter: DFlashDrafter | None, block_size: int, max_batch_size: int) -> None:
    if block_size < 1:
        raise DFlashError(f"block size must be >= 1, got {block_size}")
    if block_size > 1 and drafter is None:
        raise DFlashError(f"block size {block_size} needs a drafter (use block size 1 without one)")
    if drafter is not None and block_size > drafter.config.block_size:
        raise DFlashError(f"block size {block_size} is larger than the drafter supports "
                          f"({drafter.config.block_size})")
    if max_batch_size < 1:
        raise DFlashError(f"max batch size must be >= 1, got {max_batch_size}")
