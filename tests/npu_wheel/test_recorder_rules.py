"""The rules of the recorded calls that shapes alone cannot show: block ids in every block table
(padding included), no empty tensor to a custom op, the results of functional ops used, and
which form of each op a batch takes (all-fresh unpaged, ATB decode only without FIA)."""
from __future__ import annotations

import copy

import pytest
import torch
from qwen_npu.kernels import npu as npu_k
from rules_kit import VALUE_RULES, RuleError, check_call, check_results_used
from standin_kit import ATTENTION_ROWS, BLOCK, EMPTY, HEAD_DIM, attention_case, run_with_stand_in

FIA = "npu_fused_infer_attention_score"


def calls_of(scenarios, op):
    return [(name, c) for name, s in scenarios.items() for c in s.calls if c.op == op]


def test_every_call_recorded_with_values_passes_the_value_rules(signatures, valued_scenarios):
    problems = []
    for name, s in valued_scenarios.items():
        for call in s.calls:
            try:
                check_call(signatures, call, values=True)
            except RuleError as e:
                problems.append(f"[{name}] {e}")
    assert not problems, "\n".join(problems)
    assert set(VALUE_RULES) <= {c.op for s in valued_scenarios.values() for c in s.calls}


def test_a_block_table_padded_with_minus_one_is_refused(signatures, valued_scenarios):
    (call,) = valued_scenarios["prefill chunk"].calls
    padded = call.kwargs["block_table"].clone()
    padded[0, -1] = -1                                   # how the engine's buffers pad a row
    wrong = copy.copy(call)
    wrong.kwargs = {**call.kwargs, "block_table": padded}
    with pytest.raises(RuleError, match=r"npu_fused_infer_attention_score: argument 'block_table' must hold block ids"):
        check_call(signatures, wrong, values=True)


def test_the_value_rules_need_values(signatures, scenarios):
    (call,) = scenarios["prefill chunk"].calls          # recorded on meta
    with pytest.raises(RuleError, match="recorded without values"):
        check_call(signatures, call, values=True)


@pytest.mark.parametrize("slots, why", [([3, 3, -1], "twice"), ([-2, 4, 5], "-1 \\(skip\\)")])
def test_bad_slots_are_refused(signatures, valued_scenarios, slots, why):
    (call,) = valued_scenarios["write_kv"].calls
    wrong = copy.copy(call)
    n = call.kwargs["slot_mapping"].shape[0]
    wrong.kwargs = {**call.kwargs, "slot_mapping": torch.tensor(slots + [-1] * (n - 3), dtype=torch.int32)}
    with pytest.raises(RuleError, match=f"npu_scatter_pa_kv_cache: argument 'slot_mapping' .*{why}"):
        check_call(signatures, wrong, values=True)


def test_skipped_slots_reach_the_op_as_minus_one(valued_scenarios):
    for name in ("write_kv", "write_kv, all skipped"):
        (call,) = valued_scenarios[name].calls
        slots = call.kwargs["slot_mapping"]
        assert (slots == -1).any() and call.kwargs["cache_mode"] == "Norm", name


def test_an_empty_tensor_is_refused(signatures, scenarios):
    (call,) = scenarios["add_rms_norm"].calls
    wrong = copy.copy(call)
    wrong.args = tuple(a[:0] if isinstance(a, torch.Tensor) and a.dim() == 2 else a for a in call.args)
    with pytest.raises(RuleError, match=r"npu_add_rms_norm: argument 'x1' is an empty tensor"):
        check_call(signatures, wrong)


@pytest.mark.parametrize("name", EMPTY)
def test_a_call_with_nothing_to_compute_calls_no_op(scenarios, name):
    assert scenarios[name].calls == []


@pytest.mark.parametrize("name", [n for n in ("rope", "add_rms_norm", "rms_norm, hidden", "prefill chunk",
                                              "prefill, all fresh", "mixed", "decode")])
def test_functional_results_are_what_the_kernel_returns(signatures, scenarios, name):
    s = scenarios[name]
    assert any(signatures[c.op].functional for c in s.calls)
    check_results_used(signatures, s.calls, s.output)


