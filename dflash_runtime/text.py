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


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]], chat: bool = True) -> list[int]:
    """Token ids of a prompt: raw text, or with chat a conversation ([{"role", "content"}]; a str is one user
    message) in the model's chat template, ending with the assistant's generation prompt. Without a chat
    template a str is encoded raw and a conversation is refused."""
    if not prompt:
        raise DFlashError("empty prompt")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(prompt, str) and not (chat and template):
        return tokenizer.encode(prompt)
    if not template:
        raise DFlashError("this model's tokenizer has no chat template: send the prompt as text")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
