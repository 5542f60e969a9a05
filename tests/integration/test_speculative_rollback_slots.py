"""The slots of rejected drafts: marked in the ledger when the sample gives them back, named by the
slot views and the slot checks, and caught by ``check()`` when a rollback leaves one in a context."""
import pytest

from qwen_npu import SamplingParams, Session
from qwen_npu.cache.slot_check import StepWrites, check_step_writes
from qwen_npu.engine import verify
from qwen_npu.testing import tiny_trained_qwen3

PROMPT = "the red house and the red house and the"
OPTIONS = dict(device="cpu", kernels="reference", max_batch=2, block_size=4, num_blocks=64, max_model_len=128,
               speculative="ngram", num_speculative_tokens=3)


def step_until_a_rejection(sess, req, limit=40):
    """Step until a verification rejects a draft; returns that (sampled) step."""
    for _ in range(limit):
        step = sess.step()
        if step.rolled_back.get(req.id):
            return step
    raise AssertionError("no draft was rejected: the test proves nothing")


def test_rejected_drafts_are_marked_until_written_again():
    sess = Session.from_pretrained(tiny_trained_qwen3(), **OPTIONS)
    req = sess.add_request(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    step = step_until_a_rejection(sess, req)
    slots = step.rolled_back[req.id]
    for s in slots:
        info = sess.kv.slot(s)
        assert info.rolled_back_in == step.index and info.request_id == req.id and not info.is_live
        assert f"rolled back in step {step.index}" in repr(info)
        assert sess._engine.ledger.history(s)[-1].rolled_back_in == step.index
    assert sess.check().ok
    sess.step()                                   # the next step writes the first given-back slot again
    again = sess.kv.slot(slots[0])
    assert again.rolled_back_in is None and again.written_at_step == step.index + 1 and again.is_live


def test_a_write_into_a_rejected_drafts_slot_is_named_by_the_slot_check():
    sess = Session.from_pretrained(tiny_trained_qwen3(), **OPTIONS)
    req = sess.add_request(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    step = step_until_a_rejection(sess, req)
    slot = step.rolled_back[req.id][-1]
    bs = sess.kv.block_size
    # another request's token (request 99, a block of its own) mapped onto that slot by mistake
    writes = StepWrites(step=step.index + 1, kind="decode", num_dispatched=1, num_active=1, row_request_ids=[99],
                        row_positions=[[0]], row_slots=[[slot]], row_block_tables=[[63]])
    problems = check_step_writes(writes, block_size=bs, num_blocks=64, ledger=sess._engine.ledger)
    assert problems and problems[0].check == "outside_blocks"
    assert f"a rejected draft, rolled back in step {step.index}" in problems[0].message


def test_check_catches_a_rollback_that_keeps_a_rejected_draft(monkeypatch):
    """An off-by-one rollback that books the first rejected draft's position as computed: the
    position's token is the resampled one, its slot still holds the draft's K/V, and check()
    names the slot."""
    def forgetful(draft, req, row, kept):
        verify_rollback(draft, req, row, kept + 1 if kept < len(row.drafts) else kept)
    verify_rollback = verify.rollback
    sess = Session.from_pretrained(tiny_trained_qwen3(), **OPTIONS)
    req = sess.add_request(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    monkeypatch.setattr(verify, "rollback", forgetful)
    step = step_until_a_rejection(sess, req)
    report = sess.check()
    found = [p for p in report.problems if "rollback left a rejected draft" in p]
    assert found and f"step {step.index} rejected" in found[0], report


def test_step_views_and_dumps_show_drafts_kept_and_rolled_back(tmp_path):
    from qwen_npu import load_dump
    sess = Session.from_pretrained(tiny_trained_qwen3(), **OPTIONS)
    req = sess.add_request(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))
    step = step_until_a_rejection(sess, req)
    drafts, kept, slots = step.drafts[req.id], step.accepted[req.id], step.rolled_back[req.id]
    text = repr(step)
    assert f"{len(drafts)} drafts {list(drafts)}, {kept} kept" in text
    assert f"rolled back: request {req.id}: slots" in text and "given back (rejected drafts)" in text
    html = step._repr_html_()
    assert "rolled back" in html and f"{kept} kept" in html
    got = load_dump(sess.dump(tmp_path / "run.json")).steps[-1]
    assert got.kind == "verify" and got.drafts == {req.id: list(drafts)} and got.accepted == {req.id: kept}
    assert got.rolled_back == {req.id: list(slots)}
    assert f"{len(drafts)} drafts, {kept} kept" in got.summary()
