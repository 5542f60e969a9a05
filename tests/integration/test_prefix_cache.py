"""The prefix cache seen from the Session: what a step computes, what it reuses, what it shares."""
import pytest
import torch
from cache_kit import TOL, assert_no_leaks, assert_same_outputs, record_dispatch, run_logits, written_blocks
from session_kit import greedy, make_untied, open_session, prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_untied(tmp_path_factory.mktemp("prefix_cache"))


def row_of(step, rid):
    """(positions, query_len) of ``rid``'s row in ``step``."""
    row = step.request_ids.index(rid)
    start = int(step.query_lens[:row].sum())
    n = int(step.query_lens[row])
    return step.positions[start:start + n].tolist(), n


def shared_prefix_plan():
    base = prompts((30,), seed=1)[0]
    tails = prompts((3, 6, 1), seed=2)
    return [
        (0, base, greedy(6)),
        (3, base[:22] + tails[0], greedy(5)),       # shares 5 blocks of 4 with request 0
        (3, base + tails[1], greedy(4)),            # shares every full block of request 0's prompt
        (9, base, greedy(6)),                       # the same prompt again
        (9, base[:5] + tails[2], greedy(3)),        # shares one block
        (12, prompts((9,), seed=3)[0], greedy(5)),  # shares nothing
    ]


def test_same_tokens_and_logits_with_the_prefix_cache_on_and_off(ckpt):
    on = open_session(ckpt, prefix_cache=True)
    off = open_session(ckpt, prefix_cache=False)
    got_on = run_logits(on, shared_prefix_plan())
    got_off = run_logits(off, shared_prefix_plan())
    assert_same_outputs(got_on, got_off)
    assert on.prefix_cache_stats.hit_blocks > 0
    assert off.prefix_cache_stats.hit_blocks == off.prefix_cache_stats.queries == 0
    computed_on = sum(int(s.query_lens.sum()) for s in got_on[2] if s.kind == "prefill")
    computed_off = sum(int(s.query_lens.sum()) for s in got_off[2] if s.kind == "prefill")
    assert computed_off - computed_on == on.prefix_cache_stats.hit_tokens
    assert_no_leaks(on)
    assert_no_leaks(off)


def test_a_request_sharing_a_long_prefix_computes_only_its_unshared_tokens(ckpt):
    sess = open_session(ckpt, block_size=4)
    base = prompts((30,), seed=4)[0]
    first = sess.add_request(base, greedy(4))
    sess.step()
    first_blocks = first.block_table
    while not first.is_done:
        sess.step()
    before = sess.prefix_cache_stats
    second = sess.add_request(base[:26] + [7, 8, 9, 10, 11], greedy(4))
    step = sess.step()
    # eligible blocks: (31 - 1) // 4 = 7; blocks 0..5 (positions 0..23) match request 0's prompt,
    # block 6 holds positions 24..27, whose tokens differ from request 0's
    assert row_of(step, second.id) == (list(range(24, 31)), 7)
    assert second.num_cached_tokens == 24
    assert second.block_table[:6] == first_blocks[:6]
    after = sess.prefix_cache_stats
    assert (after.queries - before.queries, after.hit_blocks - before.hit_blocks,
            after.hit_tokens - before.hit_tokens, after.miss_blocks - before.miss_blocks) == (1, 6, 24, 1)
    blocks = sess.blocks
    assert [blocks[b].request_ids for b in first_blocks[:6]] == [(second.id,)] * 6
    assert "6 blocks hit" in repr(sess) and "6 blocks hit" in repr(blocks)
    while not second.is_done:
        sess.step()
    # the same tokens as computing it alone, with nothing cached
    alone = open_session(ckpt, block_size=4, prefix_cache=False)
    assert alone.generate([second.prompt_token_ids], greedy(4), progress=False)[0].token_ids == \
        tuple(second.output_token_ids)
    assert_no_leaks(sess)


def test_equal_token_blocks_under_different_prefixes_do_not_match(ckpt):
    sess = open_session(ckpt, block_size=4)
    x, y, z = prompts((4, 4, 4), seed=5)
    sess.generate([x + y + [1]], greedy(2), progress=False)
    hits = sess.prefix_cache_stats.hit_blocks
    other = sess.add_request(z + y + [1], greedy(2))           # block 1 holds y, after z
    step = sess.step()
    assert row_of(step, other.id) == (list(range(9)), 9)
    assert sess.prefix_cache_stats.hit_blocks == hits
    same = sess.add_request(x + y + [2], greedy(2))            # x then y: both blocks match
    step = sess.step()
    assert row_of(step, same.id) == ([8], 1)
    assert same.num_cached_tokens == 8
    assert sess.prefix_cache_stats.hit_blocks == hits + 2


