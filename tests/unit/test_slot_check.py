import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen_npu.cache.ledger import SlotLedger
from qwen_npu.cache.slot_check import (
    SlotCollisionWarning,
    SlotProblem,
    StepWrites,
    check_slot_mapping,
    check_step_writes,
    format_problems,
    raise_or_warn,
)
from qwen_npu.errors import SlotCollisionError

BS = 16


def slot(table, pos, bs=BS):
    return table[pos // bs] * bs + pos % bs


def replicate_padding(num_rows=16, active=3):
    """Fixed-batch decode: rows 3..15 copied row 0's block table, position and slot."""
    tables = [[127, 128], [5, 6], [9, 10]]
    pos = [19, 20, 30]
    tables += [tables[0]] * (num_rows - active)
    pos += [pos[0]] * (num_rows - active)
    slots = [slot(t, p) for t, p in zip(tables, pos)]
    return slots, tables, pos


# ------------------------------------------------------------------ check_slot_mapping

def test_correct_decode_is_ok_with_lists_and_tensors():
    slots, tables, pos = replicate_padding(3, 3)
    rep = check_slot_mapping(slots, tables, BS, positions=pos, num_blocks=200)
    assert rep.ok and rep.problems == () and rep.items == ()
    rep_t = check_slot_mapping(torch.tensor(slots, dtype=torch.int32), torch.tensor(tables), BS,
                               seq_lens=torch.tensor([p + 1 for p in pos]), num_blocks=200)
    assert rep_t.ok
    assert "ok" in repr(rep) and "ok" in rep._repr_html_()


def test_replicate_padding_gives_one_duplicate_naming_all_rows():
    slots, tables, pos = replicate_padding()
    assert slots[0] == 2051
    rep = check_slot_mapping(slots, tables, BS, positions=pos, active_rows=3)
    assert not rep.ok
    dups = [p for p in rep.items if p.check == "duplicate"]
    assert len(dups) == 1
    d = dups[0]
    assert (d.slot, d.block, d.offset) == (2051, 128, 3)
    assert d.rows == (0,) + tuple(range(3, 16))
    assert d.message == "rows 0, 3..15 all write slot 2051 (block 128, offset 3)"
    assert rep.problems[0] == d.message  # the duplicate comes first
    pads = [p for p in rep.items if p.check == "padding_write"]
    assert len(pads) == 1 and pads[0].rows == tuple(range(3, 16))
    assert {p.check for p in rep.items} == {"duplicate", "padding_write"}


def test_runtime_batch_prefix_view_is_ok():
    slots, tables, pos = replicate_padding()
    rep = check_slot_mapping(slots[:3], tables[:3], BS, positions=pos[:3])
    assert rep.ok


def test_padding_rows_with_minus_one_are_fine():
    slots, tables, pos = replicate_padding()
    slots = slots[:3] + [-1] * 13
    rep = check_slot_mapping(slots, tables, BS, positions=pos, active_rows=3)
    assert rep.ok


def test_active_row_with_minus_one_is_fine():
    rep = check_slot_mapping([-1, 5 * BS], [[1], [5]], BS, positions=[0, 0])
    assert rep.ok


def test_padding_row_writing_a_distinct_slot_is_reported():
    rep = check_slot_mapping([BS, 2 * BS + 1], [[1], [2]], BS, active_rows=1)
    (p,) = rep.items
    assert p.check == "padding_write" and p.rows == (1,) and p.slot == 2 * BS + 1
    assert "row 1 is padding (only 1 active)" in p.message


def test_slot_outside_the_rows_blocks():
    rep = check_slot_mapping([3 * BS + 2], [[1, 2]], BS, positions=[18])
    (p,) = rep.items
    assert p.check == "outside_blocks" and (p.block, p.offset) == (3, 2)
    assert "outside its blocks [1, 2]" in p.message
    assert "expected slot 34 (block 2, offset 2)" in p.message


def test_outside_blocks_without_positions():
    rep = check_slot_mapping([3 * BS + 2, BS + 1], [[1, 2], [1]], BS)
    assert [p.check for p in rep.items] == ["outside_blocks"]


def test_slot_disagreeing_with_the_block_table():
    table = [4, 7]
    rep = check_slot_mapping([slot(table, 20) + 1], [table], BS, positions=[20])
    (p,) = rep.items
    assert p.check == "wrong_slot"
    assert p.message == ("row 0, position 20: expected slot 116 (block 7, offset 4) = block_table[1] * 16 "
                         "+ 4, got slot 117 (block 7, offset 5)")
    rep_sl = check_slot_mapping([slot(table, 20) + 1], [table], BS, seq_lens=[21])
    assert rep_sl.problems == rep.problems


def test_position_without_a_block():
    rep = check_slot_mapping([4 * BS], [[4, -1]], BS, positions=[BS])
    (p,) = rep.items
    assert p.check == "wrong_slot" and "has no block" in p.message


def test_slot_beyond_the_cache():
    rep = check_slot_mapping([10 * BS + 1], [[10]], BS, positions=[1], num_blocks=10)
    (p,) = rep.items
    assert p.check == "beyond_cache"
    assert "beyond the cache (10 blocks x 16 = 160 slots)" in p.message
    assert check_slot_mapping([10 * BS + 1], [[10]], BS, positions=[1]).ok  # unknown cache size


def test_prefill_rows_by_query_lens():
    t0, t1 = [3, 4], [8]
    slots = [slot(t0, p) for p in range(5, 20)] + [slot(t1, p) for p in range(4)]
    rep = check_slot_mapping(slots, [t0 + [-1], t1 + [-1, -1]], BS, seq_lens=[20, 4], query_lens=[15, 4])
    assert rep.ok and rep.num_tokens == 19
    bad = list(slots)
    bad[-1] = slots[0]  # row 1's last token writes row 0's first slot
    rep = check_slot_mapping(bad, [t0, t1], BS, seq_lens=[20, 4], query_lens=[15, 4])
    checks = [p.check for p in rep.items]
    assert checks[0] == "duplicate" and "outside_blocks" in checks
    assert rep.items[0].message.startswith("rows 0, 1 both write slot 53 (block 3, offset 5)")


def test_duplicate_within_one_row():
    rep = check_slot_mapping([33, 33], [[2]], BS, query_lens=[2])
    assert rep.items[0].message == "row 0 writes slot 33 (block 2, offset 1) 2 times"


def test_count_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="query_lens"):
        check_slot_mapping([1, 2, 3], [[0], [0]], BS)
    with pytest.raises(ValueError, match="positions"):
        check_slot_mapping([1, 2], [[0], [0]], BS, positions=[1])
    with pytest.raises(ValueError, match="active_rows"):
        check_slot_mapping([1, 2], [[0], [0]], BS, active_rows=3)


