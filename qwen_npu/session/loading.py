"""From a checkpoint folder and the Session options to a model, a SessionConfig and a tokenizer.

Every option was checked when its ``SessionOptions`` was made, so a bad argument costs nothing;
here the ``None`` defaults are resolved from the device, the checkpoint and the environment.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import device as devices
from ..cache.kv_cache import bytes_per_block
from ..config import ModelConfig, SessionConfig, device_outputs_default, sync_timings_default
from ..errors import InvalidRequestError
from ..kernels import get_kernels
from ..kernels.invariant import BatchInvariant
from ..model.loader import load_checkpoint, resolve_dtype
from ..model.qwen3 import Qwen3Model
from ..text.tokenizer import Tokenizer
from . import memory
from .options import SessionOptions

CPU_KV_BUDGET = 4 << 30     # default KV cache budget on the CPU, in bytes


def load_session(path, options: SessionOptions) -> tuple[Qwen3Model, SessionConfig, Tokenizer | None]:
    """Resolve ``options`` (already checked: see ``SessionOptions``) and load the checkpoint at
    ``path``. The device and the kernel set are resolved before the weights are read."""
    path = Path(path)
    o = options
    dev = devices.resolve_device(o.device)
    devices.resolve_kernels(o.kernels, dev)                  # refuses an impossible set before any work
    device_outputs = device_outputs_default() if o.device_outputs is None else o.device_outputs
    sync_timings = sync_timings_default() if o.sync_timings is None else o.sync_timings
    mc = ModelConfig.from_pretrained(path)
    kernel_name = devices.prepare_kernels(o.kernels, dev)    # builds the cpu set now, never in a step
    max_model_len = o.max_model_len or min(mc.max_position_embeddings, 8192)
    block_size = o.block_size or devices.default_block_size(dev)
    load_dtype = None if o.dtype == "auto" else o.dtype
    dtype = resolve_dtype(load_dtype, mc)
    if kernel_name == "cpu" and dtype not in (torch.bfloat16, torch.float32):
        if o.kernels != "auto":
            raise InvalidRequestError(f"kernels='cpu' runs bfloat16 and float32 models, not {dtype} ({path}); "
                                      f"load it with dtype='bfloat16' or 'float32', or use kernels='reference'")
        kernel_name = "reference"                # "auto": the set that runs float16 on the CPU
    kernels = get_kernels(kernel_name)
    if o.deterministic:
        kernels = BatchInvariant(kernels)        # plain matrices: no prepare_weight
    # A set that holds the matrices in its own form gets plain tensors, not arena views: each
    # plain matrix is freed once its prepared form exists (an arena would keep its pages).
    prepares = getattr(kernels, "prepares_weights", lambda dtype: False)(dtype)
    _, weights = load_checkpoint(path, dtype=load_dtype, device=dev, arena=not prepares)
    model = Qwen3Model(mc, weights, kernels, max_positions=max_model_len, consume=prepares)
    del weights
    num_blocks = o.num_blocks
    if o.kv_memory is not None:
        num_blocks = memory.blocks_for_model(o.kv_memory, mc, model.dtype, dev, block_size)
    if num_blocks is None:
        num_blocks = default_num_blocks(mc, model.dtype, dev, o.max_batch, max_model_len, block_size)
    config = SessionConfig(
        device=str(dev), dtype=str(model.dtype).removeprefix("torch."), max_batch=o.max_batch,
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, chunk_size=o.chunk_size,
        prefix_cache=o.prefix_cache, device_outputs=device_outputs, slot_check=o.slot_check,
        decode_padding=o.decode_padding, kernels=kernel_name, deterministic=o.deterministic,
        sync_timings=sync_timings, mixed_steps=o.mixed_steps, speculative=o.speculative,
        num_speculative_tokens=0 if o.speculative is None else o.num_speculative_tokens or 3)
    return model, config, Tokenizer.load(path)


def default_num_blocks(mc: ModelConfig, dtype, dev, max_batch, max_model_len, block_size) -> int:
    """Enough blocks for ``max_batch`` full-length sequences, capped by a memory budget
    (``CPU_KV_BUDGET`` on the CPU, half the free memory on a device), never below one sequence."""
    per_block = bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim, dtype)
    per_seq = -(-max_model_len // block_size)
    want = max_batch * per_seq
    budget = CPU_KV_BUDGET if dev.type == "cpu" else devices.free_memory(dev) // 2
    return max(per_seq, min(want, budget // per_block))
