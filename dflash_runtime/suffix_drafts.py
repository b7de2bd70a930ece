"""Draft-free drafts: the continuation of the longest earlier occurrence of a request's own recent text.

When an answer repeats what its prompt or its own output already holds (code edits, rewrites, quotes, lists,
later turns of a conversation), the tokens that followed the earlier occurrence are a good guess, and making it
costs no drafter pass. This is SuffixDecoding's rule (arXiv 2411.04975) on one request's tokens: find the longest
suffix of the text (up to MAX_MATCH tokens) that occurred before, then walk forward through its earlier
occurrences at once (the MAX_OCCURRENCES most recent), taking at each position the most frequent next token
(ties: the most recent occurrence's) and estimating its probability as that token's share of the occurrences
still agreeing; stop when the path's probability falls below MIN_PROBABILITY. The path's cumulative
probabilities are the draft's score: their sum is the expected number of accepted drafts by the text's own counts
(verify_length.suffix_rates weighs them with what was measured).

The index is the request's tokens in a numpy array that grows with it (4 bytes a token, within its context); one
proposal is a vectorised scan of it, tens of microseconds for a few thousand tokens. Drafts come only from the
request's own prompt and output: nothing crosses between requests.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

MAX_MATCH = 32  # the longest suffix matched (SuffixDecoding's tree depth bounds it the same way)
MIN_PROBABILITY = 0.1  # a draft stops where its path's estimated probability falls below this
# the continuation is counted over this many of the match's most recent occurrences at most: a text that repeats
# one token thousands of times costs a step no more than a few
MAX_OCCURRENCES = 64


@dataclass
class SuffixDraft:
    tokens: list[int]
    probabilities: list[float]  # per draft position: the estimated probability that it and all before it are right
    match_length: int  # tokens of the text's suffix that the earlier occurrences share


class TokenHistory:
    """A request's tokens (prompt, then output), appended as they are committed."""

    def __init__(self):
        self.tokens = np.zeros(64, dtype=np.int32)
        self.length = 0

    def sync(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Append what the request committed since the last call (its lists only grow)."""
        total = len(prompt_ids) + len(output_ids)
        if total <= self.length:
            return
        new = (prompt_ids + output_ids)[self.length:] if self.length < len(prompt_ids) else \
            output_ids[self.length - len(prompt_ids):]
        if total > len(self.tokens):
            self.tokens = np.resize(self.tokens, max(total, 2 * len(self.tokens)))
        self.tokens[self.length:total] = new
        self.length = total

    def propose(self, max_tokens: int, max_match: int = MAX_MATCH,
                min_probability: float = MIN_PROBABILITY) -> SuffixDraft | None:
        """The draft after the text's longest repeated suffix (see the module's docstring), or None where the
        newest token never occurred before or no continuation is likely enough."""
        text, n = self.tokens[:self.length], self.length
        if n < 2 or max_tokens < 1:
            return None
        ends = np.flatnonzero(text[:n - 1] == text[n - 1])  # earlier occurrences of the newest token
        if not ends.size:
            return None
        ends, match = _longest_match(text, ends, max_match)
        ends = ends[-MAX_OCCURRENCES:]
        tokens, probabilities, probability = [], [], 1.0
        follow = (ends + 1).tolist()  # where each occurrence's continuation is; all < n
        while len(tokens) < max_tokens and follow:
            if len(follow) == 1:  # one occurrence left: its continuation, at the path's probability
                rest = text[follow[0]:follow[0] + max_tokens - len(tokens)].tolist()
                tokens += rest
                probabilities += [probability] * len(rest)
                break
            counts = Counter(int(text[i]) for i in follow)
            best = max(counts.values())
            token = next(int(text[i]) for i in reversed(follow) if counts[int(text[i])] == best)  # ties: most recent
            probability *= best / len(follow)
            if probability < min_probability:
                break
            tokens.append(token)
            probabilities.append(probability)
            follow = [i + 1 for i in follow if text[i] == token and i + 1 < n]
        return SuffixDraft(tokens, probabilities, match) if tokens else None


FEW = 16  # occurrences compared whole at once, not position by position


def _longest_match(text: np.ndarray, ends: np.ndarray, max_match: int) -> tuple[np.ndarray, int]:
    """The earlier occurrences (their last positions, ascending) that share the longest suffix with the text, up to
    max_match tokens, and that length. ends: those that share its newest token."""
    n, match = len(text), 1
    while match < max_match and ends.size > FEW:  # many: narrowed one position back at a time
        room = ends[ends >= match]
        longer = room[text[room - match] == text[n - 1 - match]]
        if not longer.size:
            return ends, match
        ends, match = longer, match + 1
    if match == max_match:
        return ends, match
    # few: each one's whole agreement at once, positions match .. max_match - 1 back
    back = np.arange(match, max_match)
    before = ends[:, None] - back
    agree = (before >= 0) & (text[np.maximum(before, 0)] == text[np.maximum(n - 1 - back, 0)])  # before < n - 1 - back
    lengths = match + np.cumprod(agree, axis=1).sum(axis=1)
    longest = lengths.max()
    return ends[lengths == longest], int(longest)