def test_report_reprs_are_readable_and_deterministic():
    slots, tables, pos = replicate_padding()
    rep = check_slot_mapping(slots, tables, BS, positions=pos, active_rows=3)
    text = repr(rep)
    assert text.startswith("SlotReport: 2 problems (16 tokens in 16 rows (3 active))")
    assert "rows 0, 3..15 all write slot 2051" in text
    h = rep._repr_html_()
    assert h == check_slot_mapping(slots, tables, BS, positions=pos, active_rows=3)._repr_html_()
    assert "<table>" in h and "0, 3..15" in h and "duplicate" in h


# ------------------------------------------------------------------ check_step_writes

def decode_writes(step=7, slots=None, tables=None, pos=None, reqs=None, active=None):
    n = len(slots)
    return StepWrites(step, "decode", n, n if active is None else active, reqs,
                      [[p] for p in pos], [[s] for s in slots], tables)


def test_step_replicate_padding_message_shape():
    slots, tables, pos = replicate_padding()
    reqs = [12, 13, 14] + [12] * 13
    pos = [515, 20, 30] + [515] * 13
    tables = [[0] * 32 + [128]] + tables[1:]
    tables[3:] = [tables[0]] * 13
    slots = [slot(t, p) for t, p in zip(tables, pos)]
    ledger = SlotLedger(8192)
    ledger.record(6, [2051], [12], [515])
    w = decode_writes(7, slots, tables, pos, reqs, active=3)
    probs = check_step_writes(w, block_size=BS, num_blocks=512, ref_count=lambda b: 1, ledger=ledger,
                              is_live=lambda r, p, s: True)
    dups = [p for p in probs if p.check == "duplicate"]
    assert len(dups) == 1 and probs[0] is dups[0]
    assert dups[0].rows == (0,) + tuple(range(3, 16)) and dups[0].request_ids == (12,)
    assert dups[0].message == ("step 7 (decode, 16 rows dispatched, 3 active): rows 0, 3..15 (request 12) "
                               "all write slot 2051 (block 128, offset 3), last written by request 12 "
                               "at position 515")
    assert [p.check for p in probs] == ["duplicate", "padding_write"]


