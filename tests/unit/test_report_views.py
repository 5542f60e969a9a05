"""Views of the KV cache, a slot, the blocks and the check / audit reports: healthy, empty, broken."""
import warnings

from views_kit import run_two_requests, small_session, watch_device_reads

from qwen_npu import SamplingParams


def views(obj) -> tuple[str, str]:
    return repr(obj), obj._repr_html_()


def collided(ckpt):
    """Replicate padding with slot checks on "warn": step 1 writes slot 3 from rows 0, 2 and 3."""
    sess = small_session(ckpt, decode_padding="replicate", slot_check="warn")
    sess.add_request([1, 2, 3], SamplingParams(max_new_tokens=4))
    sess.add_request([4, 5], SamplingParams(max_new_tokens=4))
    sess.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess.step()
    return sess


def test_kv_view_empty_and_after_steps(tiny_ckpt_small_vocab):
    sess = small_session(tiny_ckpt_small_vocab)
    _, empty = views(sess.kv)
    assert "KV cache" in empty and "slots written</span> 0" in empty and "[32, 4, 2, 16]" in empty
    run_two_requests(sess)
    with watch_device_reads(sess) as reads:
        _, html = views(sess.kv)
    assert reads == []
    assert "slots written</span> 15" in html                # 10 + 3 prompt tokens, then 2 decode tokens
    assert "block 3 (slots 12..15): cached" in html and "block 0 (slots 0..3): used" in html
    assert html == sess.kv._repr_html_()


def test_slot_info_views(tiny_ckpt_small_vocab):
    sess = collided(tiny_ckpt_small_vocab)
    _, html = views(sess.kv.slot(3))
    assert "Slot 3 (collided)" in html and "slot 3 written 3 times (rows 0, 2, 3)" in html
    assert "collisions and faults" in html
    _, never = views(sess.kv.slot(100))
    assert "never written" in never and "collided" not in never and "collisions and faults" not in never


def test_check_views_ok_and_broken(tiny_ckpt_small_vocab):
    healthy = run_two_requests(small_session(tiny_ckpt_small_vocab))
    text, html = views(healthy.check())
    assert text.startswith("CheckReport: ok") and "&#10003; ok (" in html
    broken = collided(tiny_ckpt_small_vocab)
    text, html = views(broken.check())
    assert "&#10007;" in html and "collisions (1)" in html and "slot 3 (block 0, offset 3)" in html
    assert html == broken.check()._repr_html_()


def test_audit_views_ok_and_corrupted(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    req = sess.requests[0]
    _, ok = views(sess.audit(req))
    assert "the cached K/V of 11 tokens match a dense recomputation" in ok and "BAD" not in ok
    slot = sess.kv.slot_of(req, 5)
    sess.kv.value(1)[slot // 4, slot % 4] += 1.0              # corrupt one token's V in layer 1
    text, bad = views(sess.audit(req))
    assert "BAD" in text and "BAD" in bad and "mismatches in 11 tokens" in bad
    assert "position 5" in bad


def test_blocks_view_uses_the_common_frame(tiny_ckpt_small_vocab):
    sess = run_two_requests(small_session(tiny_ckpt_small_vocab))
    text, html = views(sess.blocks)
    assert "Blocks" in html and "border-left:3px solid #0969da" in html
    assert "free: 4..31" in text
