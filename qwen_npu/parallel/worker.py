"""The process of rank ``r > 0``: its shard of the model, its KV cache, and a loop over rank 0's
commands (``group.py`` sends them through a pipe; the tensors of a step through
``torch.distributed``).

    step      the plan (as ``plan_message`` makes it): confirm it on the CPU group, copy the blocks
              rank 0 guards, run the forward; answer done, mismatch or error
    rollback  put back the blocks copied before the step (the step failed somewhere)
    read      the K/V of some slots in some layers; ``layer``: one layer's whole cache
    audit     recompute a prompt's K/V in lockstep with rank 0; answer this rank's heads
    fault     arm a test fault for the next step (``FAULTS``)
    close     leave the group and exit

The copy kept for the last step lives until the next ``step`` (reads, audits and faults leave
it, so a read from another thread between a failed step and its rollback cannot cancel the
rollback): rank 0 sends ``rollback`` before the next step when a step fails, so a step that
reaches the next one has committed. A
failure inside the forward cannot be rolled back here (the other ranks wait in a collective):
the rank reports it and exits, and rank 0 reports the rank lost. SIGINT is ignored: rank 0 holds
the Ctrl-C of the notebook and tells every rank what to do. The loop exits when rank 0's process
is gone.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import signal
import traceback

import torch
import torch.distributed as dist

from ..cache.block_table import pad_block_tables
from ..cache.kv_cache import KVCache
from ..device import load_torch_npu
from ..engine.recompute import recompute_kv
from ..engine.transaction import KVGuard
from ..kernels import get_kernels
from ..kernels.metadata import AttentionMetadata
from ..model.loader import load_checkpoint
from ..model.qwen3 import Qwen3Model
from .collectives import Collectives, GatheringHook
from .sharding import shard_config, shard_weights

FAULTS = ("corrupt_plan", "fail_after_forward", "exit_in_forward")


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its part (picklable: it crosses the spawn)."""
    path: str
    dtype: str
    device_type: str            # "cpu", "cuda" or "npu": rank r takes device index r
    kernels: str
    block_size: int
    num_blocks: int
    max_model_len: int
    size: int
    backend: str                # gloo, nccl or hccl
    store_host: str
    store_port: int
    timeout_s: float
    threads: int
    prepares: bool              # the kernel set holds the matrices in its own form (rank 0 decided)


def select_device(device_type: str, rank: int) -> torch.device:
    """Rank ``rank``'s device, made the process's current one (torch_npu loaded first on an NPU)."""
    if device_type == "npu":
        load_torch_npu().npu.set_device(rank)
    elif device_type == "cuda":
        torch.cuda.set_device(rank)
    return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, rank)


def plan_hash(plan: dict) -> int:
    """A signed 64-bit digest of a step's plan (what every rank confirms before its forward)."""
    digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def open_store(spec: RankSpec, rank: int):
    """The group's rendezvous: rank 0 serves it (on a free port when ``store_port`` is 0), the
    others connect to it."""
    return dist.TCPStore(spec.store_host, spec.store_port, spec.size, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=spec.timeout_s), wait_for_workers=False)


def init_group(spec: RankSpec, rank: int, store=None):
    """Join the device group (the default process group) and the CPU group through ``store``;
    returns (store, the CPU group)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = open_store(spec, rank) if store is None else store
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.size, timeout=timeout)
    cpu = dist.group.WORLD if spec.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return store, cpu


def confirm_plan(plan: dict, cpu_group, size: int) -> list[int]:
    """Every rank's digest of its plan, in rank order (one all-gather on the CPU group)."""
    mine = torch.tensor([plan_hash(plan)], dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=cpu_group)
    return [int(p.item()) for p in parts]


