"""Held-out loss of a model, the unigram baseline it has to beat, and its induction heads.

Losses are mean cross-entropy in nats per token over the same held-out windows; perplexity is
``exp(loss)``. The unigram baseline predicts every token from its training-set frequency
(add-one smoothed), ignoring all context. ``induction`` scores every head on random ordinary
tokens repeated once, the probe notebook 07 runs on the paged cache.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

INDUCTION_LEN = 24            # random tokens, then the same tokens again


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


@torch.no_grad()
def induction(model, *, pad_id: int, first_id: int, vocab_size: int, length: int = INDUCTION_LEN,
              probes: int = 4, seed: int = 0) -> dict:
    """Per head, over the second copy of ``pad, s, s`` (``s``: ``length`` random ordinary tokens),
    the mean attention to the token that followed the first occurrence of the query's token (the
    induction target) and to the previous token; the best head of each; and the mean
    log-probability of the tokens of the first and of the second copy (after its first token).
    Averaged over ``probes`` sequences drawn from ``seed``."""
    was_training, attn = model.training, model.config._attn_implementation
    model.eval()
    model.set_attn_implementation("eager")                # sdpa does not return attention weights
    gen = torch.Generator().manual_seed(seed)
    q = torch.arange(length + 1, 2 * length + 1)
    ind, prev, first, second = [], [], [], []
    try:
        for _ in range(probes):
            s = torch.randint(first_id, vocab_size, (length,), generator=gen)
            ids = torch.cat([torch.tensor([pad_id]), s, s])[None]
            out = model(input_ids=ids, output_attentions=True)
            ind.append(torch.stack([a[0][:, q, q - length + 1].mean(-1) for a in out.attentions]))
            prev.append(torch.stack([a[0][:, q, q - 1].mean(-1) for a in out.attentions]))
            logp = out.logits[0].float().log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
            first.append(logp[1:length].mean())
            second.append(logp[length + 1:].mean())
    finally:
        model.set_attn_implementation(attn)
        model.train(was_training)
    ind, prev = torch.stack(ind).mean(0), torch.stack(prev).mean(0)

    def best(scores):
        layer, head = divmod(int(scores.argmax()), scores.shape[1])
        return {"layer": layer, "head": head, "score": round(float(scores.max()), 4)}
    return {"induction": best(ind), "previous_token": best(prev),
            "logprob_first_copy": round(float(torch.stack(first).mean()), 3),
            "logprob_second_copy": round(float(torch.stack(second).mean()), 3)}
