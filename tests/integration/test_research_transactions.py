"""Captures and interventions are part of a step's transaction: a step that fails or is
interrupted anywhere before its commit adds no capture record, no streamed slice, no running sum,
no edit count and no private mark; the retried step then captures exactly what an uninterrupted
run captures."""
import pytest
import torch
from fault_kit import Boom, raise_at
from research_kit import greedy, make_ckpt, open_session, sequences

from qwen_npu.research import mean_positions, zero

POINTS = ["validated#1", "fwd:layers.0.resid_mid#1", "fwd:logits#1", "dispatched#1", "booked#1", "commit#1"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_txn"), layers=2)


def _capture_state(cap):
    return ([(r.step, r.request_id, {k: [tuple(t.shape) for t in v] for k, v in r.chunks.items()})
             for r in cap.records], cap.nbytes, list(cap.steps))


def _run(ckpt, fail_point=None, exc=Boom, **capture_kw):
    """Two requests, prefill then decode under a capture; the 3rd step fails once at ``fail_point``."""
    sess = open_session(ckpt, prefix_cache=True, chunk_size=8)
    for prompt in sequences([11, 6], seed=3):
        sess.add_request(prompt, greedy(4))
    streamed = []
    kw = dict(capture_kw)
    if kw.pop("stream", False):
        kw["on_step"] = streamed.append
    with sess.capture(["layers.0.resid_mid", "logits"], **kw) as cap:
        for _ in range(2):
            sess.step()
        if fail_point is not None:
            before = (_capture_state(cap), len(streamed), sess.state_digest())
            assert raise_at(sess, lambda s: s.step(), fail_point, exc)
            assert (_capture_state(cap), len(streamed), sess.state_digest()) == before
        while any(not q.is_done for q in sess.requests):
            sess.step()
    got = {(r.step, r.request_id): {k: r.tensor(k).clone() for k in r.chunks} for r in cap.records}
    return got, [(s.step, s.request_id, s.name, tuple(s.positions)) for s in streamed], \
        [r.output_token_ids for r in sess.requests]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_a_failed_step_leaves_no_capture_record(ckpt, point, exc):
    want = _run(ckpt, positions="last")
    got = _run(ckpt, point, exc, positions="last")
    assert got[2] == want[2]
    assert got[0].keys() == want[0].keys()
    for key, names in want[0].items():
        for name, t in names.items():
            assert torch.equal(got[0][key][name], t), (key, name)


@pytest.mark.parametrize("point", ["fwd:logits#1", "commit#1"])
def test_streamed_slices_arrive_once_per_committed_step(ckpt, point):
    _, want, tokens = _run(ckpt, stream=True)
    _, got, tokens2 = _run(ckpt, point, stream=True)
    assert got == want and tokens2 == tokens and want


def test_running_sums_skip_a_failed_step(ckpt):
    def means(fail):
        sess = open_session(ckpt, chunk_size=8)
        r = sess.add_request(sequences([13], seed=4)[0], greedy(3))
        with sess.capture("layers.1.resid_pre", reduce=mean_positions()) as cap:
            sess.step()
            if fail:
                assert raise_at(sess, lambda s: s.step(), "fwd:logits#1", Boom)
            while any(not q.is_done for q in sess.requests):
                sess.step()
        return cap.mean("layers.1.resid_pre", r)
    assert torch.equal(means(True), means(False))


@pytest.mark.parametrize("point", ["fwd:logits#1", "booked#1", "commit#1"])
def test_a_failed_edited_step_counts_no_edit_and_marks_nothing_private(ckpt, point):
    sess = open_session(ckpt, prefix_cache=True, chunk_size=64)
    r = sess.add_request(sequences([12], seed=5)[0], greedy(2))
    with sess.intervene("layers.0.attn.out", zero()) as edit:
        digest = sess.state_digest()
        assert raise_at(sess, lambda s: s.step(), point, Boom)
        assert edit.num_edits == 0
        assert sess.state.manager.private_reason(r.id) is None
        assert sess.state_digest() == digest
        sess.step()                                          # the retried step is edited for real
        assert edit.num_edits > 0
        assert "edited" in sess.state.manager.private_reason(r.id)
