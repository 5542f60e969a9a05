"""sess.audit(request): a dense recomputation of a request's K/V against what its slots hold."""
import pytest
import torch
from collision_kit import BS, greedy, open_session, prompts

from qwen_npu import InvalidRequestError


def running_session(path, **kw):
    """Three requests mid-decode, computed over several chunked prefill steps and decode steps."""
    sess = open_session(path, chunk_size=7, **kw)
    reqs = [sess.add_request(p, greedy(12)) for p in prompts((5, 9, 14))]
    for _ in range(9):
        sess.step()
    assert all(r.status == "decoding" for r in reqs)
    return sess, reqs


def state(sess):
    kv = sess.kv
    tensors = [kv.key(i).clone() for i in range(kv.num_layers)] + [kv.value(i).clone() for i in range(kv.num_layers)]
    return len(sess.history), sess.last_step.index, repr(sess._engine.ledger), len(sess._engine.ledger), tensors


def test_healthy_session_passes_and_audit_changes_nothing(tiny_ckpt_small_vocab):
    sess, reqs = running_session(tiny_ckpt_small_vocab)
    before = state(sess)
    for r in reqs:
        report = sess.audit(r)
        assert report.ok, report
        assert report.num_tokens == r.num_computed_tokens
        assert len(report.layers) == sess.kv.num_layers
        assert report.max_diff < 1e-5
        assert report.first is None and report.problems == ()
        assert repr(report).startswith(f"AuditReport(request {r.id}, {r.num_computed_tokens} tokens, float32): ok")
        assert report._repr_html_() == sess.audit(r)._repr_html_()
    after = state(sess)
    assert before[:4] == after[:4]
    assert all(a.equal(b) for a, b in zip(before[4], after[4]))
    assert sess.check().ok


@pytest.mark.parametrize("layer, kind", [(1, "key"), (0, "value")])
def test_zeroed_slot_is_found_and_located(tiny_ckpt_small_vocab, layer, kind):
    sess, reqs = running_session(tiny_ckpt_small_vocab)
    victim, position = reqs[1], 6
    slot = sess.kv.slot_of(victim, position)
    cache = sess.kv.key(layer) if kind == "key" else sess.kv.value(layer)
    cache[slot // BS, slot % BS].zero_()                     # inject the fault into the live cache
    report = sess.audit(victim)
    assert not report.ok
    assert len(report.mismatches) == 1                       # injected after the fact: nothing else moved
    m = report.first
    assert (m.layer, m.kind, m.position, m.slot, m.block, m.offset) == (layer, kind, position, slot, slot // BS,
                                                                       slot % BS)
    assert m.max_diff > 0.1
    assert not report.layers[layer].ok and report.layers[1 - layer].ok
    assert str(m) in report.problems[0] and f"request {victim.id}" in report.problems[0]
    assert "BAD" in repr(report)
    assert all(sess.audit(r).ok for r in reqs if r is not victim)


def test_tolerance_separates_rounding_from_damage(tiny_ckpt_small_vocab):
    sess, reqs = running_session(tiny_ckpt_small_vocab)
    slot = sess.kv.slot_of(reqs[0], 3)
    sess.kv.value(1)[slot // BS, slot % BS, 0, 0] += 1e-7
    assert sess.audit(reqs[0]).ok
    sess.kv.value(1)[slot // BS, slot % BS, 0, 0] += 1e-3
    report = sess.audit(reqs[0])
    assert [(m.layer, m.kind, m.position) for m in report.mismatches] == [(1, "value", 3)]
    assert sess.audit(reqs[0], tol=1e-2).ok


def test_nan_slot_is_a_mismatch(tiny_ckpt_small_vocab):
    sess, reqs = running_session(tiny_ckpt_small_vocab)
    slot = sess.kv.slot_of(reqs[2], 0)
    sess.kv.key(0)[slot // BS, slot % BS, 1, 5] = float("nan")
    report = sess.audit(reqs[2])
    assert (report.first.layer, report.first.position, report.first.max_diff) == (0, 0, float("inf"))


def test_prefix_shared_blocks_audit_clean(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    base = prompts((13,))[0]
    a = sess.add_request(base, greedy(4))
    sess.step()
    b = sess.add_request(base[:12] + [7], greedy(4))
    sess.step()
    assert b.num_cached_tokens == 12 and set(a.block_table[:3]) == set(b.block_table[:3])
    assert sess.audit(a).ok and sess.audit(b).ok


def test_audit_refuses_requests_without_cached_tokens(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    done = sess.add_request(prompts((5,))[0], greedy(1))
    sess.step()
    waiting = sess.add_request(prompts((6,))[0], greedy(1))
    with pytest.raises(InvalidRequestError, match="finished"):
        sess.audit(done)
    with pytest.raises(InvalidRequestError, match="no computed tokens"):
        sess.audit(waiting)
    with pytest.raises(InvalidRequestError, match="no request with id 99"):
        sess.audit(99)


def test_bfloat16_audit(tiny_ckpt_small_vocab):
    sess, reqs = running_session(tiny_ckpt_small_vocab, dtype="bfloat16")
    report = sess.audit(reqs[2])
    assert report.ok and report.dtype == "bfloat16"
    assert all(l.key_tol >= 8 * torch.finfo(torch.bfloat16).eps for l in report.layers)   # 8 ulps, scaled up
    slot = sess.kv.slot_of(reqs[2], 9)
    sess.kv.key(1)[slot // BS, slot % BS].zero_()
    report = sess.audit(reqs[2])
    assert (report.first.layer, report.first.position) == (1, 9) and len(report.mismatches) == 1