def test_step_outside_blocks_and_beyond_cache():
    w = decode_writes(3, [5 * BS, 99 * BS], [[4], [6]], [0, 0], [1, 2])
    probs = check_step_writes(w, block_size=BS, num_blocks=50)
    assert [p.check for p in probs] == ["beyond_cache", "outside_blocks"]
    assert probs[1].message.startswith("step 3 (decode, 2 rows dispatched, 2 active): row 0 (request 1) "
                                       "writes slot 80 (block 5, offset 0), outside its blocks [4]")


def test_step_shared_block_write():
    w = StepWrites(2, "prefill", 1, 1, [9], [[31]], [[slot([3, 8], 31)]], [[3, 8]])
    probs = check_step_writes(w, block_size=BS, num_blocks=16, ref_count={3: 1, 8: 2}.get)
    (p,) = probs
    assert p.check == "shared_block" and p.block == 8 and p.request_ids == (9,)
    assert "block 8 is shared (ref count 2)" in p.message
    assert check_step_writes(w, block_size=BS, num_blocks=16, ref_count=lambda b: 1) == []


def test_step_live_overwrite_of_another_request():
    ledger = SlotLedger(16 * BS)
    ledger.record(4, [2 * BS + 3], [5], [3])
    w = decode_writes(5, [2 * BS + 3], [[2]], [3], [6])
    probs = check_step_writes(w, block_size=BS, num_blocks=16, ledger=ledger, is_live=lambda r, p, s: r == 5)
    (p,) = probs
    assert p.check == "live_overwrite"
    assert p.message == ("step 5 (decode, 1 row dispatched, 1 active): row 0 (request 6) overwrites slot 35 "
                         "(block 2, offset 3), which still holds request 5 at position 3 (written in step 4)")
    # freed (not live) or same request: no problem
    assert check_step_writes(w, block_size=BS, num_blocks=16, ledger=ledger, is_live=lambda r, p, s: False) == []
    same = decode_writes(5, [2 * BS + 3], [[2]], [3], [5])
    always = lambda r, p, s: True
    assert check_step_writes(same, block_size=BS, num_blocks=16, ledger=ledger, is_live=always) == []


def writes_from_flat(step, kind, request_ids, query_lens, positions, slot_mapping, block_tables):
    """A StepWrites from flat per-token positions / slots, split into rows by ``query_lens``."""
    ints = lambda x: [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]
    qls, pos, slots = ints(query_lens), ints(positions), ints(slot_mapping)
    starts = [0]
    for n in qls:
        starts.append(starts[-1] + n)
    rows = range(len(qls))
    tables = block_tables.tolist() if isinstance(block_tables, torch.Tensor) else [list(t) for t in block_tables]
    return StepWrites(step, kind, len(qls), len(qls), ints(request_ids), [pos[starts[r]:starts[r + 1]] for r in rows],
                      [slots[starts[r]:starts[r + 1]] for r in rows], tables)


def test_step_writes_validation_and_from_flat():
    with pytest.raises(ValueError, match="kind"):
        StepWrites(1, "sideways", 0, 0, [], [], [], [])
    with pytest.raises(ValueError, match="row_slots"):
        StepWrites(1, "decode", 2, 2, [1, 2], [[0], [0]], [[0]], [[0], [1]])
    w = writes_from_flat(1, "prefill", torch.tensor([4, 5]), [2, 1], [0, 1, 0],
                             torch.tensor([16, 17, 32]), torch.tensor([[1], [2]]))
    assert w.row_slots == [[16, 17], [32]] and w.row_positions == [[0, 1], [0]] and w.num_active == 2
    assert check_step_writes(w, block_size=BS, num_blocks=4) == []


