"""The pre-dispatch slot checks (a)-(e) in a live Session, for slot_check "raise", "warn" and "off".

Each case injects one bad write into a real step's plan (after scheduling, before the checks):
  duplicate       (a) row 1 writes row 0's slot
  outside_blocks  (b) row 1 writes a slot in a block no request holds
  shared_block    (c) a prefix-sharing request writes into the shared block
  live_overwrite  (d) row 1 overwrites request A's position 0
  beyond_cache    (e) row 1 writes past the last slot
"""
import warnings

import pytest
from collision_kit import (
    BS,
    EXTERNAL_CHECKS,
    NUM_BLOCKS,
    free_block,
    greedy,
    open_session,
    prompts,
    tampered_plans,
    two_decoding,
)

from qwen_npu import SlotCollisionError, SlotCollisionWarning, check_slot_mapping

CASES = ("duplicate", "outside_blocks", "shared_block", "live_overwrite", "beyond_cache")
# sections of sess.check() that must report the damage once the bad step has run
DAMAGE = {"duplicate": {"collisions", "slots"}, "outside_blocks": {"slots"}, "shared_block": {"slots"},
          "live_overwrite": {"slots"}}


def setup(sess, case):
    """Bring the session to the step that will be tampered with; returns (run_step, edit)."""
    if case == "shared_block":
        a_prompt = prompts([9])[0]
        sess.add_request(a_prompt, greedy(8))
        sess.sample(sess.prefill())
        b = sess.add_request(a_prompt[:8] + [(a_prompt[8] + 1) % 511], greedy(8))

        def edit(plan):
            table = plan.block_tables[0]            # request B's, sharing blocks 0 and 1 with A
            plan.slot_mapping[0] = table[1] * BS + BS - 1
        return (lambda: sess.prefill([b])), edit
    two_decoding(sess)

    def edit(plan):
        if case == "duplicate":
            plan.slot_mapping[1] = plan.slot_mapping[0]
        elif case == "outside_blocks":
            plan.slot_mapping[1] = free_block(sess) * BS + plan.positions[1] % BS
        elif case == "live_overwrite":
            plan.slot_mapping[1] = plan.block_tables[0][0] * BS     # request A, position 0
        else:
            plan.slot_mapping[1] = NUM_BLOCKS * BS + 1
    return sess.decode_step, edit


def frozen_state(sess):
    """What a refused step must not change: steps, ledger, the K/V (scheduling may admit requests)."""
    kv = sess.kv
    cache = [kv.key(i).clone() for i in range(kv.num_layers)] + [kv.value(i).clone() for i in range(kv.num_layers)]
    return len(sess.history), len(sess._engine.ledger), repr(sess._engine.ledger), cache


def same_state(a, b) -> bool:
    return a[:3] == b[:3] and all(x.equal(y) for x, y in zip(a[3], b[3]))


@pytest.mark.parametrize("case", CASES)
def test_raise_refuses_the_step_and_the_session_stays_usable(tiny_ckpt_small_vocab, monkeypatch, case):
    sess = open_session(tiny_ckpt_small_vocab, slot_check="raise")
    run_step, edit = setup(sess, case)
    before = frozen_state(sess)
    with tampered_plans(monkeypatch, edit), pytest.raises(SlotCollisionError) as err:
        run_step()
    checks = {p.check for p in err.value.problems}
    assert case in checks
    assert str(err.value).startswith(f"step {len(sess.history)} (")
    assert same_state(frozen_state(sess), before)       # nothing was dispatched or recorded
    step = run_step()                                    # the same step, untampered, runs
    assert step.slot_problems == []
    sess.sample(step)
    report = sess.check()
    assert report.ok, report


@pytest.mark.parametrize("case", CASES)
def test_warn_runs_the_step_and_check_finds_the_damage(tiny_ckpt_small_vocab, monkeypatch, case):
    sess = open_session(tiny_ckpt_small_vocab, slot_check="warn")
    run_step, edit = setup(sess, case)
    assert sess.check().ok
    with tampered_plans(monkeypatch, edit), pytest.warns(SlotCollisionWarning) as caught:
        if case == "beyond_cache":               # the warning comes first, then the write itself fails
            with pytest.raises((IndexError, RuntimeError), match="out of bounds|beyond"):
                run_step()
            return
        step = run_step()
    assert any(str(w.message).startswith(f"step {step.index} (") for w in caught)
    assert case in {p.check for p in step.slot_problems}
    # the external checker, fed the step's dispatched arguments, finds the same problems
    rep = check_slot_mapping(step.slot_mapping, step.block_tables, BS, positions=step.positions,
                             query_lens=step.query_lens, num_blocks=NUM_BLOCKS, active_rows=step.num_active)
    live = {(p.check, p.slot) for p in step.slot_problems if p.check in EXTERNAL_CHECKS}
    assert {(p.check, p.slot) for p in rep.items} == live
    report = sess.check()
    for name in DAMAGE[case]:
        assert report.section(name), report


@pytest.mark.parametrize("case", CASES)
def test_off_runs_without_a_word_and_check_finds_the_damage(tiny_ckpt_small_vocab, monkeypatch, case):
    sess = open_session(tiny_ckpt_small_vocab, slot_check="off")
    run_step, edit = setup(sess, case)
    with tampered_plans(monkeypatch, edit), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if case == "beyond_cache":               # nothing checks it: the kernel's own bounds check fails
            with pytest.raises((IndexError, RuntimeError), match="out of bounds|beyond"):
                run_step()
        else:
            step = run_step()
            assert step.slot_problems == []
    assert not [w for w in caught if issubclass(w.category, SlotCollisionWarning)]
    if case == "beyond_cache":
        return
    report = sess.check()
    for name in DAMAGE[case]:
        assert report.section(name), report


def test_overwrite_message_names_the_victim(tiny_ckpt_small_vocab, monkeypatch):
    sess = open_session(tiny_ckpt_small_vocab, slot_check="off")
    a, b = two_decoding(sess)
    victim = a.block_table[0] * BS
    with tampered_plans(monkeypatch, lambda plan: plan.slot_mapping.__setitem__(1, victim)):
        sess.decode_step()
    msgs = sess.check().section("slots")
    assert (f"request {a.id} position 0 lives in slot {victim} (block {victim // BS}, offset 0), but the slot was "
            f"last written by request {b.id} at position 7 in step 1") in msgs[0]
    assert any(f"request {b.id} position 7 is computed, but the ledger has no write to its slot" in m for m in msgs)
    info = sess.kv.slot(victim)
    assert (info.request_id, info.position, info.written_at_step) == (b.id, 7, 1)
    assert info.held_by == ((a.id, 0),)
    assert [(w.request_id, w.position) for w in info.history] == [(a.id, 0), (b.id, 7)]
