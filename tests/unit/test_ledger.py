import pytest

from qwen_npu.cache.ledger import SlotCollision, SlotLedger, SlotWrite


def test_last_write_and_untouched_slots():
    ledger = SlotLedger(64)
    ledger.record(1, [10, 11, 12], [5, 5, 5], [0, 1, 2])
    ledger.record(2, [11], [7], [40])
    assert ledger.last(10) == SlotWrite(5, 0, 1)
    assert ledger.last(11) == SlotWrite(7, 40, 2)
    assert ledger.last(13) is None
    assert ledger.history(13) == ()
    assert ledger.history(11) == (SlotWrite(5, 1, 1), SlotWrite(7, 40, 2))
    assert len(ledger) == 3 and 12 in ledger and 13 not in ledger
    assert ledger.written_slots() == [10, 11, 12]
    assert ledger.collisions == []


def test_negative_slots_are_not_writes():
    ledger = SlotLedger(16)
    ledger.record(1, [-1, 3, -1], [1, 2, 3], [0, 0, 0])
    assert ledger.written_slots() == [3]
    assert ledger.collisions == []


def test_history_is_bounded_and_oldest_first():
    ledger = SlotLedger(8, history=3)
    for step in range(10):
        ledger.record(step, [4], [step], [step * 10])
    hist = ledger.history(4)
    assert len(hist) == 3
    assert [w.step for w in hist] == [7, 8, 9]
    assert ledger.last(4) == SlotWrite(9, 90, 9)


def test_duplicates_within_one_call_are_remembered():
    ledger = SlotLedger(4096)
    slots = [2051] + [100, 101] + [2051] * 13
    reqs = [12, 13, 14] + [12] * 13
    pos = [515, 7, 9] + [515] * 13
    found = ledger.record(7, slots, reqs, pos, rows=list(range(16)))
    assert len(found) == 1
    col = found[0]
    assert col == ledger.collisions[0]
    assert (col.step, col.slot) == (7, 2051)
    assert col.rows == (0,) + tuple(range(3, 16))
    assert col.request_ids == (12,) * 14 and col.positions == (515,) * 14
    assert "slot 2051 written 14 times" in str(col)
    assert ledger.num_collisions == 1
    # the later write (row order) is the one kept as last
    assert ledger.last(2051) == SlotWrite(12, 515, 7)


def test_duplicates_across_calls_are_not_collisions():
    ledger = SlotLedger(16)
    ledger.record(1, [3], [1], [0])
    ledger.record(2, [3], [2], [0])
    assert ledger.collisions == []


def test_collision_rows_are_optional():
    ledger = SlotLedger(16)
    (col,) = ledger.record(3, [5, 5], [1, 2], [0, 4])
    assert col == SlotCollision(3, 5, (1, 2), (0, 4), None)


def test_collisions_are_bounded():
    ledger = SlotLedger(16, max_collisions=5)
    for step in range(12):
        ledger.record(step, [1, 1], [0, 0], [0, 0])
    assert [c.step for c in ledger.collisions] == [7, 8, 9, 10, 11]
    assert ledger.num_collisions == 12


def test_reset_forgets_everything():
    ledger = SlotLedger(16)
    ledger.record(1, [1, 1, 2], [0, 0, 0], [0, 0, 1])
    ledger.reset()
    assert len(ledger) == 0 and ledger.last(1) is None and ledger.collisions == []
    assert ledger.num_collisions == 0


def test_records_are_frozen_snapshots():
    ledger = SlotLedger(16)
    ledger.record(1, [2], [3], [4])
    with pytest.raises(AttributeError):
        ledger.last(2).step = 5
    hist = ledger.history(2)
    ledger.record(2, [2], [3], [5])
    assert len(hist) == 1


def test_bad_input_is_refused():
    ledger = SlotLedger(16)
    with pytest.raises(ValueError, match="differ in length"):
        ledger.record(1, [1, 2], [1], [0, 1])
    with pytest.raises(ValueError, match="beyond the cache"):
        ledger.record(1, [16], [1], [0])
    with pytest.raises(ValueError):
        SlotLedger(16, history=0)


def test_a_rolled_back_write_is_marked_until_the_slot_is_written_again():
    ledger = SlotLedger(16)
    ledger.record(1, [4, 5, 6], [3, 3, 3], [10, 11, 12])
    ledger.roll_back([5, 6, 9], step=1)                  # 9 was never written: nothing to mark
    assert ledger.rolled_back() == {5: 1, 6: 1}
    assert ledger.last(5) == SlotWrite(3, 11, 1, rolled_back_in=1) and ledger.last(4).rolled_back_in is None
    assert ledger.history(6)[-1].rolled_back_in == 1
    assert "a rejected draft rolled back in step 1" in ledger.last(6).describe()
    ledger.record(2, [5], [3], [11])                    # the position computed again, same slot
    assert ledger.rolled_back() == {6: 1} and ledger.last(5) == SlotWrite(3, 11, 2)
    assert ledger.history(5) == (SlotWrite(3, 11, 1), SlotWrite(3, 11, 2))
    ledger.reset()
    assert ledger.rolled_back() == {}
