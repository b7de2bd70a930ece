"""Text in and out: the tokenizer of a checkpoint, prompt encoding (with the chat template), decoding.

User text never becomes the tokenizer's special tokens: the target's tokenizer reads "<|im_end|>" in any text as
its control token, so a prompt could otherwise end its own turn or forge a system turn. Only the chat template's
own markers (and, with allow_special_tokens, a trusted prompt's) are special.
"""
from __future__ import annotations

import re
from pathlib import Path

from dflash_contract.chat import hermes_messages, template_has_tools

from .config import DFlashError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
INCOMPLETE = "\ufffd"  # what decoding yields for the first bytes of an unfinished UTF-8 character
# masks for special-token text while the template renders: Private Use Area characters, which no template treats
# specially (trim, split); each is unmasked before the tokenizer sees it
MASKS = range(0xE000, 0xF900)


def load_tokenizer(path: Path):
    """A transformers tokenizer from a checkpoint directory, or None when it has none."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and type(backend.model).__name__ == "BPE":
        # Many checkpoints (SmolLM2's among them) ask for WordPiece's space clean-up, which transformers skips
        # for BPE with a warning on every decode; saying what it does anyway keeps the output and drops the noise.
        tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = True, allow_special_tokens: bool = False,
                  template_args: dict | None = None) -> list[int]:
    """Token ids of a prompt: raw text, or with chat a conversation ([{"role", "content"}]; a str is one user
    message) in the model's chat template, ending with the assistant's generation prompt. Without a chat
    template a str is encoded raw and a conversation is refused. Special-token text in the prompt (a raw prompt's,
    every message's content) is encoded as ordinary text unless allow_special_tokens (a trusted prompt).
    template_args: the template's `tools` and other arguments (dflash_contract.chat)."""
    if not prompt:
        raise DFlashError("empty prompt")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(prompt, str) and not (chat and template):
        return tokenizer.encode(prompt, split_special_tokens=not allow_special_tokens)
    if not template:
        raise DFlashError("this model's tokenizer has no chat template: send the prompt as text")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    specials = _special_text(tokenizer)
    if allow_special_tokens or not any(specials.search(m["content"]) for m in messages):
        # nothing to keep from the tokenizer: the templated text's ids as they always were
        return tokenizer.encode(_render(tokenizer, messages, template_args), add_special_tokens=False)
    return _encode_guarded(tokenizer, messages, specials, template_args)


def _special_text(tokenizer) -> re.Pattern:
    """A pattern of the tokenizer's special tokens' text (all its added tokens marked special, which
    split_special_tokens splits), longest first as the tokenizer matches them; one that never matches if none."""
    texts = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts)) or "(?!)")


def _render(tokenizer, messages: list[dict], template_args: dict | None = None) -> str:
    args = dict(template_args or {})
    tools = args.pop("tools", None)
    if not template_has_tools(tokenizer.chat_template):  # its tools, calls and results in the Hermes format
        messages, tools = hermes_messages(messages, tools or []), None
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **args)


def _encode_guarded(tokenizer, messages: list[dict], specials: re.Pattern, template_args: dict | None) -> list[int]:
    """A conversation whose contents hold special-token text: the template renders with each such text masked (a
    character found nowhere in the conversation), so the special tokens in what it renders are its own markers.
    The tokenizer encodes the text between special tokens on its own anyway, so each piece, unmasked, is encoded
    with special tokens split and the markers go between: the same ids as the tokenizer would give if only the
    markers were special (for tokenizers whose pre-tokenizer ignores where a piece starts, as byte-level BPE's)."""
    found = sorted({text for m in messages for text in specials.findall(m["content"])})
    used = set(_render(tokenizer, messages, template_args))
    masks = dict(zip(found, (chr(c) for c in MASKS if chr(c) not in used)))
    if len(masks) < len(found):
        raise DFlashError("the prompt uses every Private Use Area character: its special-token text cannot be masked")
    masked = [{**m, "content": specials.sub(lambda t: masks[t.group()], m["content"])} for m in messages]
    unmask = str.maketrans({mask: text for text, mask in masks.items()})
    rendered = _render(tokenizer, masked, template_args)
    pieces = re.split(f"({specials.pattern})", rendered)  # text, marker, text, ..., text
    ids = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids.append(tokenizer.convert_tokens_to_ids(piece))
        elif piece:
            ids += tokenizer.encode(piece.translate(unmask), add_special_tokens=False, split_special_tokens=True)
    return ids


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def decode_complete(tokenizer, ids: list[int]) -> str:
    """The text of ids up to the last whole character: the first bytes of an unfinished UTF-8 character decode as
    U+FFFD, which is no text of the model's (the next tokens complete it; an answer cut there ends before it)."""
    return decode(tokenizer, ids).rstrip(INCOMPLETE)
