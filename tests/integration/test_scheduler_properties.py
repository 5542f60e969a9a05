"""Random add / step / abort / reset sequences on tiny caches keep every invariant and lose no request.

Tiny caches (a few blocks of 1..4 slots) force preemption; prompts drawn from a three-token
alphabet repeat prefixes, so blocks are shared, published, cached and evicted all the time.
"""
import pytest
from cache_kit import assert_no_leaks, live_slot_problems
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen_npu import InvalidRequestError, OutOfBlocksError, SamplingParams, Session

MAX_MODEL_LEN = 16


@pytest.fixture(scope="module")
def sessions(tiny_ckpt_small_vocab):
    """One Session per cache shape, reused across examples through ``reset()``."""
    made: dict[tuple, Session] = {}

    def get(**kw) -> Session:
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = Session.from_pretrained(tiny_ckpt_small_vocab, device="cpu", max_model_len=MAX_MODEL_LEN,
                                                **kw)
        sess = made[key]
        sess.reset()
        return sess

    return get


class Tables:
    """Block tables are append-only while a request holds them (a preemption starts a new one)."""

    def __init__(self):
        self.seen: dict[int, tuple[int, list[int]]] = {}      # request id -> (preemptions, table)

    def check(self, sess: Session) -> list[str]:
        problems = []
        for r in sess.requests:
            table = r.block_table
            if r.id in self.seen and self.seen[r.id][0] == r.num_preemptions and table:
                old = self.seen[r.id][1]
                if table[:len(old)] != old:
                    problems.append(f"request {r.id}: block table {old} became {table}")
            self.seen[r.id] = (r.num_preemptions, table)
        return problems


def check_invariants(sess: Session, tables: Tables) -> None:
    problems = sess._engine.manager.check() + live_slot_problems(sess) + tables.check(sess)
    for r in sess.requests:
        if r.is_done and r.block_table:
            problems.append(f"request {r.id} is {r.status} but holds blocks {r.block_table}")
        if r.status == "waiting" and (r.block_table or r.num_computed_tokens):
            problems.append(f"request {r.id} waits but holds blocks {r.block_table} "
                            f"({r.num_computed_tokens} computed)")
    assert not problems, "\n".join(problems)


def one_step(sess: Session, abort_before_sample: int | None) -> None:
    """A step, sometimes run by hand with a request aborted between the forward and the sample."""
    if abort_before_sample is None:
        sess.step()
        return
    if any(r.status in ("waiting", "prefilling") for r in sess.requests):
        try:
            step = sess.prefill()
        except InvalidRequestError:
            # no prompt can make progress now (no room): the decoding requests hold the blocks
            step = sess.decode_step()
    else:
        step = sess.decode_step()
    live = [r for r in sess.requests if not r.is_done]
    if live:
        sess.abort(live[abort_before_sample % len(live)])
    if step.logits is not None:
        sess.sample(step)


KINDS = ["add"] * 4 + ["step"] * 5 + ["step_abort", "abort", "reset"]
ops = st.tuples(st.sampled_from(KINDS), st.lists(st.integers(0, 2), min_size=1, max_size=9), st.integers(1, 5))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(block_size=st.integers(1, 4), capacity=st.integers(4, 13), max_batch=st.integers(1, 4),
       chunk_size=st.integers(1, 8), prefix_cache=st.booleans(), program=st.lists(ops, min_size=4, max_size=20))
def test_random_programs_keep_the_invariants_and_finish_every_request(
        sessions, block_size, capacity, max_batch, chunk_size, prefix_cache, program):
    num_blocks = -(-capacity // block_size)
    sess = sessions(block_size=block_size, num_blocks=num_blocks, max_batch=max_batch, chunk_size=chunk_size,
                    prefix_cache=prefix_cache)
    tables = Tables()
    for op, tokens, n in program:
        live = [r for r in sess.requests if not r.is_done]
        if op == "add":
            sampling = SamplingParams(max_new_tokens=n, ignore_eos=True)
            if len(tokens) + n - 1 > num_blocks * block_size:      # it alone cannot fit: refused
                before = [(r.id, r.status, r.num_computed_tokens, r.block_table) for r in sess.requests]
                with pytest.raises(OutOfBlocksError):
                    sess.add_request(tokens, sampling)
                assert before == [(r.id, r.status, r.num_computed_tokens, r.block_table) for r in sess.requests]
            else:
                sess.add_request(tokens, sampling)
        elif op in ("step", "step_abort") and live:
            one_step(sess, n if op == "step_abort" else None)
        elif op == "abort" and live:
            sess.abort(live[n % len(live)])
        elif op == "reset":
            sess.reset()
            tables = Tables()
            assert sess.requests == [] and sess.blocks.counts()["free"] == num_blocks
        check_invariants(sess, tables)
    # never lose a request: stepping on finishes every one of them
    for _ in range(1000):
        if all(r.is_done for r in sess.requests):
            break
        sess.step()
        check_invariants(sess, tables)
    for r in sess.requests:
        assert r.status in ("finished", "aborted"), r
        if r.status == "finished":
            assert len(r.output_token_ids) == r.sampling.max_new_tokens and r.finish_reason == "length"
    assert_no_leaks(sess)
