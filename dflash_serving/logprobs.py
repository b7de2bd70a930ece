"""The engine's log-probabilities of a response's tokens -> OpenAI's per-token shape, with each token's text.

{"token": its text, "bytes": its UTF-8 bytes, "logprob", "top_logprobs": [{"token", "bytes", "logprob"}, ...]}:
the `logprobs` output of the dflash model (dflash_contract.protocol.LOGPROB_OUTPUTS), which the gateway passes on. A
byte-level BPE token (SmolLM2's, Qwen's) is its bytes, which may be part of a character: its text then holds U+FFFD
for them, and its bytes are exact, as OpenAI's are.
"""
from __future__ import annotations

from functools import lru_cache


class TokenTexts:
    """Token id -> (text, bytes) for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_of = _byte_decoder() if _byte_level(tokenizer) else None
        self.text = lru_cache(maxsize=1 << 16)(self._text)

    def _text(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if raw is None:
            return "", []
        if self.byte_of is not None and all(c in self.byte_of for c in raw):
            data = bytes(self.byte_of[c] for c in raw)
            return data.decode("utf-8", "replace"), list(data)
        text = self.tokenizer.convert_tokens_to_string([raw])
        return text, list(text.encode("utf-8"))

    def entries(self, token_ids: list[int], logprobs: list) -> list[dict]:
        """OpenAI's entries of tokens and their engine log-probabilities (dflash_runtime.logprobs.TokenLogprobs)."""
        return [{**self._entry(token, lp), "top_logprobs": [self._entry(t, v) for t, v in top]}
                for token, (lp, top) in zip(token_ids, logprobs)]

    def _entry(self, token: int, logprob: float) -> dict:
        text, data = self.text(int(token))
        return {"token": text, "bytes": data, "logprob": logprob}


def _byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in type(backend.pre_tokenizer).__name__ + str(backend.pre_tokenizer)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
