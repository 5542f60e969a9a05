"""Paragraphs to one token stream, and seeded random windows of it as training batches.

Paragraphs are joined with ``<|endoftext|>``. A seeded tenth of the definitions is also written
as a one-turn chat in the Qwen3 format, so the chat path of the trained model answers
"What does X mean?" with a definition:

    <|im_start|>user\\nWhat does breathe mean?<|im_end|>\\n<|im_start|>assistant\\nbreathe means ...<|im_end|>
"""
from __future__ import annotations

import random

import torch

CHAT_FRACTION = 0.1


def as_chat(paragraph: str) -> str | None:
    """The chat form of a "X means ..." paragraph, or None for one without a definition."""
    word, sep, _ = paragraph.partition(" means ")
    if not sep or not word:
        return None
    return (f"<|im_start|>user\nWhat does {word} mean?<|im_end|>\n"
            f"<|im_start|>assistant\n{paragraph}<|im_end|>\n")


def with_chats(paragraphs: list[str], seed: int, fraction: float = CHAT_FRACTION) -> list[str]:
    """``paragraphs`` with a seeded ``fraction`` of them followed by their chat form."""
    rng = random.Random(seed + 1)
    out = []
    for p in paragraphs:
        out.append(p)
        chat = as_chat(p) if rng.random() < fraction else None
        if chat is not None:
            out.append(chat)
    return out


def token_stream(tok, paragraphs: list[str], separator_id: int) -> torch.Tensor:
    """All paragraphs as one int64 tensor of ids, each paragraph followed by ``separator_id``."""
    ids: list[int] = []
    for enc in tok.encode_batch(paragraphs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(separator_id)
    return torch.tensor(ids, dtype=torch.int64)


class Batches:
    """Random windows of ``seq_len + 1`` tokens from ``stream``, drawn by one seeded generator."""

    def __init__(self, stream: torch.Tensor, *, batch_size: int, seq_len: int, seed: int):
        if stream.numel() <= seq_len + 1:
            raise ValueError(f"token stream of {stream.numel()} ids is too short for seq_len={seq_len}")
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``[batch_size, seq_len]``; targets are inputs shifted by one."""
        starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)
        rows = torch.stack([self.stream[s:s + self.seq_len + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``seq_len + 1`` ids from the start of ``stream``."""
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    return torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
