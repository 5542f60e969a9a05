"""Held-out loss of a model, and of the unigram baseline it has to beat.

Losses are mean cross-entropy in nats per token over the same held-out windows; perplexity is
``exp(loss)``. The unigram baseline predicts every token from its training-set frequency
(add-one smoothed), ignoring all context.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def model_loss(model, windows: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy of ``model`` over ``windows`` (``[n, seq_len + 1]`` ids)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        rows = windows[i:i + batch_size]
        logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1),
                               reduction="sum")
        total += float(loss)
        count += rows[:, 1:].numel()
    model.train(was_training)
    return total / count


def unigram_loss(train_stream: torch.Tensor, windows: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy of the targets of ``windows`` under add-one-smoothed training unigram counts."""
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    return float(-logp[windows[:, 1:].reshape(-1)].mean())


def perplexity(loss: float) -> float:
    return math.exp(loss)
