"""Shared pieces of the slot-collision tests: small sessions, schedules and bad-plan injection.

Imported by ``tests/integration/test_collisions_*.py`` (pytest puts this folder on ``sys.path``).
"""
from __future__ import annotations

import contextlib

import torch

import qwen_npu.engine.step as session_module
from qwen_npu import SamplingParams, Session
from qwen_npu.cache.slot_check import CHECKS

BS = 4
NUM_BLOCKS = 32
# the checks a runner's own dump can be checked for (no ref counts, no ledger)
EXTERNAL_CHECKS = tuple(c for c in CHECKS if c not in ("shared_block", "live_overwrite"))


def open_session(path, **kw) -> Session:
    args = {"device": "cpu", "max_batch": 4, "block_size": BS, "num_blocks": NUM_BLOCKS, "max_model_len": 64,
            "chunk_size": 64}
    args.update(kw)
    return Session.from_pretrained(path, **args)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def prompts(lens, vocab: int = 511, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def two_decoding(sess: Session, lens=(6, 7)):
    """Requests A and B, prefilled and sampled: the next step is a decode with rows A, B."""
    reqs = [sess.add_request(p, greedy(8)) for p in prompts(lens)]
    sess.sample(sess.prefill())
    return reqs


@contextlib.contextmanager
def tampered_plans(monkeypatch, edit):
    """Every plan the session builds inside the block goes through ``edit(plan)`` before its checks."""
    real = session_module.build_plan

    def build(*args, **kwargs):
        plan = real(*args, **kwargs)
        edit(plan)
        return plan

    with monkeypatch.context() as m:
        m.setattr(session_module, "build_plan", build)
        yield


def slot_of(sess: Session, req, position: int) -> int:
    table = req.block_table
    return table[position // BS] * BS + position % BS


def free_block(sess: Session) -> int:
    """A block that no request holds."""
    held = {b for r in sess.requests for b in r.block_table}
    return max(set(range(NUM_BLOCKS)) - held)


def run_schedule(sess: Session, lens, new_tokens):
    """Add one request per prompt length, then step until all finish; returns the requests."""
    reqs = [sess.add_request(p, greedy(n)) for p, n in zip(prompts(lens), new_tokens)]
    while not all(r.is_done for r in reqs):
        sess.step()
    return reqs
