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
    """Random windows of ``seq_len + 1`` tokens from ``stream``, drawn by one seeded generator.

    The first ``repeat_rows`` rows of every batch are *repeated* windows: half a window of text,
    then the same half again (``w w``), so the second half is predictable only by looking back
    at what followed each token the first time. That is the job of an induction head, and these
    rows make one form within a CPU-sized training run.
    """

    def __init__(self, stream: torch.Tensor, *, batch_size: int, seq_len: int, seed: int,
                 repeat_rows: int = 0):
        if stream.numel() <= seq_len + 1:
            raise ValueError(f"token stream of {stream.numel()} ids is too short for seq_len={seq_len}")
        if not 0 <= repeat_rows <= batch_size:
            raise ValueError(f"repeat_rows={repeat_rows}: choose 0..batch_size ({batch_size})")
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.repeat_rows = repeat_rows
        self.gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each ``[batch_size, seq_len]``; targets are inputs shifted by one."""
        starts = torch.randint(0, self.stream.numel() - self.seq_len - 1, (self.batch_size,),
                               generator=self.gen)
        half = (self.seq_len + 1) // 2
        rows = []
        for i, s in enumerate(starts.tolist()):
            window = self.stream[s:s + self.seq_len + 1]
            if i < self.repeat_rows:
                window = torch.cat([window[:half], window[:half], window[half:]])[:self.seq_len + 1]
            rows.append(window)
        rows = torch.stack(rows)
        return rows[:, :-1], rows[:, 1:]


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``seq_len + 1`` ids from the start of ``stream``."""
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    return torch.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
