"""Abort anywhere, reset, and errors inside a step: every other request stays intact and runnable."""
import pytest
from cache_kit import assert_no_leaks, assert_same_outputs, run_logits
from session_kit import greedy, make_untied, open_session, prompts, state

import qwen_npu.engine.step
from qwen_npu import InvalidRequestError, SlotCollisionError
from qwen_npu.cache.manager import PrefixCacheStats


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_untied(tmp_path_factory.mktemp("robustness"))


@pytest.fixture(scope="module")
def others(ckpt):
    """The prompts that keep running around an aborted one, and their tokens when run alone."""
    ps = prompts((7, 12), seed=21)
    sess = open_session(ckpt, block_size=4, chunk_size=8)
    return ps, [list(c.token_ids) for c in sess.generate(ps, greedy(6), progress=False)]


def finish(sess, reqs, max_steps=500):
    for _ in range(max_steps):
        if all(r.is_done for r in reqs):
            return
        sess.step()
    raise AssertionError("requests did not finish")


def assert_gone(sess, req):
    assert req.status == "aborted" and req.finish_reason == "abort"
    assert req.block_table == [] and not sess._engine.manager.has(req.id)
    assert sess.blocks.of_request(req.id) == ()
    with pytest.raises(InvalidRequestError, match="already aborted"):
        sess.abort(req)


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding", "before its sample"])
def test_abort_at_any_point_frees_its_blocks_and_the_others_finish(ckpt, others, where):
    ps, want = others
    sess = open_session(ckpt, block_size=4, chunk_size=8)
    victim = sess.add_request(prompts((20,), seed=22)[0], greedy(6))    # three chunks of 8 tokens
    reqs = [sess.add_request(p, greedy(6)) for p in ps]
    if where == "waiting":
        sess.abort(victim)
    elif where == "prefilling":
        sess.step()
        assert victim.status == "prefilling" and 0 < victim.num_computed_tokens < 20
        sess.abort(victim.id)
    elif where == "decoding":
        while victim.status != "decoding":
            sess.step()
        sess.abort(victim)
    else:
        while True:
            step = sess.prefill() if victim.status in ("waiting", "prefilling") else sess.decode_step()
            if victim.id in step.logits_request_ids:
                break
            if step.logits is not None:
                sess.sample(step)
        outputs = list(victim.output_token_ids)
        sess.abort(victim)
        ids = sess.sample(step)
        assert ids.shape[0] == len(step.logits_request_ids)
        assert victim.output_token_ids == outputs            # its row was sampled but not applied
    assert_gone(sess, victim)
    finish(sess, reqs)
    assert [r.output_token_ids for r in reqs] == want
    assert_no_leaks(sess)


def plan_of(seed):
    ps = prompts((9, 14, 6), seed=seed)
    return [(0, ps[0], greedy(5)), (0, ps[1], greedy(4)), (2, ps[0][:8] + ps[2], greedy(6))]


def test_reset_returns_the_session_to_its_initial_state(ckpt):
    sess = open_session(ckpt, block_size=4, num_blocks=7)
    run_logits(sess, plan_of(23))                  # prefix hits and preemptions happen here
    assert sess.prefix_cache_stats.hit_blocks > 0
    assert sum(r.num_preemptions for r in sess.requests) > 0
    sess.add_request([1, 2, 3], greedy(2))
    sess.prefill()                                 # a step left unsampled
    sess.reset()
    assert sess.requests == [] and len(sess.history) == 0 and sess.last_step is None
    assert sess.prefix_cache_stats == PrefixCacheStats()
    assert sess.blocks.counts() == {"used": 0, "cached": 0, "free": 7}
    assert sess._engine.manager.pool.free_queue() == list(range(7))
    assert all(not t.any() for t in sess._engine.kv_cache.keys + sess._engine.kv_cache.values)
    again = run_logits(sess, plan_of(24))
    fresh_sess = open_session(ckpt, block_size=4, num_blocks=7)
    fresh = run_logits(fresh_sess, plan_of(24))
    assert [r.id for r in again[0]] == [r.id for r in fresh[0]] == [0, 1, 2]
    assert [s.index for s in again[2]] == [s.index for s in fresh[2]] == list(range(len(fresh[2])))
    assert_same_outputs(again, fresh, tol=0.0)
    assert sess.prefix_cache_stats == fresh_sess.prefix_cache_stats
    assert repr(sess.blocks) == repr(fresh_sess.blocks)
    assert_no_leaks(sess)


def test_a_step_refused_by_the_slot_check_leaves_every_request_runnable(ckpt, monkeypatch):
    want = run_logits(open_session(ckpt, block_size=4), plan_of(25))
    sess = open_session(ckpt, block_size=4)
    real = qwen_npu.engine.step.build_plan
    broken = []

    def build_plan(kind, *args, **kwargs):
        plan = real(kind, *args, **kwargs)
        if kind == "decode" and len(plan.rows) > 1 and not broken:
            plan.slot_mapping[1] = plan.slot_mapping[0]      # rows 0 and 1 write one slot
            broken.append(plan.index)
        return plan

    monkeypatch.setattr(qwen_npu.engine.step, "build_plan", build_plan)
    reqs = [sess.add_request(p, sp) for _, p, sp in plan_of(25)[:2]]
    sess.step()
    before = state(sess)
    with pytest.raises(SlotCollisionError, match="rows 0 and 1|rows 0, 1"):
        sess.step()
    assert state(sess) == before and broken
    reqs.append(sess.add_request(*plan_of(25)[2][1:]))
    finish(sess, reqs)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in want[0]]
    assert_no_leaks(sess)


def test_an_error_inside_the_forward_leaves_every_request_runnable(ckpt):
    want = run_logits(open_session(ckpt, block_size=4), plan_of(26))
    sess = open_session(ckpt, block_size=4)
    reqs = [sess.add_request(p, sp) for _, p, sp in plan_of(26)]
    sess.step()
    sess.step()

    def failing(x):
        raise RuntimeError("injected failure")

    before = state(sess)
    # layers 0 and 1 have written K/V when the forward fails
    with sess.intervene("layers.1.attn.out", failing), pytest.raises(RuntimeError, match="injected failure"):
        sess.step()
    assert state(sess) == before
    finish(sess, reqs)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in want[0]]
    assert_no_leaks(sess)


def test_a_bad_forced_token_is_refused_and_the_step_can_still_be_sampled(ckpt, others):
    ps, want = others
    sess = open_session(ckpt, block_size=4, chunk_size=8)
    reqs = [sess.add_request(p, greedy(6)) for p in ps]
    step = sess.prefill()
    while step.logits is None:
        step = sess.prefill()
    before = state(sess)
    vocab = sess.model_config.vocab_size
    rid = step.logits_request_ids[0]
    for force, match in (({rid: vocab}, "outside the vocabulary"), ({rid: -1}, "outside the vocabulary"),
                         ({999: 1}, "no logits row"), ([1] * (len(step.logits_request_ids) + 1), "logits rows")):
        with pytest.raises(InvalidRequestError, match=match):
            sess.sample(step, force=force)
        assert state(sess) == before
    with pytest.raises(InvalidRequestError, match="unsampled"):
        sess.step()
    sess.sample(step)
    finish(sess, reqs)
    assert [r.output_token_ids for r in reqs] == want
    assert_no_leaks(sess)
