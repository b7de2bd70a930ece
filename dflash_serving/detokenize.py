"""Incremental detokenization, split so that the side that decodes can be stateless.

The side that owns a sequence (the engine loop) sends a short window of token ids (a few
already-shown tokens for context plus the new ones) and how many of them were already shown;
`text_delta` (the postprocessing model) turns that into new text. The context tokens make a
word-piece or a multi-byte character that spans the boundary decode whole.
"""
from __future__ import annotations

from dflash_runtime.text import decode

# Already-shown tokens sent again as decoding context (vLLM's incremental detokenizer uses 5 too).
CONTEXT_TOKENS = 5
INCOMPLETE = "\ufffd"  # what decoding yields for the first bytes of an unfinished UTF-8 character


def token_window(output_ids: list[int], shown: int) -> tuple[list[int], int]:
    """(window, read_offset): the ids to send for a stream that has shown `shown` of `output_ids`."""
    start = max(0, shown - CONTEXT_TOKENS)
    return output_ids[start:], shown - start


def text_delta(tokenizer, window: list[int], read_offset: int, final: bool) -> str:
    """The text that window[read_offset:] adds after window[:read_offset].

    An unfinished multi-byte character at the end is held back (it is sent once the next tokens
    complete it) unless the stream is final.
    """
    before = decode(tokenizer, window[:read_offset]).rstrip(INCOMPLETE)
    after = decode(tokenizer, window)
    if not final:
        after = after.rstrip(INCOMPLETE)
    return after[len(before):]
