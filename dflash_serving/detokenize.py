"""Incremental detokenization, split so that the side that decodes can be stateless.

The side that owns a sequence (the engine loop) sends a short window of token ids (a few
already-shown tokens for context plus the new ones) and how many of them were already shown;
`text_delta` (the postprocessing model) turns that into new text. The context tokens make a
word-piece or a multi-byte character that spans the boundary decode whole.
"""
from __future__ import annotations

from dflash_runtime.text import decode_complete

# Already-shown tokens sent again as decoding context (vLLM's incremental detokenizer uses 5 too).
CONTEXT_TOKENS = 5


def token_window(output_ids: list[int], shown: int) -> tuple[list[int], int]:
    """(window, read_offset): the ids to send for a stream that has shown `shown` of `output_ids`."""
    start = max(0, shown - CONTEXT_TOKENS)
    return output_ids[start:], shown - start


def text_delta(tokenizer, window: list[int], read_offset: int) -> str:
    """The text that window[read_offset:] adds after window[:read_offset].

    An unfinished multi-byte character at the end is held back until the next tokens complete it; where none
    come (an answer cut by max_tokens in the middle of a character) it is never sent: the answer ends before
    it, not in U+FFFD.
    """
    before = decode_complete(tokenizer, window[:read_offset])
    return decode_complete(tokenizer, window)[len(before):]
