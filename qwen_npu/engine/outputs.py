"""What a step hands back: StepResult (host copies of what was dispatched) and DeviceLogits.

DeviceLogits is a view of rows of a cached device output buffer. It stays valid until a later
step writes the same buffer; then ``.tensor`` raises StaleOutputError unless you ``.clone()``d it.
Nothing here copies the full logits to the host unless asked (``to_host``), and every copy that
crosses the host/device boundary is added to the step's ``transfers``.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import StaleOutputError
from ..extensions import implementation
from .buffers import OutputBuffer


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
        """The device view. Raises StaleOutputError once a later step reused the buffer."""
        if self._private is not None:
            return self._private
        if self.is_stale:
            raise StaleOutputError(
                f"the logits of step {self.step_index} were overwritten by a later step that reused "
                f"the same device buffer; call .clone() on them before running another step to keep them")
        return self._buffer.tensor[:self._rows]

    def view_unchecked(self) -> torch.Tensor:
        """The rows without the staleness check: for the engine, inside the step that wrote them."""
        return self._private if self._private is not None else self._buffer.tensor[:self._rows]

    def clone(self) -> "DeviceLogits":
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
        return implementation("logits_html")(self)


@dataclasses.dataclass
class StepResult:
    """One step: what was dispatched (host copies), its device logits and, once sampled, tokens."""

    kind: str                       # "prefill" | "decode" | "mixed" (decode rows and prefill chunks)
    index: int                      # the session's step counter
    request_ids: list[int]          # one per dispatched row (padding rows repeat the copied id)
    batch_size: int                 # rows dispatched
    num_active: int                 # rows that belong to a real request (< batch_size only when padded)
    input_ids: torch.Tensor         # [tokens]
    positions: torch.Tensor         # [tokens]
    slot_mapping: torch.Tensor      # [tokens]
    query_lens: torch.Tensor        # [rows]
    block_tables: torch.Tensor      # [rows, max_blocks] -1 padded
    seq_lens: torch.Tensor          # [rows]
    logits: DeviceLogits | None
    logits_request_ids: list[int]
    host_logits: torch.Tensor
    hidden: torch.Tensor | None = None          # device view [rows_out, hidden]
    token_ids: torch.Tensor | None = None       # after sampling: [rows_out] int64 on the host
    timings: dict = dataclasses.field(default_factory=dict)
    transfers: dict = dataclasses.field(default_factory=lambda: {"h2d": 0, "d2h": 0})
    health: list = dataclasses.field(default_factory=list)   # rows whose logits look broken
    slot_problems: list = dataclasses.field(default_factory=list)
    block_size: int | None = None                # the cache's block size (slot = block * block_size + offset)
    cache_usage: dict = dataclasses.field(default_factory=dict)   # blocks {"used", "cached", "free"} after the run
    # per active row: its request's num_preemptions when the step ran (a change between two steps of a
    # request means it was preempted in between and restarted with a new block table)
    row_preemptions: list = dataclasses.field(default_factory=list)
    # per dispatched row: "decode" (one token of a decoding request) or "prefill" (a prompt chunk);
    # a "mixed" step has both, the others one kind throughout
    row_kinds: list = dataclasses.field(default_factory=list)

    @property
    def sampled(self) -> bool:
        return self.token_ids is not None or not self.logits_request_ids

    def to_dict(self, *, logits_topk: int = 0) -> dict:
        """What the step dispatched (and sampled) as plain JSON types; see docs/dump-format.md."""
        from ..dump import step_to_dict
        return step_to_dict(self, logits_topk=logits_topk)

    def __repr__(self) -> str:
        return repr(implementation("take_step")(self))

    def _repr_html_(self) -> str:
        return implementation("take_step")(self)._repr_html_()
