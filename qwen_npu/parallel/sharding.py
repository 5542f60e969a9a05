"""Which slice of each weight a rank holds, following the model's structure (Megatron's split).

With ``N`` ranks, rank ``r`` holds heads ``[r * H / N, (r + 1) * H / N)`` of the queries and
``[r * KV / N, (r + 1) * KV / N)`` of the keys and values, so every query head finds its KV head
(``h // (H / KV)``) on its own rank, and its KV cache holds only its ``KV / N`` heads::

    q_proj, k_proj, v_proj   [heads * hd, hidden]   rows: by heads (column-parallel)
    gate_proj, up_proj       [inter, hidden]        rows: by columns of the MLP
    o_proj                   [hidden, heads * hd]   columns (row-parallel): partial sums, all-reduced
    down_proj                [hidden, inter]        columns (row-parallel): partial sums, all-reduced
    q_norm, k_norm           [hd]                   replicated: per head, no communication
    embedding, LM head, norms                        replicated

So a layer needs two all-reduces (after ``o_proj`` and after ``down_proj``), and every rank ends
the layer with the same residual stream.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import ModelConfig
from ..errors import InvalidRequestError

ROW_SPLIT = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
COLUMN_SPLIT = ("self_attn.o_proj", "mlp.down_proj")


def check_tensor_parallel(mc: ModelConfig, size: int, where: str) -> None:
    """Refuse a split the model's shape does not allow (before any process starts)."""
    for name, count in (("num_key_value_heads", mc.num_key_value_heads),
                        ("num_attention_heads", mc.num_attention_heads),
                        ("intermediate_size", mc.intermediate_size)):
        if count % size:
            raise InvalidRequestError(
                f"{where}: tensor_parallel_size={size} does not divide the model's {name} ({count}): every "
                f"rank must hold whole KV heads and an equal share; choose a divisor of "
                f"{mc.num_key_value_heads} (num_key_value_heads)")


def shard_config(mc: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank's model computes: its heads and its share of the MLP."""
    return dataclasses.replace(mc, num_attention_heads=mc.num_attention_heads // size,
                               num_key_value_heads=mc.num_key_value_heads // size,
                               intermediate_size=mc.intermediate_size // size)


def shard_weights(weights: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights by Hugging Face name (contiguous copies of its slices; the rest is
    the same tensor as in ``weights``). ``weights`` loses the full matrices as they are split."""
    out = {}
    for name in list(weights):
        w = weights[name]
        part = name.removeprefix("model.layers.").split(".", 1)[-1].removesuffix(".weight")
        if part in ROW_SPLIT:
            n = w.shape[0] // size
            out[name] = w[rank * n:(rank + 1) * n].contiguous()
        elif part in COLUMN_SPLIT:
            n = w.shape[1] // size
            out[name] = w[:, rank * n:(rank + 1) * n].contiguous()
        else:
            out[name] = w
            continue
        del weights[name]
    return out


def head_ranges(num_heads: int, size: int) -> list[range]:
    """The heads each rank holds, in rank order."""
    n = num_heads // size
    return [range(r * n, (r + 1) * n) for r in range(size)]
