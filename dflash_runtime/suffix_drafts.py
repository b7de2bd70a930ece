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
proposal is a vectorised scan of it, tens of microseconds for a few thousand tokens. By default drafts come only
from the request's own prompt and output. Where the operator asks (SharedResponses), the same search also runs over
earlier requests' outputs, a bounded ring, and the draft of the longer match wins: an agent re-emitting a file, a
retried request, a template answered again. A draft never changes an answer, but how fast an answer
comes tells whether similar text was generated before: across tenants, a timing side channel.
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
MIN_SHARED_MATCH = 8  # tokens a match in earlier responses needs to be drafted from
SEPARATOR = -1  # between responses in SharedResponses' ring: no token equals it, so no match crosses it


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

    def propose(self, max_tokens: int, shared: SharedResponses | None = None, max_match: int = MAX_MATCH,
                min_probability: float = MIN_PROBABILITY) -> SuffixDraft | None:
        """The draft after the text's longest repeated suffix (see the module's docstring), or None where the
        newest token never occurred before or no continuation is likely enough. With `shared`, the draft after
        the query's occurrences in earlier responses where those match a longer suffix (at least MIN_SHARED_MATCH
        tokens: a short match among many answers is chance), on a tie the one whose estimate (the sum of its
        probabilities) is higher; on a second tie, the request's own."""
        text, n = self.tokens[:self.length], self.length
        if n < 1 or max_tokens < 1:
            return None
        own = _draft(text, np.flatnonzero(text[:n - 1] == text[n - 1]), text, max_tokens, max_match, min_probability)
        other = shared.propose(text, max_tokens, max_match, min_probability) if shared is not None else None
        if other is None or other.match_length < MIN_SHARED_MATCH:
            return own
        return own if own is not None and _strength(own) >= _strength(other) else other


class SharedResponses:
    """Earlier requests' outputs for suffix drafts across requests: a ring of `capacity` tokens (4 bytes each), each
    response followed by SEPARATOR, the newest overwriting the oldest. One thread (the engine's) uses it. Positions
    stand for recency (the search's ties and MAX_OCCURRENCES); once the ring wraps, the oldest answers left count as
    the most recent: a draft is a guess either way, never an answer."""

    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError(f"a shared suffix store holds 2 tokens at least, got {capacity}")
        self.tokens = np.full(capacity, SEPARATOR, dtype=np.int32)
        self.position = 0  # where the next response is written
        self.held = 0  # tokens of responses in the ring (a metric)

    @classmethod
    def of(cls, capacity: int) -> SharedResponses | None:
        """A store of `capacity` tokens; None for 0 (drafts from a request's own text only)."""
        return cls(capacity) if capacity else None

    def add(self, tokens: list[int]) -> None:
        """A finished request's output (its last capacity - 1 tokens)."""
        tokens = tokens[-(len(self.tokens) - 1):]
        if not tokens:
            return
        if self.position + len(tokens) >= len(self.tokens):  # no room before the end: the rest of the ring is idle
            self._overwrite(self.position, len(self.tokens))
            self.position = 0
        end = self.position + len(tokens)
        self._overwrite(self.position, end + 1)
        self.tokens[self.position:end] = tokens
        self.held += len(tokens)
        self.position = end + 1

    def propose(self, query: np.ndarray, max_tokens: int, max_match: int = MAX_MATCH,
                min_probability: float = MIN_PROBABILITY) -> SuffixDraft | None:
        """The draft after the query's longest suffix found in earlier responses (TokenHistory.propose's rule)."""
        return _draft(self.tokens, np.flatnonzero(self.tokens == query[-1]), query, max_tokens, max_match,
                      min_probability)

    def _overwrite(self, start: int, end: int) -> None:
        self.held -= int(np.count_nonzero(self.tokens[start:end] != SEPARATOR))
        self.tokens[start:end] = SEPARATOR


def _strength(draft: SuffixDraft) -> tuple[int, float]:
    return draft.match_length, sum(draft.probabilities)


def _draft(corpus: np.ndarray, ends: np.ndarray, query: np.ndarray, max_tokens: int, max_match: int,
           min_probability: float) -> SuffixDraft | None:
    """The draft after the occurrences in `corpus` of the query's longest suffix; ends: the positions in corpus of
    the query's newest token (a request's own text is both, its newest token left out of ends)."""
    if not ends.size:
        return None
    ends, match = _longest_match(corpus, query, ends, max_match)
    ends, n = ends[-MAX_OCCURRENCES:], len(corpus)
    tokens, probabilities, probability = [], [], 1.0
    follow = [i for i in (ends + 1).tolist() if i < n and corpus[i] != SEPARATOR]  # where each continuation is
    while len(tokens) < max_tokens and follow:
        if len(follow) == 1:  # one occurrence left: its continuation, at the path's probability
            rest = corpus[follow[0]:follow[0] + max_tokens - len(tokens)].tolist()
            rest = rest[:rest.index(SEPARATOR)] if SEPARATOR in rest else rest
            tokens += rest
            probabilities += [probability] * len(rest)
            break
        counts = Counter(int(corpus[i]) for i in follow)
        best = max(counts.values())
        token = next(int(corpus[i]) for i in reversed(follow) if counts[int(corpus[i])] == best)  # ties: most recent
        probability *= best / len(follow)
        if probability < min_probability:
            break
        tokens.append(token)
        probabilities.append(probability)
        follow = [i + 1 for i in follow if corpus[i] == token and i + 1 < n and corpus[i + 1] != SEPARATOR]
    return SuffixDraft(tokens, probabilities, match) if tokens else None


def drafts_of(batch: list, max_tokens: list[int], shared: SharedResponses | None) -> list[SuffixDraft | None]:
    """Each sequence's suffix draft of at most max_tokens[i] tokens, None where it has none or may not use one:
    guided rows (their drafts must be grammatical) and rejection sampling's (it needs the drafter's distribution)."""
    drafts = []
    for seq, most in zip(batch, max_tokens):
        if seq.grammar is not None or seq.params.acceptance_kind == "rejection":
            drafts.append(None)
            continue
        seq.history = seq.history or TokenHistory()
        seq.history.sync(seq.prompt_ids, seq.output_ids)
        drafts.append(seq.history.propose(most, shared))
    return drafts


FEW = 16  # occurrences compared whole at once, not position by position


def _longest_match(corpus: np.ndarray, query: np.ndarray, ends: np.ndarray, max_match: int) -> tuple[np.ndarray, int]:
    """The occurrences in corpus (their last positions, ascending) that share the longest suffix with the query, up
    to max_match tokens, and that length. ends: those that share its newest token."""
    q, match, max_match = len(query), 1, min(max_match, len(query))
    while match < max_match and ends.size > FEW:  # many: narrowed one position back at a time
        room = ends[ends >= match]
        longer = room[corpus[room - match] == query[q - 1 - match]]
        if not longer.size:
            return ends, match
        ends, match = longer, match + 1
    if match == max_match:
        return ends, match
    # few: each one's whole agreement at once, positions match .. max_match - 1 back
    back = np.arange(match, max_match)
    before = ends[:, None] - back
    agree = (before >= 0) & (corpus[np.maximum(before, 0)] == query[q - 1 - back])
    lengths = match + np.cumprod(agree, axis=1).sum(axis=1)
    longest = lengths.max()
    return ends[lengths == longest], int(longest)
