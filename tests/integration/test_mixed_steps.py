"""Mixed steps: decode rows and prefill chunks in one forward (``mixed_steps=True``).

Greedy streams must not depend on how steps are packed: requests arriving at different times, with
the prefix cache on and off, and with preemption in a small cache, give the same tokens with mixed
steps on and off. The token budget holds (decode rows first, prefill chunks in the rest), and
``prefill()`` / ``decode_step()`` keep their meaning.
"""
from __future__ import annotations

import pytest
from session_kit import greedy, make_untied, prompts

from qwen_npu import Session
from qwen_npu.errors import InvalidRequestError

LENS = (5, 11, 19, 26)
NEW = (12, 10, 9, 8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_untied(tmp_path_factory.mktemp("mixed"))


def open_session(ckpt, **kw):
    args = {"device": "cpu", "max_batch": 4, "block_size": 4, "max_model_len": 96, "num_blocks": 256,
            "chunk_size": 8}
    args.update(kw)
    return Session.from_pretrained(ckpt, **args)


def staggered(sess, shared_prefix=False):
    """Request 0 first; request 1 after three steps; requests 2 and 3 after five. Returns
    (tokens per request, step kinds, steps). ``check()`` passes after every step."""
    ps = prompts(LENS)
    if shared_prefix:                        # requests 1 and 3 start with request 0's prompt
        ps[1] = ps[0][:4] + ps[1]
        ps[3] = ps[0][:4] + ps[3]
    reqs = [sess.add_request(ps[0], greedy(NEW[0]))]
    steps = []
    for i in range(400):
        if i == 3:
            reqs.append(sess.add_request(ps[1], greedy(NEW[1])))
        if i == 5:
            reqs += [sess.add_request(ps[2], greedy(NEW[2])), sess.add_request(ps[3], greedy(NEW[3]))]
        if i > 5 and all(r.is_done for r in reqs):
            break
        steps.append(sess.step())
        report = sess.check()
        assert report.ok, f"after step {steps[-1].index} ({steps[-1].kind}): {report}"
    assert all(r.is_done for r in reqs)
    return [list(r.output_token_ids) for r in reqs], [s.kind for s in steps], steps


CASES = {
    "prefix_cache": {"prefix_cache": True},
    "no_prefix_cache": {"prefix_cache": False},
    "preemption": {"num_blocks": 12},       # 48 slots: the four requests cannot all stay
    "deterministic": {"deterministic": True},   # batch-invariant kernels, mixed steps included
}


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_streams_are_identical_with_mixed_steps_on_and_off(ckpt, case, kernels):
    kw = {**CASES[case], "kernels": kernels}
    shared = case == "prefix_cache"
    want, kinds_off, _ = staggered(open_session(ckpt, mixed_steps=False, **kw), shared)
    sess = open_session(ckpt, mixed_steps=True, **kw)
    got, kinds_on, steps = staggered(sess, shared)
    assert "mixed" not in kinds_off
    assert kinds_on.count("mixed") >= 3, kinds_on
    assert got == want
    assert [len(t) for t in got] == list(NEW)
    if case == "preemption":
        assert any(r.num_preemptions for r in sess.requests)
    if case == "prefix_cache":
        assert sess.prefix_cache_stats.hit_blocks >= 1
    for s in steps:                          # the budget: chunk_size tokens per step, decode rows first
        assert int(s.query_lens.sum()) <= sess.config.chunk_size
        if s.kind == "mixed":
            kinds = s.row_kinds
            assert kinds == sorted(kinds), f"step {s.index}: decode rows come first: {kinds}"
            assert {"decode", "prefill"} <= set(kinds)
            assert all(int(q) == 1 for q, k in zip(s.query_lens, kinds) if k == "decode")
            decoding_before = [rid for rid, k in zip(s.request_ids, kinds) if k == "decode"]
            assert decoding_before, s
        else:
            assert set(s.row_kinds) == {s.kind}


def test_every_decoding_request_keeps_decoding_while_a_newcomer_prefills(ckpt):
    sess = open_session(ckpt, mixed_steps=True, chunk_size=6)
    ps = prompts(LENS)
    a = sess.add_request(ps[0], greedy(20))
    b = sess.add_request(ps[1], greedy(20))
    while a.status != "decoding" or b.status != "decoding":
        sess.step()
    c = sess.add_request(ps[3], greedy(3))           # 26 tokens: five steps of 4 tokens
    seen = []
    while c.status != "decoding":
        before = (len(a.output_token_ids), len(b.output_token_ids))
        s = sess.step()
        seen.append(s.kind)
        assert s.kind == "mixed"
        assert s.request_ids[:2] == [a.id, b.id] and s.row_kinds == ["decode", "decode", "prefill"]
        assert (len(a.output_token_ids), len(b.output_token_ids)) == (before[0] + 1, before[1] + 1)
        assert s.query_lens.tolist() == [1, 1, min(4, 26 - s.positions[2].item())]
    assert len(seen) == 7                            # ceil(26 / 4)


def test_generate_with_mixed_steps_matches_separate_steps(ckpt):
    ps = prompts(LENS)
    outs = {}
    for mixed in (False, True):
        sess = open_session(ckpt, mixed_steps=mixed, chunk_size=6)
        done = sess.generate(ps, [greedy(n) for n in NEW], progress=False)
        outs[mixed] = [c.token_ids for c in done]
        kinds = [s.kind for s in sess.history]
        assert ("mixed" in kinds) == mixed
    assert outs[True] == outs[False]


def test_prefill_and_decode_step_keep_their_meaning_with_mixed_steps_on(ckpt):
    sess = open_session(ckpt, mixed_steps=True, chunk_size=64)
    ps = prompts(LENS)
    a = sess.add_request(ps[0], greedy(4))
    sess.sample(sess.prefill())
    b = sess.add_request(ps[1], greedy(4))
    s = sess.prefill()                               # only the newcomer, although a is decoding
    assert s.kind == "prefill" and s.request_ids == [b.id]
    sess.sample(s)
    s = sess.decode_step()
    assert s.kind == "decode" and s.request_ids == [a.id, b.id]
    sess.sample(s)


def test_mixed_steps_must_be_a_bool(ckpt):
    with pytest.raises(InvalidRequestError, match="mixed_steps='yes' must be True or False"):
        open_session(ckpt, mixed_steps="yes")


def test_views_dumps_and_captures_of_a_mixed_step(ckpt, tmp_path, capsys):
    import json

    from qwen_npu import load_dump
    from qwen_npu.tools.cli import main

    sess = open_session(ckpt, mixed_steps=True, chunk_size=6)
    ps = prompts(LENS)
    a = sess.add_request(ps[0], greedy(6))
    while a.status != "decoding":
        sess.step()
    b = sess.add_request(ps[2], greedy(2))
    with sess.capture(["layers.0.attn.k", "logits"]) as cap:
        step = sess.step()
    assert step.kind == "mixed" and step.row_kinds == ["decode", "prefill"]
    assert step.request_ids == [a.id, b.id] and step.query_lens.tolist() == [1, 5]

    text = repr(step)
    assert text.startswith(f"StepResult(step {step.index}, mixed, 2 rows (1 decode, 1 prefill), 6 tokens")
    assert f"{a.id} (decode)" in text and f"{b.id} (prefill)" in text
    html = step._repr_html_()
    assert f"Step {step.index}: mixed" in html and "decode" in html and "prefill" in html

    kinds = {(r.request_id, r.kind, r.row_kind) for r in cap.records}
    assert kinds == {(a.id, "mixed", "decode"), (b.id, "mixed", "prefill")}
    assert f"step {step.index} (mixed, decode row) request {a.id}" in repr(cap)
    assert cap.records[0].tensor("layers.0.attn.k").shape[0] == 1          # a's one decode token
    assert cap.records[1].tensor("layers.0.attn.k").shape[0] == 5          # b's chunk of five

    path = sess.dump(tmp_path / "mixed.json")
    d = json.loads(path.read_text())
    assert d["meta"]["mixed_steps"] is True
    assert d["steps"][-1]["kind"] == "mixed" and d["steps"][-1]["row_kinds"] == ["decode", "prefill"]
    back = load_dump(path).steps[-1]
    assert back.row_kinds == ["decode", "prefill"]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"step {step.index} (mixed: 1 decode, 1 prefill): 2 rows, 6 tokens" in out
    assert "all steps ok" in out

    d["steps"][-1].pop("row_kinds")                     # a mixed step must say which row is which
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(InvalidRequestError, match="is mixed but its row_kinds"):
        load_dump(tmp_path / "bad.json")


def test_decode_rows_that_fill_the_budget_make_a_plain_decode_step(ckpt):
    sess = open_session(ckpt, mixed_steps=True, chunk_size=2)
    ps = prompts(LENS)
    a, b = sess.add_request(ps[0][:1], greedy(3)), sess.add_request(ps[1][:1], greedy(3))
    assert sess.step().kind == "prefill"               # both one-token prompts: now both decode
    c = sess.add_request(ps[2][:3], greedy(2))
    kinds = []
    while not c.is_done:
        kinds.append(sess.step().kind)
    # two decode rows use the whole budget of two tokens: c waits until a and b finish
    assert kinds == ["decode", "decode", "prefill", "prefill", "decode"]
    assert a.is_done and b.is_done and len(c.output_token_ids) == 2
