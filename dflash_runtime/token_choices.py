"""What a step's logits become: the drafts to verify (grammatical for guided rows), the target's token at each block
position (greedy, Gumbel-max sampled, or rejection sampling's verdict), and the masks laid on the logits before either
(min_tokens' held stop ids, grammars). One per engine; it keeps the proposal rule it learns and the host time guided
decoding's masks took."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .counter_noise import DRAFT
from .grammar import mask_logits, new_bitmask
from .sampling import (GumbelNoise, ProposalRule, RowParams, SamplingParams, greedy_tokens, proposal_hits,
                       propose_tokens, rejection_choices, sampling_scores, to_device)
from .sequence import Sequence


@dataclass
class SampledRows:
    """A step's sampled rows: their indices [S], parameters, positions [S, k] (block row t chooses the token
    at position start + 1 + t, which draft t + 1 guesses) and the noise there; which rows use rejection
    sampling ([S] bool), None when none does; the drafter's sampling scores [S, k - 1, V] once it drafted."""

    rows: torch.Tensor
    params: RowParams
    positions: torch.Tensor
    noise: GumbelNoise
    rejection: torch.Tensor | None
    draft_scores: torch.Tensor | None = None


class TokenChoices:
    def __init__(self, device: torch.device, vocab_size: int, block_size: int, eos_token_ids: frozenset[int],
                 proposal_rule: ProposalRule):
        self.device, self.vocab_size, self.eos_token_ids = device, vocab_size, eos_token_ids
        self.offsets = torch.arange(block_size, device=device)  # positions within a block
        self.proposal_rule = proposal_rule
        self.mask_seconds = 0.0  # host time spent on guided decoding's masks, for benchmarks

    def hold_stop_tokens(self, logits: torch.Tensor, batch: list[Sequence], row_of: list[int]) -> None:
        """min_new_tokens: a sequence's stop ids get no probability at the block positions before its
        min_new_tokens-th token (in place: logits [R, k, V] are the pass's own). The target's own decoding
        under the same rule gives the same tokens, so speculation stays lossless (TensorRT-LLM's min_length
        bans the end id the same way)."""
        index = [(row, j, token) for seq, row in zip(batch, row_of)
                 for j in range(min(logits.shape[1], seq.params.min_new_tokens - len(seq.output_ids)))
                 for token in self.stop_ids(seq.params)]
        if index:
            rows, positions, tokens = to_device(list(zip(*index)), self.device)
            logits[rows, positions, tokens] = float("-inf")

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(params.stop_token_ids) if params.ignore_eos else self.eos_token_ids.union(params.stop_token_ids)

    def sampled_rows(self, batch: list[Sequence], row_of: list[int], starts: torch.Tensor,
                     k: int) -> SampledRows | None:
        """The step's sampled rows (SampledRows); None if every sequence is greedy."""
        sampled = [(row, seq.params) for seq, row in zip(batch, row_of) if not seq.params.greedy]
        if not sampled:
            return None
        vocab = self.vocab_size
        params = RowParams.of([p for _, p in sampled], vocab, self.device)
        rows = to_device([row for row, _ in sampled], self.device)
        positions = starts[rows, None] + 1 + self.offsets[:k]
        rejection = [p.speculative_sampling == "rejection" for _, p in sampled]
        return SampledRows(rows, params, positions, GumbelNoise(params.seeds, positions, vocab),
                           to_device(rejection, self.device, torch.bool) if any(rejection) else None)

    def _propose(self, logits: torch.Tensor, sampled: SampledRows | None) -> torch.Tensor:
        """The drafts [R, k - 1] from the drafter's logits: the argmax for greedy rows; for sampled rows the
        proposal rule of sampling.propose_tokens with the noise of the positions they guess, or for
        rejection sampling a sample of the drafter's own distribution."""
        drafts = greedy_tokens(logits)
        if sampled is None:
            return drafts
        mine, params = logits[sampled.rows], sampled.params
        scores = sampled.draft_scores = sampling_scores(mine, params)  # also judged and tested in choose
        guesses = propose_tokens(mine, scores, sampled.noise.first(mine.shape[1]), self.proposal_rule.sharpness())
        if sampled.rejection is not None:
            own = GumbelNoise(params.seeds, sampled.positions[:, :mine.shape[1]], mine.shape[-1], DRAFT).argmax(scores)
            guesses = torch.where(sampled.rejection[:, None], own, guesses)
        drafts[sampled.rows] = guesses
        return drafts

    def drafts(self, batch: list[Sequence], row_of: list[int], logits: torch.Tensor,
               sampled: SampledRows | None) -> torch.Tensor:
        """The drafts [R, k - 1] (_propose), each of a guided sequence grammatical after those before it: where its
        grammar refuses a draft, the drafter's logits there are masked and the drafts proposed again. Proposals are
        per position, so those before it stay as they were; a round per refused position at most."""
        drafts = self._propose(logits, sampled)
        guided = [(seq.grammar, row) for seq, row in zip(batch, row_of) if seq.grammar is not None]
        width = logits.shape[1]
        for _ in range(width if guided else 0):
            start = time.perf_counter()
            flat = logits.view(-1, logits.shape[-1])  # row r's position j at r * width + j
            bitmask = new_bitmask(len(flat), flat.shape[-1])
            host = drafts[[row for _, row in guided]].tolist()
            refused = [row * width + j for (grammar, row), mine in zip(guided, host)
                       if (j := grammar.first_refused(mine, bitmask, row * width)) is not None]
            mask_logits(flat, bitmask, refused)
            self.mask_seconds += time.perf_counter() - start
            if not refused:
                break
            drafts = self._propose(logits, sampled)
        return drafts

    def guided_rows(self, batch: list[Sequence], row_of: list[int], block: torch.Tensor) -> list[tuple]:
        """(sequence, row, its drafts on the host) of the guided sequences in a step."""
        guided = [(seq, row) for seq, row in zip(batch, row_of) if seq.grammar is not None]
        if not guided:
            return []
        drafts = block[[row for _, row in guided], 1:].tolist()
        return [(seq, row, mine) for (seq, row), mine in zip(guided, drafts)]

    def mask_guided(self, logits: torch.Tensor, guided: list[tuple]) -> None:
        """Mask logits [R, k, V] in place at each guided row's block positions: position j by the grammar's state
        after the row's drafts 1..j (grammar.py)."""
        if not guided:
            return
        start = time.perf_counter()
        k = logits.shape[1]
        flat = logits.view(-1, logits.shape[-1])  # row r's position j at r * k + j
        bitmask = new_bitmask(len(flat), flat.shape[-1])
        masked = [row * k + j for seq, row, drafts in guided for j in seq.grammar.fill_along(drafts, bitmask, row * k)]
        mask_logits(flat, bitmask, masked)
        self.mask_seconds += time.perf_counter() - start

    def choose(self, logits: torch.Tensor, block: torch.Tensor, draft_logits: torch.Tensor | None,
               sampled: SampledRows | None) -> torch.Tensor:
        """The target's token at each block position, [R, k] on the device: the argmax for greedy rows, for
        the others the Gumbel-max sample with the noise of (seed, position), or rejection sampling's choice.
        A learning proposal rule is told which rules would have guessed the samples at the first draft."""
        chosen = greedy_tokens(logits)
        if sampled is None:
            return chosen
        rows = sampled.rows
        scores = sampling_scores(logits[rows], sampled.params)
        samples = sampled.noise.argmax(scores)
        if draft_logits is not None and self.proposal_rule.learning:
            self.proposal_rule.observe(proposal_hits(draft_logits[rows, :1], sampled.draft_scores[:, :1],
                                                     sampled.noise.first(1), samples[:, :1]))
        if sampled.rejection is not None and draft_logits is not None:
            verdicts = rejection_choices(scores, sampled.draft_scores, block[rows, 1:], sampled.params.seeds,
                                         sampled.positions, samples)
            samples = torch.where(sampled.rejection[:, None], verdicts, samples)
        chosen[rows] = samples
        return chosen
