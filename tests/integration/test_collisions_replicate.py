"""The original bug on demand: replicate decode padding, its detection, its emulated damage, its fix.

Schedule: four requests decode together (a full batch of max_batch 4); request 0 stops first, and
from then on every decode step is partial, so replicate padding copies row 0 into row 3.
"""
import warnings

import pytest
import torch
from collision_kit import BS, EXTERNAL_CHECKS, NUM_BLOCKS, greedy, open_session, prompts, run_schedule

from qwen_npu import (
    FaultEmulationWarning,
    InvalidRequestError,
    SlotCollisionError,
    SlotCollisionWarning,
    StreamHealthWarning,
    check_slot_mapping,
)
from qwen_npu.cache.slot_check import ranges_text

LENS = (5, 6, 7, 8)
NEW = (2, 7, 6, 5)


def partial_decodes(sess):
    return [s for s in sess.history if s.kind == "decode" and s.num_active < s.batch_size]


@pytest.fixture(scope="module")
def runtime_streams(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    reqs = run_schedule(sess, LENS, NEW)
    report = sess.check()
    assert report.ok, report
    assert sess._engine.ledger.num_collisions == 0
    return [r.output_token_ids for r in reqs]


def test_runtime_padding_is_clean_and_matches_each_request_alone(tiny_ckpt_small_vocab, runtime_streams):
    for i, (n, new) in enumerate(zip(LENS, NEW)):
        solo = open_session(tiny_ckpt_small_vocab, max_batch=1)
        req = solo.add_request(prompts(LENS)[i], greedy(new))
        while not req.is_done:
            solo.step()
        assert req.output_token_ids == runtime_streams[i]


def test_replicate_with_checks_raises_at_the_first_partial_batch(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="raise")
    reqs = [sess.add_request(p, greedy(n)) for p, n in zip(prompts(LENS), NEW)]
    with pytest.raises(SlotCollisionError) as err:
        for _ in range(50):
            sess.step()
    decodes = [s for s in sess.history if s.kind == "decode"]
    assert decodes and all(s.batch_size == s.num_active == 4 for s in decodes)   # full batches ran
    assert reqs[0].is_done and all(not r.is_done for r in reqs[1:])               # the first partial one
    slot = reqs[1].block_table[reqs[1].num_computed_tokens // BS] * BS + reqs[1].num_computed_tokens % BS
    index = len(sess.history)
    first = err.value.problems[0]
    assert first.check == "duplicate" and first.slot == slot and first.rows == (0, 3)
    assert str(first) == (f"step {index} (decode, 4 rows dispatched, 3 active): rows 0, 3 (request {reqs[1].id}) "
                          f"both write slot {slot} (block {slot // BS}, offset {slot % BS})")
    assert {p.check for p in err.value.problems} == {"duplicate", "padding_write"}


def test_replicate_with_checks_off_runs_and_check_lists_every_collision(tiny_ckpt_small_vocab, runtime_streams):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # no check, no fault emulation: silent
        reqs = run_schedule(sess, LENS, NEW)
    # on the CPU the duplicate writes carry identical values, so the streams come out right:
    assert [r.output_token_ids for r in reqs] == runtime_streams
    partial = partial_decodes(sess)
    assert len(partial) >= 3
    report = sess.check()
    collisions = report.section("collisions")
    assert len(collisions) == len(partial)
    for step, msg in zip(partial, collisions):
        slot = int(step.slot_mapping[0])
        rows = [0, *range(step.num_active, step.batch_size)]       # row 0 and every padding row
        assert msg.startswith(f"step {step.index}: rows {ranges_text(rows)} (request {step.request_ids[0]}) wrote slot "
                              f"{slot} (block {slot // BS}, offset {slot % BS}) {len(rows)} times in one step")
    assert report.problems == collisions                     # nothing else is wrong


def test_external_checker_agrees_with_the_live_checks_on_every_step(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="warn")
    with pytest.warns(SlotCollisionWarning):
        run_schedule(sess, LENS, NEW)
    flagged = 0
    for step in sess.history:
        for kw in ({"positions": step.positions, "query_lens": step.query_lens},
                   {"seq_lens": step.seq_lens, "query_lens": step.query_lens}):
            rep = check_slot_mapping(step.slot_mapping, step.block_tables, BS, num_blocks=NUM_BLOCKS,
                                     active_rows=step.num_active, **kw)
            live = {(p.check, p.slot, p.rows) for p in step.slot_problems if p.check in EXTERNAL_CHECKS}
            assert {(p.check, p.slot, p.rows) for p in rep.items} == live, step.index
        flagged += bool(step.slot_problems)
    assert flagged == len(partial_decodes(sess)) >= 3


def test_nan_fault_model_turns_the_row0_stream_into_zeros(tiny_ckpt_small_vocab, runtime_streams):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    with sess.emulate_faults("nan_on_collision"):
        assert "EMULATED" in repr(sess)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reqs = run_schedule(sess, LENS, NEW)
    assert sess.fault_model is None                          # the with block restored "off"
    first = partial_decodes(sess)[0]
    victim = first.request_ids[0]                            # row 0 of the first partial batch
    faults = [str(w.message) for w in caught if w.category is FaultEmulationWarning]
    assert faults and all(m.startswith("EMULATED fault (nan_on_collision)") for m in faults)
    health = [str(w.message) for w in caught if w.category is StreamHealthWarning]
    assert health and all(f"request {victim}: non-finite logits" in m for m in health)
    for step in sess.history:
        assert {rid for rid, _ in step.health} <= {victim}
    # the victim's tokens before the fault are right; every token after it is 0
    out = reqs[victim].output_token_ids
    good = len(out) - sum(1 for s in sess.history if s.index > first.index and victim in s.logits_request_ids)
    assert out[:good] == runtime_streams[victim][:good]
    assert out[good:] == [0] * (len(out) - good) and len(out) > good
    for r in reqs:
        if r.id != victim:
            assert r.output_token_ids == runtime_streams[r.id]


def test_zero_fault_model_leaves_zeroed_slots_that_audit_locates(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    reqs = [sess.add_request(p, greedy(n)) for p, n in zip(prompts(LENS), (2, 12, 6, 5))]
    sess.emulate_faults("zero_on_collision")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while not reqs[3].is_done:
            sess.step()
    assert any(w.category is FaultEmulationWarning and str(w.message).startswith("EMULATED") for w in caught)
    victim = reqs[1]
    assert not victim.is_done and sess.fault_model == "zero_on_collision"
    hit = sorted({int(s.positions[0]) for s in partial_decodes(sess)})
    assert hit and all(s.request_ids[0] == victim.id for s in partial_decodes(sess))
    for p in hit:
        for layer in range(sess.kv.num_layers):
            k, v = sess.kv.read(victim, p, layer)
            assert not k.any() and not v.any()
    assert all(not s.health for s in sess.history)           # zeroed K/V keep the logits finite
    report = sess.audit(victim)
    assert not report.ok
    assert (report.first.layer, report.first.kind, report.first.position) == (0, "key", hit[0])
    assert report.first.slot == sess.kv.slot_of(victim, hit[0])
    # layer 0 K/V depend on the token alone: exactly the faulted positions differ there
    assert sorted({m.position for m in report.mismatches if m.layer == 0}) == hit
    others = [r for r in reqs if r is not victim and not r.is_done]
    assert others and all(sess.audit(r).ok for r in others)
    assert sess.kv.slot(report.first.slot).faults


def test_emulate_faults_setting(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab)
    assert sess.fault_model is None and "EMULATED" not in repr(sess)
    with pytest.raises(InvalidRequestError, match="zero_on_collision"):
        sess.emulate_faults("zero")
    assert sess.fault_model is None
    setting = sess.emulate_faults("zero_on_collision")
    assert sess.fault_model == "zero_on_collision" and "EMULATED" in repr(setting)
    with sess.emulate_faults("nan_on_collision"):
        assert sess.fault_model == "nan_on_collision"
    assert sess.fault_model == "zero_on_collision"
    sess.emulate_faults(None)
    assert sess.fault_model is None


def test_runtime_batch_never_triggers_the_fault_model(tiny_ckpt_small_vocab, runtime_streams):
    sess = open_session(tiny_ckpt_small_vocab)
    sess.emulate_faults("nan_on_collision")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reqs = run_schedule(sess, LENS, NEW)
    assert [r.output_token_ids for r in reqs] == runtime_streams
    assert sess.check().ok
    assert torch.isfinite(sess.kv.key(0)).all()


def test_reset_forgets_collisions_and_faults_but_keeps_the_fault_model(tiny_ckpt_small_vocab):
    sess = open_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="off")
    sess.emulate_faults("zero_on_collision")
    with pytest.warns(FaultEmulationWarning):
        run_schedule(sess, LENS, NEW)
    slot = int(partial_decodes(sess)[0].slot_mapping[0])
    assert sess.kv.slot(slot).faults and not sess.check().ok
    sess.reset()
    assert sess.fault_model == "zero_on_collision"
    info = sess.kv.slot(slot)
    assert (info.request_id, info.collisions, info.faults) == (None, (), ())
    assert sess.check().ok
