"""The npu set's per-step inputs (``kernels/npu_step.py``): built once per step and reused by
every layer, but never served stale: a table or position changed in place, another block size or
another device builds anew. Runs without the wheel."""
from __future__ import annotations

import copy

import torch
from qwen_npu.kernels.npu_step import step_inputs
from standin_kit import ATTENTION_ROWS, BLOCK, attention_case

CPU = torch.device("cpu")


def mixed_meta():
    return attention_case(ATTENTION_ROWS["mixed"][0], BLOCK, device="cpu")[3]


def test_the_same_step_gets_the_same_inputs_and_a_new_step_new_ones():
    meta = mixed_meta()
    first = step_inputs(meta, BLOCK, CPU)
    assert step_inputs(meta, BLOCK, CPU) is first
    assert step_inputs(copy.copy(meta), BLOCK, CPU) is not first


def test_a_table_changed_in_place_gets_a_fresh_result():
    meta = mixed_meta()
    before = step_inputs(meta, BLOCK, CPU)
    old = int(before.block_table[1, 0])
    meta.block_tables[1, 0] = old + 1                 # the engine rewrote the row's first block
    after = step_inputs(meta, BLOCK, CPU)
    assert after is not before and int(after.block_table[1, 0]) == old + 1
    assert int(before.block_table[1, 0]) == old      # the earlier result is not changed either


def test_positions_changed_in_place_give_fresh_gather_slots():
    rows, bs, _ = ATTENTION_ROWS["prefill, all fresh"]
    meta = attention_case(rows, bs, device="cpu")[3]
    before = step_inputs(meta, bs, CPU)
    assert before.all_fresh and before.fresh_slots is not None
    meta.positions[0] = 1
    after = step_inputs(meta, bs, CPU)
    assert int(after.fresh_slots[0]) == int(before.fresh_slots[1])


def test_two_block_sizes_get_two_results():
    meta = mixed_meta()
    small, large = step_inputs(meta, BLOCK, CPU), step_inputs(meta, 2 * BLOCK, CPU)
    assert small is not large
    assert small.block_table.shape[1] == -(-meta.max_seq_len // BLOCK)
    assert large.block_table.shape[1] == -(-meta.max_seq_len // (2 * BLOCK))
    assert torch.equal(step_inputs(meta, BLOCK, CPU).block_table, small.block_table)


def test_two_devices_get_two_results():
    meta = mixed_meta()
    on_cpu = step_inputs(meta, BLOCK, CPU)
    on_meta = step_inputs(meta, BLOCK, torch.device("meta"))
    assert on_cpu.block_table.device == CPU and on_meta.block_table.device.type == "meta"


def test_the_gather_slots_read_each_position_through_the_zero_padded_table():
    rows, bs, skipped = ATTENTION_ROWS["prefill, all fresh, a skipped token"]
    meta = attention_case(rows, bs, device="cpu", skipped=skipped)[3]
    inputs = step_inputs(meta, bs, CPU)
    table = meta.block_tables.long()
    want = [int(table[r, p // bs]) * bs + p % bs for r, (done, q) in enumerate(rows) for p in range(done, done + q)]
    assert inputs.fresh_slots.tolist() == want and int(meta.slot_mapping[3]) == -1
    assert step_inputs(mixed_meta(), BLOCK, CPU).fresh_slots is None      # only all-fresh steps gather
