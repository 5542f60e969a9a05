"""Token ids -> text, one token at a time, never splitting a character.

A byte-level BPE token can hold part of a UTF-8 character: the emoji 🦜 is two tokens, and
decoding the first alone gives the replacement character U+FFFD. ``IncrementalDetokenizer``
keeps such an incomplete tail back until the tokens that complete it arrive::

    tokens   [123918]        [123918, 250]
    decoded  "\ufffd"        "🦜"
    .text    ""              "🦜"          (the stable text only ever grows)

The stepping is ``tokenizers.decoders.DecodeStream`` (special tokens skipped); this class adds
what a step needs around it: an independent ``copy()`` (a step stages its tokens on one), the
token ids so far, and ``finish()``, which flushes an incomplete tail. For byte-level tokenizers
(Qwen3) the final ``.text`` (after ``finish``) equals decoding all tokens at once.
"""
from __future__ import annotations

import copy as _copy


def fast_tokenizer(tokenizer):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer``: a ``tokenizers.Tokenizer``, a
    ``qwen_npu.text.tokenizer.Tokenizer``, or the bound ``decode`` method of either."""
    tokenizer = getattr(tokenizer, "__self__", tokenizer)      # a bound decode method
    return getattr(tokenizer, "fast", tokenizer)


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoded with ``tokenizer`` (see ``fast_tokenizer``)."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream
        self._fast = fast_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._pending: list[int] = []     # tokens after the last piece of text: not decodable yet
        self.text = ""                    # every complete character so far

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def copy(self) -> IncrementalDetokenizer:
        """An independent copy (a step stages its tokens on one)."""
        new = object.__new__(IncrementalDetokenizer)
        new._fast, new._stream, new.text = self._fast, _copy.copy(self._stream), self.text
        new._ids, new._pending = list(self._ids), list(self._pending)
        return new

    def push(self, token_ids) -> str:
        """Add tokens; returns the text they completed (possibly "")."""
        new = ""
        for t in token_ids:
            t = int(t)
            self._ids.append(t)
            self._pending.append(t)
            piece = self._stream.step(self._fast, t)
            if piece:
                new += piece
                self._pending = []
        self.text += new
        return new

    def finish(self) -> str:
        """Flush whatever is held back (an incomplete tail decodes to U+FFFD); returns it."""
        from tokenizers.decoders import DecodeStream
        new = self._fast.decode(self._pending, skip_special_tokens=True) if self._pending else ""
        self.text += new
        self._pending = []
        self._stream = DecodeStream(skip_special_tokens=True)
        return new