def main(rank: int, spec: RankSpec, conn) -> None:
    """The worker process (``multiprocessing`` spawn target; importable from a notebook)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    conn.send(("started", os.getpid()))
    try:
        worker = Worker(rank, spec)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        worker.serve(conn, parent)
    finally:
        worker.leave()


class Worker:
    def __init__(self, rank: int, spec: RankSpec):
        torch.set_num_threads(spec.threads)
        self.rank, self.spec = rank, spec
        self.device = select_device(spec.device_type, rank)
        self.store, self.cpu_group = init_group(spec, rank)     # the store lives as long as the group
        self.comms = Collectives(rank, spec.size)
        mc, weights = load_checkpoint(spec.path, dtype=spec.dtype, device=self.device, arena=False)
        c = shard_config(mc, spec.size)
        self.model = Qwen3Model(c, shard_weights(weights, rank, spec.size), get_kernels(spec.kernels),
                                max_positions=spec.max_model_len, consume=spec.prepares,
                                all_reduce=self.comms.all_reduce)
        del weights
        self.kv = KVCache(c.num_hidden_layers, spec.num_blocks, spec.block_size, c.num_key_value_heads, c.head_dim,
                          self.model.dtype, self.device)
        self.pending = None             # (step index, KVGuard) of the last step, until the next command
        self.faults: set[str] = set()

    def serve(self, conn, parent: int) -> None:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:          # rank 0 is gone: nobody will send again
                    return
                continue
            try:
                msg = conn.recv()
            except EOFError:
                return
            kind, arg = msg
            if kind == "rollback":
                conn.send(("ok", self.rollback(arg)))
                continue
            if kind == "close":
                conn.send(("ok", None))
                return
            try:
                conn.send(self.handle(kind, arg))
            except _Fatal as e:
                conn.send(("fatal", str(e)))
                return

    def handle(self, kind: str, arg):
        if kind == "step":
            return self.step(arg)
        if kind == "read":
            layers, slots = arg
            return ("ok", self.read(layers, slots))
        if kind == "layer":
            return ("ok", (self.kv.keys[arg].cpu().clone(), self.kv.values[arg].cpu().clone()))
        if kind == "audit":
            return ("ok", self.audit(*arg))
        if kind == "fault":
            unknown = set(arg) - set(FAULTS)
            if unknown:
                return ("error", f"unknown faults {sorted(unknown)}; known: {FAULTS}")
            self.faults |= set(arg)
            return ("ok", None)
        return ("error", f"unknown command {kind!r}")

    def step(self, m: dict):
        self.pending = None                  # the last step committed: rank 0 would have rolled it back
        plan = m["plan"]
        if "corrupt_plan" in self.faults:
            self.faults.discard("corrupt_plan")
            plan = dict(plan, slot_mapping=[plan["slot_mapping"][0] + 1] + plan["slot_mapping"][1:])
        hashes = confirm_plan(plan, self.cpu_group, self.spec.size)
        if len(set(hashes)) > 1:
            return ("mismatch", plan)
        guard = KVGuard(self.kv, m["guard_blocks"])
        try:
            if "exit_in_forward" in self.faults:
                raise RuntimeError("an injected fault inside the forward")
            self.forward(plan, frozenset(m["wanted"]))
        except BaseException as e:
            raise _Fatal(f"rank {self.rank} failed in the forward of step {m['index']}: "
                         f"{''.join(traceback.format_exception_only(e)).strip()}") from e
        self.pending = (m["index"], guard)
        if "fail_after_forward" in self.faults:
            self.faults.discard("fail_after_forward")
            return ("error", f"an injected fault after the forward of step {m['index']}")
        return ("done", None)

    def forward(self, plan: dict, wanted: frozenset[str]) -> None:
        d = self.device
        meta = plan_metadata(plan, d)
        hook = GatheringHook(None, wanted, self.comms) if wanted else None
        with torch.no_grad():
            self.model(torch.tensor(plan["input_ids"], dtype=torch.int64, device=d), meta, self.kv.layers(),
                       torch.zeros(0, dtype=torch.int64, device=d), hook=hook)

    def rollback(self, index: int) -> bool:
        """Put back the blocks copied before step ``index``; False when no such step is pending."""
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != index:
            return False
        pending[1].restore()
        return True

    def read(self, layers: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [layers, slots, kv_heads of this rank, head_dim] on the host."""
        k, v = self.kv.rows(layers, slots)
        return k.cpu(), v.cpu()

    def audit(self, token_ids: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's recomputed (k, v) [layers, n, kv_heads of this rank, head_dim] of ``token_ids``."""
        scratch = recompute_kv(self.model, token_ids, block_size)
        k, v = scratch.rows(range(scratch.num_layers), range(len(token_ids)))
        return k.cpu(), v.cpu()

    def leave(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:       # the group may be broken already; the process ends anyway
                pass


class _Fatal(Exception):
    """A failure this rank cannot roll back: it reports it and exits."""


def plan_metadata(plan: dict, device: torch.device):
    """The AttentionMetadata of a plan message, on ``device``."""
    width = max((len(t) for t in plan["block_tables"]), default=1) or 1
    qsl = [0]
    for n in plan["query_lens"]:
        qsl.append(qsl[-1] + n)
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        positions=torch.tensor(plan["positions"], dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(plan["slot_mapping"], dtype=torch.int64, device=device),
        block_tables=torch.tensor(pad_block_tables(plan["block_tables"], width), **i32),
        seq_lens=torch.tensor(plan["seq_lens"], **i32),
        query_start_loc=torch.tensor(qsl, **i32),
        query_lens_host=tuple(plan["query_lens"]), seq_lens_host=tuple(plan["seq_lens"]),
        is_decode=plan["kind"] == "decode")
