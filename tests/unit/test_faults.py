"""The EMULATED fault models on a bare KV cache (no model, no Session)."""
import math
import types
import warnings

import pytest
import torch

from qwen_npu import FaultEmulationWarning, InvalidRequestError
from qwen_npu.cache.kv_cache import KVCache
from qwen_npu.cache.ledger import SlotLedger
from qwen_npu.engine.faults import FAULT_MODELS, FaultEmulator, set_fault_model

BS = 4


def filled_cache():
    cache = KVCache(num_layers=2, num_blocks=3, block_size=BS, num_kv_heads=2, head_dim=3,
                    dtype=torch.float32, device=torch.device("cpu"))
    for i, t in enumerate(cache.keys + cache.values):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t) + 1000 * i)
    return cache


def collisions_of(step, slots, request_ids, positions, rows):
    return SlotLedger(3 * BS).record(step, slots, request_ids, positions, rows)


@pytest.mark.parametrize("model", sorted(FAULT_MODELS))
def test_collided_slots_are_overwritten_in_every_layer_and_nothing_else(model):
    cache = filled_cache()
    before = [t.clone() for t in cache.keys + cache.values]
    # step 7: rows 0 and 2 write slot 5, rows 1 and 3 write slot 9; slot 2 is written once
    found = collisions_of(7, [5, 9, 5, 9, 2], [0, 1, 0, 1, 2], [13, 21, 13, 21, 6], [0, 1, 2, 3, 4])
    emu = FaultEmulator(model)
    with pytest.warns(FaultEmulationWarning) as caught:
        faults = emu.apply(7, found, cache)
    assert [(f.slot, f.block, f.offset, f.rows, f.request_ids) for f in faults] == [
        (5, 1, 1, (0, 2), (0, 0)), (9, 2, 1, (1, 3), (1, 1))]
    assert len(caught) == 1 and str(caught[0].message).startswith(f"EMULATED fault ({model}) after step 7: slot 5")
    for t, old in zip(cache.keys + cache.values, before):
        flat, old_flat = t.view(-1, 2, 3), old.view(-1, 2, 3)
        for s in range(3 * BS):
            if s in (5, 9):
                assert (flat[s] == 0).all() if model == "zero_on_collision" else flat[s].isnan().all()
            else:
                assert flat[s].equal(old_flat[s])
    assert emu.find(7, 9) is faults[1] and emu.find(7, 2) is None and emu.find(6, 5) is None
    assert list(emu.applied) == faults and "EMULATED" in repr(emu)


def test_no_collision_no_fault_no_warning():
    cache = filled_cache()
    before = cache.keys[0].clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FaultEmulator("nan_on_collision").apply(3, [], cache) == []
    assert cache.keys[0].equal(before)


@pytest.mark.parametrize("bad", ["zero", "", None, 0, ["zero_on_collision"]])
def test_unknown_models_are_refused(bad):
    with pytest.raises(InvalidRequestError, match="zero_on_collision"):
        FaultEmulator(bad)


def test_set_fault_model_applies_at_once_and_restores_in_a_with_block():
    owner = types.SimpleNamespace(faults=None)
    set_fault_model(owner, "zero_on_collision")
    assert owner.faults.model == "zero_on_collision" and owner.faults.value == 0.0
    with set_fault_model(owner, "nan_on_collision") as setting:
        assert math.isnan(owner.faults.value) and "EMULATED faults: nan_on_collision" in repr(setting)
    assert owner.faults.model == "zero_on_collision"
    with pytest.raises(InvalidRequestError):
        set_fault_model(owner, "bogus")
    assert owner.faults.model == "zero_on_collision"          # refused before anything changed
    set_fault_model(owner, None)
    assert owner.faults is None
