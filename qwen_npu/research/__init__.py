"""Research hooks: activations and attention during serving, interventions, forks, divergence.

    with sess.capture("layers.*.attn.q") as cap: ...     capture.py    activations per step and row
    sess.attention(request, layer)                       attention.py  probabilities from the paged cache
    with sess.intervene(name, fn): ...                   intervene.py  edit an activation in flight
    child = sess.fork()                                  fork.py       branch with copy-on-write KV blocks
    qwen_npu.compare(a, b, requests)                     compare.py    the first place two sessions differ

Hook points and their shapes: ``sess.capture_names()`` and ``qwen_npu/model/qwen3.py``.
"""
from .attention import AttentionPattern
from .capture import Capture, CaptureRecord
from .compare import Divergence, DivergenceReport, compare
from .intervene import Intervention, add, replace, scale, zero, zero_heads

__all__ = [
           "AttentionPattern",
           "Capture",
           "CaptureRecord",
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
