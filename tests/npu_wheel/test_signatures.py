"""Every torch_npu call the npu kernel set makes, bound against the signatures in the wheel.

The calls are recorded on the CPU through a stand-in for torch_npu (standin_kit.py); the
signatures are read from the pinned wheel's files (schema_kit.py); the documented requirements
of each op are in rules_kit.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
from rules_kit import RULES, RuleError, check_call
from schema_kit import NO_DEFAULT, BindError, bind, compiled_schema, compiled_schemas
from wheel_kit import ATB_HEADER, ATB_LIBRARY, NPU_LIBRARY, exposed_ops

OPS = set(RULES)

# defaults of arguments the kernel set leaves out and relies on
RELIED_DEFAULTS = [
    ("npu_fused_infer_attention_score", "pse_shift", None),
    ("npu_fused_infer_attention_score", "query_padding_size", None),
    ("npu_fused_infer_attention_score", "kv_padding_size", None),
    ("npu_fused_infer_attention_score", "antiquant_scale", None),
    ("npu_fused_infer_attention_score", "key_shared_prefix", None),
    ("npu_fused_infer_attention_score", "query_rope", None),
    ("npu_fused_infer_attention_score", "inner_precise", 0),
    ("npu_fused_infer_attention_score", "softmax_lse_flag", False),
    ("npu_fused_infer_attention_score", "pre_tokens", 2147483647),
    ("npu_fused_infer_attention_score", "next_tokens", 2147483647),
    ("_npu_paged_attention", "workspace", None),
    ("npu_scatter_pa_kv_cache", "compress_lens", None),
    ("npu_scatter_pa_kv_cache", "compress_seq_offsets", None),
    ("npu_scatter_pa_kv_cache", "seq_lens", None),
]


def all_calls(scenarios):
    return [(name, c) for name, s in scenarios.items() for c in s.calls]


def test_the_kernel_set_calls_exactly_the_checked_ops(scenarios):
    assert {c.op for _, c in all_calls(scenarios)} == OPS


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_exists_in_the_wheel(signatures, wheel, op):
    assert op in signatures, f"{op} is not declared by torch-npu {wheel.version}"
    namespace = "atb" if signatures[op].source == ATB_HEADER else "npu"
    assert exposed_ops(wheel).get(op) == f"torch.ops.{namespace}.{op}", f"torch_npu.{op} is not exported"


def test_every_recorded_call_binds_and_follows_the_documentation(signatures, scenarios):
    problems = []
    for name, call in all_calls(scenarios):
        try:
            check_call(signatures, call)
        except (BindError, RuleError) as e:
            problems.append(f"[{name}] {e}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("op, arg, value", RELIED_DEFAULTS)
def test_defaults_we_rely_on(signatures, scenarios, op, arg, value):
    param = signatures[op].param(arg)
    assert param.default is not NO_DEFAULT and param.default == value, (op, arg, param.default)
    calls = [c for _, c in all_calls(scenarios) if c.op == op]
    assert calls and all(arg not in c.kwargs for c in calls)
    assert all(bind(signatures[op], c.args, c.kwargs)[arg] == value for c in calls)


def test_atb_header_agrees_with_the_compiled_schemas(wheel, signatures):
    """The ATB signatures come from the C++ header; wherever the compiled library keeps a whole
    schema, its names, order, types and None defaults must be the header's."""
    compiled = compiled_schemas(wheel.read_bytes(ATB_LIBRARY), ATB_LIBRARY)
    compared = [op for op in compiled if signatures.get(op) and signatures[op].source == ATB_HEADER]
    assert len(compared) >= 2, compared
    for op in compared:
        mine, theirs = signatures[op].params, compiled[op].params
        assert [(p.name, p.type, p.mutable) for p in mine] == [(p.name, p.type, p.mutable) for p in theirs], op
        for p, q in zip(mine, theirs):
            if q.default is not NO_DEFAULT:
                assert p.default == q.default, (op, p.name)


