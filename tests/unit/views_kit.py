"""Small sessions and a device-read detector shared by the view, explorer and plot tests."""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

import qwen_npu
from qwen_npu import SamplingParams


def small_session(ckpt, **kw):
    opts = {"max_batch": 4, "block_size": 4, "num_blocks": 32, "max_model_len": 64, "chunk_size": 8,
            "kernels": "reference"}
    opts.update(kw)
    return qwen_npu.Session.from_pretrained(ckpt, **opts)


def run_two_requests(sess, *, decode_steps: int = 1):
    """Request 0 (10 tokens: two prefill chunks) and request 1 (3 tokens), then decode steps."""
    sess.add_request(list(range(1, 11)), SamplingParams(max_new_tokens=6))
    sess.add_request([20, 21, 22], SamplingParams(max_new_tokens=2))
    sess.step()
    sess.step()
    for _ in range(decode_steps):
        sess.step()
    return sess


def device_tensors(sess) -> list[torch.Tensor]:
    """The tensors a view must never read: every output buffer and every layer's K/V cache."""
    engine = sess._engine
    outs = [b.tensor for b in engine.buffers._outputs.values()]
    return outs + list(engine.kv_cache.keys) + list(engine.kv_cache.values)


METADATA = {"__get__", "size", "dim", "numel", "element_size", "stride", "storage_offset", "is_contiguous"}


class _Reads(TorchFunctionMode):
    def __init__(self, watched):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in watched}
        self.hits: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for a in list(args) + list((kwargs or {}).values()):
            name = getattr(func, "__name__", str(func))
            if name in METADATA:
                continue                                       # shape, dtype, device: no data read
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.ptrs:
                self.hits.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watch_device_reads(sess):
    """Collects the names of torch calls that read data of an output buffer or the KV cache
    (metadata such as shape, dtype and device is not a read)."""
    mode = _Reads(device_tensors(sess))
    with mode:
        yield mode.hits