def test_rope_is_functional_in_the_wheel_and_dropping_its_results_is_caught(signatures, scenarios):
    sig = signatures["npu_apply_rotary_pos_emb"]
    assert sig.functional and sig.returns == 2                  # -> (Tensor, Tensor), nothing written
    assert not signatures["npu_scatter_pa_kv_cache"].functional
    s = scenarios["rope"]
    copies = tuple(t.clone() for t in s.output)                 # what the kernel returned before
    with pytest.raises(RuleError, match=r"npu_apply_rotary_pos_emb: argument 'result 0' is dropped"):
        check_results_used(signatures, s.calls, copies)


def test_an_all_fresh_batch_runs_unpaged_and_the_others_paged(scenarios):
    (fresh,) = scenarios["prefill, all fresh"].calls
    qlens = [q for _, q in ATTENTION_ROWS["prefill, all fresh"][0]]
    ends = [sum(qlens[:i + 1]) for i in range(len(qlens))]
    assert fresh.kwargs.get("block_table") is None
    assert fresh.kwargs["actual_seq_lengths"] == fresh.kwargs["actual_seq_lengths_kv"] == ends
    assert tuple(fresh.kwargs["key"].shape) == (ends[-1], 2, HEAD_DIM)
    for name in ("prefill chunk", "mixed", "decode"):
        (call,) = scenarios[name].calls
        assert call.op == FIA and call.kwargs["block_table"] is not None, name


def test_decode_takes_atb_only_where_the_stack_has_no_fia(scenarios):
    assert [c.op for c in scenarios["decode"].calls] == [FIA]
    assert [c.op for c in scenarios["decode, ATB (no FIA)"].calls] == ["_npu_paged_attention"]
    (fresh,) = scenarios["decode, all fresh"].calls               # one-token prompts: FIA unpaged
    assert fresh.op == FIA and fresh.kwargs.get("block_table") is None
    assert [c.op for c in scenarios["decode, all fresh, ATB (no FIA)"].calls] == ["_npu_paged_attention"]


def test_an_all_fresh_batch_reads_a_skipped_tokens_position_through_the_table(valued_scenarios):
    """Token 3 has slot -1: the unpaged K/V hold its position's slot (table[row, 3 // block]),
    as the reference reads it, never slot 0."""
    rows, block_size, skipped = ATTENTION_ROWS["prefill, all fresh, a skipped token"]
    _, kc, _, m = attention_case(rows, block_size, device="cpu", skipped=skipped)
    (call,) = valued_scenarios["prefill, all fresh, a skipped token"].calls
    table = m.block_tables.long()
    want = [int(table[r, p // block_size]) * block_size + p % block_size
            for r, (done, q) in enumerate(rows) for p in range(done, done + q)]
    assert int(m.slot_mapping[3]) == -1
    assert torch.equal(call.kwargs["key"], kc.view(-1, *kc.shape[2:])[want])


def test_the_zero_padded_table_is_built_once_per_step_and_the_engine_table_keeps_minus_one(meta):
    query, kc, vc, meta_ = attention_case(ATTENTION_ROWS["mixed"][0], BLOCK, device="cpu")
    engine_table = meta_.block_tables.clone()
    assert (engine_table == -1).any()

    def two_layers_then_a_new_step():
        npu_k.paged_attention(query, kc, vc, meta_, 0.1)
        npu_k.paged_attention(query, kc, vc, meta_, 0.1)
        again = copy.copy(meta_)                                   # the next step's metadata
        npu_k.paged_attention(query, kc, vc, again, 0.1)
    _, calls, fell_back = run_with_stand_in(meta, "cpu", two_layers_then_a_new_step)
    tables = [c.kwargs["block_table"] for c in calls]
    assert not fell_back and len(tables) == 3
    assert tables[0] is tables[1] and tables[2] is not tables[0]
    assert torch.equal(meta_.block_tables, engine_table)
    assert int(tables[0].min()) >= 0
