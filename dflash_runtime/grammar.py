"""Guided decoding in the engine: guides compiled to grammars by xgrammar, a matcher per sequence, token masks.

A guided sequence's every token is chosen under the mask its grammar gives after the tokens before it. In a
verify step the target's token at block position j follows the newest token and drafts 1..j, so position j is
masked by the grammar's state after those drafts: the drafts are accepted into the matcher one by one, each
position's mask filled, then rolled back (xgrammar's speculative decoding recipe, vLLM's 1 + K masks). The drafts
themselves are grammatical (token_choices.TokenChoices.drafts), so every prefix the target verifies is one the
grammar allows, and guided DFlash chooses what guided plain decoding chooses, token for token.

xgrammar is imported here only: an engine without it serves every unguided request, and refuses a guided one
saying what is missing.
"""
from __future__ import annotations

import concurrent.futures
from typing import Iterable

import torch

from .config import DFlashError
from dflash_contract.guided_decoding import GUIDE_INPUT, Guide

# A guide's compile time limit: a schema or regex whose grammar takes longer is refused, and the engine keeps
# serving (the compile runs on a thread of its own; xgrammar caches grammars by content, so a guide seen before
# compiles in microseconds). Typical schemas compile in milliseconds.
COMPILE_SECONDS = 10.0
COMPILE_THREADS = 2  # concurrent compiles; more wait their turn within the limit


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise DFlashError(f"guided decoding needs the xgrammar package ({e}): pip install xgrammar") from None
    return xgrammar


class GrammarCompiler:
    """Guides -> grammars for one tokenizer, off the caller's thread and within COMPILE_SECONDS."""

    def __init__(self, tokenizer_info, compile_seconds: float = COMPILE_SECONDS):
        xgr = _xgrammar()
        self.vocab_size = tokenizer_info.vocab_size
        self.special_token_ids = frozenset(tokenizer_info.special_token_ids)
        self.compile_seconds = compile_seconds
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=COMPILE_THREADS)
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> "GrammarCompiler":
        """The compiler of a transformers tokenizer; vocab_size: the target's logits' (it may pad the tokenizer's)."""
        xgr = _xgrammar()
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_token_ids)))

    def compile(self, guide: Guide):
        """The compiled grammar of `guide`; DFlashError naming the guide if it does not compile in time."""
        future = self._pool.submit(self._compile, guide)
        try:
            return future.result(timeout=self.compile_seconds)
        except concurrent.futures.TimeoutError:
            raise DFlashError(f"{GUIDE_INPUT}: the {guide.type} guide did not compile within "
                              f"{self.compile_seconds:g} s") from None
        except RuntimeError as e:  # xgrammar's refusals: a bad schema, regex or grammar
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise DFlashError(f"{GUIDE_INPUT}: the {guide.type} guide does not compile: {_plain(detail)}") from None

    def _compile(self, guide: Guide):
        if guide.type == "json":
            return self._compiler.compile_builtin_json_grammar()
        if guide.type == "json_schema":
            return self._compiler.compile_json_schema(guide.text, any_whitespace=False)
        if guide.type == "regex":
            return self._compiler.compile_regex(guide.text)
        return self._compiler.compile_grammar(guide.text)

    def grammar(self, guide: Guide, stop_token_ids: Iterable[int]) -> "SequenceGrammar":
        return SequenceGrammar(self.compile(guide), self.vocab_size, stop_token_ids, self.special_token_ids)


def _plain(message: str) -> str:
    """xgrammar's message without its log prefix ("[13:31:10] /project/cpp/x.cc:83: ")."""
    head, sep, rest = message.partition(": ")
    return rest if sep and head.startswith("[") and ".cc:" in head else message


class SequenceGrammar:
    """One sequence's grammar state: it has accepted every token the sequence committed."""

    def __init__(self, compiled, vocab_size: int, stop_token_ids: Iterable[int], special_token_ids: frozenset[int]):
        xgr = _xgrammar()
        stops = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        # never in a grammar's text: refused here, where xgrammar would log a warning for each one a drafter guessed
        self.refused = special_token_ids.difference(stops)
        # no stop id (ignore_eos): the grammar ends where its text does, and the sequence stops there
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                          terminate_without_stop_token=not stops)

    def accept(self, token: int) -> bool:
        """Take `token`; False (nothing changed) if the grammar refuses it."""
        return token not in self.refused and self.matcher.accept_token(token)

    def first_refused(self, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> int | None:
        """The index j of the first draft the grammar refuses after those before it, with its position's mask in
        bitmask[first_row + j]; None if it takes them all (or ends before one). The state is left as it was."""
        taken, refused = 0, None
        for j, token in enumerate(drafts):
            if self.matcher.is_terminated():
                break
            if not self.accept(token):
                self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
                refused = j
                break
            taken += 1
        self.matcher.rollback(taken)
        return refused

    def fill_along(self, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> list[int]:
        """Fill bitmask rows first_row + j with the mask after drafts[:j], for j = 0.. while the grammar runs; the
        rows filled (offsets j). Positions past its end are left unmasked: nothing there can be committed."""
        filled, taken = [], 0
        for j in range(len(drafts) + 1):
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
            filled.append(j)
            if j == len(drafts) or not self.accept(drafts[j]):
                break
            taken += 1
        self.matcher.rollback(taken)
        return filled


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Host bitmasks [rows, ceil(V / 32)] with every token allowed."""
    return _xgrammar().allocate_token_bitmask(rows, vocab_size)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Refused tokens of logits [N, V] get -inf in `rows`, by bitmask's rows of the same indices, in place."""
    if rows:
        _xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
