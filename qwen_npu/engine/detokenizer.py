"""Token ids -> text, one token at a time, never splitting a character.

A byte-level BPE token can hold part of a UTF-8 character: the emoji 🦜 is two tokens, and
decoding the first alone gives the replacement character U+FFFD. ``IncrementalDetokenizer``
keeps such an incomplete tail back until the tokens that complete it arrive::

    tokens   [123918]        [123918, 250]
    decoded  "\ufffd"        "🦜"
    .text    ""              "🦜"          (the stable text only ever grows)

Only a short window of recent tokens is decoded per push, so feeding n tokens costs O(n).
For byte-level tokenizers (Qwen3) the final ``.text`` (after ``finish``) equals decoding all
tokens at once.
"""
from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing list of token ids; ``decode(ids) -> str`` decodes a list of ids."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0          # window start: tokens before it are already in .text
        self._stable = 0         # tokens [start, stable) decode to the window's stable prefix
        self.text = ""           # every complete character so far

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def copy(self) -> IncrementalDetokenizer:
        """An independent copy (a step stages its tokens on one)."""
        new = IncrementalDetokenizer(self._decode)
        new._ids, new._start, new._stable, new.text = list(self._ids), self._start, self._stable, self.text
        return new

    def push(self, token_ids) -> str:
        """Add tokens; returns the text they completed (possibly "")."""
        self._ids += [int(t) for t in token_ids]
        head = self._decode(self._ids[self._start:self._stable])
        window = self._decode(self._ids[self._start:])
        if window.endswith(REPLACEMENT) or not window.startswith(head):
            return ""            # an incomplete character at the end: wait for more tokens
        new = window[len(head):]
        self.text += new
        self._start, self._stable = self._stable, len(self._ids)
        return new

    def finish(self) -> str:
        """Flush whatever is held back (an incomplete tail decodes to U+FFFD); returns it."""
        head = self._decode(self._ids[self._start:self._stable])
        window = self._decode(self._ids[self._start:])
        new = window[len(head):] if window.startswith(head) else window
        self.text += new
        self._start = self._stable = len(self._ids)
        return new
