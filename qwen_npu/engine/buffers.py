"""Dispatch and output buffers, allocated once at capacity and handed out as prefix views.

A step with ``n`` rows fills rows ``[0, n)`` and dispatches views ``buffer[:n]``; rows ``n..``
are never read or written by it::

    input_ids  [max_batch]   | r0 | r1 | r2 | .. untouched .. |
                              \\_ view [:3] _/

Output buffers (logits, next-hidden) live on the device and are cached by key
(kind, name, capacity, width, dtype, pair). Each kind has two pairs: a step writes the pair
that the last committed step of its kind did not, so a step that fails half way never touches
the logits a user still holds. Committing a step bumps the generations of both pairs of its kind,
which is how an older ``DeviceLogits`` handle learns that it is no longer the latest::

    step 4 (decode) -> pair 0, commit: pair 0 current       step 4's logits valid
    step 5 (decode) fails inside its forward (wrote pair 1) step 4's logits still valid
    step 5 (decode) -> pair 1, commit: pair 1 current       step 4's logits stale (generation bumped)
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class OutputBuffer:
    tensor: torch.Tensor
    generation: int = 0


class DispatchBuffers:
    def __init__(self, *, max_batch: int, max_tokens: int, max_blocks: int, vocab_size: int,
                 hidden_size: int, hidden_dtype: torch.dtype, device: torch.device):
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.device = device
        i32, i64 = torch.int32, torch.int64

        def z(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        # the decode set: one token per row, leading size max_batch
        # prefill set: up to max_tokens tokens over at most max_batch rows
        self.tensors: dict[str, torch.Tensor] = {}
        for kind, tokens in (("decode", max_batch), ("prefill", max_tokens)):
            pre = "" if kind == "decode" else "prefill."
            self.tensors[pre + "input_ids"] = z(tokens, dtype=i64)
            self.tensors[pre + "positions"] = z(tokens, dtype=i64)
            self.tensors[pre + "slot_mapping"] = z(tokens, dtype=i64)
            self.tensors[pre + "seq_lens"] = z(max_batch, dtype=i32)
            self.tensors[pre + "block_tables"] = z(max_batch, max_blocks, dtype=i32)
            self.tensors[pre + "query_start_loc"] = z(max_batch + 1, dtype=i32)
            self.tensors[pre + "logits_index"] = z(max_batch, dtype=i64)
        self._outputs: dict[tuple, OutputBuffer] = {}
        self.current = {"decode": 0, "prefill": 0}   # the pair holding the last committed step's outputs
        for kind in ("decode", "prefill"):
            pre = "" if kind == "decode" else "prefill."
            for pair, tail in ((0, ""), (1, ".1")):
                self.tensors[pre + "logits" + tail] = self.output(kind, "logits", max_batch, vocab_size,
                                                                  torch.float32, pair).tensor
                self.tensors[pre + "hidden" + tail] = self.output(kind, "hidden", max_batch, hidden_size,
                                                                  hidden_dtype, pair).tensor

    def output(self, kind: str, name: str, capacity: int, width: int, dtype: torch.dtype,
               pair: int = 0) -> OutputBuffer:
        """The cached output buffer for this key, allocated on first use."""
        key = (kind, name, capacity, width, dtype, pair)
        buf = self._outputs.get(key)
        if buf is None:
            buf = self._outputs[key] = OutputBuffer(torch.zeros(capacity, width, dtype=dtype, device=self.device))
        return buf

    def spare(self, kind: str) -> int:
        """The pair a new step of ``kind`` writes: not the one the last committed step holds."""
        return 1 - self.current[kind]

    def publish(self, kind: str) -> None:
        """Commit a step of ``kind``: its pair becomes current; older handles of ``kind`` go stale."""
        pair = 1 - self.current[kind]
        self.current[kind] = pair
        for key, buf in self._outputs.items():
            if key[0] == kind:
                buf.generation += 1

    def generations(self) -> dict:
        """Output buffer generations by key (part of the Session's state digest)."""
        return {k: b.generation for k, b in self._outputs.items()}

    def fill(self, name: str, host: torch.Tensor) -> int:
        """Copy ``host`` into the leading rows of buffer ``name``; returns the bytes moved h2d."""
        buf = self.tensors[name]
        if host.dim() == 2:
            buf[:host.shape[0], :host.shape[1]].copy_(host)
            if host.shape[1] < buf.shape[1]:
                buf[:host.shape[0], host.shape[1]:].fill_(-1)
        else:
            buf[:host.shape[0]].copy_(host)
        return host.nbytes

    def view(self, name: str, n: int) -> torch.Tensor:
        return self.tensors[name][:n]
