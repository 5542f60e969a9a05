"""Shared pieces of the prefix-cache, preemption and robustness tests.

Imported by ``test_prefix_cache.py``, ``test_preemption.py``, ``test_robustness.py`` and
``test_scheduler_properties.py`` (pytest puts this folder on ``sys.path``).
"""
from __future__ import annotations

import torch

from qwen_npu import Session

TOL = 1e-4      # float32 logits of one position, computed in different batches / chunks


def leak_problems(sess: Session) -> list[str]:
    """With no live request: every block must be free, or a cached prefix with ref count 0."""
    problems = list(sess._engine.manager.check())
    live = [r.id for r in sess.requests if not r.is_done]
    if live:
        return problems + [f"requests {live} are still live"]
    for e in sess.blocks:
        if e.ref_count != 0 or e.request_ids or e.state not in ("free", "cached"):
            problems.append(f"block {e.block_id} is {e.state} with ref_count {e.ref_count}, held by "
                            f"{list(e.request_ids)}, after every request finished")
    held = sess._engine.manager.request_ids()
    if held:
        problems.append(f"requests {held} still hold block tables after they finished")
    return problems


def assert_no_leaks(sess: Session) -> None:
    problems = leak_problems(sess)
    check = getattr(sess, "check", None)
    if check is not None:
        report = check()
        problems += [f"sess.check(): {p}" for p in report.problems]
    assert not problems, "\n".join(problems)


def live_slot_problems(sess: Session) -> list[str]:
    """Two live tokens in one slot: a slot may be shared only by the same position of the same prefix."""
    bs = sess.config.block_size
    seen: dict[int, tuple[int, int, tuple[int, ...]]] = {}
    problems = []
    for r in sess.requests:
        if r.is_done:
            continue
        table, tokens = r.block_table, r.all_token_ids
        for pos in range(r.num_computed_tokens):
            slot = table[pos // bs] * bs + pos % bs
            key = (r.id, pos, tuple(tokens[:pos + 1]))
            other = seen.setdefault(slot, key)
            if other[1:] != key[1:]:
                problems.append(f"slot {slot} holds request {other[0]} position {other[1]} and request "
                                f"{r.id} position {pos} with different prefixes")
    return problems


def run_logits(sess: Session, plan, max_steps: int = 5000):
    """Run ``plan`` = [(step number, prompt, SamplingParams)]: each prompt is added before that step.

    Steps with ``sess.step()`` until every added request is done. Returns (requests in plan order,
    {(plan index, position): logits row [vocab] on the host}, steps).
    """
    reqs: list = [None] * len(plan)
    logits: dict[tuple[int, int], torch.Tensor] = {}
    steps = []
    index_of: dict[int, int] = {}
    for n in range(max_steps):
        for i, (at, prompt, sp) in enumerate(plan):
            if at == n:
                reqs[i] = sess.add_request(prompt, sp)
                index_of[reqs[i].id] = i
        if all(r is not None and r.is_done for r in reqs):
            return reqs, logits, steps
        if not any(not r.is_done for r in sess.requests):
            continue                              # nothing to run yet: wait for the next arrival
        step = sess.step()
        steps.append(step)
        if step.logits is not None:
            rows = step.logits.tensor.detach().cpu()
            for row, rid in enumerate(step.logits_request_ids):
                r = sess.request(rid)
                if rid in index_of:
                    # the row predicts the token after position num_tokens - 2 (sample appended one)
                    logits[(index_of[rid], r.num_tokens - 2)] = rows[row].clone()
    raise AssertionError("requests did not finish")


def assert_same_outputs(a, b, *, tol: float = TOL) -> None:
    """Two ``run_logits`` results: identical tokens, and logits within ``tol`` at every position."""
    reqs_a, logits_a, _ = a
    reqs_b, logits_b, _ = b
    assert [r.output_token_ids for r in reqs_a] == [r.output_token_ids for r in reqs_b]
    assert [r.finish_reason for r in reqs_a] == [r.finish_reason for r in reqs_b]
    assert logits_a.keys() == logits_b.keys()
    worst = max((logits_a[k] - logits_b[k]).abs().max().item() for k in logits_a)
    assert worst <= tol, f"max |logits difference| {worst:.2e} > {tol}"


def written_blocks(step, block_size: int) -> set[int]:
    return {int(s) // block_size for s in step.slot_mapping.tolist() if s >= 0}


def record_dispatch(sess: Session, monkeypatch) -> list:
    """Record ``(plan, blocks)`` at the moment each step is dispatched (before the forward): the
    blocks as the step's plan booked them (its draft, which the step's commit publishes)."""
    from qwen_npu.inspect.blocks import take_blocks
    import qwen_npu.engine.step as step_module
    seen = []
    original = step_module.check

    def check(engine, plan, requests, draft, *args, **kwargs):      # runs just before the dispatch
        tokens = {r.id: r.all_token_ids for r in sess.requests if draft.manager.has(r.id)}
        seen.append((plan, take_blocks(draft.manager, tokens, plan.index)))
        return original(engine, plan, requests, draft, *args, **kwargs)

    monkeypatch.setattr(step_module, "check", check)
    return seen
