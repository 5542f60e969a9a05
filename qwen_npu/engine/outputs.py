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
from ..cache.block_table import pad_block_tables
from .runner import OutputBuffer


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
        from ..inspect.step_view import logits_html
        return logits_html(self)


@dataclasses.dataclass(eq=False)
class StepResult:
    """One step: what was dispatched, its device logits and, once sampled, its tokens.

    What was dispatched is read from the step's plan (``engine/plan.py``), the one record of it:
    ``input_ids``, ``positions``, ``slot_mapping``, ``query_lens``, ``seq_lens`` and
    ``block_tables`` are host tensors made from the plan when first read."""

    plan: object                    # the StepPlan that ran (engine/plan.py)
    logits: DeviceLogits | None
    host_logits: torch.Tensor
    max_blocks: int                 # the width ``block_tables`` is padded to (-1)
    hidden: torch.Tensor | None = None          # device view [rows_out, hidden]
    token_ids: torch.Tensor | None = None       # after sampling: [rows_out] int64 on the host
    timings: dict = dataclasses.field(default_factory=dict)
    transfers: dict = dataclasses.field(default_factory=lambda: {"h2d": 0, "d2h": 0})
    health: list = dataclasses.field(default_factory=list)   # rows whose logits look broken
    slot_problems: list = dataclasses.field(default_factory=list)
    block_size: int | None = None                # the cache's block size (slot = block * block_size + offset)
    # blocks {"used", "cached", "free"} after the run
    cache_usage: dict = dataclasses.field(default_factory=dict)
    # per active row: its request's num_preemptions when the step ran (a change between two steps of a
    # request means it was preempted in between and restarted with a new block table)
    row_preemptions: list = dataclasses.field(default_factory=list)
    _tensors: dict = dataclasses.field(default_factory=dict, repr=False)

    kind = property(lambda self: self.plan.kind, doc='"prefill" | "decode" | "mixed" (both kinds of row)')
    index = property(lambda self: self.plan.index, doc="the session's step counter")
    request_ids = property(lambda self: self.plan.request_ids,
                           doc="one per dispatched row (padding rows repeat the copied id)")
    batch_size = property(lambda self: len(self.plan.rows), doc="rows dispatched")
    num_active = property(lambda self: self.plan.num_active,
                          doc="rows that belong to a real request (< batch_size only when padded)")
    row_kinds = property(lambda self: self.plan.row_kinds,
                         doc='per dispatched row: "decode" or "prefill" (a mixed step has both)')

    @property
    def logits_request_ids(self) -> list[int]:
        """The request of each logits row, in order."""
        return [self.plan.rows[r].request.id for r in self.plan.logits_rows]

    def _tensor(self, name: str, make) -> torch.Tensor:
        t = self._tensors.get(name)
        if t is None:
            t = self._tensors[name] = make()
        return t

    input_ids = property(lambda self: self._tensor("input_ids", lambda: torch.tensor(self.plan.input_ids)),
                         doc="[tokens]")
    positions = property(lambda self: self._tensor("positions", lambda: torch.tensor(self.plan.positions)),
                         doc="[tokens]")
    slot_mapping = property(lambda self: self._tensor("slot_mapping", lambda: torch.tensor(self.plan.slot_mapping)),
                            doc="[tokens]")
    query_lens = property(lambda self: self._tensor("query_lens", lambda: torch.tensor(self.plan.query_lens)),
                          doc="[rows]")
    seq_lens = property(lambda self: self._tensor("seq_lens", lambda: torch.tensor(self.plan.seq_lens)),
                        doc="[rows]")
    block_tables = property(lambda self: self._tensor("block_tables", self._padded_tables),
                            doc="[rows, max_blocks] int32, -1 padded")

    def _padded_tables(self) -> torch.Tensor:
        tables = self.plan.block_tables
        out = torch.full((len(tables), self.max_blocks), -1, dtype=torch.int32)
        used = max(map(len, tables), default=0)
        if used:
            out[:, :used] = torch.tensor(pad_block_tables(tables, used), dtype=torch.int32)
        return out

    @property
    def sampled(self) -> bool:
        return self.token_ids is not None or not self.logits_request_ids

    def to_dict(self, *, logits_topk: int = 0) -> dict:
        """What the step dispatched (and sampled) as plain JSON types; see docs/dump-format.md."""
        from ..dump import step_to_dict
        return step_to_dict(self, logits_topk=logits_topk)

    def __repr__(self) -> str:
        from ..inspect.snapshot import take_step
        return repr(take_step(self))

    def _repr_html_(self) -> str:
        from ..inspect.snapshot import take_step
        return take_step(self)._repr_html_()
