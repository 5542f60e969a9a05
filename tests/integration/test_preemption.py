"""Preemption instead of failure: a tiny cache finishes every request with the large cache's tokens."""
import pytest
from cache_kit import assert_no_leaks, assert_same_outputs, run_logits
from session_kit import greedy, make_untied, open_session, prompts, state

from qwen_npu import OutOfBlocksError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_untied(tmp_path_factory.mktemp("preemption"))


def workload():
    """Five requests, two sharing a prefix, arriving over the first steps; 14 to 23 tokens each.

    The longest computes 22 tokens: 6 blocks of 4, 11 of 2 or 22 of 1 are the smallest caches.
    """
    ps = prompts((9, 14, 5, 11), seed=11)
    return [(0, ps[0], greedy(8)), (0, ps[1], greedy(5)), (1, ps[2], greedy(9)),
            (2, ps[0][:8] + ps[3], greedy(4)), (2, ps[3], greedy(7))]


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("block_size, num_blocks", [(4, 6), (2, 11), (1, 22)])
def test_a_tiny_cache_gives_the_same_tokens_and_logits_as_a_large_one(ckpt, prefix_cache, block_size,
                                                                       num_blocks):
    large = open_session(ckpt, block_size=block_size, num_blocks=512, prefix_cache=prefix_cache)
    tiny = open_session(ckpt, block_size=block_size, num_blocks=num_blocks, prefix_cache=prefix_cache)
    want = run_logits(large, workload())
    got = run_logits(tiny, workload())
    assert_same_outputs(got, want)
    assert all(r.finish_reason == "length" for r in got[0])
    assert sum(r.num_preemptions for r in got[0]) > 0
    assert sum(r.num_preemptions for r in want[0]) == 0
    assert_no_leaks(tiny)


def test_generate_completes_every_request_under_a_tiny_cache(ckpt):
    ps = [p for _, p, _ in workload()]
    sps = [sp for _, _, sp in workload()]
    want = open_session(ckpt, num_blocks=512).generate(ps, sps, progress=False)
    tiny = open_session(ckpt, block_size=4, num_blocks=6)
    got = tiny.generate(ps, sps, progress=False)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert sum(r.num_preemptions for r in tiny.requests) > 0
    assert_no_leaks(tiny)


def test_a_preempted_request_waits_keeping_its_tokens_and_is_recomputed(ckpt):
    sess = open_session(ckpt, block_size=4, num_blocks=5)
    old_p, new_p = prompts((7, 6), seed=12)
    old = sess.add_request(old_p, greedy(12))       # computes at most 18 tokens: 5 blocks, the whole cache
    new = sess.add_request(new_p, greedy(6))
    seen = []                                       # (step, status of old, status of new) after each step
    kept = None
    while not (old.is_done and new.is_done):
        before = list(new.output_token_ids)
        step = sess.step()
        seen.append((step.kind, old.status, new.status))
        if new.status == "waiting" and kept is None and before:
            # the most recently added request was preempted: no blocks, nothing computed, tokens kept
            kept = before
            assert new.output_token_ids == before and new.block_table == [] and new.num_computed_tokens == 0
            assert old.status == "decoding" and old.num_preemptions == 0
    assert kept is not None and new.num_preemptions >= 1
    assert new.output_token_ids[:len(kept)] == kept
    # once back, the request's whole sequence (prompt + kept outputs) is prefilled again
    assert ("prefill", "finished", "decoding") in seen or ("prefill", "decoding", "decoding") in seen
    want = open_session(ckpt, num_blocks=512).generate([old_p, new_p], [greedy(12), greedy(6)], progress=False)
    assert [old.output_token_ids, new.output_token_ids] == [list(c.token_ids) for c in want]
    assert_no_leaks(sess)


def test_only_the_most_recently_added_request_is_preempted(ckpt):
    # 5 blocks of 2: the older request computes at most 8 tokens (4 blocks), the newer one 9 (5)
    sess = open_session(ckpt, block_size=2, num_blocks=5, chunk_size=2, max_batch=2)
    old_p, new_p = prompts((3, 8), seed=17)
    old = sess.add_request(old_p, greedy(6))
    new = sess.add_request(new_p, greedy(2))
    statuses = []
    while not (old.is_done and new.is_done):
        step = sess.step()
        statuses.append((step.kind, old.status, new.status))
        if new.status == "prefilling" and old.status == "decoding" and step.kind == "decode":
            # the newer request's chunk found no block: it waited instead of preempting the older one
            assert len(new.block_table) == 3
    assert ("decode", "decoding", "prefilling") in statuses and ("decode", "decoding", "waiting") in statuses
    assert old.num_preemptions == 0 and new.num_preemptions >= 1
    want = open_session(ckpt, num_blocks=512).generate([old_p, new_p], [greedy(6), greedy(2)], progress=False)
    assert [old.output_token_ids, new.output_token_ids] == [list(c.token_ids) for c in want]
    assert_no_leaks(sess)


def test_out_of_blocks_only_when_one_request_alone_cannot_fit(ckpt):
    sess = open_session(ckpt, block_size=4, num_blocks=5)
    running = sess.add_request(prompts((6,), seed=13)[0], greedy(4))
    sess.step()
    before = state(sess)
    with pytest.raises(OutOfBlocksError, match="needs 6 blocks"):
        sess.add_request(prompts((18,), seed=14)[0], greedy(4))        # computes 21 tokens: 6 blocks
    with pytest.raises(OutOfBlocksError):
        sess.generate([[1, 2, 3], prompts((20,), seed=15)[0]], greedy(2), progress=False)
    assert state(sess) == before                                      # nothing added, nothing ran
    # exactly the whole cache (computes 20 tokens: 5 blocks) runs, preempting the other as needed
    fits = sess.add_request(prompts((17,), seed=16)[0], greedy(4))
    while not (running.is_done and fits.is_done):
        sess.step()
    assert fits.finish_reason == running.finish_reason == "length"
    assert_no_leaks(sess)
