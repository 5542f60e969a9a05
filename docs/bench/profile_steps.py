"""Where the time of a step goes: each kernel function timed from outside, the rest by subtraction.

A Session's model calls its kernels through ``model.kernels``; ``TimedKernels`` stands in for the
set, forwards every call and adds up the wall-clock seconds per part (on the CPU every call is
synchronous, so the time of a call is the time of its work):

    linear    the q/k/v, o, gate/up and down projections     lm_head   the logits rows
              (gate_up_silu included)
    attention paged_attention                                write_kv  the K/V scatter
    norms     rms_norm, add_rms_norm, rope, qk_norm_rope     other     the rest of the forward
                                                             (silu_mul, greedy_health included)
    engine    the step outside the forward: scheduling, slot checks, buffers, sampling, bookkeeping

The timed set has every function the set has (any it does not time is handed through), so the
model takes the same route through it as through the set itself: the fused LM head with greedy
sampling's read (``lm_head``, timed as lm_head) included.
"""
from __future__ import annotations

import collections
import time

import torch.nn.functional as F

from qwen_npu.kernels import panels

PARTS = ("linear", "lm_head", "attention", "write_kv", "norms", "other", "engine")
KERNEL_PARTS = {"write_kv": "write_kv", "paged_attention": "attention", "rms_norm": "norms",
                "add_rms_norm": "norms", "rope": "norms"}
# Functions a set may lack (the model then makes separate calls): timed only when the set has them.
OPTIONAL_PARTS = {"qk_norm_rope": "norms", "silu_mul": "other", "lm_head": "lm_head", "greedy_health": "other",
                  "gate_up_silu": "linear"}


class TimedKernels:
    def __init__(self, inner, vocab_size: int):
        self._inner = inner
        self.seconds: collections.Counter = collections.Counter()
        for name, part in KERNEL_PARTS.items():
            setattr(self, name, self._timed(part, getattr(inner, name)))
        for name, part in OPTIONAL_PARTS.items():
            if hasattr(inner, name):
                setattr(self, name, self._timed(part, getattr(inner, name)))
        inner_linear = getattr(inner, "linear", F.linear)

        def linear(x, weight):
            t = time.perf_counter()
            y = inner_linear(x, weight)
            self.seconds["lm_head" if panels.out_features(weight) == vocab_size else "linear"] += time.perf_counter() - t
            return y
        self.linear = linear

    def __getattr__(self, name):
        """A function of the set that is not timed (its time falls in "other"). The layers' calls
        made in one (``decoder_layers``) are not offered, so that each of them is timed on its own."""
        if name.startswith("__") or name in ("_inner", "decoder_layers"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _timed(self, part, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - t
            return out
        return call


def profile(sess, *, batch: int, context: int, decode_steps: int) -> dict:
    """Milliseconds per step by part. ``decode_steps`` > 0: ``batch`` rows sharing one ``context``-token
    prompt, timed over that many decode steps; 0: the one prefill step of a single such prompt
    (``context`` <= the session's chunk size)."""
    from qwen_npu import SamplingParams
    from qwen_npu.tools.workloads import custom
    sess.reset()
    inner = sess.model.kernels
    timed = TimedKernels(inner, sess.model_config.vocab_size)
    prompt = custom(context, 1, n=1)[0][0]
    reqs = [sess.add_request(prompt, SamplingParams(max_new_tokens=decode_steps + 2, ignore_eos=True))
            for _ in range(batch if decode_steps else 1)]
    total = forward = 0.0
    steps = max(decode_steps, 1)
    sess.model.kernels = timed
    try:
        if decode_steps:
            while any(r.status in ("waiting", "prefilling") for r in reqs):
                sess.step()
            timed.seconds.clear()
        for _ in range(steps):
            t = time.perf_counter()
            step = sess.step()
            total += time.perf_counter() - t
            forward += step.timings["forward"]
    finally:
        sess.model.kernels = inner
    sess.reset()
    parts = {p: 1e3 * timed.seconds[p] / steps for p in PARTS[:5]}
    parts["other"] = 1e3 * forward / steps - sum(parts.values())
    parts["engine"] = 1e3 * (total - forward) / steps
    parts["total"] = 1e3 * total / steps
    return {k: round(v, 2) for k, v in parts.items()}
