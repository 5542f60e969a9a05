"""From a checkpoint folder and the Session options to a model, a SessionConfig and a tokenizer.

Every option is checked here, before the weights are read, so a bad argument costs nothing.
"""
from __future__ import annotations

from pathlib import Path

from . import device as devices
from . import memory
from .cache.kv_cache import bytes_per_block
from .config import ModelConfig, SessionConfig, device_outputs_default, sync_timings_default
from .errors import InvalidRequestError
from .kernels import get_kernels
from .model.loader import load_checkpoint
from .model.qwen3 import Qwen3Model
from .tokenizer import Tokenizer

CPU_KV_BUDGET = 4 << 30     # default KV cache budget on the CPU, in bytes


def load_session(path, *, device, dtype, max_batch, block_size, num_blocks, max_model_len, chunk_size,
                 prefix_cache, device_outputs, slot_check, decode_padding, kernels, kv_memory,
                 deterministic, sync_timings=None,
                 mixed_steps=False) -> tuple[Qwen3Model, SessionConfig, Tokenizer | None]:
    """Resolve the options of ``Session.from_pretrained`` and load the checkpoint at ``path``."""
    path = Path(path)
    if kv_memory is not None:
        if num_blocks is not None:
            raise InvalidRequestError("Session.from_pretrained: give num_blocks or kv_memory, not both")
        memory.parse_memory(kv_memory)
    dev = devices.resolve_device(device)
    _check_choice("slot_check", slot_check, ("raise", "warn", "off"))
    _check_choice("decode_padding", decode_padding, ("runtime", "replicate"))
    if not isinstance(mixed_steps, bool):
        raise InvalidRequestError(f"Session.from_pretrained: mixed_steps={mixed_steps!r} must be True or False")
    for name, v in (("max_batch", max_batch), ("chunk_size", chunk_size)):
        if not isinstance(v, int) or v < 1:
            raise InvalidRequestError(f"Session.from_pretrained: {name}={v!r} must be an int >= 1")
    kernel_name = devices.resolve_kernels(kernels, dev)
    if device_outputs is None:
        device_outputs = device_outputs_default()
    if sync_timings is None:
        sync_timings = sync_timings_default()
    mc = ModelConfig.from_pretrained(path)
    kernel_name = devices.prepare_kernels(kernels, dev)      # builds the cpu set now, never in a step
    max_model_len = max_model_len or min(mc.max_position_embeddings, 8192)
    block_size = block_size or devices.default_block_size(dev)
    load_dtype = None if dtype == "auto" else dtype
    _, weights = load_checkpoint(path, dtype=load_dtype, device=dev)
    model = Qwen3Model(mc, weights, get_kernels(kernel_name), max_positions=max_model_len)
    if kv_memory is not None:
        num_blocks = memory.blocks_for_model(kv_memory, mc, model.dtype, dev, block_size)
    if num_blocks is None:
        num_blocks = default_num_blocks(mc, model.dtype, dev, max_batch, max_model_len, block_size)
    config = SessionConfig(
        device=str(dev), dtype=str(model.dtype).removeprefix("torch."), max_batch=max_batch,
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, chunk_size=chunk_size,
        prefix_cache=bool(prefix_cache), device_outputs=bool(device_outputs), slot_check=slot_check,
        decode_padding=decode_padding, kernels=kernel_name, deterministic=bool(deterministic),
        sync_timings=bool(sync_timings), mixed_steps=bool(mixed_steps))
    return model, config, Tokenizer.load(path)


def _check_choice(name, value, choices):
    if value not in choices:
        raise InvalidRequestError(f"{name}={value!r}: choose one of {', '.join(map(repr, choices))}")


def default_num_blocks(mc: ModelConfig, dtype, dev, max_batch, max_model_len, block_size) -> int:
    """Enough blocks for ``max_batch`` full-length sequences, capped by a memory budget
    (``CPU_KV_BUDGET`` on the CPU, half the free memory on a device), never below one sequence."""
    per_block = bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim, dtype)
    per_seq = -(-max_model_len // block_size)
    want = max_batch * per_seq
    budget = CPU_KV_BUDGET if dev.type == "cpu" else devices.free_memory(dev) // 2
    return max(per_seq, min(want, budget // per_block))
