"""sess.capture at scale: positions filter, device reductions, host offload, budget, streaming.
Each option is checked against a plain capture of the same run."""
import pytest
import torch
from research_kit import TOL, greedy, make_ckpt, open_session, sequences

from qwen_npu import InvalidRequestError
from qwen_npu.errors import CaptureCallbackError
from qwen_npu.research import mean_positions, norm, topk_logits

NAMES = ["layers.1.attn.q", "layers.2.residual", "logits"]
LENS = [9, 6]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_scale"))


def run(ckpt, **opts):
    """Two prompts, chunked prefill then 3 decode steps, captured with ``opts``."""
    sess = open_session(ckpt, prefix_cache=False)
    reqs = [sess.add_request(p, greedy(4)) for p in sequences(LENS, seed=5)]
    with sess.capture(NAMES, **opts) as cap:
        while not all(r.is_done for r in reqs):
            sess.step()
    return sess, reqs, cap


@pytest.fixture(scope="module")
def full(ckpt):
    return run(ckpt)


def test_positions_last_generated_and_absolute_keep_only_those(ckpt, full):
    _, reqs, everything = full
    for filt in ("last", "generated", [0, 5, 7, 10]):
        _, _, cap = run(ckpt, positions=filt)
        for i, req in enumerate(reqs):
            n = LENS[i]
            all_pos = everything.positions(req, "layers.1.attn.q")
            if filt == "last":     # each step's last token of the row: chunk ends, then every decode token
                steps = everything.steps_of(req, "layers.1.attn.q")
                expect = [p for j, p in enumerate(all_pos) if j + 1 == len(all_pos) or steps[j + 1] != steps[j]]
            elif filt == "generated":
                expect = [p for p in all_pos if p >= n]
            else:
                expect = [p for p in all_pos if p in filt]
            assert cap.positions(req, "layers.1.attn.q") == expect
            ref = everything.stack("layers.1.attn.q", req)[[all_pos.index(p) for p in expect]]
            assert torch.equal(cap.stack("layers.1.attn.q", req), ref)
            # logits: one row per logits row; "generated" drops the prompt's last position
            want = [p for p in everything.positions(req, "logits") if filt == "last" or p in expect]
            if want:
                assert cap.positions(req, "logits") == want
            else:
                with pytest.raises(InvalidRequestError, match="nothing of 'logits' captured"):
                    cap.positions(req, "logits")
    with pytest.raises(InvalidRequestError, match="positions='first'"):
        full[0].capture("embed", positions="first")
    with pytest.raises(InvalidRequestError, match="ints >= 0"):
        full[0].capture("embed", positions=[-1])


def test_reductions_run_on_the_device_and_match_the_plain_capture(ckpt, full):
    _, reqs, everything = full
    _, _, cap = run(ckpt, reduce=norm())
    _, _, top = run(ckpt, reduce=topk_logits(3))
    _, _, mean = run(ckpt, reduce=mean_positions())
    for req in reqs:
        for name in NAMES:
            x = everything.stack(name, req).float()
            torch.testing.assert_close(cap.stack(name, req), torch.linalg.vector_norm(x, dim=-1), atol=TOL, rtol=0)
            torch.testing.assert_close(mean.mean(name, req), x.mean(0), atol=TOL, rtol=0)
        logits = everything.stack("logits", req)
        vals, ids = logits.topk(3, dim=-1)
        got = top.stack("logits", req)
        assert got.shape == (logits.shape[0], 3, 2)
        assert torch.equal(got[..., 1].long(), ids) and torch.equal(got[..., 0], vals)
    assert cap.nbytes < everything.nbytes / 10
    assert mean.nbytes == len(reqs) * 4 * (4 * 16 + 64 + 512)         # one float32 row per request and name
    with pytest.raises(InvalidRequestError, match=r"read them with cap.mean"):
        mean.stack("logits", reqs[0])
    with pytest.raises(InvalidRequestError, match="reduce must be callable"):
        full[0].capture("embed", reduce=3)


