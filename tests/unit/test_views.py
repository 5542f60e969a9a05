"""Text and HTML views: healthy, empty and error states; snapshots; determinism; no device reads."""
import re
import warnings

import pytest
from views_kit import run_two_requests, small_session, watch_device_reads

from qwen_npu import InvalidRequestError, SamplingParams
from qwen_npu.inspect import inspect_slot, snapshot, topk

TIME = re.compile(r"\d+\.\d{3} ms")


def views(obj) -> tuple[str, str]:
    return repr(obj), obj._repr_html_()


def assert_self_contained(html: str):
    assert "<script" not in html and "<style" not in html and " id=" not in html
    assert "http://" not in html and "https://" not in html


def test_empty_session_view(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)
    text, html = views(sess)
    assert "no requests" in text and "none yet" in text
    assert "0 used, 0 cached, 32 free of 32 blocks x 4 slots" in text
    assert "no requests" in html and "32 free of 32 blocks" in html
    assert_self_contained(html)


def test_healthy_session_view_shows_model_cache_requests_and_last_step(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    text, html = views(sess)
    # request 0 holds blocks 0..2 (11 computed tokens); request 1 finished after 2 tokens and its
    # full block 3 (tokens 20, 21, 22, 22) stays in the prefix cache
    assert "layers 2" in text and "device=cpu" in text and "decode_padding=runtime" in text
    assert "3 used, 1 cached, 28 free of 32 blocks" in text
    assert "requests: 1 decoding, 1 finished" in text
    assert "    000c" + "." * 28 in text                  # the block grid: owner digit per block
    assert "steps: 3; last step: step 2 (decode): 2 rows, 2 tokens" in text
    for rid in (0, 1):
        assert f">r{rid}</span>" in html
    assert html.count("block 0 (slots 0..3): used, ref count 1, requests 0") == 1
    assert "block 3 (slots 12..15): cached, ref count 0, no request, 4/4 tokens" in html
    assert "cached (reusable prefix)" in html               # in the legend
    assert "prefix cache: 2 lookups" in html
    assert_self_contained(html)


def test_request_views_track_status_including_aborted(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)
    req = sess.add_request([5, 6, 7], SamplingParams(max_new_tokens=3))
    assert "status='waiting'" in repr(req) and "waiting" in req._repr_html_()
    assert "no blocks" in req._repr_html_()
    sess.step()
    text, html = views(req)
    assert "prefilling" not in text and "decoding" in text and "blocks=[0]" in text
    assert "[5, 6, 7]" in html
    sess.abort(req)
    text, html = views(req)
    assert "aborted" in text and "finish_reason='abort'" in text
    assert "aborted" in html and "abort" in html


def test_step_view_rows_slots_and_tokens(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)
    sess.add_request(list(range(1, 11)), SamplingParams(max_new_tokens=4))
    first = sess.prefill()                 # 8 of 10 prompt tokens: no logits
    text, html = views(first)
    assert "no row produced logits" in text and "0..7" in text
    assert "logits: none" in text
    assert html.count('title="row 0, request 0, position') == 8
    sess.prefill()
    sess.sample()
    step = sess.decode_step()
    text, html = views(step)
    assert "1 logits row, not sampled yet" in text
    sess.sample()
    text, html = views(step)
    assert f"sampled {step.token_ids.tolist()}" in text
    # position 10 (the first sampled token) lives in block_table[2] = block 2, offset 2 -> slot 10
    assert "position 10 -&gt; slot 10 (block 2, offset 2)" in html
    assert "block_table[2] = block 2 (written in this step)" in html
    assert_self_contained(html)


def test_collision_step_shows_padding_and_duplicate_slots(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab, decode_padding="replicate", slot_check="warn")
    sess.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    sess.add_request([4, 5], SamplingParams(max_new_tokens=4))
    sess.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = sess.step()                    # 2 active rows + 2 padding rows copying row 0
    text, html = views(step)
    assert "4 rows (2 active, 2 padding)" in text
    assert "slots written by more than one row: 3 (rows 0, 2, 3)" in text
    assert "problem: step 1" in text
    assert "padding row" in html and "slot written twice" in html
    assert "ALSO written by rows 0, 2, 3" in html
    assert "1 slot written by more than one row" in html
    sess_text, sess_html = views(sess)
    assert "slot collisions recorded: 1" in sess_text and "1 slot collisions recorded" in sess_html


def test_device_logits_view_states(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)
    sess.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    sess.step()
    step = sess.step()                 # a decode step: the next decode step reuses its buffer
    logits = step.logits
    text, html = views(logits)
    assert "live view" in text and "[1, 512]" in html and "float32" in html
    kept = logits.clone()
    sess.step()
    text, html = views(logits)
    assert "stale" in text and "StaleOutputError" in html
    assert "private copy" in repr(kept) and "private device copy" in kept._repr_html_()


def test_views_never_read_device_tensors_or_count_transfers(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    step = sess.last_step
    before = dict(step.transfers)
    with watch_device_reads(sess) as reads:
        for obj in (sess, step, step.logits, *sess.requests, snapshot(sess), snapshot(step)):
            views(obj)
    assert reads == []
    assert step.transfers == before
    # the detector does see a real read
    with watch_device_reads(sess) as reads:
        step.logits.topk(2)
    assert reads


def test_snapshot_is_frozen_while_the_session_moves_on(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    snap = sess.snapshot()
    step_snap = snapshot(sess.last_step)
    text, html, step_html = repr(snap), snap._repr_html_(), step_snap._repr_html_()
    sess.step()
    assert repr(snap) == text and snap._repr_html_() == html and step_snap._repr_html_() == step_html
    assert sess._repr_html_() != html


def test_same_state_same_bytes_across_two_sessions(tiny_ckpt_small_vocab):
    a = run_two_requests(small_session(tiny_ckpt_small_vocab), decode_steps=2)
    b = run_two_requests(small_session(tiny_ckpt_small_vocab), decode_steps=2)
    assert repr(a) == repr(b) and a._repr_html_() == b._repr_html_()
    assert a._repr_html_() == a._repr_html_()
    for sa, sb in zip(a.history, b.history):
        assert TIME.sub("T", repr(sa)) == TIME.sub("T", repr(sb))
        assert TIME.sub("T", sa._repr_html_()) == TIME.sub("T", sb._repr_html_())
    for ra, rb in zip(a.requests, b.requests):
        assert views(ra) == views(rb)


def test_views_do_not_advance_state(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    state = [(r.status, r.num_computed_tokens, tuple(r.output_token_ids)) for r in sess.requests]
    views(sess)
    views(sess.last_step)
    assert [(r.status, r.num_computed_tokens, tuple(r.output_token_ids)) for r in sess.requests] == state
    assert len(sess.history) == 3


def test_slot_detail_view(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    d = inspect_slot(sess, 9)                   # block 2, offset 1: request 0, position 9
    assert (d.block, d.offset, d.holders) == (2, 1, ((0, 9),))
    assert d.history == ((0, 9, 1),) and len(d.k_norms) == 2 and d.k_norms[0] > 0
    text, html = views(d)
    assert "held by: request 0 position 9" in text and "|K|" in html
    gone = inspect_slot(sess, 13)               # block 3: request 1 finished, its block is cached
    assert gone.holders == () and gone.cached and gone.history == ((1, 1, 1),)
    assert "cached (ref count 0, reusable prefix)" in repr(gone)
    empty = inspect_slot(sess, 127)
    assert empty.history == () and empty.k_norms == (0.0, 0.0)
    assert "never written" in repr(empty) and "never written" in empty._repr_html_()
    with pytest.raises(InvalidRequestError, match="slot 128 is outside the cache"):
        inspect_slot(sess, 128)


def test_topk_counts_its_transfer_and_refuses_stale_logits(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    step = sess.last_step
    d2h = step.transfers["d2h"]
    t = topk(step, 3)
    assert step.transfers["d2h"] == d2h + 2 * 3 * (4 + 8)       # float32 probs + int64 ids per row
    assert t.request_ids == tuple(step.logits_request_ids)
    for row, token in zip(t.token_ids, step.token_ids.tolist()):
        assert row[0] == token                                   # greedy picked the top-1
    assert all(p[0] >= p[1] >= p[2] > 0 for p in t.probs)
    assert "request 0:" in repr(t) and ">r1</span>" in t._repr_html_()
    sess.step()
    with pytest.raises(InvalidRequestError, match="stale"):
        topk(step, 3)


def test_a_large_cache_draws_its_leading_blocks_only(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab, num_blocks=300)
    sess.add_request(list(range(1, 40)), SamplingParams(max_new_tokens=2))
    sess.step()                                               # 8 tokens of 39: blocks 0 and 1
    text, html = views(sess)
    assert "(blocks 32..299 not drawn)" in text
    assert "blocks 32..299 not drawn: free 268" in html
    assert html.count('title="block ') == 32


def test_request_view_marks_blocks_from_the_prefix_cache(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)
    prompt = list(range(1, 11))
    sess.add_request(prompt, SamplingParams(max_new_tokens=2))
    sess.step()
    sess.step()                                               # request 0: 10 tokens computed
    second = sess.add_request(prompt[:9] + [99], SamplingParams(max_new_tokens=2))
    sess.step()                                               # its first 8 tokens come from the cache
    assert second.num_cached_tokens == 8
    html = second._repr_html_()
    assert html.count("(from the prefix cache)") == 2
    assert "block_table[0] = block 0: positions 0..3, 4/4 computed (from the prefix cache)" in html
    assert "block_table[2] = block 3: positions 8..11, 2/4 computed\"" in html
    assert "cached=8" in repr(sess.snapshot().requests[1])


def test_inspect_slot_and_kv_slot_agree_on_who_holds_a_slot(tiny_ckpt_small_vocab):
    """A slot is held by a running request only up to its computed tokens: the free end of a
    request's last block is listed in its block table but held by nobody, in both views."""
    sess = small_session(tiny_ckpt_small_vocab)
    req = sess.add_request([20, 21, 22], SamplingParams(max_new_tokens=4))
    sess.step()                                           # prefill: positions 0..2 computed
    block = req.block_table[0]
    computed, free_end = block * 4 + 2, block * 4 + 3
    assert inspect_slot(sess, computed).holders == sess.kv.slot(computed).held_by == ((req.id, 2),)
    assert inspect_slot(sess, free_end).holders == sess.kv.slot(free_end).held_by == ()
    for bad in (-1, 128, "3"):
        with pytest.raises(InvalidRequestError) as a:
            inspect_slot(sess, bad)
        with pytest.raises(InvalidRequestError) as b:
            sess.kv.slot(bad)
        assert str(a.value) == str(b.value)


def test_a_newline_the_model_wrote_shows_once_as_backslash_n():
    """The requests table shows output text as its repr: a newline appears as \\n, not as \\\\n
    (which would read as if the model had written a backslash)."""
    import dataclasses
    import html as html_lib

    from qwen_npu.inspect import views
    from qwen_npu.inspect.snapshot import RequestSnapshot
    r = RequestSnapshot(id=0, status="finished", prompt_token_ids=(1,), output_token_ids=(2, 3),
                        num_computed_tokens=2, num_cached_tokens=0, num_preemptions=0, block_table=(0,),
                        finish_reason="stop", prompt_text="hi", output_text="user\n")
    table = html_lib.unescape(views.requests_html([r]))
    assert "'user\\n'" in table and "\\\\n" not in table
    long = dataclasses.replace(r, output_text="line\n" * 20)
    shown = html_lib.unescape(views.requests_html([long]))
    assert "'line\\nline\\n" in shown and "\\\\n" not in shown and "...'" in shown


def test_the_blocks_snapshot_shows_the_free_queue_in_the_order_blocks_are_handed_out(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)
    before = sess.blocks.free_queue
    assert sorted(before) == list(range(len(sess.blocks)))       # every block free, each once
    a = sess.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=2, ignore_eos=True))
    sess.step()
    taken = len(a.block_table)
    assert a.block_table == list(before[:taken])                   # the head of the queue went first
    assert sess.blocks.free_queue == before[taken:]
