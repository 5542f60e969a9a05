"""Shared pieces of the Session tests: checkpoints, state snapshots and a step driver.

Imported by ``tests/integration/test_session_*.py`` (pytest puts this folder on ``sys.path``).
"""
from __future__ import annotations

import torch

from qwen_npu import SamplingParams, Session
from qwen_npu.testing import make_tiny_qwen3

# Logits of the same row agree with the dense reference to about 1e-5 on this CPU (batch size and
# chunk boundaries change the summation order); tokens are compared only where the reference's
# top-2 margin is at least MARGIN, ten times the parity tolerance of the paged forward.
TOL = 1e-4
MARGIN = 1e-3

# An untied tiny checkpoint whose greedy streams are varied (a tied tiny model tends to repeat the
# last prompt token) and whose greedy top-2 margins on PROMPTS stay above MARGIN.
UNTIED = dict(vocab_size=512, tie_word_embeddings=False, seed=6)
PROMPT_LENS = (5, 11, 19, 26)


def make_untied(root) -> "object":
    return make_tiny_qwen3(root, **UNTIED)


def prompts(lens=PROMPT_LENS, vocab: int = 511, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths, never containing the eos id ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def open_session(path, **kw) -> Session:
    """A small CPU session; keyword arguments override the defaults."""
    args = dict(device="cpu", max_batch=4, block_size=4, max_model_len=96, num_blocks=256)
    args.update(kw)
    return Session.from_pretrained(path, **args)


def used_blocks(sess: Session) -> int:
    """Blocks held by requests (not free, not merely cached)."""
    return sess._engine.manager.num_used_blocks


def state(sess: Session) -> tuple:
    """Everything a refused call must leave unchanged: requests, blocks, steps, buffers."""
    reqs = tuple((r.id, r.status, tuple(r.prompt_token_ids), tuple(r.output_token_ids),
                  r.num_computed_tokens, tuple(r.block_table), r.finish_reason) for r in sess.requests)
    last = sess.last_step
    return (reqs, used_blocks(sess), len(sess.history), last.index if last else None,
            last.token_ids.tolist() if last is not None and last.token_ids is not None else None)


def run_to_end(sess: Session, check=None, max_steps: int = 10_000) -> list:
    """Drive prefill/decode/sample by hand until every request is done; returns the steps.

    ``check(step)`` runs on each step with logits, before it is sampled.
    """
    steps = []
    for _ in range(max_steps):
        live = [r for r in sess.requests if not r.is_done]
        if not live:
            return steps
        pending = any(r.status in ("waiting", "prefilling") for r in live)
        step = sess.prefill() if pending else sess.decode_step()
        if step.logits is not None:
            if check is not None:
                check(step)
            sess.sample(step)
        steps.append(step)
    raise AssertionError("requests did not finish")


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """[rows] top-1 minus top-2 logit of each row."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]
