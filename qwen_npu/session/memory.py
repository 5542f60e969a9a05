"""Memory sizing: a KV-cache budget that sizes ``num_blocks``, and the ``sess.memory()`` report
(``sess.close()``, which gives the memory back, is ``session_close``).

    kv_memory="2GiB" | "512MB" | 3_000_000 (bytes)  ->  num_blocks = budget // bytes per block
    kv_memory=0.5                                   ->  half the memory free after the weights load
                                                        (the device's; on the CPU, available RAM)

One block holds K and V of ``block_size`` tokens in every layer::

    bytes per block = 2 * layers * block_size * kv_heads * head_dim * dtype size
"""
from __future__ import annotations

import dataclasses
import os
import re

import torch

from .. import device as devices
from ..errors import InvalidRequestError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(spec) -> int | float:
    """Bytes (int) for "2GiB", "1.5 GB", "4096" or an int; a fraction (float in (0, 1]) as is."""
    if isinstance(spec, bool):
        raise InvalidRequestError(f"kv_memory={spec!r}: give bytes ('2GiB', an int) or a fraction in (0, 1]")
    if isinstance(spec, int):
        if spec < 1:
            raise InvalidRequestError(f"kv_memory={spec}: must be at least 1 byte")
        return spec
    if isinstance(spec, float):
        if not 0 < spec <= 1:
            raise InvalidRequestError(f"kv_memory={spec}: a float is a fraction of free memory and must be "
                                      f"in (0, 1]; give bytes as an int or a string like '2GiB'")
        return spec
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", spec) if isinstance(spec, str) else None
    if m is None or m.group(2).lower() not in UNITS:
        raise InvalidRequestError(f"kv_memory={spec!r}: use a size like '2GiB', '512MiB', '1.5GB' or a "
                                  f"fraction like 0.5")
    n = int(float(m.group(1)) * UNITS[m.group(2).lower()])
    if n < 1:
        raise InvalidRequestError(f"kv_memory={spec!r}: must be at least 1 byte")
    return n


def available_memory(device: torch.device) -> int:
    """Free bytes on an accelerator; on the CPU, the RAM the OS reports as available."""
    if device.type != "cpu":
        return devices.free_memory(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def blocks_for_budget(kv_memory, bytes_per_block: int, device: torch.device) -> int:
    """``num_blocks`` for a ``kv_memory`` budget; InvalidRequestError when not even one block fits."""
    spec = parse_memory(kv_memory)
    budget = int(spec * available_memory(device)) if isinstance(spec, float) else spec
    n = budget // bytes_per_block
    if n < 1:
        raise InvalidRequestError(f"kv_memory={kv_memory!r} ({budget} bytes) is less than one KV block "
                                  f"({bytes_per_block} bytes); raise it or lower block_size")
    return n


def blocks_for_model(kv_memory, mc, dtype: torch.dtype, device: torch.device, block_size: int) -> int:
    """``num_blocks`` for a ``kv_memory`` budget and a model's shape (ModelConfig ``mc``)."""
    from ..cache.kv_cache import bytes_per_block
    per_block = bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim, dtype)
    return blocks_for_budget(kv_memory, per_block, device)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """A snapshot of where a session's memory goes (bytes unless named blocks/tokens)."""

    device: str
    weights: int                  # model parameters and RoPE tables
    kv_cache: int                 # every K and V block of every layer
    block_bytes: int
    num_blocks: int
    used_blocks: int              # held by requests
    cached_blocks: int            # free to allocate, still holding a reusable prefix
    free_blocks: int              # empty
    buffers: int                  # dispatch and output buffers
    largest_request: int          # tokens: the longest request the empty cache can hold
    fits_now: int                 # tokens: the longest new request that fits now without preemption
    device_free: int | None       # free device memory now (available RAM on the CPU)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.buffers

    def rows(self) -> list[tuple[str, str]]:
        b = self.block_bytes
        return [
            ("weights", _size(self.weights)),
            ("KV cache", f"{_size(self.kv_cache)} in {self.num_blocks} blocks of {_size(b)}"),
            ("  used", f"{self.used_blocks} blocks ({_size(self.used_blocks * b)})"),
            ("  cached", f"{self.cached_blocks} blocks ({_size(self.cached_blocks * b)}), reusable prefixes"),
            ("  free", f"{self.free_blocks} blocks ({_size(self.free_blocks * b)})"),
            ("buffers", _size(self.buffers)),
            ("total", _size(self.total)),
            ("largest request", f"{self.largest_request} tokens (empty cache); "
                                f"{self.fits_now} tokens fit now"),
            ("device free", "-" if self.device_free is None else _size(self.device_free)),
        ]

    def __repr__(self) -> str:
        return "\n".join([f"MemoryReport({self.device})"] + [f"  {k:<16} {v}" for k, v in self.rows()])

    def _repr_html_(self) -> str:
        from ..inspect.report_views import memory_report_html
        return memory_report_html(self)


def memory_report(sess) -> MemoryReport:
    engine, cfg = sess.state.engine, sess.config
    pool = engine.manager.pool
    kv = engine.kv_cache
    block_bytes = kv.nbytes // max(kv.num_blocks, 1)
    buffers = list(engine.buffers.tensors.values()) + [b.tensor for b in engine.buffers._outputs.values()]
    fits = min(cfg.max_model_len, pool.num_free * cfg.block_size)
    dev = sess.model.device
    free = available_memory(dev) if dev.type in ("cpu", "cuda") else _try_free(dev)
    return MemoryReport(
        device=cfg.device, weights=_unique_bytes(model_tensors(sess.model)), kv_cache=kv.nbytes,
        block_bytes=block_bytes, num_blocks=kv.num_blocks, used_blocks=pool.num_used,
        cached_blocks=pool.num_cached, free_blocks=pool.num_free - pool.num_cached,
        buffers=_unique_bytes(buffers),
        largest_request=min(cfg.max_model_len, kv.num_blocks * cfg.block_size),
        fits_now=fits, device_free=free)


def model_tensors(model) -> list[torch.Tensor]:
    out = [v for v in vars(model).values() if isinstance(v, torch.Tensor)]
    for layer in model.layers:
        out += [getattr(layer, f.name) for f in dataclasses.fields(layer)]
    return out


def _try_free(dev) -> int | None:
    try:
        return available_memory(dev)
    except Exception:  # noqa: BLE001 - a report must not fail because a query did
        return None


def _unique_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        if t.is_mkldnn:                    # a weight the kernel set reordered: opaque, its own memory
            seen[-id(t)] = t.nbytes
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
