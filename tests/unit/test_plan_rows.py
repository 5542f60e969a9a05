"""A plan is the record of what a step ran: its rows cannot be changed, and the lists it hands
out are new ones, so changing them changes nothing recorded."""
import pytest

from qwen_npu import SamplingParams
from qwen_npu.cache.slot_check import check_step_writes
from qwen_npu.engine.plan import build_plan
from qwen_npu.engine.request import DECODING, Request
from qwen_npu.engine.transaction import RequestDraft


def decoding(rid: int, prompt: list[int]) -> RequestDraft:
    d = RequestDraft(Request(rid, prompt, SamplingParams(max_new_tokens=4), frozenset(), block_table=lambda r: []))
    d.num_computed_tokens, d.status = len(prompt) - 1, DECODING
    return d


def test_rows_are_immutable_and_handed_out_lists_are_copies():
    a, b = decoding(0, [1, 2, 3]), decoding(1, [4, 5, 6, 7, 8])
    plan = build_plan("decode", 7, [(a, 1), (b, 1)], {0: [3], 1: [5, 9]}, 4, pad_to=3)
    assert plan.input_ids == [3, 8, 3] and plan.num_active == 2 and plan.num_drafts == 0
    assert plan.rows[2] == plan.rows[0]._replace(padding=True) and not plan.rows[0].padding
    assert plan.token_writes() == ([14, 36, 14], [2, 4, 2], [0, 1, 2])
    ids = plan.request_ids
    ids.reverse()
    assert plan.request_ids == plan.row_request_ids == plan.token_request_ids == [0, 1, 0]
    with pytest.raises(AttributeError):
        plan.rows[0].start = 0
    problems = check_step_writes(plan, block_size=4, num_blocks=16)
    assert [(p.check, p.slot, p.rows) for p in problems] == [("duplicate", 14, (0, 2)), ("padding_write", 14, (2,))]
