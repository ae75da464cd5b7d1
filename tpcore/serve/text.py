"""Text of a generation as its tokens come: deltas safe to send, and stop strings.

Each new token re-decodes the generated ids (``skip_special_tokens``) and sends what is new. Text that might
be the start of a stop string, or ends in an incomplete UTF-8 character, is held back until the next token
decides; a stop string ends the text just before it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TextStream"]


class TextStream:
    """The text of one request's generated tokens; ``stop`` strings end it."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text sent so far

    def add(self, token_id: int) -> tuple[str, bool]:
        """Take one token: the text to send now, and whether a stop string ended the text."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        ends = [text.find(stop, max(0, self.sent - len(stop))) for stop in self.stop]
        found = [end for end in ends if end >= 0]
        if found:
            return self._send(text[: min(found)]), True
        return self._send(text[: len(text) - self._held(text)]), False

    def flush(self) -> str:
        """The rest of the text, held back for a stop string that did not come."""
        return self._send(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _held(self, text: str) -> int:
        """How many characters at the end of ``text`` may still turn into a stop string (or a character)."""
        if text.endswith("\ufffd"):
            return len(text) - self.sent
        return max((n for stop in self.stop for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)

    def _send(self, text: str) -> str:
        delta = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return delta
