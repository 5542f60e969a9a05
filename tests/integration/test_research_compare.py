"""qwen_npu.compare: no divergence between equal sessions; a perturbed kernel is found at its layer."""
import types

import pytest
from research_kit import greedy, make_ckpt, open_session, sequences

import qwen_npu
from qwen_npu import InvalidRequestError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("research_compare"), layers=4)


@pytest.fixture(scope="module")
def prompts():
    return sequences([7, 12, 3], seed=31)


def perturbed_kernels(kernels, weight, delta):
    """A kernel set whose RMSNorm adds ``delta`` to the output of the norm with ``weight`` only."""
    proxy = types.SimpleNamespace(**vars(kernels))          # every kernel as it is, but one

    def add_rms_norm(x, residual, w, eps):
        h, s = kernels.add_rms_norm(x, residual, w, eps)
        return (h + delta if w is weight else h), s

    proxy.add_rms_norm = add_rms_norm
    return proxy


def test_identical_sessions_do_not_diverge(ckpt, prompts):
    a, b = open_session(ckpt), open_session(ckpt)
    report = qwen_npu.compare(a, b, prompts, sampling=greedy(4))
    assert not report.diverged and report.first is None and report.firsts == ()
    assert report.num_requests == 3 and report.num_positions == sum(len(p) + 3 for p in prompts)
    assert max(report.max_diffs.values()) == 0.0              # same kernels, same batches: bit-identical
    assert len(report.max_diffs) == len([n for n in a.capture_names() if not n.endswith(".scores")]) and report.token_mismatches == ()
    assert "no divergence" in repr(report)
    assert all(r.is_done for r in a.requests + b.requests)


def test_a_perturbed_norm_in_layer_2_is_found_at_layer_2(ckpt, prompts):
    a, b = open_session(ckpt), open_session(ckpt)
    b.model.kernels = perturbed_kernels(b.model.kernels, b.model.layers[2].input_norm, 1e-3)
    report = qwen_npu.compare(a, b, prompts, sampling=greedy(4), atol=1e-4)
    first = report.first
    assert report.diverged
    assert (first.name, first.layer, first.step_a, first.request, first.position) == ("layers.2.attn.in", 2, 0, 0, 0)
    assert first.max_abs_diff == pytest.approx(1e-3, rel=1e-2)
    by_layer = report.by_layer()
    assert by_layer["embed"] == by_layer[0] == by_layer[1] == 0.0 and by_layer[2] > 1e-4
    assert "layer 2, layers.2.attn.in" in repr(report)


def test_batched_against_one_request_at_a_time_agrees_within_tolerance(ckpt, prompts):
    a, b = open_session(ckpt), open_session(ckpt, max_batch=1, chunk_size=64)
    report = qwen_npu.compare(a, b, prompts, sampling=greedy(3), atol=1e-4,
                              names=["layers.*.residual", "logits"])
    assert not report.diverged, report
    assert len(report.max_diffs) == 5


def test_compare_refuses_busy_sessions(ckpt, prompts):
    a, b = open_session(ckpt), open_session(ckpt)
    b.add_request(prompts[0], greedy(2))
    with pytest.raises(InvalidRequestError, match="session b still runs requests \\[0\\]"):
        qwen_npu.compare(a, b, prompts)
    assert a.requests == []
    with pytest.raises(InvalidRequestError, match="did you mean"):
        qwen_npu.compare(a, a, prompts, names=["layers.0.attn.outt"])
