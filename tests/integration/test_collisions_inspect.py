"""sess.kv (slot view), sess.check() on crafted damage, and stream health flags."""
import dataclasses

import pytest
import torch
from collision_kit import BS, NUM_BLOCKS, greedy, open_session, two_decoding

from qwen_npu import InvalidRequestError, StreamHealthWarning


@pytest.fixture
def sess(tiny_ckpt_small_vocab):
    return open_session(tiny_ckpt_small_vocab)


# ---- sess.kv -----------------------------------------------------------------------------------

def test_kv_shapes_and_live_tensors(sess):
    kv = sess.kv
    mc = sess.model_config
    assert (kv.num_layers, kv.num_blocks, kv.block_size) == (mc.num_hidden_layers, NUM_BLOCKS, BS)
    assert kv.key(0).shape == (NUM_BLOCKS, BS, mc.num_key_value_heads, mc.head_dim) == kv.value(1).shape
    a, _ = two_decoding(sess)
    kv.value(1)[a.block_table[0], 2] = 3.0                   # writing the live tensor changes the cache
    assert kv.read(a, 2, 1)[1].eq(3.0).all()
    for bad in (-1, kv.num_layers, "0", True):
        with pytest.raises(InvalidRequestError, match="layer"):
            kv.key(bad)


def test_read_returns_host_copies_of_one_token(sess):
    _, b = two_decoding(sess)
    kv = sess.kv
    slot = kv.slot_of(b, 5)
    assert slot == b.block_table[1] * BS + 1
    k, v = kv.read(b.id, 5, 0)                               # a Request or its id
    assert k.shape == (sess.model_config.num_key_value_heads, sess.model_config.head_dim)
    assert k.equal(kv.key(0)[slot // BS, slot % BS]) and v.equal(kv.value(0)[slot // BS, slot % BS])
    k.zero_()                                                # a copy: the cache is untouched
    assert kv.read(b, 5, 0)[0].abs().sum() > 0


def test_read_refuses_tokens_not_in_the_cache(sess):
    a, _ = two_decoding(sess, lens=(6, 7))
    kv = sess.kv
    with pytest.raises(InvalidRequestError, match=r"computed positions 0\.\.5; position 6 is not in the cache"):
        kv.read(a, 6, 0)                                     # sampled, not yet fed
    with pytest.raises(InvalidRequestError, match="position"):
        kv.read(a, 1.5, 0)
    sess.abort(a)
    with pytest.raises(InvalidRequestError, match="aborted: its blocks were freed"):
        kv.read(a, 0, 0)
    waiting = sess.add_request([1, 2, 3], greedy(2))
    with pytest.raises(InvalidRequestError, match="waiting: it holds no blocks"):
        kv.read(waiting, 0, 0)
    with pytest.raises(InvalidRequestError, match="no request with id 42"):
        kv.read(42, 0, 0)


def test_slot_info_snapshot(sess):
    a, _ = two_decoding(sess)
    kv = sess.kv
    slot = kv.slot_of(a, 4)
    info = kv.slot(slot)
    assert (info.slot, info.block, info.offset) == (slot, slot // BS, slot % BS)
    assert (info.request_id, info.position, info.written_at_step) == (a.id, 4, 0)
    assert info.held_by == ((a.id, 4),) and info.is_live and not info.collisions
    assert [(w.request_id, w.position, w.step) for w in info.history] == [(a.id, 4, 0)]
    assert f"slot {slot} (block {slot // BS}, offset {slot % BS})" in repr(info)
    assert info._repr_html_() == kv.slot(slot)._repr_html_()
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.position = 0
    sess.decode_step()                                       # a snapshot does not follow the session
    assert info.written_at_step == 0
    free = max(set(range(NUM_BLOCKS)) - {x for r in sess.requests for x in r.block_table}) * BS
    empty = kv.slot(free)
    assert (empty.request_id, empty.position, empty.written_at_step, empty.held_by) == (None, None, None, ())
    assert "never written" in repr(empty)
    for bad in (-1, NUM_BLOCKS * BS, "3"):
        with pytest.raises(InvalidRequestError, match="slot"):
            kv.slot(bad)


# ---- sess.check() --------------------------------------------------------------------------------

def test_check_is_ok_on_a_healthy_session(sess):
    two_decoding(sess)
    sess.sample(sess.decode_step())
    report = sess.check()
    assert report.ok and report.problems == () and report.num_running == 2
    assert repr(report).startswith("CheckReport: ok (2 running requests")
    assert report._repr_html_() == sess.check()._repr_html_()


def crafted(sess, how):
    """Damage the bookkeeping or the cache on purpose, the way a bug would."""
    a, b = two_decoding(sess)
    sess.sample(sess.decode_step())
    state = sess._engine.manager._requests[a.id]
    if how == "ref_count":
        sess._engine.manager.pool._blocks[a.block_table[0]].ref_count += 1
    elif how == "table_shrunk":
        state.table.pop()
    elif how == "table_rewritten":
        held = {x for r in sess.requests for x in r.block_table}
        state.table[0] = max(set(range(NUM_BLOCKS)) - held)
    elif how == "finished_holding":
        b.status = "finished"
    elif how == "tokens_differ":                             # b's block 0 claimed by a: same index, other tokens
        sess._engine.manager._requests[b.id].table[0] = a.block_table[0]
    elif how == "nan":
        slot = sess.kv.slot_of(b, 3)
        sess.kv.value(1)[slot // BS, slot % BS, 0, 0] = float("nan")
        return slot, b
    return a, b


@pytest.mark.parametrize("how, section, text", [
    ("ref_count", "blocks", "has ref_count 2 but 1 block tables hold it"),
    ("table_shrunk", "requests", "but its block table"),
    ("table_rewritten", "append_only", "tables are append-only"),
    ("finished_holding", "requests", "is finished but still holds blocks"),
    ("tokens_differ", "slots", "but their tokens differ at position 0"),
])
def test_check_reports_crafted_damage(sess, how, section, text):
    crafted(sess, how)
    report = sess.check()
    assert not report.ok
    assert any(text in m for m in report.section(section)), report
    assert text in repr(report) and "&#10007;" in report._repr_html_()


def test_check_reports_non_finite_values_where_they_are(sess):
    slot, b = crafted(sess, "nan")
    report = sess.check()
    expected = (f"slot {slot} (block {slot // BS}, offset {slot % BS}; request {b.id} position 3) holds "
                f"non-finite values: V in layer 1")
    assert report.problems == (expected,)
    with pytest.raises(ValueError, match="section"):
        report.section("nope")


# ---- stream health ---------------------------------------------------------------------------------

def test_non_finite_logits_are_flagged_naming_the_request(sess):
    _, b = two_decoding(sess)
    slot = sess.kv.slot_of(b, 2)
    sess.kv.key(0)[slot // BS, slot % BS] = float("nan")      # a torn slot: K and V both garbage
    sess.kv.value(0)[slot // BS, slot % BS] = float("nan")
    step = sess.decode_step()
    with pytest.warns(StreamHealthWarning, match=f"step {step.index}: request {b.id}: non-finite logits"):
        sess.sample(step)
    assert step.health == [(b.id, "non-finite logits")]


def test_all_zero_logits_are_flagged_naming_the_request(sess):
    from qwen_npu.research import zero
    a, _ = two_decoding(sess)
    with sess.intervene("final_norm", zero(), requests=[a]):      # row a's final hidden state -> 0
        step = sess.decode_step()
    assert step.logits.tensor[0].eq(0).all() and step.logits.tensor[1].ne(0).any()
    with pytest.warns(StreamHealthWarning, match=f"request {a.id}: all-zero logits"):
        sess.sample(step)
    assert step.health == [(a.id, "all-zero logits")]
    sess.sample(sess.decode_step())                          # healthy again: nothing flagged
    assert sess.last_step.health == []
    assert torch.isfinite(sess.last_step.logits.tensor).all()


def test_check_audit_and_slots_see_every_branch_after_a_fork(sess):
    a, _ = two_decoding(sess)
    child = sess.fork()
    for s in (sess, child):
        s.sample(s.decode_step())
        report = s.check()
        assert report.ok, report
    a2 = child.requests[0]
    assert child.audit(a2).ok and sess.audit(a).ok
    shared = sess.kv.slot_of(a, 0)                           # a full prefix block, now held by both
    assert child.kv.slot_of(a2, 0) == shared
    assert set(sess.kv.slot(shared).held_by) == {(a.id, 0), (a2.id, 0)}
