"""Slot checks in a mixed step (decode rows and a prefill chunk in one forward).

A mixed step's plan is tampered with after scheduling: the prefill chunk writes the slot of a
decode row (duplicate), or a decode row overwrites a live token of the newcomer's neighbour. With
"raise" the step is refused and nothing changes; with "warn" it runs, and ``check()`` and the
ledger name the decode and prefill rows that collided.
"""
import warnings

import pytest
from collision_kit import greedy, open_session, prompts, tampered_plans

from qwen_npu import SlotCollisionError, SlotCollisionWarning


def to_mixed_step(sess):
    """Requests A and B decoding, C waiting: the next step() is mixed (rows A, B decode; C prefills)."""
    pa, pb, pc = prompts((6, 7, 9))
    a, b = sess.add_request(pa, greedy(8)), sess.add_request(pb, greedy(8))
    while a.status != "decoding" or b.status != "decoding":
        sess.step()
    c = sess.add_request(pc, greedy(4))
    return a, b, c


def duplicate(plan):
    if plan.kind == "mixed":
        plan.slot_mapping[2] = plan.slot_mapping[0]     # C's first token onto A's decode slot


def overwrite(plan):
    if plan.kind == "mixed":
        plan.slot_mapping[1] = plan.block_tables[0][0] * 4   # B's decode token onto A's position 0


@pytest.mark.parametrize("edit, check", [(duplicate, "duplicate"), (overwrite, "live_overwrite")])
def test_raise_refuses_a_tampered_mixed_step_and_changes_nothing(tiny_ckpt_small_vocab, monkeypatch, edit, check):
    sess = open_session(tiny_ckpt_small_vocab, slot_check="raise", mixed_steps=True)
    to_mixed_step(sess)
    before = sess.state_digest()
    with tampered_plans(monkeypatch, edit), pytest.raises(SlotCollisionError) as err:
        sess.step()
    assert check in {p.check for p in err.value.problems}
    msg = str(err.value)
    assert "(mixed: 2 decode, 1 prefill," in msg
    assert ("decode row 0" in msg and "prefill row 2" in msg) if check == "duplicate" else "decode row 1" in msg
    assert sess.state_digest() == before
    step = sess.step()                                  # the same step, untampered, runs
    assert step.kind == "mixed" and step.slot_problems == []
    assert sess.check().ok


def test_warn_runs_a_colliding_mixed_step_and_check_names_its_row_kinds(tiny_ckpt_small_vocab, monkeypatch):
    sess = open_session(tiny_ckpt_small_vocab, slot_check="warn", mixed_steps=True)
    to_mixed_step(sess)
    with tampered_plans(monkeypatch, duplicate), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        step = sess.step()
    assert step.kind == "mixed"
    assert any(issubclass(w.category, SlotCollisionWarning) for w in seen)
    assert step.slot_problems[0].check == "duplicate"
    (collision,) = sess._engine.ledger.collisions
    assert collision.kinds == ("decode", "prefill") and collision.rows == (0, 2)
    report = sess.check()
    assert not report.ok
    assert any("(decode, prefill: a mixed step)" in m for m in report.section("collisions"))
