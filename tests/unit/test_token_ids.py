"""A request draft's tokens as a view: every index and slice reads what ``all_token_ids`` holds."""
import itertools

import pytest

from qwen_npu import SamplingParams
from qwen_npu.engine.request import Request
from qwen_npu.engine.transaction import RequestDraft, TokenIds


@pytest.mark.parametrize("prompt,output", [([], []), ([1, 2, 3], []), ([], [4, 5]), ([1, 2, 3], [4, 5, 6, 7])])
def test_every_index_and_slice_matches_the_joined_list(prompt, output):
    view, joined = TokenIds(prompt, output), prompt + output
    assert len(view) == len(joined) and list(view) == joined
    bounds = [None, *range(-len(joined) - 2, len(joined) + 3)]
    for start, stop, stride in itertools.product(bounds, bounds, [None, 1, 2, -1, -3]):
        assert view[start:stop:stride] == joined[start:stop:stride], (start, stop, stride)
    for i in range(-len(joined), len(joined)):
        assert view[i] == joined[i], i
    for i in (len(joined), len(joined) + 5, -len(joined) - 1):
        with pytest.raises(IndexError, match=rf"token -?\d+ of {len(joined)}"):
            view[i]


def test_a_draft_gives_the_view_of_its_own_lists():
    req = Request(3, [1, 2, 3], SamplingParams(max_new_tokens=4), frozenset(), block_table=lambda rid: [])
    req.output_token_ids.append(8)
    d = RequestDraft(req)
    d.append_token(9)                              # staged: the draft's copy, not the request's
    assert req.all_token_ids == [1, 2, 3, 8]
    assert list(d.token_ids) == d.all_token_ids == [1, 2, 3, 8, 9]
    assert d.token_ids[2:5] == [3, 8, 9] and d.token_ids[4] == 9
    assert d.num_output_tokens == 2 and d.num_tokens == 5 and len(req.output_token_ids) == 1


def test_a_drafts_token_reads_the_prompt_the_output_and_what_the_step_staged():
    req = Request(3, [1, 2, 3], SamplingParams(max_new_tokens=4), frozenset(), block_table=lambda rid: [])
    req.output_token_ids += [8, 7]
    d = RequestDraft(req)
    assert [d.token(i) for i in range(d.num_tokens)] == [1, 2, 3, 8, 7]
    d.append_token(9)
    assert [d.token(i) for i in range(d.num_tokens)] == list(d.token_ids) == [1, 2, 3, 8, 7, 9]
    with pytest.raises(IndexError):
        d.token(d.num_tokens)
