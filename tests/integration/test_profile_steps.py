"""docs/bench/profile_steps.py: a profiled step takes the route an unprofiled one takes (the same
kernel functions, the same tokens), so the parts it reports are those of the real step."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from qwen_npu import SamplingParams, Session
from qwen_npu.kernels import cpu, reference

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"


@pytest.fixture
def profile_steps(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "profile_steps", raising=False)
    import profile_steps
    return profile_steps


def test_every_function_of_the_set_is_there_timed_or_handed_through(profile_steps):
    calls = []
    inner = types.SimpleNamespace(
        **{name: getattr(reference, name) for name in profile_steps.KERNEL_PARTS},
        lm_head=lambda x, weight, out: calls.append("lm_head"), greedy_health=lambda logits: calls.append("greedy"),
        fused_extra=lambda: "handed through")
    timed = profile_steps.TimedKernels(inner, vocab_size=8)
    timed.lm_head(None, None, None)
    timed.greedy_health(None)
    assert calls == ["lm_head", "greedy"] and timed.seconds["lm_head"] > 0 and timed.seconds["other"] > 0
    assert timed.fused_extra() == "handed through"
    assert not hasattr(timed, "qk_norm_rope")         # absent from the set: the model makes the separate calls


@pytest.mark.skipif(not cpu.available(), reason="the cpu kernel set is not built here")
def test_a_profiled_decode_step_takes_the_lm_head_route_the_step_takes(profile_steps, tiny_ckpt, monkeypatch):
    sess = Session.from_pretrained(tiny_ckpt, kernels="cpu", dtype="bfloat16", max_model_len=256, num_blocks=64)
    runs = []
    inner_lm_head = sess.model.kernels.lm_head

    def lm_head(x, weight, out):
        found = inner_lm_head(x, weight, out)
        runs.append(found is not None)
        return found
    monkeypatch.setattr(sess.model.kernels, "lm_head", lm_head)
    req = sess.add_request([5] * 20, SamplingParams(max_new_tokens=4, ignore_eos=True))
    while not req.is_done:
        sess.step()
    plain = list(runs)
    runs.clear()
    parts = profile_steps.profile(sess, batch=2, context=16, decode_steps=2)
    # the profiled steps call the set's lm_head as the unprofiled ones do, with the same outcome
    # (fused on AMX tiles and on panels; a CPU with AVX512-BF16 and no AMX falls back in both)
    assert plain and runs and set(runs) == set(plain) and len(set(plain)) == 1 and parts["lm_head"] > 0
    assert set(parts) == set(profile_steps.PARTS) | {"total"}
