"""Text from a growing token list, one token at a time, in constant work per token.

- :class:`IncrementalDetokenizer` decodes only a short window of recent tokens per step
  (decoding the whole answer every step is quadratic in its length).
- :class:`StopFilter` releases text that cannot be the start of a stop string and cuts the
  text at the first complete one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]
INCOMPLETE = "\ufffd"  # what a tokenizer shows for the first bytes of a multi-byte character


class IncrementalDetokenizer:
    """The text a token adds, given the tokens before it.

    Decoding a token alone loses what depends on its neighbours (a leading space a
    SentencePiece decoder drops at the start of a text, the other bytes of a multi-byte
    character), so each step decodes a window that starts one step back, at the last point
    where the text was complete, and returns what is new in it. Text is released up to a
    character whose bytes are still incomplete (U+FFFD at the end), the rest once they are.
    """

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.tokens: list[int] = []
        self._window = 0  # the window's first token
        self._read = 0  # the window's text up to this token was complete when released
        self._released = 0  # characters of the window's text already returned

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.decode(self.tokens[self._window:])
        complete = len(text.rstrip(INCOMPLETE))
        piece = text[self._released:complete]
        self._released = max(self._released, complete)
        if complete == len(text):  # a clean boundary: the next window starts at the previous one
            self._window, self._read = self._read, len(self.tokens)
            self._released = len(self.decode(self.tokens[self._window:self._read]))
        return piece

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character stays U+FFFD)."""
        piece = self.decode(self.tokens[self._window:])[self._released:]
        self._window = self._read = len(self.tokens)
        self._released = 0
        return piece


def stop_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that begins one of the stop strings."""
    return max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)


class StopFilter:
    """Holds back a tail that may grow into a stop string; ``stopped`` once one is complete.

    Only the held-back tail and the new text are searched: text released earlier could not
    begin a stop string, so none can start there."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add decoded text; return what is safe to show now."""
        self.pending += text
        at = min((i for s in self.stops if (i := self.pending.find(s)) >= 0), default=-1)
        if at >= 0:
            self.stopped = True
            released, self.pending = self.pending[:at], ""
            return released
        keep = stop_prefix(self.pending, self.stops)
        released, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return released

    def flush(self) -> str:
        """At the end of the generation, a held-back tail that never became a stop string."""
        released, self.pending = self.pending, ""
        return released