def test_custom_op_schemas_agree_with_libtorch_npu_and_differing_names_are_passed_by_position(
        wheel, signatures, scenarios):
    """The yaml schemas against the ones compiled into libtorch_npu.so: same order, types and
    defaults. Where a keyword differs (npu_rms_norm's first argument is 'self' in one, 'input' in
    the other), the kernel set must pass that argument by position."""
    library = wheel.read_bytes(NPU_LIBRARY)
    for op in sorted(o for o in OPS if signatures[o].source != ATB_HEADER):
        compiled = compiled_schema(library, op, NPU_LIBRARY)
        assert compiled is not None, f"{op}: no schema in {NPU_LIBRARY}"
        mine, theirs = signatures[op].params, compiled.params
        assert [(p.type, p.kwarg_only) for p in mine] == [(p.type, p.kwarg_only) for p in theirs], op
        assert [p.default for p in mine] == [p.default for p in theirs], op
        renamed = {i for i, (p, q) in enumerate(zip(mine, theirs)) if p.name != q.name}
        for _, call in all_calls(scenarios):
            if call.op == op:
                assert all(i < len(call.args) for i in renamed), (
                    f"{op}: argument {mine[min(renamed)].name!r} must be passed by position")


# --- a deliberately wrong call fails, and says which op and which argument -------------------

def swapped(call, a, b):
    """A copy of ``call`` with two arguments swapped (int: positions, str: keywords)."""
    wrong = copy.copy(call)
    if isinstance(a, int):
        args = list(call.args)
        args[a], args[b] = args[b], args[a]
        wrong.args = tuple(args)
    else:
        kwargs = dict(call.kwargs)
        kwargs[a], kwargs[b] = kwargs[b], kwargs[a]
        wrong.kwargs = kwargs
    return wrong


WRONG_CALLS = [   # scenario, op, swapped pair, the argument the check must name
    ("rms_norm, hidden", "npu_rms_norm", (1, 2), "gamma"),
    ("add_rms_norm", "npu_add_rms_norm", (2, 3), "gamma"),
    ("decode, ATB (no FIA)", "_npu_paged_attention", ("num_kv_heads", "scale_value"), "num_kv_heads"),
    ("decode, ATB (no FIA)", "_npu_paged_attention", ("block_table", "context_lens"), "block_table"),
    ("write_kv", "npu_scatter_pa_kv_cache", ("key_cache", "slot_mapping"), "key_cache"),
    ("prefill chunk", "npu_fused_infer_attention_score",
     ("actual_seq_lengths", "actual_seq_lengths_kv"), "actual_seq_lengths"),
    ("rope", "npu_apply_rotary_pos_emb", (0, 2), "cos"),
]


@pytest.mark.parametrize("scenario, op, pair, arg", WRONG_CALLS, ids=[f"{w[1]}-{w[3]}" for w in WRONG_CALLS])
def test_a_swapped_call_is_caught_naming_op_and_argument(signatures, scenarios, scenario, op, pair, arg):
    call = next(c for c in scenarios[scenario].calls if c.op == op)
    check_call(signatures, call)                                   # the real call passes
    with pytest.raises((BindError, RuleError)) as caught:
        check_call(signatures, swapped(call, *pair))
    message = str(caught.value)
    assert message.startswith(f"{op}:") and f"'{arg}'" in message, message


def test_a_keyword_the_op_does_not_have_is_caught(signatures, scenarios):
    call = next(c for c in scenarios["decode, ATB (no FIA)"].calls if c.op == "_npu_paged_attention")
    wrong = copy.copy(call)
    wrong.kwargs = {("seq_lens" if k == "context_lens" else k): v for k, v in call.kwargs.items()}
    with pytest.raises(BindError, match=r"_npu_paged_attention: has no argument 'seq_lens'"):
        check_call(signatures, wrong)


def test_a_missing_required_argument_is_caught(signatures, scenarios):
    call = next(c for c in scenarios["write_kv"].calls if c.op == "npu_scatter_pa_kv_cache")
    wrong = copy.copy(call)
    wrong.kwargs = {k: v for k, v in call.kwargs.items() if k != "slot_mapping"}
    with pytest.raises(BindError, match=r"npu_scatter_pa_kv_cache: argument 'slot_mapping' is required"):
        check_call(signatures, wrong)


def test_positional_arguments_past_the_star_are_caught(signatures):
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(BindError, match=r"npu_fused_infer_attention_score: takes 3 positional"):
        bind(signatures["npu_fused_infer_attention_score"], (q, q, q, None), {})
