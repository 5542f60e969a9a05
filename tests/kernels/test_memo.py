"""``kernels/memo.py``: a step's derived index tensors are reused across layers and die with it."""
from __future__ import annotations

import gc

import torch

from qwen_npu.kernels.memo import LastResult


class Meta:                                   # stands in for a step's AttentionMetadata
    def __init__(self):
        self.slots = torch.arange(4)


def test_reused_for_the_same_unchanged_object_and_rebuilt_otherwise():
    memo, built = LastResult(), []

    def make():
        built.append(1)
        return object()
    meta = Meta()
    first = memo.get(meta, (meta.slots,), ("a",), make)
    assert memo.get(meta, (meta.slots,), ("a",), make) is first and len(built) == 1
    meta.slots.add_(1)                                    # changed in place: rebuilt
    assert memo.get(meta, (meta.slots,), ("a",), make) is not first and len(built) == 2
    memo.get(meta, (meta.slots,), ("b",), make)           # another key: rebuilt
    assert len(built) == 3


def test_the_entry_dies_with_its_object():
    memo = LastResult()
    meta = Meta()
    value = memo.get(meta, (meta.slots,), (), lambda: torch.zeros(1000))
    alive = [value]
    del meta
    gc.collect()
    assert memo._entry is None                # the memo no longer holds what the step derived
    assert alive[0].numel() == 1000           # (a caller's own reference still does)


def test_a_dying_older_object_leaves_the_newer_entry():
    memo = LastResult()
    old, new = Meta(), Meta()
    memo.get(old, (old.slots,), (), lambda: "old")
    memo.get(new, (new.slots,), (), lambda: "new")
    del old
    gc.collect()
    assert memo.get(new, (new.slots,), (), lambda: "rebuilt") == "new"
