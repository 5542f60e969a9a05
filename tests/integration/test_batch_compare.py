"""compare_batched: rounding, contamination or identical bits of a request in a batch."""
import pytest
from session_kit import greedy, make_untied, open_session, prompts

from qwen_npu import InvalidRequestError, compare_batched
from qwen_npu.research import BatchDivergence


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_untied(tmp_path_factory.mktemp("batch-compare"))


def request_and_neighbours():
    ps = prompts((9, 6, 13, 4, 11, 7, 15), seed=21)
    return (ps[0], greedy(4)), [(p, greedy(3)) for p in ps[1:]]


def session(ckpt, **kw):
    return open_session(ckpt, kernels="reference", max_batch=8, prefix_cache=False, **kw)


def test_ordinary_kernels_round_differently_in_a_batch_and_nothing_leaks(ckpt):
    sess = session(ckpt)
    request, neighbours = request_and_neighbours()
    got = compare_batched(sess, request, neighbours)
    assert isinstance(got, BatchDivergence) and got.verdict == "rounding"
    assert got.first is not None and got.contamination is None and got.num_neighbours == 6
    assert got.first.max_abs_diff < 1e-3                     # rounding, not a different computation
    assert got.margin is not None and got.margin >= 0
    assert got.batched.tokens == got.perturbed.tokens
    assert "rounding" in repr(got) and "leaves this row's bits" in repr(got)
    assert list(sess.requests) == [] and list(sess.history) == []      # left reset


def test_batch_invariant_kernels_give_identical_bits(ckpt):
    got = compare_batched(session(ckpt, deterministic=True), *request_and_neighbours())
    assert got.verdict == "identical" and got.first is None and got.margin is None
    assert got.batched.num_positions > 0


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_planted_leak_between_rows_is_contamination(ckpt, monkeypatch, deterministic):
    """Norms that add a little of the mean over every token of the step: other rows' data. The
    first norm the leak reaches is layer 0's input norm."""
    sess = session(ckpt, deterministic=deterministic)
    kernels = sess._engine.model.kernels
    norm = kernels.rms_norm
    monkeypatch.setattr(kernels, "rms_norm", lambda x, w, eps: norm(x, w, eps) + 1e-3 * x.mean(0, keepdim=True))
    got = compare_batched(sess, *request_and_neighbours())
    assert got.verdict == "contamination" and got.contamination is not None
    assert (got.contamination.name, got.contamination.position) == ("layers.0.attn.in", 0)
    assert "changing only the neighbours changes this row" in repr(got)


def test_bad_calls_are_refused_before_anything_runs(ckpt):
    sess = session(ckpt)
    request, neighbours = request_and_neighbours()
    with pytest.raises(InvalidRequestError, match="no neighbours"):
        compare_batched(sess, request, [])
    live = sess.add_request(*request)
    with pytest.raises(InvalidRequestError, match="still runs requests"):
        compare_batched(sess, request, neighbours)
    assert sess.requests == [live] and not live.is_done
    with pytest.raises(InvalidRequestError):
        sess.abort(live) or compare_batched(sess, ([10**6], greedy(2)), neighbours)   # an id outside the vocabulary
    assert len(sess.requests) == 1


def test_an_interrupted_comparison_leaves_the_session_reset_and_usable(ckpt, monkeypatch):
    from qwen_npu.research import batch_compare
    sess = session(ckpt)
    request, neighbours = request_and_neighbours()
    real, calls = batch_compare._run, []

    def interrupted(*args, **kw):
        calls.append(1)
        if len(calls) == 3:                       # the perturbed run, after the lone and the batched ones
            raise KeyboardInterrupt
        return real(*args, **kw)
    monkeypatch.setattr(batch_compare, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compare_batched(sess, request, neighbours)
    assert list(sess.requests) == [] and list(sess.history) == []
    monkeypatch.setattr(batch_compare, "_run", real)
    assert compare_batched(sess, request, neighbours).verdict == "rounding"
