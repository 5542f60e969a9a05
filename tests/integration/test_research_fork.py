"""sess.fork(): branches share KV blocks copy-on-write; writes never leak; nothing leaks at the end."""
import pytest
from research_kit import greedy, make_ckpt, open_session, sequences

from qwen_npu import InvalidRequestError, SamplingParams

BS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_fork"))


def run(sess, reqs):
    while not all(r.is_done for r in reqs):
        sess.step()


def fresh(ckpt, prompt, sampling):
    sess = open_session(ckpt, block_size=BS)
    req = sess.add_request(prompt, sampling)
    run(sess, [req])
    return req.output_token_ids


def owner_writes(sess, req):
    """The ledger's last writer of every slot of ``req``'s computed tokens: {position: request id}."""
    table, ledger = req.block_table, sess._engine.ledger
    return {p: ledger.last(table[p // BS] * BS + p % BS).request_id for p in range(req.num_computed_tokens)}


def test_branches_continue_differently_each_like_a_fresh_run_and_share_blocks_until_written(ckpt):
    prompt = sequences([10], seed=21)[0]
    parent = open_session(ckpt, block_size=BS)
    p = parent.add_request(prompt, greedy(12))
    for _ in range(3):
        parent.step()                                          # prefill (chunks of 6) + decode
    assert p.status == "decoding" and p.num_computed_tokens == 11
    shared, partial = p.block_table[:2], p.block_table[2]
    child = parent.fork()
    (c,) = child.requests
    assert c.id != p.id and c.status == "decoding" and c.all_token_ids == p.all_token_ids
    assert c.block_table[:2] == shared and c.block_table[2] != partial   # full blocks shared, last copied
    pool = parent._engine.manager.pool
    assert [pool.ref_count(b) for b in shared] == [2, 2]
    assert pool.ref_count(partial) == 1 and pool.ref_count(c.block_table[2]) == 1
    assert owner_writes(child, c) == {q: (p.id if q < 8 else c.id) for q in range(11)}
    assert parent.check().ok and child.check().ok

    # the child takes another token at the fork point, then both go on greedily, interleaved
    step = child.decode_step()
    forced = (int(step.logits.tensor[0].argmax()) + 1) % 511
    child.sample(step, force={c.id: forced})
    while not (p.is_done and c.is_done):
        for sess, req in ((parent, p), (child, c)):
            if not req.is_done:
                sess.step()
        if not (p.is_done or c.is_done):
            assert [pool.ref_count(b) for b in shared] == [2, 2]
            assert owner_writes(parent, p) == {q: p.id for q in range(p.num_computed_tokens)}
            cw = owner_writes(child, c)
            assert all(cw[q] == (p.id if q < 8 else c.id) for q in cw)
    assert p.output_token_ids == fresh(ckpt, prompt, greedy(12))
    head = c.output_token_ids[:3]
    assert head == p.output_token_ids[:2] + [forced] and p.output_token_ids[2] != forced
    assert c.output_token_ids[3:] == fresh(ckpt, prompt + head, greedy(9))
    manager = parent._engine.manager
    assert manager.check() == [] and manager.num_used_blocks == 0
    assert all(pool.ref_count(b) == 0 for b in range(manager.num_blocks))
    assert parent.check().ok and child.check().ok


def test_a_child_with_its_own_sampling_equals_a_fresh_seeded_run(ckpt):
    prompt = sequences([7], seed=22)[0]
    parent = open_session(ckpt, block_size=BS)
    p = parent.add_request(prompt, greedy(9))
    parent.step()
    parent.step()
    parent.step()
    done = list(p.output_token_ids)
    assert len(done) == 2
    sampled = SamplingParams(max_new_tokens=9, temperature=1.0, seed=5, ignore_eos=True)
    child = parent.fork(sampling=sampled)
    (c,) = child.requests
    run(child, [c])
    run(parent, [p])
    assert c.output_token_ids[:2] == done
    again = SamplingParams(max_new_tokens=7, temperature=1.0, seed=5, ignore_eos=True)
    assert c.output_token_ids[2:] == fresh(ckpt, prompt + done, again)
    assert c.output_token_ids != p.output_token_ids
    assert parent._engine.manager.num_used_blocks == 0 and parent._engine.manager.check() == []


def test_an_unchanged_child_samples_what_the_parent_samples(ckpt):
    prompt = sequences([6], seed=23)[0]
    parent = open_session(ckpt, block_size=BS)
    p = parent.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=0.9, seed=3, ignore_eos=True))
    parent.step()
    child = parent.fork()
    run(child, child.requests)
    run(parent, [p])
    assert child.requests[0].output_token_ids == p.output_token_ids


def test_fork_refusals_and_branch_reset(ckpt):
    parent = open_session(ckpt, block_size=BS)
    p = parent.add_request(sequences([5], seed=24)[0], greedy(6))
    step = parent.prefill()
    with pytest.raises(InvalidRequestError, match="unsampled rows"):
        parent.fork()
    parent.sample(step)
    with pytest.raises(InvalidRequestError, match="max_new_tokens=1 leaves nothing"):
        parent.fork(sampling=greedy(1))
    child = parent.fork()
    extra = child.add_request([1, 2, 3], greedy(2))
    assert extra.id not in (p.id, child.requests[0].id)          # ids are unique across branches
    child.step()
    child.reset()                                                 # aborts only the child's requests
    assert child.requests == [] and p.status == "decoding"
    run(parent, [p])
    assert parent._engine.manager.num_used_blocks == 0 and parent.check().ok
