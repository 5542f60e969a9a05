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
    size = o.tensor_parallel_size
    if size == 1:
        _, weights = load_checkpoint(path, dtype=load_dtype, device=dev, arena=not prepares)
        model = Qwen3Model(mc, weights, kernels, max_positions=max_model_len, consume=prepares)
        del weights
        num_blocks = kv_blocks(o, mc, model.dtype, dev, max_model_len, block_size)
        return model, settings(o, model, num_blocks, dev, block_size, max_model_len, kernel_name, device_outputs,
                               sync_timings), Tokenizer.load(path), None
    model, num_blocks, parallel = load_parallel(path, o, mc, dev, kernels, kernel_name, dtype, block_size,
                                                max_model_len, prepares)
    try:                                 # the other ranks' processes stop with a start that fails
        config = settings(o, model, num_blocks, dev, block_size, max_model_len, kernel_name, device_outputs,
                          sync_timings)
        return model, config, Tokenizer.load(path), parallel
    except BaseException:
        parallel.close()
        raise


def settings(o: SessionOptions, model, num_blocks: int, dev, block_size: int, max_model_len: int,
             kernel_name: str, device_outputs: bool, sync_timings: bool) -> SessionConfig:
    """The SessionConfig of the options as resolved."""
    return SessionConfig(
        device=str(dev), dtype=str(model.dtype).removeprefix("torch."), max_batch=o.max_batch,
        block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, chunk_size=o.chunk_size,
        prefix_cache=o.prefix_cache, device_outputs=device_outputs, slot_check=o.slot_check,
        decode_padding=o.decode_padding, kernels=kernel_name, deterministic=o.deterministic,
        sync_timings=sync_timings, mixed_steps=o.mixed_steps, speculative=o.speculative,
        num_speculative_tokens=0 if o.speculative is None else o.num_speculative_tokens or 3,
        tensor_parallel_size=o.tensor_parallel_size)


def kv_blocks(o: SessionOptions, mc: ModelConfig, dtype, dev, max_model_len: int, block_size: int) -> int:
    """The cache's block count: ``num_blocks``, or what ``kv_memory`` or the default budget
    holds of blocks of ``mc``'s KV heads (one rank's, with tensor parallelism)."""
    if o.num_blocks is not None:
        return o.num_blocks
    if o.kv_memory is not None:
        return memory.blocks_for_model(o.kv_memory, mc, dtype, dev, block_size)
    return default_num_blocks(mc, dtype, dev, o.max_batch, max_model_len, block_size)


def load_parallel(path: Path, o: SessionOptions, mc: ModelConfig, dev, kernels, kernel_name: str, dtype,
                  block_size: int, max_model_len: int, prepares: bool):
    """Rank 0's shard, the cache's block count, and the started group of the other ranks.

    Rank ``r`` runs on device index ``r`` of rank 0's device type, so rank 0 must be on index 0.
    The workers start first and load their shards while rank 0 loads its own."""
    import os
    from ..parallel.collectives import Collectives
    from ..parallel.group import TensorParallelGroup
    from ..parallel.sharding import check_tensor_parallel, shard_config, shard_weights
    from ..parallel.worker import RankSpec
    size = o.tensor_parallel_size
    where = f"Session.from_pretrained({path}, tensor_parallel_size={size})"
    check_tensor_parallel(mc, size, where)
    if dev.type != "cpu":
        if dev.index not in (None, 0):
            raise InvalidRequestError(f"{where}: rank r runs on {dev.type}:r, so rank 0 (this process) must be on "
                                      f"{dev.type}:0, not {dev}")
        count = devices.device_count(dev.type)
        if count < size:
            raise InvalidRequestError(f"{where}: {size} ranks need {size} {dev.type} devices; {count} are visible")
    shard = shard_config(mc, size)
    num_blocks = kv_blocks(o, shard, dtype, dev, max_model_len, block_size)
    spec = RankSpec(path=str(path), dtype=str(dtype).removeprefix("torch."), device_type=dev.type,
                    kernels=kernel_name, block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                    size=size, backend={"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[dev.type],
                    store_host="127.0.0.1", store_port=0,
                    timeout_s=float(os.environ.get("QWEN_NPU_TP_TIMEOUT_S", "120")),
                    threads=max(1, torch.get_num_threads() // size), prepares=prepares)
    group = TensorParallelGroup.start(spec)
    try:
        _, weights = load_checkpoint(path, dtype=spec.dtype, device=dev, arena=False)
        model = Qwen3Model(shard, shard_weights(weights, 0, size), kernels, max_positions=max_model_len,
                           consume=prepares, all_reduce=Collectives(0, size).all_reduce, full_config=mc)
    except BaseException:
        group.close()
        raise
    return model, num_blocks, group


def default_num_blocks(mc: ModelConfig, dtype, dev, max_batch, max_model_len, block_size) -> int:
    """Enough blocks for ``max_batch`` full-length sequences, capped by a memory budget
    (``CPU_KV_BUDGET`` on the CPU, half the free memory on a device), never below one sequence."""
    per_block = bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim, dtype)
    per_seq = -(-max_model_len // block_size)
    want = max_batch * per_seq
    budget = CPU_KV_BUDGET if dev.type == "cpu" else devices.free_memory(dev) // 2
    return max(per_seq, min(want, budget // per_block))
