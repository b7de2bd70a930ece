"""Text in and out: prompt encoding (with the chat template) and incremental detokenization.

Streaming detokenization is split so that the side that decodes can be stateless: the side that
owns a sequence sends a short window of token ids (a few already-shown tokens for context plus the
new ones) and how many of them were already shown; `text_delta` turns that into new text. The
context tokens make a word-piece or a multi-byte character that spans the boundary decode whole.
"""
from __future__ import annotations

from pathlib import Path

from .config import DFlashError

# Already-shown tokens sent again as decoding context (vLLM's incremental detokenizer uses 5 too).
CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"  # what decoding yields for the first bytes of an unfinished UTF-8 character

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path):
    """A transformers tokenizer from a checkpoint directory, or None when it has none."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of a prompt; with chat, `text` is a user message wrapped in the chat template."""
    if not text:
        raise DFlashError("empty prompt")
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def token_window(output_ids: list[int], shown: int) -> tuple[list[int], int]:
    """(window, read_offset): the ids to send for a stream that has shown `shown` of `output_ids`."""
    start = max(0, shown - CONTEXT_TOKENS)
    return output_ids[start:], shown - start


def text_delta(tokenizer, window: list[int], read_offset: int, final: bool) -> str:
    """The text that window[read_offset:] adds after window[:read_offset].

    An unfinished multi-byte character at the end is held back (it is sent once the next tokens
    complete it) unless the stream is final.
    """
    before = decode(tokenizer, window[:read_offset]).rstrip(_INCOMPLETE)
    after = decode(tokenizer, window)
    if not final:
        after = after.rstrip(_INCOMPLETE)
    return after[len(before):]
