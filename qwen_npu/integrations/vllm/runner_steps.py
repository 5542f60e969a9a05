"""Read one step from a vLLM model runner as `StepInputs`, one per KV cache group.

Both runners keep the step in the same places: `input_batch.req_ids` / `num_reqs` (rows),
`query_start_loc.np` (row boundaries, host), `positions` (the tensor the slot mapping was computed
from), `input_batch.block_table[group]` (`.block_table.gpu`, `.num_blocks_per_row`, `.block_size`)
and `kv_cache_config` (blocks in the cache). They differ in where the forward's slot mapping lives:

- vLLM 0.32: `ForwardContext.slot_mapping`, a dict layer name -> tensor (what the KV-update op reads);
- vllm-ascend: `ForwardContext.attn_metadata[layer].slot_mapping` (its forward context has no
  `slot_mapping`; the attention backends read the metadata's).

A group the guard cannot judge is returned as a sentence (logged once) instead of a StepInputs.
"""
from __future__ import annotations

from ..step_guard import StepInputs


def vllm_steps(runner) -> list:
    from vllm.forward_context import get_forward_context
    by_layer = get_forward_context().slot_mapping
    if not isinstance(by_layer, dict):
        return ["micro-batched steps (a list of slot mappings) are not checked"]
    return _steps(runner, lambda layer: by_layer.get(layer))


def ascend_steps(runner) -> list:
    from vllm.forward_context import get_forward_context
    meta = get_forward_context().attn_metadata
    if not isinstance(meta, dict):
        return ["micro-batched steps (a list of attention metadata) are not checked"]
    return _steps(runner, lambda layer: getattr(meta.get(layer), "slot_mapping", None))


def _steps(runner, slot_mapping_of) -> list:
    config = runner.kv_cache_config
    batch = runner.input_batch
    rows = int(batch.num_reqs)
    req_ids = list(batch.req_ids[:rows])
    qsl = runner.query_start_loc.np[:rows + 1]
    positions = runner.positions
    positions = getattr(positions, "gpu", positions)      # a CpuGpuBuffer in some runners
    if positions.dim() != 1:
        return ["multi-dimensional positions (M-RoPE) are not checked"]
    out: list = []
    for gid, group in enumerate(config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec).__name__ == "EncoderOnlyAttentionSpec" or not hasattr(spec, "block_size"):
            continue
        table = batch.block_table[gid]
        mode = getattr(table, "slot_mapping_mode", None)
        if mode is not None and getattr(mode, "name", "") == "NONE":
            continue                                       # state caches (Mamba): no token slots
        if getattr(table, "dcp_world_size", 1) > 1 or getattr(table, "pcp_world_size", 1) > 1:
            out.append("context-parallel slot mappings (interleaved virtual blocks) are not checked")
            continue
        slots = next((s for s in map(slot_mapping_of, group.layer_names) if s is not None), None)
        if slots is None:
            out.append(f"KV cache group {gid} has no slot mapping in the forward context; not checked")
            continue
        num_slots = int(config.num_blocks) * int(spec.block_size)
        out.append(StepInputs(req_ids, qsl, slots, positions, table.block_table.gpu,
                              table.num_blocks_per_row, int(table.block_size),
                              num_slots // int(table.block_size)))
    return out
