"""Reasoning parsers: a thinking model's reasoning apart from its answer, as `reasoning_content` beside `content`.

"qwen3" (vLLM's and SGLang's qwen3 parser): the answer opens with `<think>`, the reasoning runs to `</think>`, the
content follows. An answer with no `<think>` (Qwen3 with `enable_thinking: false`, whose template closes an empty
block in the prompt) is all content; one cut before `</think>` (max_tokens) is all reasoning while it streams, and
content in a whole response, as vLLM returns it. The build names the parser (`build.py --reasoning-parser`: the
Qwen3 presets' default; none for SmolLM2, which does not think).
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def split(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None where the answer has no closed think block."""
    body = text.lstrip()
    if not body.startswith(START) or END not in body:
        return None, text
    reasoning, _, content = body[len(START):].partition(END)
    return reasoning.strip("\n") or None, content.lstrip("\n")


class StreamSplitter:
    """Deltas of a streamed answer -> (reasoning delta, content delta), each "" when it has none. A marker cut
    between deltas is held back until it is whole."""

    def __init__(self):
        self.text, self.sent_reasoning, self.sent_content = "", 0, 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self._parts(final)
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out

    def _parts(self, final: bool) -> tuple[str, str]:
        body = self.text.lstrip()
        if not body.startswith(START):
            if not final and START.startswith(body):  # "<thi": it may yet open a block
                return "", ""
            return "", self.text
        inside = body[len(START):]
        if END in inside:
            reasoning, _, content = inside.partition(END)
            return reasoning.lstrip("\n"), content.lstrip("\n") if content.strip() or final else ""
        held = next((n for n in range(len(END) - 1, 0, -1) if inside.endswith(END[:n])), 0) if not final else 0
        return inside[:len(inside) - held].lstrip("\n"), ""
