"""The dispatch buffers, and running the model on a StepPlan copied into them.

Only the first ``n`` rows of every capacity buffer are written and dispatched (runtime batch);
the model's outputs land in cached device buffers, so nothing but what the plan needs moves.

Timings: ``prepare`` and ``forward`` are host wall-clock time. On an asynchronous device (NPU,
CUDA) the forward returns once its kernels are queued, so its time would land in the next phase
that waits for the device (``sample``'s token-id copy). With ``sync_timings`` on, each of the two
phases ends at a device synchronisation, so every phase holds its own time; that costs the
overlap of host work with queued device work, two synchronisations per step (a no-op on the CPU).

The dispatch and output buffers are allocated once at capacity and handed out as prefix views.
A step with ``n`` rows fills rows ``[0, n)`` and dispatches views ``buffer[:n]``; rows ``n..``
are never read or written by it::

    input_ids  [max_batch]   | r0 | r1 | r2 | .. untouched .. |
                              \\_ view [:3] _/

Output buffers (logits, next-hidden, and for a step sampled in the call that runs it each logits
row's argmax and its health code packed with it, "greedy", laid out [2, rows]: ids, then words)
live on the device and are cached by key (kind, name, leading size, width, dtype, pair). Each kind has two pairs: a step writes the pair
that the last committed step of its kind did not, so a step that fails half way never touches
the logits a user still holds. Committing a step bumps the generations of both pairs of its kind,
which is how an older ``DeviceLogits`` handle (a view of rows of one output buffer) learns that it
is no longer the latest: its ``.tensor`` then raises StaleOutputError unless it was ``.clone()``d.
Nothing copies logits to the host unless asked (``to_host``, ``topk``), and every copy that
crosses the host/device boundary is added to the step's ``transfers``::

    step 4 (decode) -> pair 0, commit: pair 0 current       step 4's logits valid
    step 5 (decode) fails inside its forward (wrote pair 1) step 4's logits still valid
    step 5 (decode) -> pair 1, commit: pair 1 current       step 4's logits stale (generation bumped)
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from ..cache.block_table import pad_block_tables
from ..cache.kv_cache import KVCache
from ..device import synchronize
from ..errors import StaleOutputError
from ..kernels.metadata import AttentionMetadata
from ..model.qwen3 import Hook, Qwen3Model
from . import pinned
from .plan import StepPlan, buffer_set
from .transaction import KVGuard


@dataclasses.dataclass(eq=False)
class OutputBuffer:
    tensor: torch.Tensor
    generation: int = 0
    _views: dict = dataclasses.field(default_factory=dict, repr=False)

    def rows(self, n: int) -> torch.Tensor:
        """The view ``tensor[:n]``, made once per ``n`` (the buffer is never reallocated)."""
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = self.tensor[:n]
        return view

    def lanes(self, n: int) -> torch.Tensor:
        """The view ``tensor[:, :n]`` of a buffer laid out [fields, rows] (the greedy output), made
        once per ``n``; ``lanes(n)[j]`` is field j of the first n rows, contiguous."""
        view = self._views.get(("lanes", n))
        if view is None:
            view = self._views[("lanes", n)] = self.tensor[:, :n]
        return view

    def lane_views(self, n: int) -> tuple[torch.Tensor, ...]:
        """``lanes(n)`` split into its fields, made once per ``n``."""
        views = self._views.get(("lane views", n))
        if views is None:
            views = self._views[("lane views", n)] = self.lanes(n).unbind(0)
        return views

    def free(self) -> None:
        """Drop the tensor and every view of it (plain assignments: a closing Session's)."""
        self.tensor, self._views = torch.empty(0), {}


class DeviceLogits:
    """Logits [rows, vocab] resident on the device, one row per row that produces a next token."""

    def __init__(self, buffer: OutputBuffer | None, rows: int, transfers: dict, step_index: int,
                 *, private: torch.Tensor | None = None, generation: int | None = None):
        self._buffer = buffer
        if generation is None and buffer is not None:
            generation = buffer.generation
        self._generation = generation
        self._rows = rows
        self._private = private
        self._transfers = transfers
        self.step_index = step_index
        ref = private if private is not None else buffer.tensor
        self.shape = (rows, ref.shape[1])
        self.dtype = ref.dtype
        self.device = ref.device

    @property
    def is_stale(self) -> bool:
        return self._private is None and self._buffer.generation != self._generation

    @property
    def tensor(self) -> torch.Tensor:
        """The device view. Raises StaleOutputError once a later step of the same kind committed
        (its buffers are then free for the step after, which may overwrite these rows)."""
        if self._private is not None:
            return self._private
        if self.is_stale:
            raise StaleOutputError(
                f"the logits of step {self.step_index} are stale: a later step of the same kind has "
                f"committed, and each kind's two output buffers are used in turn, so the next such step "
                f"may overwrite them; call .clone() on them before running another step to keep them")
        return self._buffer.tensor[:self._rows]

    def view_unchecked(self) -> torch.Tensor:
        """The rows without the staleness check: for the engine, inside the step that wrote them."""
        return self._private if self._private is not None else self._buffer.rows(self._rows)

    def clone(self) -> DeviceLogits:
        """A private device copy that later steps cannot overwrite."""
        return DeviceLogits(None, self._rows, self._transfers, self.step_index, private=self.tensor.clone())

    def topk(self, k: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, token ids) [rows, k] on the host; only 2*k numbers per row cross."""
        values, ids = self.tensor.topk(k, dim=-1)
        values, ids = values.cpu(), ids.cpu()
        self._transfers["d2h"] += values.nbytes + ids.nbytes
        return values, ids

    def to_host(self) -> torch.Tensor:
        """An explicit full copy to the host (counted in the step's transfers)."""
        host = self.tensor.cpu() if self.device.type != "cpu" else self.tensor.clone()
        self._transfers["d2h"] += host.nbytes
        return host

    def __repr__(self) -> str:
        state = "stale" if self.is_stale else ("private copy" if self._private is not None else "live view")
        return (f"DeviceLogits(step {self.step_index}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, {state})")

    def _repr_html_(self) -> str:
        from ..inspect.step_view import logits_html
        return logits_html(self)


class DispatchBuffers:
    def __init__(self, *, max_batch: int, max_tokens: int, max_blocks: int, vocab_size: int,
                 hidden_size: int, hidden_dtype: torch.dtype, device: torch.device, max_logits: int | None = None):
        self.max_batch = max_batch
        # logits rows of a step of each set: one per row, but in the prefill set one per token of a
        # verification row (speculative decoding: max_batch * (1 + drafts per row))
        self.max_logits = {"decode": max_batch, "prefill": max_logits or max_batch}
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
            self.tensors[pre + "logits_index"] = z(self.max_logits[kind], dtype=i64)
        # pinned mirrors of each set's buffers, and the sampler's (on an accelerator: pinned.py)
        self.pinned: dict[str, pinned.PinnedCopies] = {}
        if pinned.pins(device):
            self.pinned = {kind: pinned.PinnedCopies(device, {
                n: (t.numel(), t.dtype) for n, t in self.tensors.items()
                if n.startswith("prefill.") == (kind == "prefill")}) for kind in ("decode", "prefill")}
            self.pinned["sample"] = pinned.PinnedCopies(device)
        # NumPy views of the CPU's buffers, which the CPU's steps write in place
        self._host_views = {n: t.numpy() for n, t in self.tensors.items()} if device.type == "cpu" else {}
        self._outputs: dict[tuple, OutputBuffer] = {}
        self.current = {"decode": 0, "prefill": 0}   # the pair holding the last committed step's outputs
        for kind in ("decode", "prefill"):
            pre = "" if kind == "decode" else "prefill."
            for pair, tail in ((0, ""), (1, ".1")):
                rows = self.max_logits[kind]
                self.tensors[pre + "logits" + tail] = self.output(kind, "logits", rows, vocab_size,
                                                                  torch.float32, pair).tensor
                self.tensors[pre + "hidden" + tail] = self.output(kind, "hidden", rows, hidden_size,
                                                                  hidden_dtype, pair).tensor
                self.tensors[pre + "greedy" + tail] = self.output(kind, "greedy", 2, rows, torch.int64, pair).tensor

    def output(self, kind: str, name: str, capacity: int, width: int, dtype: torch.dtype,
               pair: int = 0) -> OutputBuffer:
        """The cached output buffer for this key, allocated on first use."""
        key = (kind, name, capacity, width, dtype, pair)
        buf = self._outputs.get(key)
        if buf is None:
            tensor = torch.zeros(capacity, width, dtype=dtype, device=self.device)
            buf = self._outputs[key] = OutputBuffer(tensor)
        return buf

    def spare(self, kind: str) -> int:
        """The pair a new step of ``kind`` writes: not the one the last committed step holds."""
        return 1 - self.current[kind]

    def staging(self, kind: str) -> pinned.PinnedCopies | None:
        """The pinned set that copies of ``kind`` ("decode", "prefill", "sample") go through; None
        on the CPU, where data is used where it is."""
        return self.pinned.get(kind)

    def writing(self, kind: str):
        """A context for a step's copies of ``kind``: they write the spare pinned set (see
        ``PinnedCopies.writing``); nothing on the CPU."""
        staging = self.pinned.get(kind)
        return staging.writing() if staging is not None else contextlib.nullcontext()

    def publish(self, kind: str) -> None:
        """Commit a step of ``kind``: its pair (and its pinned set) becomes current; older handles
        of ``kind`` go stale. ``"sample"`` publishes the sampler's pinned set only."""
        staging = self.pinned.get(kind)
        if staging is not None:
            staging.publish()
        if kind == "sample":
            return
        pair = 1 - self.current[kind]
        self.current[kind] = pair
        for key, buf in self._outputs.items():
            if key[0] == kind:
                buf.generation += 1

    def generations(self) -> dict:
        """Output buffer generations by key (part of the Session's state digest)."""
        return {k: b.generation for k, b in self._outputs.items()}

    def fill(self, name: str, values: list) -> int:
        """Set the leading rows of buffer ``name`` to ``values``: ints, or for a 2-D buffer rows of
        ints of one width (the rest of those rows is set to -1). On the CPU they are written in
        place (through a NumPy view of the buffer: no tensor is made for them); on an accelerator
        through its pinned buffer, without blocking. Returns the bytes moved h2d."""
        rows, buf = len(values), self.tensors[name]
        width = len(values[0]) if buf.dim() == 2 and values else None
        staging = self.pinned.get("prefill" if name.startswith("prefill.") else "decode")
        if staging is None:                                  # the CPU
            host = self._host_views[name]
            if width is None:
                host[:rows] = values
            else:
                host[:rows, :width] = values
                host[:rows, width:] = -1
        else:
            part = (slice(0, rows),) if width is None else (slice(0, rows), slice(0, width))
            staging.copy_into(buf[part], values, name)
            if width is not None and width < buf.shape[1]:
                buf[:rows, width:] = -1
        return rows * (1 if width is None else width) * buf.element_size()

    def view(self, name: str, n: int) -> torch.Tensor:
        """A new view ``tensors[name][:n]`` for each step: the kernels may keep what they derive
        from a step's metadata for the very same tensor object (``kernels/memo.py``), and the CPU's
        writes through NumPy leave its version counter as it was."""
        return self.tensors[name][:n]


class ModelRunner:
    interruptible = True         # Ctrl-C may land in the forward (``interrupts.py``)

    def __init__(self, model: Qwen3Model, kv_cache: KVCache, buffers: DispatchBuffers, *,
                 sync_timings: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.buffers = buffers
        self.sync_timings = sync_timings

    def end_phase(self) -> None:
        """Wait for the device's queued work when timings must hold per phase (see the module doc)."""
        if self.sync_timings:
            synchronize(self.model.device)

    def guard(self, blocks, staging, plan: StepPlan) -> KVGuard:
        """The KVGuard of a step that overwrites the committed ``blocks``."""
        return KVGuard(self.kv_cache, blocks, staging)

    def dispatch(self, plan: StepPlan, timings: dict, transfers: dict, *, hook: Hook | None = None,
                 guard: KVGuard | None = None, greedy: bool = False
                 ) -> tuple[OutputBuffer, OutputBuffer, tuple[torch.Tensor, torch.Tensor] | None]:
        """Run the plan; returns the (logits, hidden) buffers its logits rows were written to, and
        with ``greedy`` (the step is sampled in the same call) the two rows of the model's
        ``greedy_out``: each logits row's argmax and packed word (``pack_greedy``), [rows] int64
        each, on the device. The caller runs it with gradients off; ``guard`` is the step's (a
        tensor-parallel runner has every rank copy its blocks)."""
        t0 = time.perf_counter()
        meta = self.fill(plan, transfers)
        kind = buffer_set(plan.kind)
        logits_buf, hidden_buf = self.outputs(kind)
        pre = "" if kind == "decode" else "prefill."
        b, out_rows = self.buffers, len(plan.logits_index)
        greedy_buf = b.output(kind, "greedy", 2, b.max_logits[kind], torch.int64, b.spare(kind)) if greedy else None
        self.end_phase()
        t1 = time.perf_counter()
        timings["prepare"] = timings.get("prepare", 0.0) + t1 - t0
        kv = list(zip(self.kv_cache.keys, self.kv_cache.values))             # [(key, value)] per layer
        self.model(b.view(pre + "input_ids", plan.num_tokens), meta, kv, b.view(pre + "logits_index", out_rows),
                   logits_out=logits_buf.rows(out_rows), hidden_out=hidden_buf.rows(out_rows),
                   greedy_out=greedy_buf.lanes(out_rows) if greedy else None, hook=hook)
        self.end_phase()
        timings["forward"] = timings.get("forward", 0.0) + time.perf_counter() - t1
        return logits_buf, hidden_buf, greedy_buf.lane_views(out_rows) if greedy else None

    def fill(self, plan: StepPlan, transfers: dict) -> AttentionMetadata:
        """Copy the plan into rows [0, n) of its buffer set; returns metadata over views [:n]."""
        b = self.buffers
        pre = "" if buffer_set(plan.kind) == "decode" else "prefill."
        rows, tokens = len(plan.rows), plan.num_tokens
        width = max(len(t) for t in plan.block_tables) or 1
        tables = pad_block_tables(plan.block_tables, width)                     # [rows][width]
        qsl = [0]
        for n in plan.query_lens:
            qsl.append(qsl[-1] + n)
        with b.writing(buffer_set(plan.kind)):
            h2d = b.fill(pre + "input_ids", plan.input_ids)
            h2d += b.fill(pre + "positions", plan.positions)
            h2d += b.fill(pre + "slot_mapping", plan.slot_mapping)
            h2d += b.fill(pre + "seq_lens", plan.seq_lens)
            h2d += b.fill(pre + "block_tables", tables)
            h2d += b.fill(pre + "query_start_loc", qsl)
            h2d += b.fill(pre + "logits_index", plan.logits_index)
        transfers["h2d"] += h2d
        return AttentionMetadata(
            positions=b.view(pre + "positions", tokens),
            slot_mapping=b.view(pre + "slot_mapping", tokens),
            block_tables=b.view(pre + "block_tables", rows),
            seq_lens=b.view(pre + "seq_lens", rows),
            query_start_loc=b.view(pre + "query_start_loc", rows + 1),
            query_lens_host=tuple(plan.query_lens),
            seq_lens_host=tuple(plan.seq_lens),
            is_decode=plan.kind == "decode",
        )

    def outputs(self, kind: str) -> tuple[OutputBuffer, OutputBuffer]:
        """The (logits, hidden) output buffers a new step of ``kind`` writes: the spare pair, whose
        handles are all stale already (the step's commit publishes it; see the module docstring)."""
        b, cfg = self.buffers, self.model.config
        pair = b.spare(kind)
        logits_buf = b.output(kind, "logits", b.max_logits[kind], cfg.vocab_size, torch.float32, pair)
        hidden_buf = b.output(kind, "hidden", b.max_logits[kind], cfg.hidden_size, self.model.dtype, pair)
        return logits_buf, hidden_buf
