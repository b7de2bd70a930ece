"""What a request returns: the text, why it ended, the speculation statistics and the timings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class SpeculationStats:
    """The server's per-request counters (cumulative over the request): speculation, and the token counts."""

    accepted_draft_tokens: int = 0
    draft_tokens: int = 0
    acceptance_rate: float | None = None  # accepted / drafted; None: nothing drafted (or the server sends none)
    draft_steps: int = 0  # verify passes
    mean_acceptance_length: float | None = None  # tokens per verify pass (accepted drafts + 1), "tau"; None: none
    prompt_tokens: int = 0  # the templated prompt's tokens
    cached_tokens: int = 0  # of those, the server found in its prefix cache
    completion_tokens: int = 0  # generated so far


@dataclass(frozen=True)
class TextChunk:
    text: str
    seconds: float  # arrival, since the request was sent


@dataclass(frozen=True)
class Timings:
    ttft: float  # seconds to the first non-empty text (the whole text when not streaming)
    total: float  # seconds to the final response
    chunks: tuple[TextChunk, ...]  # every non-empty text delta as it arrived

    def token_latencies(self, count_tokens: Callable[[str], int]) -> list[float]:
        """Seconds per generated token after the first, by the tokenizer behind `count_tokens`.

        The server streams groups of tokens (a verify pass commits several at once), so a group's
        gap since the previous one is shared equally by its tokens; tokens that arrive with the
        first one cost nothing (their wait is in the TTFT), so the mean is (total - ttft) / (tokens - 1).
        Token counts come from re-tokenizing the growing text: they sum to count_tokens(whole text).
        """
        latencies, text, counted, last = [], "", 0, None
        for chunk in self.chunks:
            text += chunk.text
            total = count_tokens(text)
            if total <= counted:
                continue  # a delta that completes a token already counted: its gap joins the next
            new, counted = total - counted, total
            if last is None:
                latencies += [0.0] * (new - 1)
            else:
                latencies += [(chunk.seconds - last) / new] * new
            last = chunk.seconds
        return latencies


@dataclass(frozen=True)
class Generation:
    text: str
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length" (max_tokens)
    stats: SpeculationStats
    timings: Timings
    attempts: int = 1  # 1 + retries after "server unavailable"
    logprobs: tuple[dict, ...] = ()  # per token, where asked for (GenerationParams.logprobs): OpenAI's entries


@dataclass(frozen=True)
class Health:
    url: str
    live: bool
    ready: bool  # the server and the model both ready: requests will be served
    detail: str = ""  # why not, when not ready
