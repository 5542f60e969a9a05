"""Research hooks: activations and attention during serving, interventions, forks, divergence.

    with sess.capture("layers.*.attn.q") as cap: ...     capture.py    activations per step and row
    sess.attention(request, layer)                       attention.py  probabilities from the paged cache
    with sess.intervene(name, fn): ...                   intervene.py  edit an activation in flight
    child = sess.fork()                                  ../session_fork.py  branch with copy-on-write KV blocks
    qwen_npu.compare(a, b, requests)                     compare.py    the first place two sessions differ
    qwen_npu.compare_batched(sess, request, others)      batch_compare.py  rounding or contamination in a batch
    logit_lens(sess, cap, request)                       lens.py       final norm + LM head on any residual
    direct_logit_attribution(sess, cap, request, t)      attribution.py  per head / MLP direct logit effects
    activation_patching(sess, clean, corrupted, t)       patching.py   clean -> corrupted, one slice at a time

Hook points and their shapes: ``sess.capture_names()`` and ``qwen_npu/model/qwen3.py``.
"""
from .attention import AttentionPattern
from .attribution import DLA_NAMES, LogitAttribution, direct_logit_attribution
from .capture import Capture, CaptureRecord, CaptureSlice
from .batch_compare import BatchDivergence, compare_batched
from .capture_memory import CaptureEstimate
from .compare import Divergence, DivergenceReport, compare
from .intervene import Intervention, add, replace, scale, zero, zero_heads
from .lens import LogitLens, logit_lens, unembed
from .patching import PatchingResult, activation_patching
from .reductions import mean_positions, norm, topk_logits

__all__ = [
           "DLA_NAMES",
           "AttentionPattern",
           "BatchDivergence",
           "Capture",
           "CaptureEstimate",
           "CaptureRecord",
           "CaptureSlice",
           "LogitAttribution",
           "LogitLens",
           "PatchingResult",
           "activation_patching",
           "compare_batched",
           "direct_logit_attribution",
           "logit_lens",
           "mean_positions",
           "norm",
           "topk_logits",
           "unembed",
           "Divergence",
           "DivergenceReport",
           "Intervention",
           "add",
           "compare",
           "replace",
           "scale",
           "zero",
           "zero_heads",
]
