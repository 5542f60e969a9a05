"""Looking at a Session: snapshots with text and HTML views, an ipywidgets explorer, plots.

    snapshot(obj)                 frozen copy of a Session, Request or StepResult (renders itself)
    inspect_slot(sess, slot)      one KV slot: holders, write history, K/V norms by layer
    topk(step, k, decode=None)    top-k next tokens with probabilities of a step's logits rows
    explore(sess)                 the interactive explorer (needs ipywidgets)
    plot_*(...)                   matplotlib figures (needs matplotlib); see ``plots``

ipywidgets and matplotlib are imported only when ``explore`` or a plot is used.
"""
from .slot_detail import SlotDetail, inspect_slot
from .snapshot import take as snapshot
from .topk import TopK, topk

_LAZY = {
    "explore": "explorer", "Explorer": "explorer",
    "plot_cache_occupancy": "plots", "plot_rows_per_step": "plots", "plot_step_timings": "plots",
    "plot_topk": "plots", "plot_kv_norms": "plots", "kv_norms": "plots",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Explorer",
    "SlotDetail",
    "TopK",
    "explore",
    "inspect_slot",
    "kv_norms",
    "plot_cache_occupancy",
    "plot_kv_norms",
    "plot_rows_per_step",
    "plot_step_timings",
    "plot_topk",
    "snapshot",
    "topk",
]