def test_offload_to_host_keeps_the_same_values(ckpt, full):
    _, reqs, everything = full
    _, _, cap = run(ckpt, offload="host")
    for req in reqs:
        for name in NAMES:
            got = cap.stack(name, req)
            assert got.device.type == "cpu" and torch.equal(got, everything.stack(name, req))
    assert cap.nbytes == everything.nbytes
    with pytest.raises(InvalidRequestError, match="offload='disk'"):
        full[0].capture("embed", offload="disk")


def test_the_estimate_is_exact_and_a_capture_over_budget_is_refused(ckpt, full):
    _, _, everything = full
    sess = open_session(ckpt, prefix_cache=False)
    reqs = [sess.add_request(p, greedy(4)) for p in sequences(LENS, seed=5)]
    est = sess.capture(NAMES).estimate()
    assert est.bytes == everything.nbytes and est.requests == tuple(r.id for r in reqs)
    assert est.positions == sum(n + 3 for n in LENS)
    with pytest.raises(InvalidRequestError, match=r"over its budget of [0-9.]+ KiB; narrow names"):
        with sess.capture(NAMES, budget=est.bytes - 1):
            pass
    assert sess._engine.hook is None
    with sess.capture(NAMES, budget=est.bytes) as cap:
        while not all(r.is_done for r in reqs):
            sess.step()
    assert cap.nbytes == est.bytes
    # a request added inside the block is counted when its step comes: the step is refused before it runs
    with sess.capture(NAMES, budget=1000) as small:          # nothing live yet: the block opens
        late = sess.add_request(sequences([30], seed=6)[0], greedy(2))
        with pytest.raises(InvalidRequestError, match=r"step \d+: capture of .* would keep"):
            sess.step()
    assert late.num_computed_tokens == 0 and late.status == "waiting" and small.nbytes == 0
    sess.generate([[1, 2, 3]], greedy(2))                    # the session goes on


def test_streaming_hands_every_slice_to_the_callback_and_keeps_nothing(ckpt, full):
    _, reqs, everything = full
    got = {}

    def on_step(s):
        got.setdefault((s.request_id, s.name), []).append((s.positions, s.tensor.clone()))
    _, _, cap = run(ckpt, on_step=on_step)
    assert cap.nbytes == 0 and cap.records == []
    for req in reqs:
        for name in NAMES:
            parts = got[(req.id, name)]
            positions = [p for ps, _ in parts for p in ps]
            assert positions == everything.positions(req, name)
            assert torch.equal(torch.cat([t for _, t in parts]), everything.stack(name, req))


def test_a_raising_callback_still_gets_every_other_slice_and_the_step_stays_committed(ckpt, full):
    _, reqs, everything = full
    sess = open_session(ckpt, prefix_cache=False)
    live = [sess.add_request(p, greedy(4)) for p in sequences(LENS, seed=5)]
    got, calls = [], []

    def on_step(s):
        calls.append((s.step, s.request_id, s.name))
        if len(calls) == 1:                      # the first slice of the first step
            raise ValueError("boom")
        got.append((s.step, s.request_id, s.name, s.tensor.clone()))

    with sess.capture(NAMES, on_step=on_step):
        history, index = len(sess.history), sess.state.step_index
        with pytest.raises(CaptureCallbackError, match=rf"step {index} committed.*raised for 1 of its "
                           rf"(\d+) slices: layers\.1\.attn\.q of request {live[0].id}.*ValueError: boom") as e:
            sess.step()
        assert isinstance(e.value.__cause__, ValueError) and e.value.step == index
        assert len(sess.history) == history + 1 and sess.state.step_index == index + 1   # committed
        first_step = [c for c in calls if c[0] == index]
        assert len(first_step) == e.value.delivered == 1 + len([g for g in got if g[0] == index]) > 1
        while not all(r.is_done for r in live):     # the session goes on, the capture still streams
            sess.step()
    assert [r.output_token_ids for r in live] == [r.output_token_ids for r in reqs]
    for step, rid, name, tensor in got:
        req = {r.id: i for i, r in enumerate(live)}[rid]
        want = everything.get(name, step=step, request=reqs[req])
        assert torch.equal(tensor, want)
    assert sess.check().ok
