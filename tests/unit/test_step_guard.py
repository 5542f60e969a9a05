"""The vectorised screen and the step guard, on host tensors shaped like a serving engine's step."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen_npu.cache.slot_screen import count_holders, screen_slot_mapping
from qwen_npu.errors import SlotCollisionError
from qwen_npu.integrations.step_guard import StepGuard, StepInputs, describe

BS = 4
NUM_BLOCKS = 32


def good_step(lens=(3, 1, 5), computed=(0, 6, 2), pad=2, tables=None):
    """A correct step: row r computes positions computed[r] .. computed[r] + lens[r] - 1."""
    rows = len(lens)
    if tables is None:
        tables = [[1 + 8 * r + j for j in range(8)] for r in range(rows)]
    bpr = [-(-(c + q) // BS) for c, q in zip(computed, lens)]
    pos, slots = [], []
    for r, (c, q) in enumerate(zip(computed, lens)):
        for p in range(c, c + q):
            pos.append(p)
            slots.append(tables[r][p // BS] * BS + p % BS)
    n = len(slots)
    pos += [0] * pad
    slots += [-1] * pad
    return StepInputs([f"req-{r}" for r in range(rows)], np.array([0, *np.cumsum(lens)]),
                      torch.tensor(slots), torch.tensor(pos), torch.tensor(tables),
                      np.array(bpr), BS, NUM_BLOCKS), n


def screen(step, n):
    rows = len(step.request_ids)
    tok_rows = torch.from_numpy(np.repeat(np.arange(rows), np.diff(step.query_start_loc)))
    bpr = torch.from_numpy(step.blocks_per_row)
    holders = count_holders(step.block_tables, bpr, NUM_BLOCKS)
    mask = screen_slot_mapping(step.slot_mapping, step.positions, tok_rows, step.block_tables, bpr,
                               block_size=BS, num_blocks=NUM_BLOCKS, num_real_tokens=n, holders=holders)
    return mask, describe(0, step, n, holders)


def test_a_correct_step_passes_the_screen_and_the_checker():
    step, n = good_step()
    mask, problems = screen(step, n)
    assert not mask.any() and problems == []


@pytest.mark.parametrize("fault, check, token", [
    ("copy_row0", "duplicate", 3),
    ("off_by_one", "wrong_slot", 3),
    ("past_blocks", "outside_blocks", 3),
    ("padding_slot0", "padding_write", 9),
    ("beyond", "beyond_cache", 0),
])
def test_each_fault_is_flagged_at_its_token_and_named(fault, check, token):
    step, n = good_step()
    s, p = step.slot_mapping, step.positions
    if fault == "copy_row0":
        s[3] = s[0]
    elif fault == "off_by_one":
        s[3] += 1
    elif fault == "past_blocks":                  # row 1 holds 2 blocks; position 8 needs a third
        p[3] = 8
        s[3] = step.block_tables[1, 2] * BS
    elif fault == "padding_slot0":
        s[9] = 0
    else:
        s[0] = NUM_BLOCKS * BS + 1
    mask, problems = screen(step, n)
    assert mask[token]
    assert check in [q.check for q in problems]
    hit = next(q for q in problems if q.check == check)
    if fault == "copy_row0":
        assert hit.rows == (0, 1) and hit.request_ids == ("req-0", "req-1")
    if fault == "padding_slot0":
        assert hit.request_ids == ("padding-tail",) and hit.slot == 0
    if fault == "past_blocks":
        assert "has no block in the row's table" in hit.message and hit.request_ids == ("req-1",)


def test_a_write_into_a_block_another_row_holds_is_a_shared_block_problem():
    tables = [[1, 2, 3, 4], [1, 9, 10, 11], [12, 13, 14, 15]]   # rows 0 and 1 share prefix block 1
    step, n = good_step(lens=(1, 1, 1), computed=(5, 5, 0), pad=0, tables=tables)
    assert not screen(step, n)[0].any()
    step.slot_mapping[1] = 1 * BS + 2                            # row 1 writes into the shared block
    mask, problems = screen(step, n)
    assert mask.tolist() == [False, True, False]
    shared = next(q for q in problems if q.check == "shared_block")
    assert shared.request_ids == ("req-1",) and shared.block == 1


def test_a_block_filled_this_step_may_already_be_another_rows_prefix():
    """vLLM hands a block to later rows of the same step as a prefix hit while row 0 computes it."""
    tables = [[1, 2, 3, 4], [1, 9, 10, 11], [1, 12, 13, 14]]
    step, n = good_step(lens=(4, 1, 1), computed=(0, 4, 4), pad=0, tables=tables)
    assert step.slot_mapping[:4].tolist() == [4, 5, 6, 7]        # row 0 fills block 1
    mask, problems = screen(step, n)
    assert not mask.any() and problems == []
    step.slot_mapping[4] = 1 * BS + 1                            # row 1 writes into it as well: wrong
    mask, problems = screen(step, n)
    assert mask.tolist() == [False, True, False, False, True, False]
    assert "duplicate" in [q.check for q in problems]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_screen_flags_exactly_the_tokens_the_checker_names(data):
    lens = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    computed = data.draw(st.lists(st.integers(0, 10), min_size=len(lens), max_size=len(lens)))
    pad = data.draw(st.integers(0, 3))
    step, n = good_step(tuple(lens), tuple(computed), pad)
    total = step.slot_mapping.shape[0]
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, total - 1))
        step.slot_mapping[i] = data.draw(st.integers(-1, NUM_BLOCKS * BS + 3))
    mask, problems = screen(step, n)
    assert bool(mask.any()) == bool(problems)
    qsl = step.query_start_loc
    named = set()
    for q in problems:
        for r in q.rows:
            lo, hi = (int(qsl[r]), int(qsl[r + 1])) if r < len(lens) else (n, total)
            named |= {i for i in range(lo, hi) if int(step.slot_mapping[i]) == q.slot}
    assert named == set(torch.nonzero(mask).flatten().tolist())


def test_modes_count_warn_raise_and_the_json_log(tmp_path, caplog):
    bad, _ = good_step()
    bad.slot_mapping[3] = bad.slot_mapping[0]
    good, _ = good_step()
    log = tmp_path / "guard.jsonl"
    counting = StepGuard("count", log_path=str(log))
    counting.check(good)
    counting.check(bad)
    assert counting.steps_checked == 2 and counting.counts["duplicate"] == 1
    line = json.loads(log.read_text().splitlines()[0])
    assert line["step"] == 1 and line["problems"][0]["request_ids"] == ["req-0", "req-1"]
    with caplog.at_level("WARNING", logger="qwen_npu.guard"):
        StepGuard("warn").check(bad)
    assert "rows 0, 1 (requests req-0, req-1) both write slot" in caplog.text
    raising = StepGuard("raise")
    with pytest.raises(SlotCollisionError, match="req-1"):
        raising.check(bad)
    raising.check(good)                                     # still usable after raising
    assert raising.steps_checked == 2
    with pytest.raises(ValueError, match="warn, count, raise"):
        StepGuard("loud")


class _DoneEvent:
    def __init__(self):
        self.waited = False

    def query(self):
        return False

    def synchronize(self):
        self.waited = True


def test_a_device_verdict_is_reported_one_step_late(monkeypatch):
    """The accelerator path, driven on the CPU: verdicts wait in flight until a later check or flush."""
    from qwen_npu.integrations import step_guard as sg
    guard = StepGuard("count")
    bad, n = good_step()
    bad.slot_mapping[3] = bad.slot_mapping[0]
    flag = torch.tensor(True)
    guard._pending.append(sg._Pending(7, flag, _DoneEvent(), (sg._frozen(bad, bad.block_tables[:len(bad.request_ids)]), n,
                                                              torch.zeros(NUM_BLOCKS, dtype=torch.int32))))
    bad.slot_mapping[3] = 99                                  # the engine reuses its buffer
    guard.check(good_step()[0])                               # not complete yet: nothing reported
    assert not guard.reports
    guard.flush()
    (report,) = guard.reports
    assert report.step == 7 and report.late and report.problems[0].check == "duplicate"
