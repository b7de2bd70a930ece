"""The batched speculative engine: prefill, then per step {draft block -> verify block -> accept -> bonus}.

Sequences join and leave the running batch between steps (continuous batching, see scheduler.py).
One step runs one drafter pass and one target pass for the whole batch. The step's verify length k
(the newest token + k - 1 drafts) is forced by an integer block size or chosen per step ("auto",
verify_length.py); k = 1 skips the drafter. Block size 1 (or no drafter) is plain autoregressive
decoding through the same code, which makes it the fair baseline.

A step leaves the device only once: drafts, the target's choices (samples too), the accepted counts
and the cache lengths are computed there, and one copy brings back the tokens and counts. On CUDA the
passes run over fixed shapes as CUDA graphs (step_graphs.py), all captured when the engine starts.

Everything the engine runs, its start-up included, runs under torch.inference_mode: a pass that records
autograd history keeps its activations alive for as long as the cache it wrote (the engine's lifetime).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence as Seq

import torch

from dflash_contract.presets import AUTO_BLOCK_SIZE, DEFAULT_SPECULATIVE_SAMPLING, check_speculative_sampling

from .config import DFlashError
from .drafter import DFlashDrafter
from .drafter_context import DrafterContext
from .engine_sizes import (cache_capacity, check_sizes, context_in, default_kv_cache_tokens, injection_tokens,
                           verify_lengths)
from .block_manager import BlockManager
from .grammar import GrammarCompiler
from .logprobs import token_logprobs
from .penalties import apply_penalties, penalised
from .prefill_pacing import PrefillPacing
from .kv_cache import BLOCK_SIZE, null_padded
from .kv_injection.op import KERNEL_IS_FASTER
from .sampling import DraftSources, ProposalRule, SamplingParams, choose_tokens, to_device
from .scheduler import Occupancy, Scheduler
from .sequence import Sequence, Status
from .step_clock import PhaseTimer, StepClock
from .step_graphs import StepGraphs, batch_bucket, cuda_graphs_by_default, length_bucket, length_buckets
from .suffix_drafts import SharedResponses, SuffixDraft, drafts_of
from .target import TargetModel
from .token_choices import SampledRows, TokenChoices
from .verify_length import (StepCosts, StepPlan, VerifyLengthPolicy, device_signature, doubling, match_bucket,
                           profiled_costs)


@dataclass
class StepOutput:
    sequence: Sequence
    new_token_ids: list[int]
    acceptance_length: int | None = None  # accepted drafts + 1 for a verify step; None for a prefill
    # whether these tokens ended the sequence, fixed when made: a step may prefill a sequence and then verify
    # it, and only the second of its two outputs finishes it
    finished: bool = field(init=False)

    def __post_init__(self):
        self.finished = self.sequence.finished


class SpeculativeEngine:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None = None, *,
                 block_size: int | str | None = AUTO_BLOCK_SIZE, max_batch_size: int = 8,
                 max_context: int | None = None, decode: Callable[[list[int]], str] | None = None,
                 step_costs: StepCosts | None = None, static_shapes: bool | None = None,
                 draft_sharpness: float | None = None, speculative_sampling: str = DEFAULT_SPECULATIVE_SAMPLING,
                 kv_cache_tokens: int | None = None, prefix_caching: bool = True, prefill_chunk: int | None = None,
                 grammars: GrammarCompiler | None = None, suffix_drafts: bool = True, shared_suffix_tokens: int = 0,
                 learned_acceptance: dict | None = None):
        """block_size: an integer verifies that many tokens every step; "auto" (or None) picks each step's length up
        to the drafter's block (plain decoding without a drafter). step_costs: a cost profile to start "auto" from,
        used if it was made on this device and settled (else the engine profiles itself); learned_acceptance: what an
        engine of the same drafter learned of acceptance (VerifyLengthPolicy.learned). decode: token ids -> text,
        needed only for stop strings. static_shapes: run steps over fixed shapes, as CUDA graphs on a GPU (default: on
        CUDA unless DFLASH_CUDA_GRAPHS=0; on a CPU it only pads, which the tests use to check the graphs' functions).
        draft_sharpness: how exact sampling drafts (sampling.propose_tokens): 1 couples the drafter's sample to the
        target's, 0 drafts argmax; None: learned as the engine runs (sampling.ProposalRule). speculative_sampling: the
        method of sampled requests that name none (presets.SPECULATIVE_SAMPLING).
        max_context: a sequence's tokens at most (default: the target's max_position_embeddings), cut to what
        kv_cache_tokens hold for one: positions of KV memory for all sequences, in blocks of kv_cache.BLOCK_SIZE
        (default_kv_cache_tokens). prefix_caching: reuse the blocks of prompts seen before (off for A/B runs).
        prefill_chunk: prompt tokens a step prefills at most while some sequence decodes, paced (prefill_pacing.py),
        which keeps decoding during a long prompt (None: a prompt's whole uncached part in one pass). grammars: guided
        requests' compiler (grammar.py; None: they are refused). suffix_drafts: under "auto", rows may verify suffix
        drafts (suffix_drafts.py) where they pay more than the drafter's, also from shared_suffix_tokens of earlier
        outputs."""
        adaptive = block_size is None or block_size == AUTO_BLOCK_SIZE
        if adaptive:
            block_size = drafter.config.block_size if drafter is not None else 1
        check_sizes(drafter, block_size, max_batch_size, prefill_chunk)
        self.target, self.device = target, target.device
        self.drafter = drafter if block_size > 1 else None
        self.block_size, self.grammars = block_size, grammars
        max_context = min(max_context or 1 << 30, target.config.max_position_embeddings)
        blocks = -(-(kv_cache_tokens or default_kv_cache_tokens(max_batch_size, max_context, block_size)) // BLOCK_SIZE)
        self.max_context = context_in(blocks, max_context, block_size)
        self.prefill_chunk, self.pacing, self.decode = prefill_chunk, PrefillPacing(prefill_chunk), decode
        self.proposal_rule = ProposalRule(draft_sharpness)
        self.speculative_sampling = check_speculative_sampling(speculative_sampling)
        self.choices = TokenChoices(self.device, target.config.shape.vocab_size, block_size,
                                    frozenset(target.config.eos_token_ids), self.proposal_rule)
        self.capacity = cache_capacity(self.max_context, block_size)  # the most keys a pass reads
        self.target_cache = target.new_cache(blocks + 1)  # + the null block
        self.draft_cache = self.drafter.new_cache(blocks + 1) if self.drafter else None
        self.feature_layers = self.drafter.config.target_layer_ids if self.drafter else ()
        self.block_manager = BlockManager(blocks + 1, BLOCK_SIZE, prefix_caching)
        self.scheduler = Scheduler(max_batch_size, self.block_manager, block_size)
        self.last_step_seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}  # for latency metrics
        self.last_verify_length: int | None = None  # None: the last step verified nothing
        self.phases = PhaseTimer()  # the last step's wall time by phase (step_clock.py)
        self.static_shapes = static_shapes if static_shapes is not None else cuda_graphs_by_default(self.device)
        self.graphs = StepGraphs(capture=self.static_shapes and self.device.type == "cuda")
        self.offsets = torch.arange(block_size, device=self.device)  # positions within a block
        self.injection_tokens = injection_tokens(self.max_context, max_batch_size, block_size)
        self.context = DrafterContext(self.drafter, self.draft_cache, self.injection_tokens, self._tables, block_size)
        adaptive = adaptive and self.drafter is not None
        self.verify_lengths = verify_lengths(block_size, adaptive, self.static_shapes)
        self.policy, self.suffix_drafts = None, suffix_drafts and adaptive  # policy: "auto"'s, made by _start_up
        self.shared_responses = SharedResponses.of(shared_suffix_tokens if self.suffix_drafts else 0)
        self.draft_sources = DraftSources()  # every sequence's, summed since the engine started
        self._start_up(adaptive, step_costs, learned_acceptance)

    def _start_up(self, adaptive: bool, step_costs: StepCosts | None, learned_acceptance: dict | None) -> None:
        """What a request would otherwise wait on: KV-injection timings and graph captures on CUDA, the step
        profile of "auto" (and what it starts from of acceptance)."""
        with torch.inference_mode(), self._on_device():
            if self.device.type == "cuda":
                self._time_kv_injection()
            if self.graphs.capture:
                self._capture_graphs()
            if adaptive:
                if step_costs is None or step_costs.unsettled or step_costs.device != device_signature(self.device):
                    step_costs = self._profile_step_costs()
                self.policy = VerifyLengthPolicy(self.block_size, step_costs, self.verify_lengths)
                if learned_acceptance:
                    self.policy.start_from(learned_acceptance)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int], params: SamplingParams) -> Sequence:
        seq = self.new_sequence(prompt_ids, params)
        self.scheduler.add(seq)
        return seq

    def new_sequence(self, prompt_ids: Seq[int], params: SamplingParams) -> Sequence:
        """The request as a Sequence not yet queued, or DFlashError for one this engine cannot take. Reads only
        what is fixed at load time: any thread may call it while another steps the engine."""
        prompt_ids = [int(t) for t in prompt_ids]
        vocab = self.target.config.shape.vocab_size
        if not prompt_ids:
            raise DFlashError("empty prompt")
        if len(prompt_ids) >= self.max_context:
            raise DFlashError(f"prompt has {len(prompt_ids)} tokens; the context limit is {self.max_context} "
                              f"(including at least one generated token; the KV cache holds "
                              f"{self.block_manager.num_blocks * BLOCK_SIZE} tokens for all sequences)")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise DFlashError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop_strings and self.decode is None:
            raise DFlashError("stop strings need a tokenizer")
        grammar = None
        if params.guide is not None:
            if self.grammars is None:
                raise DFlashError("guided decoding needs the target's tokenizer and the xgrammar package, which this "
                                  "engine was built without")
            grammar = self.grammars.grammar(params.guide, self.choices.stop_ids(params))  # on the caller's thread
        return Sequence(prompt_ids, params.for_engine(self.speculative_sampling), grammar=grammar)

    def cancel(self, seq: Sequence) -> None:
        """End `seq` and free its blocks; those full and cached stay findable."""
        if not seq.finished:
            self.context.drop(seq)
            self.scheduler.finish(seq, "cancelled")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def occupancy(self) -> Occupancy:
        """Counts of running and waiting sequences, KV blocks, prefix-cache lookups; a snapshot."""
        return self.scheduler.occupancy()

    def kv_cache_summary(self) -> str:
        """The KV memory in words, for start-up lines."""
        blocks = self.block_manager
        bytes_per_block = sum(2 * c.k[:, 0].numel() * c.k.element_size()  # K and V of every layer
                              for c in (self.target_cache, self.draft_cache) if c is not None)
        return (f"KV cache {blocks.num_blocks * blocks.block_size} tokens ({blocks.num_blocks} blocks of "
                f"{blocks.block_size}, {blocks.num_blocks * bytes_per_block / 2 ** 20:.0f} MiB), prefix caching "
                f"{'on' if blocks.prefix_caching else 'off'}, prefill chunk {self.prefill_chunk or 'off'}")

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        """Run requests to completion; results come back in the order of `prompts`."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return seqs

    # -- one scheduling step ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit waiting sequences and prefill (a chunk of) their prompts, then one draft + verify pass for the
        running sequences whose prompts are in."""
        with torch.inference_mode(), self._on_device():
            self.phases.start()
            self.last_step_seconds = dict.fromkeys(self.last_step_seconds, 0.0)
            self.last_verify_length = None
            outputs = self._prefill_step()
            batch = self.scheduler.reserve([s for s in self.scheduler.running if not s.prefilling])
            for seq in [s for s in self.context.pending if s.status is not Status.RUNNING]:  # preempted: recomputed
                self.context.drop(seq)
            if batch:
                suffix = self._suffix_drafts(batch)
                self.phases.lap("propose")
                plan = self._plan(batch, suffix)
                stalls = self._stalls()
                self.phases.lap("schedule")
                chosen = self._speculate(batch, plan, suffix)
                decoding = self.last_step_seconds["draft"] + self.last_step_seconds["verify"]
                self.pacing.decoded(decoding)
                if self.policy is not None and self._stalls() == stalls:  # a stalled step would teach a false cost
                    self.policy.costs.observe(len(batch), plan.k, decoding, plan.drafted)
                for i, (seq, (tokens, accepted, logprobs)) in enumerate(zip(batch, chosen)):
                    seq.num_computed += accepted + 1  # the accepted drafts and the token before them
                    committed = self._commit(seq, tokens, logprobs)
                    self._record(seq, accepted, plan, suffix[i] if i in plan.suffix_rows else None, len(committed))
                    outputs.append(StepOutput(seq, committed, seq.stats.acceptance_lengths[-1]))
                self.last_verify_length = plan.k
                self.phases.lap("commit")
            self.phases.lap("schedule")
            return outputs

    def _prefill_step(self) -> list[StepOutput]:
        """Admit waiting sequences while batch places and KV blocks allow, then prefill (chunks of) the prompts of
        admitted sequences in one pass, oldest first, within the step's budget (_prefill_budget). A sequence whose
        prompt is in gets its first token."""
        budget = self._prefill_budget()
        for _ in self.scheduler.admit():  # by places and blocks, not by this step's budget: they prefill in turn
            pass
        parts = []  # (sequence, end of the tokens this pass writes)
        for seq in [s for s in self.scheduler.running if s.prefilling]:
            end = int(min(seq.prefill_end, seq.num_computed + budget))
            if end <= seq.num_computed:
                break
            parts.append((seq, end))
            budget -= end - seq.num_computed
        self.phases.lap("schedule")
        if not parts:
            return []
        tokens = sum(end - seq.num_computed for seq, end in parts)
        firsts = self._prefill(parts)
        self.pacing.prefilled(tokens, self.last_step_seconds["prefill"])
        outputs = [StepOutput(seq, self._commit(seq, first, logprobs))
                   for (seq, _), (first, logprobs) in zip(parts, firsts) if first]
        self.phases.lap("commit")
        return outputs

    def _prefill_budget(self) -> float:
        """Prompt tokens this step prefills at most: while some sequence decodes (its step waits for the pass),
        prefill_chunk or fewer, as the pace allows (prefill_pacing.py); else a whole context's worth (nobody waits;
        a burst's prompts fill the batch at once)."""
        if not self.prefill_chunk:
            return float("inf")
        decoding = any(not s.prefilling for s in self.scheduler.running)
        return self.pacing.tokens() if decoding else max(self.prefill_chunk, self.max_context)

    def _on_device(self):
        """On CUDA, self.device as the current device: an engine on cuda:1 launches its kernels and graphs
        there whatever device the calling thread has current."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _suffix_drafts(self, batch: list[Sequence]) -> list[SuffixDraft | None]:
        if not self.suffix_drafts:
            return [None] * len(batch)
        return drafts_of(batch, [min(self.block_size, self._remaining(s)) - 1 for s in batch], self.shared_responses)

    def _plan(self, batch: list[Sequence], suffix: list[SuffixDraft | None]) -> StepPlan:
        if self.policy is None:
            return StepPlan(self.block_size, self.block_size > 1)
        policy = self.policy
        expected = [policy.expected(s.params.acceptance_kind, s.stats, self._remaining(s)) for s in batch]
        with_suffix = [draft and policy.suffix_expected(s.params.acceptance_kind, s.stats, draft, self._remaining(s))
                       for s, draft in zip(batch, suffix)]
        return policy.choose(expected, with_suffix)

    def _remaining(self, seq: Sequence) -> int:
        return min(seq.params.max_new_tokens - len(seq.output_ids), self.max_context - seq.num_tokens)

    def _record(self, seq: Sequence, accepted: int, plan: StepPlan, suffix: SuffixDraft | None, emitted: int) -> None:
        """Speculation statistics of one sequence's step, counting only what it emitted: a step cut
        short by a stop or max_tokens counts its tokens, and says nothing of the drafts after them. suffix: the
        row's suffix draft where it verified that."""
        drafted = plan.k - 1
        if emitted == accepted + 1:
            reached = min(drafted, accepted + 1)
        else:
            accepted = reached = max(emitted - 1, 0)  # 0 emitted: a guided sequence whose grammar took none
        if suffix is not None:
            source, own = "suffix", min(len(suffix.tokens), drafted)
        else:
            source, own = ("drafter", drafted) if plan.drafted else ("none", 0)
        seq.stats.record(accepted, drafted, reached, source, own)
        self.draft_sources.count(source, own, min(accepted, own))
        kind = seq.params.acceptance_kind
        if source == "drafter" and self.policy is not None:
            self.policy.acceptance[kind].observe(accepted, reached)
        elif source == "suffix":
            self.policy.suffix[kind, match_bucket(suffix.match_length)].observe(min(accepted, own), min(reached, own))

    def _prefill(self, parts: list[tuple[Sequence, int]]) -> list[tuple[list[int], list | None]]:
        """One target pass over tokens [seq.num_computed, end) of each (seq, end), after what the cache holds;
        returns each one's first output token (as a list) if its prompt is now in, else nothing, and its
        log-probabilities where asked for.

        Rows are padded to the longest part; a padding token sits past its row's end, where no query of the row
        looks, in the row's own blocks or the null block, and is overwritten before it is ever read."""
        seqs = [seq for seq, _ in parts]
        starts, widths = [seq.num_computed for seq in seqs], [end - seq.num_computed for seq, end in parts]
        width = max(widths)
        table = self._tables(seqs, max(starts) + width)
        tokens = self._to_device([seq.token_ids[start:end] + [0] * (width - (end - start))
                                  for (seq, end), start in zip(parts, starts)])
        positions = self._to_device(starts)[:, None] + torch.arange(width, device=self.device)
        logits_at = self._to_device([w - 1 for w in widths])
        self.phases.lap("inputs")
        clock = StepClock(self.device)
        logits, features = self.target(tokens, positions, self.target_cache, table, self.feature_layers,
                                       logits_at=logits_at, length=max(starts) + width,
                                       causal=not any(starts) and min(widths) == width)  # whole prompts alike
        self.phases.lap("prefill pass")
        if self.drafter is not None:
            self.context.write(features, positions, table)
            self.phases.lap("context pass")
        clock.mark()
        firsts = []
        for row, (seq, end) in enumerate(parts):
            seq.num_computed = end
            firsts.append(([], None))
            if end == len(seq.prompt_ids) and not seq.output_ids:
                self.choices.hold_stop_tokens(logits, [seq], [row])
                if penalised(seq.params):
                    apply_penalties(logits[row], None, seq.prompt_ids, [], seq.params)
                self.choices.mask_guided(logits, [(seq, row, [])] if seq.grammar is not None else [])
                first = choose_tokens(logits[row], seq.params, end)  # reads the device: the clock's marks are done
                wanted = seq.params.logprobs is not None
                firsts[-1] = first, token_logprobs(logits[row], torch.tensor(first), seq.params) if wanted else None
        self.phases.lap("sample")
        seconds, = clock.intervals()
        for seq in seqs:
            seq.stats.verify_seconds += seconds
        self.last_step_seconds["prefill"] += seconds
        self.phases.lap("stats")
        return firsts

    def _speculate(self, batch: list[Sequence], plan: StepPlan,
                   suffix: list[SuffixDraft | None]) -> list[tuple[list[int], int, list | None]]:
        """One verify pass of length plan.k for the whole batch, after a draft pass where the plan says so; the rows
        of plan.suffix_rows verify their suffix draft (padded with the drafter's or zeros). Returns per sequence
        its accepted drafts plus the target's token after them (the bonus), before any stop condition, how many
        drafts were accepted, and where asked for each block position's log-probabilities (logprobs.py)."""
        k = plan.k
        num_rows = batch_bucket(len(batch), self.scheduler.num_slots) if self.static_shapes else len(batch)
        row_of = list(range(len(batch)))  # rows past the batch (static shapes) pad: token 0 at position 0
        inputs = self._to_device([[s.output_ids[-1], s.last_position] for s in batch] + [[0, 0]] * (num_rows - len(batch)))
        tokens, starts = inputs[:, :1], inputs[:, 1]
        context = max(s.last_position for s in batch)  # the longest committed context, in tokens
        draft_length = self._length(context + self.block_size) if plan.drafted else 0
        verify_length = self._length(context + k)
        table = self._tables(batch + [None] * (num_rows - len(batch)), max(draft_length, verify_length))
        lap = self.phases.lap
        lap("inputs")
        clock = StepClock(self.device)
        sampled = self.choices.sampled_rows(batch, row_of, starts, k)
        lap("sample")
        block, draft_logits = self._block(batch, row_of, plan, suffix, tokens, starts, table, draft_length, sampled)
        lap("propose")
        clock.mark()
        key = ("verify", num_rows, k, verify_length)
        guided = self.choices.guided_rows(batch, row_of, block)  # before the pass: a copy after it would wait for it
        lap("grammar")
        logits, features = self.graphs.run(key, self._pass(key), block, starts, self._table_for(table, verify_length))
        lap("verify pass")
        self.choices.hold_stop_tokens(logits, batch, row_of)
        for seq, row in zip(batch, row_of):
            if penalised(seq.params):
                apply_penalties(logits[row], block[row], seq.prompt_ids, seq.output_ids, seq.params)
        lap("penalties")
        self.choices.mask_guided(logits, guided)
        lap("grammar")
        chosen = self.choices.choose(logits, block, draft_logits, sampled)
        accepted = (block[:, 1:] == chosen[:, :-1]).cumprod(dim=1).sum(dim=1)
        lap("accept")
        # block[0..a] are now committed context (the step's caller counts them); the bonus token's K/V comes
        # with the next block
        positions = starts[:, None] + self.offsets[:k]
        if plan.drafted:
            self.context.write(features, positions, table)
        lap("context pass")
        clock.mark()
        result = torch.cat([chosen, accepted[:, None]], dim=1).tolist()  # the step's device-to-host copy
        lap("copy")
        if not plan.drafted:
            self.context.defer(features, positions, [(seq, row, result[row][-1]) for seq, row in zip(batch, row_of)])
            lap("context pass")
        self.last_step_seconds["draft"], self.last_step_seconds["verify"] = clock.intervals()
        for seq in batch:
            seq.stats.draft_seconds += self.last_step_seconds["draft"]
            seq.stats.verify_seconds += self.last_step_seconds["verify"]
        lap("stats")
        logprobs = {row: token_logprobs(logits[row], chosen[row], seq.params)
                    for seq, row in zip(batch, row_of) if seq.params.logprobs is not None}
        lap("logprobs")
        return [(result[r][:result[r][-1] + 1], result[r][-1], logprobs.get(r)) for r in row_of]

    def _block(self, batch: list[Sequence], row_of: list[int], plan: StepPlan, suffix: list[SuffixDraft | None],
               tokens: torch.Tensor, starts: torch.Tensor, table: torch.Tensor, draft_length: int,
               sampled: SampledRows | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block [R, k] to verify: each row's newest token (tokens [R, 1]), then k - 1 drafts: the drafter's
        where it runs (its logits returned too; its pass reads draft_length keys), a suffix row's own over them,
        zeros where a row has none."""
        k, num_rows = plan.k, len(tokens)
        block, draft_logits = tokens, None
        if plan.drafted:
            self.context.flush(batch)
            self.phases.lap("context pass")
            key = ("draft", num_rows, k, draft_length)
            draft_logits = self.graphs.run(key, self._pass(key), tokens, starts, self._table_for(table, draft_length))
            self.phases.lap("draft pass")
            block = torch.cat([tokens, self.choices.drafts(batch, row_of, draft_logits, sampled)], dim=1)
        elif k > 1:
            block = torch.cat([tokens, tokens.new_zeros(num_rows, k - 1)], dim=1)
        if plan.suffix_rows:
            places = [(row_of[i], j + 1, token)
                      for i in plan.suffix_rows for j, token in enumerate(suffix[i].tokens[:k - 1])]
            rows, columns, values = self._to_device(list(zip(*places)))
            block[rows, columns] = values
        return block, draft_logits

    def _tables(self, batch: list[Sequence | None], length: int) -> torch.Tensor:
        """The block tables [len(batch), W] of sequences (None: a padding row) for passes reading `length` keys."""
        width = -(-length // BLOCK_SIZE)
        return self._to_device(null_padded([s.block_table if s else [] for s in batch], width))

    @staticmethod
    def _table_for(table: torch.Tensor, length: int) -> torch.Tensor:
        """The columns of `table` a pass reading `length` keys uses (its graph's input shape)."""
        return table[:, :-(-length // BLOCK_SIZE)]

    def _length(self, keys: int) -> int:
        return length_bucket(keys, self.capacity) if self.static_shapes else keys

    def _pass(self, key: tuple) -> Callable:
        """The pass of a graph key ("draft" or "verify", R, k, key length): a function of (tokens [R, 1] or
        block [R, k], starts [R], block tables [R, W])."""
        name, _, k, length = key
        if name == "draft":
            return partial(self._draft_pass, length=length, k=k)
        return partial(self._verify_pass, length=length)

    def graph_keys(self) -> list[tuple]:
        """Every (pass, R, k, key length) a step can run with static shapes, at most graphs.max_graphs of them:
        if there are more, small batches and short contexts are kept (they are the launch-bound ones; the
        others run eagerly). Largest first, the order to capture them in."""
        keys = [(name, rows, k, length) for rows in doubling(self.scheduler.num_slots) for k in self.verify_lengths
                for length in length_buckets(self.capacity)
                for name in (("draft", "verify") if k > 1 else ("verify",))]
        kept = sorted(keys, key=lambda key: (key[1], key[3]))[:self.graphs.max_graphs]
        return sorted(kept, key=lambda key: (key[1], key[2], key[3]), reverse=True)

    def _capture_graphs(self) -> None:
        """Capture every graph a step can need now, on dummy rows whose tables hold only the null block (what
        the captures write there is never read)."""
        def dummy_inputs(name: str, rows: int, k: int, length: int) -> tuple[torch.Tensor, ...]:
            first = torch.zeros((rows, 1 if name == "draft" else k), dtype=torch.long, device=self.device)
            starts = torch.zeros(rows, dtype=torch.long, device=self.device)
            return first, starts, self._tables([None] * rows, length)

        self.graphs.capture_all((key, self._pass(key), dummy_inputs(*key)) for key in self.graph_keys())

    def _time_kv_injection(self) -> None:
        """Let the KV-injection op time its kernel against the reference (op.py) now, for every token count
        a prefill, a step or deferred context may bring: each timing is a stall a request would wait on."""
        if self.drafter is None:
            return
        width = len(self.feature_layers) * self.target.config.shape.hidden_size
        for n in doubling(self.injection_tokens):
            features = torch.zeros((1, n, width), dtype=self.target.dtype, device=self.device)
            positions = torch.arange(n, device=self.device)[None]
            self.drafter.inject_context(features, positions, self.draft_cache, self._tables([None], n))

    def _stalls(self) -> int:
        """Graph captures and KV-injection timings so far: a step during which either happened ran slow once."""
        return self.graphs.captures + len(KERNEL_IS_FASTER)

    def _draft_pass(self, tokens: torch.Tensor, starts: torch.Tensor, table: torch.Tensor, *,
                    length: int, k: int) -> torch.Tensor:
        """The drafter's logits [R, k - 1, V] for the block positions after each row's newest token.

        The drafter always sees its whole block (its attention within the block is bidirectional, as
        trained); only the guesses to verify go through the LM head, the costly part on a large vocab."""
        masks = torch.full((len(tokens), self.block_size - 1), self.drafter.config.mask_token_id, device=self.device)
        embeddings = self.target.embed(torch.cat([tokens, masks], dim=1))
        positions = starts[:, None] + self.offsets
        hidden = self.drafter(embeddings, positions, self.draft_cache, table, length)
        return self.target.lm_head(hidden[:, 1:k])

    def _verify_pass(self, block: torch.Tensor, starts: torch.Tensor, table: torch.Tensor, *,
                     length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over each row's block: logits [R, k, V] and the drafter's features of the block."""
        positions = starts[:, None] + self.offsets[:block.shape[1]]
        return self.target(block, positions, self.target_cache, table, self.feature_layers, length=length)

    def _cacheable(self, seq: Sequence) -> int:
        """Tokens of `seq` whose target K/V and drafter context are both written."""
        return min(seq.num_computed - self.context.pending_tokens(seq), seq.num_tokens)

    def _cache_blocks(self, seq: Sequence) -> None:
        """Enter `seq`'s newly full blocks into the prefix cache. Called after every step: the token list is built
        only when a block has filled."""
        written = self._cacheable(seq)
        if self.block_manager.prefix_caching and written // BLOCK_SIZE > len(seq.block_hashes):
            self.block_manager.cache_full_blocks(seq.block_table, seq.block_hashes, seq.token_ids, written)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End `seq`, entering its full blocks into the prefix cache first (its deferred context written, so
        that a conversation's next turn finds its answer too)."""
        if self.block_manager.prefix_caching and self.drafter is not None:
            self.context.flush([seq])
        self.context.drop(seq)
        self._cache_blocks(seq)
        if self.shared_responses is not None:
            self.shared_responses.add(seq.output_ids)
        self.scheduler.finish(seq, reason)

    def _profile_step_costs(self) -> StepCosts:
        """Seconds of a step at each verify length for batch sizes 1, 2, 4, ... max_batch_size, with and without
        the drafter's pass (what a step verifying suffix drafts costs), timed in rounds (verify_length.
        profiled_costs) on short dummy sequences that are dropped afterwards (a few seconds on a CPU)."""
        vocab, prompt_length = self.target.config.shape.vocab_size, min(16, self.max_context - 1)

        def time_step(batch_size: int, k: int) -> tuple[float, float]:
            if len(self.scheduler.running) != batch_size:  # a new batch size: the last one's dummies go
                for seq in list(self.scheduler.running):
                    self.scheduler.finish(seq, "cancelled")
                for _ in range(batch_size):
                    self.scheduler.add(Sequence([t % vocab for t in range(prompt_length)], SamplingParams()))
                for seq in self.scheduler.admit():  # not committed: a dummy may not stop
                    seq.output_ids += self._prefill([(seq, prompt_length)])[0][0]
            batch = list(self.scheduler.running)
            self._speculate(batch, StepPlan(k, k > 1), [None] * batch_size)
            seconds = self.last_step_seconds
            return seconds["draft"] + seconds["verify"], seconds["verify"]

        costs = profiled_costs(device_signature(self.device), doubling(self.scheduler.num_slots),
                               doubling(self.block_size), time_step)
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq, "cancelled")
        self.block_manager.queried_tokens = self.block_manager.hit_tokens = 0  # the dummies' lookups are not traffic
        return costs

    def _to_device(self, data) -> torch.Tensor:
        return to_device(data, self.device)

    # -- postprocessing -----------------------------------------------------------------------
    def _commit(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> list[int]:
        """Append tokens up to the first stop condition, finishing `seq` there; returns what was appended. A guided
        sequence whose grammar has ended (or takes no more: min_tokens held its only stop) stops before the token."""
        p = seq.params
        stop_ids = self.choices.stop_ids(p)
        for n, token in enumerate(tokens, 1):
            if seq.grammar is not None and not seq.grammar.accept(token):
                self._finish(seq, "stop")
                return tokens[:n - 1]
            seq.output_ids.append(token)
            if logprobs is not None:
                seq.logprobs.append(logprobs[n - 1])
            stops = len(seq.output_ids) > p.min_new_tokens  # before, none applies (stop ids could not be chosen)
            if stops and (token in stop_ids or (p.stop_strings and self._matches_stop_string(seq))):
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.max_context:
                self._finish(seq, "length")
            if seq.finished:
                return tokens[:n]
        self._cache_blocks(seq)
        return tokens

    def _matches_stop_string(self, seq: Sequence) -> bool:
        # Only the tail can hold a new match: the longest stop string plus a few tokens of slack.
        window = max(map(len, seq.params.stop_strings)) + 8
        tail = self.decode(seq.output_ids[-window:])
        return any(stop in tail for stop in seq.params.stop_strings)

