"""A request draft: exactly the request's fields, the changing ones staged until the step commits."""
import pytest

from qwen_npu import SamplingParams
from qwen_npu.cache.manager import KVCacheManager
from qwen_npu.engine.transaction import RequestDraft, StepDraft
from qwen_npu.engine.request import FIXED_FIELDS, GROWING_FIELDS, STEP_FIELDS, Request


def make_request() -> Request:
    return Request(7, [1, 2, 3], SamplingParams(max_new_tokens=4, stop_token_ids=[9]), frozenset({9}),
                   block_table=lambda request_id: [])


def test_a_draft_has_the_request_fields_and_nothing_else():
    req = make_request()
    d = RequestDraft(req)
    for name in FIXED_FIELDS + STEP_FIELDS:
        assert getattr(d, name) == getattr(req, name), name
    with pytest.raises(AttributeError):
        d.block_table                      # a Request property no step stages: not read silently
    with pytest.raises(AttributeError):
        d.not_a_field = 1


def test_a_draft_copies_every_field_and_writes_back_every_step_field():
    req = make_request()
    assigned = [name for name in STEP_FIELDS if name not in GROWING_FIELDS]
    marks = {name: object() for name in FIXED_FIELDS + tuple(assigned)}     # one distinct value per field
    for name, mark in marks.items():
        object.__setattr__(req, name, mark)
    d = RequestDraft(req)
    assert {name: getattr(d, name) is mark for name, mark in marks.items()} == dict.fromkeys(marks, True)
    staged = {name: object() for name in assigned}
    for name, mark in staged.items():
        setattr(d, name, mark)
    d.write_back()
    assert {name: getattr(req, name) is mark for name, mark in staged.items()} == dict.fromkeys(staged, True)
    assert all(getattr(req, name) is marks[name] for name in FIXED_FIELDS)


def test_the_growing_lists_are_staged_as_appends_the_request_list_untouched_until_written_back():
    req = Request(7, [1, 2, 3], SamplingParams(max_new_tokens=9, logprobs=1), frozenset({9}),
                  block_table=lambda request_id: [])
    req.output_token_ids.extend([4, 5])
    req.logprobs.extend(["lp4", "lp5"])
    tokens, logprobs = req.output_token_ids, req.logprobs
    d = RequestDraft(req)
    d.append_token(6, "lp6")
    d.append_token(7, "lp7")
    assert req.output_token_ids == [4, 5] and req.logprobs == ["lp4", "lp5"]      # nothing live changed
    assert list(d.output_token_ids) == [4, 5, 6, 7] and d.logprobs == ["lp4", "lp5", "lp6", "lp7"]
    assert (d.num_tokens, d.all_token_ids, d.token_ids[2:6]) == (7, [1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6])
    with pytest.raises(AttributeError):
        d.output_token_ids = [0]                       # staged by appending only
    d.write_back()
    assert req.output_token_ids is tokens and tokens == [4, 5, 6, 7]              # one list for life
    assert req.logprobs is logprobs and logprobs == ["lp4", "lp5", "lp6", "lp7"]
    assert list(d.output_token_ids) == [4, 5, 6, 7]    # written back once: nothing left staged


def test_staged_tokens_reach_the_request_only_when_the_draft_is_applied():
    req = make_request()
    step = StepDraft(KVCacheManager(num_blocks=4, block_size=4), requests={req.id: req})
    d = step.of(req)
    step.stage_token(d, 5)
    step.stage_token(d, 9)                  # a stop token id, past min_new_tokens 0
    assert req.output_token_ids == [] and req.status == "waiting"
    assert (list(d.output_token_ids), d.status, d.finish_reason, d.stop_reason) == ([5, 9], "finished", "stop", 9)
    step.apply({})
    assert (req.output_token_ids, req.status, req.finish_reason, req.stop_reason) == ([5, 9], "finished", "stop", 9)
