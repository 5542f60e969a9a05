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
IGNORE = -100                 # a target left out of the loss (torch's cross_entropy ignore_index)


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
    """Random windows of ``seq_len + 1`` tokens from ``stream``, drawn by one seeded generator.

    The first ``copy_rows`` rows of every batch are *copy* rows instead: a sequence of random
    ordinary tokens (ids ``copy_ids[0]`` up to ``copy_ids[1] - 1``, ``copy_len[0]`` to
    ``copy_len[1]`` long) repeated to fill the window. After its first copy every token of such a
    row is predictable only by looking back at what followed the same token the last time, the
    job of an induction head; text alone did not grow one in a CPU-sized run. The targets of a copy
    row's first copy are ``IGNORE`` (left out of the loss): they are random, and learning to
    predict them would teach the model that odd tokens are followed by a uniform guess, which
    turns sampled text into word salad after one unlucky token.
    """

    def __init__(self, stream: torch.Tensor, *, batch_size: int, seq_len: int, seed: int,
                 copy_rows: int = 0, copy_ids: tuple[int, int] = (0, 0), copy_len: tuple[int, int] = (6, 32)):
        if stream.numel() <= seq_len + 1:
            raise ValueError(f"token stream of {stream.numel()} ids is too short for seq_len={seq_len}")
        if not 0 <= copy_rows <= batch_size:
            raise ValueError(f"copy_rows={copy_rows}: choose 0..batch_size ({batch_size})")
        if copy_rows and not 0 <= copy_ids[0] < copy_ids[1]:
            raise ValueError(f"copy_ids={copy_ids}: need 0 <= first < end for the copy rows' tokens")
        if copy_rows and not 1 <= copy_len[0] <= copy_len[1] <= seq_len:
            raise ValueError(f"copy_len={copy_len}: need 1 <= shortest <= longest <= seq_len ({seq_len})")
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.copy_rows, self.copy_ids, self.copy_len = copy_rows, copy_ids, copy_len
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``[batch_size, seq_len]``; targets are inputs shifted by one
        (``IGNORE`` on a copy row's first copy)."""
        starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)
        rows, first_copy = [], []
        for i, s in enumerate(starts.tolist()):
            window = self.stream[s:s + self.seq_len + 1]
            if i < self.copy_rows:
                n = int(torch.randint(self.copy_len[0], self.copy_len[1] + 1, (1,), generator=self.gen))
                seq = torch.randint(*self.copy_ids, (n,), generator=self.gen)
                window = seq.repeat(-(-(self.seq_len + 1) // n))[:self.seq_len + 1]
                first_copy.append((i, n - 1))
            rows.append(window)
        rows = torch.stack(rows)
        targets = rows[:, 1:].clone()
        for i, n in first_copy:
            targets[i, :n] = IGNORE
        return rows[:, :-1], targets


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``seq_len + 1`` ids from the start of ``stream``."""
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    return torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
