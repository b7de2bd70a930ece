"""A stop string's place in the answer's text, as OpenAI and vLLM give it: left out by default, kept with
`include_stop_str_in_output`, and in both cases nothing after it.

The engine stops at the token that completes a stop string (it decides in tokens); the text that token adds may
run past the stop string, and the stop string may have begun in text already streamed. So a stream holds back the
end of its text while it could still be the start of a stop string, and the answer's last text is cut where the
stop string begins (or ends). Text, not tokens: a stop string may end inside a token.
"""
from __future__ import annotations


class StopText:
    """Text of one answer as it streams: push each delta, send what comes back."""

    def __init__(self, stop_strings, include_stop_str: bool = False):
        self.stops = tuple(s for s in stop_strings if s)
        self.include = include_stop_str
        self.pending = ""  # received, not yet released
        self.tail = ""  # the released text's end: where a kept stop string may have begun
        self._reach = max(map(len, self.stops), default=1) - 1

    def push(self, delta: str, final: bool = False, stopped: bool = False) -> str:
        """The text to send now. `final`: the answer's last delta; `stopped`: it ended on a stop (a stop string,
        or a stop token, which leaves no string in the text)."""
        self.pending += delta
        if final:
            text = self._cut(self.pending) if stopped and self.stops else self.pending
            self.pending = ""
            return text
        held = 0 if self.include else self._held(self.pending)
        text, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        self.tail = (self.tail + text)[-self._reach:] if self._reach else ""
        return text

    def _held(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string."""
        for n in range(min(len(text), self._reach), 0, -1):
            if any(stop.startswith(text[-n:]) for stop in self.stops):
                return n
        return 0

    def _cut(self, text: str) -> str:
        """`text` without what follows the stop string that ended the answer (and without the string itself unless
        it is kept); unchanged when it holds none (a stop token ended it). That string is the one that ends first
        past the released text: the engine stopped at the first token completing one."""
        seen = self.tail + text
        found = []
        for stop in self.stops:
            start = seen.find(stop, max(0, len(self.tail) - len(stop) + 1))  # not wholly released
            if start >= 0:
                found.append((start + len(stop), start))
        if not found:
            return text
        end, start = min(found)
        return text[:max(0, (end if self.include else start) - len(self.tail))]