@pytest.mark.parametrize("length, cached, computed", [
    (8, 4, [4, 5, 6, 7]),       # a fully cached prompt on a block boundary: its last block is recomputed
    (5, 4, [4]),                # at least the last token is computed, so the request gets logits
    (4, 0, [0, 1, 2, 3]),       # one block: the block holding the last token is never shared
])
def test_the_last_prompt_token_is_always_computed_in_a_private_block(ckpt, length, cached, computed):
    sess = open_session(ckpt, block_size=4)
    base = prompts((8,), seed=6)[0]
    first = sess.add_request(base, greedy(3))
    sess.step()
    first_blocks = first.block_table
    logits_first = sess.last_step.logits.tensor[0].clone()
    while not first.is_done:
        sess.step()
    again = sess.add_request(base[:length], greedy(3))
    step = sess.step()
    assert row_of(step, again.id) == (computed, len(computed))
    assert again.num_cached_tokens == cached
    assert step.logits_request_ids == [again.id]
    last_block = again.block_table[(length - 1) // 4]
    assert last_block not in first_blocks
    assert sess.blocks[last_block].ref_count == 1
    # the first run's block with the same tokens stays cached and unshared
    assert sess.blocks[first_blocks[(length - 1) // 4]].state == "cached"
    if length == 8:
        # the recomputed logits of the last prompt token match the first run's
        torch.testing.assert_close(step.logits.tensor[0], logits_first, atol=TOL, rtol=0)
        assert again.output_token_ids[0] == first.output_token_ids[0]


def test_a_block_hash_is_published_only_after_the_step_that_fills_it(ckpt, monkeypatch):
    sess = open_session(ckpt, block_size=4, chunk_size=8)
    seen = record_dispatch(sess, monkeypatch)
    base = prompts((22,), seed=7)[0]
    a = sess.add_request(base, greedy(2))
    b = sess.add_request(base, greedy(2))
    steps = [sess.step() for _ in range(4)]
    # steps 0 and 1 compute a's positions 0..15 (the chunk budget is spent: b is not admitted);
    # step 2 computes a's 16..21, filling block 4 (positions 16..19), which b's prompt starts
    # with too: b waits rather than compute it a second time. Step 3 admits b after every full
    # block of a's prompt was published: b computes only its last two tokens.
    assert row_of(steps[2], a.id) == (list(range(16, 22)), 6)
    assert b.id not in steps[2].request_ids
    assert row_of(steps[3], b.id) == ([20, 21], 2)
    assert b.num_cached_tokens == 20
    assert b.block_table[:5] == a.block_table[:5] and b.block_table[5] != a.block_table[5]
    s = sess.prefix_cache_stats
    assert (s.queries, s.hit_blocks, s.miss_blocks) == (2, 5, 5)      # a missed all its 5 blocks
    for (plan, blocks), step in zip(seen, steps):
        for block in written_blocks(step, 4):
            assert blocks[block].block_hash is None, f"step {step.index} writes published block {block}"
            assert blocks[block].ref_count == 1
    after = sess.blocks
    assert [after[x].block_hash is not None for x in a.block_table] == [True] * 5 + [False]
    assert after[b.block_table[5]].block_hash is None                  # b's own last block
    while not (a.is_done and b.is_done):
        sess.step()
    assert_no_leaks(sess)


def test_freed_prefixes_stay_reusable_until_needed_then_are_evicted_least_recent_first(ckpt):
    sess = open_session(ckpt, block_size=4, num_blocks=6, max_model_len=24)
    pa, pb, pc = prompts((8, 8, 16), seed=8)
    a = sess.add_request(pa, greedy(1))
    while not a.is_done:
        sess.step()
    b = sess.add_request(pb, greedy(1))
    while not b.is_done:
        sess.step()
    blocks = sess.blocks
    assert blocks.counts() == {"used": 0, "cached": 4, "free": 2}
    assert {e.token_ids for e in blocks.with_state("cached")} == {tuple(pa[:4]), tuple(pa[4:]),
                                                                 tuple(pb[:4]), tuple(pb[4:])}
    # c needs 4 blocks: the 2 free ones, then the 2 least recently freed cached ones (a's)
    c = sess.add_request(pc, greedy(1))
    while not c.is_done:
        sess.step()
    cached = {e.token_ids for e in sess.blocks.with_state("cached")}
    assert tuple(pb[:4]) in cached and tuple(pa[:4]) not in cached
    assert tuple(pa[4:]) not in cached
    hits = sess.prefix_cache_stats.hit_blocks
    again_b = sess.add_request(pb, greedy(1))
    sess.step()
    assert again_b.num_cached_tokens == 4 and sess.prefix_cache_stats.hit_blocks == hits + 1
    assert again_b.output_token_ids == b.output_token_ids
    again_a = sess.add_request(pa, greedy(1))
    sess.step()
    assert again_a.num_cached_tokens == 0 and sess.prefix_cache_stats.hit_blocks == hits + 1
    assert again_a.output_token_ids == a.output_token_ids
    assert_no_leaks(sess)


def test_a_block_shared_by_two_running_requests_is_never_written(ckpt, monkeypatch):
    sess = open_session(ckpt, block_size=4)
    base = prompts((16,), seed=9)[0]
    a = sess.add_request(base, greedy(8))
    sess.step()
    sess.step()                                   # a's prompt, then one decode step
    b = sess.add_request(base, greedy(8))         # shares a's blocks 0..2, recomputes positions 12..15
    seen = record_dispatch(sess, monkeypatch)
    steps = [sess.step()]
    assert row_of(steps[0], b.id) == ([12, 13, 14, 15], 4)
    shared = a.block_table[:3]
    assert b.block_table[:3] == shared and b.block_table[3] != a.block_table[3]
    assert [sess.blocks[x].request_ids for x in shared] == [(a.id, b.id)] * 3
    kv = sess._engine.kv_cache
    before = [t[shared].clone() for t in kv.keys + kv.values]
    while not (a.is_done and b.is_done):
        steps.append(sess.step())
    assert len(seen) == len(steps)
    for (_, blocks), step in zip(seen, steps):
        for block in written_blocks(step, 4):
            assert blocks[block].ref_count == 1, f"step {step.index} writes block {block}, which is shared"
            assert block not in shared
    assert all(torch.equal(t[shared], x) for t, x in zip(kv.keys + kv.values, before))
    assert a.output_token_ids == b.output_token_ids
    assert_no_leaks(sess)


def test_sess_blocks_is_a_frozen_snapshot_of_every_block(ckpt):
    sess = open_session(ckpt, block_size=4, num_blocks=8)
    base = prompts((10,), seed=10)[0]
    a = sess.add_request(base, greedy(3))
    sess.step()
    snap = sess.blocks
    text, html = repr(snap), snap._repr_html_()
    table = a.block_table
    assert len(snap) == 8 and [e.block_id for e in snap] == list(range(8))
    assert [snap[b].state for b in table] == ["used"] * 3
    assert [snap[b].request_ids for b in table] == [(a.id,)] * 3
    assert [snap[b].token_ids for b in table] == [tuple(base[:4]), tuple(base[4:8]), tuple(base[8:])]
    assert [snap[b].block_hash is not None for b in table] == [True, True, False]
    assert snap[table[1]].parent_hash == snap[table[0]].block_hash
    assert snap.counts() == {"used": 3, "cached": 0, "free": 5}
    with pytest.raises(AttributeError):
        snap[table[0]].ref_count = 5
    sess.step()                                    # a decode step writes position 10 into block table[2]
    assert repr(snap) == text and snap._repr_html_() == html
    assert sess.blocks[table[2]].token_ids == tuple(base[8:]) + (a.output_token_ids[0],)
    while not a.is_done:
        sess.step()
    after = sess.blocks
    assert after.counts() == {"used": 0, "cached": 3, "free": 5}    # 13 tokens, 12 computed: 3 full blocks
    assert all(e.ref_count == 0 and e.request_ids == () for e in after)
    assert repr(after) == repr(sess.blocks) and after._repr_html_() == sess.blocks._repr_html_()
    assert "<table" in after._repr_html_() and "cached" in repr(after)


def test_identical_prompts_added_together_compute_their_shared_blocks_once(ckpt):
    on = open_session(ckpt, block_size=4, chunk_size=64)
    off = open_session(ckpt, block_size=4, chunk_size=64, prefix_cache=False)
    base = prompts((18,), seed=9)[0]
    outs = {}
    for sess in (on, off):
        reqs = [sess.add_request(base, greedy(3)) for _ in range(3)]
        first = sess.step()
        outs[sess is on] = (first, reqs)
        while not all(r.is_done for r in reqs):
            sess.step()
    (first_on, reqs_on), (first_off, reqs_off) = outs[True], outs[False]
    # with the cache: one row computes the whole prompt, the others wait a step and then compute
    # only their last block's two tokens; without it all three compute everything at once
    assert first_on.request_ids == [reqs_on[0].id] and first_on.query_lens.tolist() == [18]
    assert first_off.query_lens.tolist() == [18, 18, 18]
    assert [r.num_cached_tokens for r in reqs_on] == [0, 16, 16]
    assert [r.output_token_ids for r in reqs_on] == [r.output_token_ids for r in reqs_off]
    assert_no_leaks(on)


def test_a_prompt_sharing_nothing_is_admitted_beside_one_being_computed(ckpt):
    sess = open_session(ckpt, block_size=4, chunk_size=64)
    a = sess.add_request(prompts((18,), seed=10)[0], greedy(2))
    b = sess.add_request(prompts((18,), seed=11)[0], greedy(2))
    step = sess.step()
    assert step.request_ids == [a.id, b.id] and step.query_lens.tolist() == [18, 18]
