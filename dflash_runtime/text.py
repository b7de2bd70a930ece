"""Text in and out: the tokenizer of a checkpoint, prompt encoding (with the chat template), decoding."""
from __future__ import annotations

from pathlib import Path

from .config import DFlashError

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
