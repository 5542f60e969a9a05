"""Random programs over a Session and its forks never leak a block, lose a request or break an
invariant: adds, steps, aborts, resets, forks, dropped forks (garbage collection), closed forks,
scores, captures and faults injected into steps (which must change nothing).

Tiny caches force preemption and a three-token alphabet makes prefixes repeat, so blocks are
shared, published, cached, evicted and copied on fork all the time.
"""
from __future__ import annotations

import gc

import pytest
from fault_kit import Boom, raise_at
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen_npu import InvalidRequestError, OutOfBlocksError, SamplingParams, Session

MAX_MODEL_LEN = 16
POINTS = ["planned#1", "validated#1", "fwd:embed#1", "fwd:layers.0.attn.z#1", "fwd:logits#1",
          "dispatched#1", "booked#1", "sampled#1", "d2h#1", "staged#1", "commit#1"]
RUNS = {"programs": 0, "ops": 0, "faults": 0}


@pytest.fixture(scope="module")
def sessions(tiny_ckpt_small_vocab):
    made: dict[tuple, Session] = {}

    def get(**kw) -> Session:
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", max_model_len=MAX_MODEL_LEN,
                                                kernels="reference", **kw)
        sess = made[key]
        gc.collect()
        sess.reset()
        return sess

    yield get
    print(f"\nsession properties: {RUNS['programs']} programs, {RUNS['ops']} operations, "
          f"{RUNS['faults']} injected faults")


def digests(branches):
    return [b.state_digest() for b in branches]


def check_all(root, branches):
    report = root.check()
    assert report.ok, report
    assert not root.state.manager.check()
    for b in branches:
        for r in b.requests:
            if r.is_done:
                assert not r.block_table, f"request {r.id} is {r.status} but holds {r.block_table}"


def one_step(branch):
    """A step; a branch starved by its siblings is refused with their requests named."""
    try:
        branch.step()
        return True
    except InvalidRequestError as e:
        assert "other branches of this fork hold" in str(e), e
        return False


def apply_op(root, forks, capture, op, tokens, n, pick, capacity):
    """One operation of a program; returns the open capture (or None). Its locals (which may
    reference a fork) end with it, so a dropped fork is really unreachable afterwards."""
    branches = [root] + forks
    b = branches[pick % len(branches)]
    live = [r for r in b.requests if not r.is_done]
    pending = b.last_step is not None and not b.last_step.sampled
    if op == "add" and not pending:
        try:
            b.add_request(tokens, SamplingParams(max_new_tokens=n, ignore_eos=True))
        except OutOfBlocksError:
            assert len(tokens) + n - 1 > capacity
    elif op == "step" and live:
        one_step(b)
    elif op == "abort" and live:
        b.abort(live[pick % len(live)])
    elif op == "reset":
        b.reset()
    elif op == "fork" and not pending and len(forks) < 3:
        try:
            forks.append(b.fork())
        except OutOfBlocksError:
            pass
    elif op == "drop" and forks:
        forks.pop(pick % len(forks))
        gc.collect()
    elif op == "close" and forks:
        forks.pop(pick % len(forks)).close()
    elif op == "score" and not pending:
        try:
            res = root.score(tokens[:2], [1, 2][:n])
            assert len(res.logprobs) == min(n, 2)
        except (OutOfBlocksError, InvalidRequestError):
            pass
    elif op == "capture":
        if capture is None:
            capture = root.capture(["logits"])
            capture.__enter__()
        else:
            capture.__exit__(None, None, None)
            capture = None
    elif op == "fault" and not pending:
        if not live:
            try:
                b.add_request(tokens, SamplingParams(max_new_tokens=n, ignore_eos=True))
            except OutOfBlocksError:
                return capture
            branches = [root] + forks
        before = digests(branches)
        exc = KeyboardInterrupt if pick % 2 else Boom
        try:
            hit = raise_at(b, lambda s: s.step(), POINTS[pick % len(POINTS)], exc)
        except InvalidRequestError as e:            # refused: it waits for a sibling's blocks
            assert "other branches of this fork hold" in str(e), e
            hit = False
        if hit:
            RUNS["faults"] += 1
            assert digests(branches) == before
        else:
            pass                           # the point was not reached: the step ran (or was refused)
    return capture


KINDS = (["add"] * 4 + ["step"] * 6 + ["abort", "reset", "fork", "fork", "drop", "close", "score",
                                       "capture", "fault", "fault"])
ops = st.tuples(st.sampled_from(KINDS), st.lists(st.integers(0, 2), min_size=1, max_size=7),
                st.integers(1, 4), st.integers(0, 100))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(block_size=st.integers(1, 4), capacity=st.integers(6, 14), max_batch=st.integers(1, 3),
       chunk_size=st.integers(2, 6), prefix_cache=st.booleans(), program=st.lists(ops, min_size=4, max_size=18))
def test_random_programs_with_forks_scores_captures_and_faults(
        sessions, block_size, capacity, max_batch, chunk_size, prefix_cache, program):
    num_blocks = -(-capacity // block_size)
    root = sessions(block_size=block_size, num_blocks=num_blocks, max_batch=max_batch, chunk_size=chunk_size,
                    prefix_cache=prefix_cache)
    forks: list[Session] = []
    capture = None
    RUNS["programs"] += 1
    try:
        for op, tokens, n, pick in program:
            RUNS["ops"] += 1
            capture = apply_op(root, forks, capture, op, tokens, n, pick, num_blocks * block_size)
            check_all(root, [root] + forks)
        # never lose a request: stepping every branch in turn finishes them all; branches that
        # wait for each other's blocks are refused (naming them), and closing a fork resolves it
        for _ in range(2000):
            branches = [root] + forks
            todo = [x for x in branches if any(not r.is_done for r in x.requests)]
            if not todo:
                break
            moved = False
            for x in todo:
                if x.last_step is not None and not x.last_step.sampled:
                    x.sample()
                moved |= one_step(x)
            if not moved:
                assert forks, "a session without forks stopped making progress"
                forks.pop().close()
            check_all(root, [root] + forks)
        for x in [root] + forks:
            for r in x.requests:
                assert r.status in ("finished", "aborted"), r
                if r.status == "finished" and r.logprobs is None:
                    assert len(r.output_token_ids) == r.sampling.max_new_tokens
        root.check()                          # any call collects the requests of forks dropped just now
        assert root.state.manager.num_used_blocks == 0, "a block is still held after every request ended"
    finally:
        if capture is not None:
            capture.__exit__(None, None, None)
        forks.clear()
        gc.collect()