def test_a_verify_step_names_the_drafts_each_decode_row_writes():
    rows = {"row_request_ids": [1, 2], "row_positions": [[5, 6, 7], [3]], "row_slots": [[21, 22, 23], [67]],
                "row_block_tables": [[1, 2], [4]], "row_kinds": ["decode", "decode"]}
    w = StepWrites(3, "verify", 2, 2, row_drafts=[2, 0], **rows)
    assert check_step_writes(w, block_size=BS, num_blocks=8) == []
    with pytest.raises(ValueError, match="row 0 is a decode row .its last token and 1 drafts. but writes 3"):
        StepWrites(3, "verify", 2, 2, row_drafts=[1, 0], **rows)
    with pytest.raises(ValueError, match="row 0 is a decode row but writes 3"):
        StepWrites(3, "verify", 2, 2, **rows)              # no drafts named: one token per decode row
    with pytest.raises(ValueError, match="row_drafts has 1 rows"):
        StepWrites(3, "verify", 2, 2, row_drafts=[2], **rows)
    with pytest.raises(ValueError, match="row 1 has kind 'prefill'"):
        StepWrites(3, "verify", 2, 2, row_drafts=[2, 0], **{**rows, "row_kinds": ["decode", "prefill"]})


# ------------------------------------------------------------------ modes

def problems_example():
    slots, tables, pos = replicate_padding()
    return list(check_slot_mapping(slots, tables, BS, positions=pos, active_rows=3).items)


def test_raise_mode_names_every_problem_first_first():
    probs = problems_example()
    with pytest.raises(SlotCollisionError) as info:
        raise_or_warn(probs, "raise")
    text = str(info.value)
    assert text.splitlines()[0] == probs[0].message
    assert text == format_problems(probs) and len(text.splitlines()) == 2
    assert info.value.problems == tuple(probs)


def test_warn_and_off_modes():
    probs = problems_example()
    with pytest.warns(SlotCollisionWarning, match="rows 0, 3..15 all write slot 2051"):
        raise_or_warn(probs, "warn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raise_or_warn(probs, "off")
        raise_or_warn([], "raise")
    with pytest.raises(ValueError):
        raise_or_warn(probs, "loud")
    assert issubclass(SlotCollisionWarning, UserWarning)
    assert isinstance(probs[0], SlotProblem) and str(probs[0]) == probs[0].message


# ------------------------------------------------------------------ property

@st.composite
def correct_dispatch(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(4, 64))
    pool = draw(st.permutations(range(num_blocks)))
    rows = draw(st.integers(1, 8))
    tables, positions, slots, qls, seq_lens, free = [], [], [], [], [], list(pool)
    for _ in range(rows):
        if not free:
            break
        nb = draw(st.integers(1, min(4, len(free))))
        table, free = free[:nb], free[nb:]
        seq_len = draw(st.integers(1, nb * bs))
        q = draw(st.integers(1, seq_len))
        tables.append(table + [-1] * (4 - nb))
        positions += list(range(seq_len - q, seq_len))
        slots += [slot(table, p, bs) for p in range(seq_len - q, seq_len)]
        qls.append(q)
        seq_lens.append(seq_len)
    return bs, num_blocks, tables, positions, slots, qls, seq_lens


@settings(max_examples=200, deadline=None)
@given(correct_dispatch())
def test_correct_dispatch_is_always_ok(d):
    bs, num_blocks, tables, positions, slots, qls, seq_lens = d
    rep = check_slot_mapping(slots, tables, bs, positions=positions, num_blocks=num_blocks, query_lens=qls)
    assert rep.ok, rep.problems
    assert check_slot_mapping(torch.tensor(slots), torch.tensor(tables), bs, seq_lens=seq_lens,
                              num_blocks=num_blocks, query_lens=qls).ok
    w = writes_from_flat(0, "prefill", list(range(len(qls))), qls, positions, slots, tables)
    assert check_step_writes(w, block_size=bs, num_blocks=num_blocks, ref_count=lambda b: 1) == []
