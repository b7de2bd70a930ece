"""How many prompt tokens a step prefills while streams decode (chunked prefill), paced by time: a step's prefill
pass takes at most (STALL - 1) times the decoding passes it shares the step with, so a decoding stream's steps grow
at most about STALL-fold while a long prompt comes in, on any hardware; the engine's prefill_chunk is the most a
step takes. A prefill pass is costed as a pass of one token (about a decoding step) plus its tokens' share.

Why time and not tokens alone: a chunk's cost per token differs by orders of magnitude between devices. On a GPU a
chunk of 128 costs about one decoding step (the weights are read once whatever the rows), and the pace leaves the
chunk at its cap. On a CPU a prompt token costs a fifth of a decoding step: with chunks of 128 a stream decoding
the embedded default on this project's 2-core host got its tokens 76-106x slower while a 2,048-token prompt
prefilled beside it; paced, 1.8x, for a prefill that took 2.1x as long (docs/performance.md, "A long prompt beside
a decoding stream")."""
from __future__ import annotations

STALL = 3.0  # a decoding step with a prefill beside it, over one without, at most (but LEAST_TOKENS)
LEAST_TOKENS = 8  # a step prefills at least this many (or the cap), so a long prompt always gets in
SMOOTHING = 0.25  # weight of the newest timing in the running estimates


class PrefillPacing:
    def __init__(self, chunk: int | None):
        """chunk: the most prompt tokens a step prefills while streams decode (None: no chunking, no pace)."""
        self.chunk = chunk
        self.decode_seconds: float | None = None  # a step's draft and verify passes
        self.prefill_seconds_per_token: float | None = None  # a prefill pass's cost beyond a pass of one token

    def tokens(self) -> int:
        """Prompt tokens the next step prefills at most beside decoding streams: the chunk until both estimates
        exist."""
        if self.decode_seconds is None or self.prefill_seconds_per_token is None:
            return self.chunk
        paced = int((STALL - 2) * self.decode_seconds / max(self.prefill_seconds_per_token, 1e-9))
        return max(min(LEAST_TOKENS, self.chunk), min(self.chunk, paced))

    def decoded(self, seconds: float) -> None:
        """A step's draft and verify passes took this long."""
        self.decode_seconds = smoothed(self.decode_seconds, seconds)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill pass of this many prompt tokens took this long."""
        beyond = max(seconds - (self.decode_seconds or 0.0), 0.0) / tokens  # on a GPU, next to nothing
        self.prefill_seconds_per_token = smoothed(self.prefill_seconds_per_token, beyond)


def smoothed(estimate: float | None, measured: float) -> float:
    return measured if estimate is None else estimate + SMOOTHING * (measured - estimate)
