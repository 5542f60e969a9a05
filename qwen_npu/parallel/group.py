"""Rank 0's side of a tensor-parallel Session: the worker processes and what is said to them.

``TensorParallelGroup.start`` spawns ranks ``1..N-1`` (``worker.main``, an importable entry point,
so a notebook cell can start them), joins the process group with them, and waits until each has
loaded its shard. Rank 0 is the notebook's process: it owns the Session, the scheduler, the slot
checks and sampling. Each step, ``send_step`` hands every rank the plan (one pipe message per
rank), ``confirm`` has all ranks compare digests of the plan they hold (on the CPU group), the
forward runs with its collectives, and ``finish_step`` collects every rank's answer.

Every wait here is bounded: a pipe answer by ``timeout_s`` (``start``: ``load_timeout_s``, the
load of a shard), a collective by the process group's timeout. A rank that exits, or does not
answer in time, makes the group ``broken``: the error names the rank, every later use raises it,
and ``close`` stops whatever is left. ``close`` (idempotent, also run when the Session is
garbage collected or the interpreter exits) asks each worker to leave, then terminates and
finally kills it, so no process outlives the Session.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import multiprocessing
import threading
import time
import weakref

import torch

from ..engine.interrupts import hold_interrupts, release_interrupts
from .collectives import TensorParallelError
from .processes import Rank, abandon, rank_state, stop
from .worker import RankSpec, confirm_plan, init_group, main, open_store, select_device


STATE_TAIL = "; the Session's state is as before the call that found it; close() it and open a new one"
START_HINT = ("; the tensor-parallel Session did not start. The workers are spawned: they import the program's "
              "main module, so a script must open the Session under `if __name__ == \"__main__\":` (a "
              "notebook need not)")


class TensorParallelGroup:
    def __init__(self, spec: RankSpec, ranks: list[Rank], store, cpu_group):
        self.spec, self.ranks, self.store, self.cpu_group = spec, ranks, store, cpu_group
        self.size = spec.size
        self.broken: str | None = None
        self.closed = False
        self._lock = threading.Lock()
        self._owner: int | None = None      # the thread inside an exchange
        self._finalizer = weakref.finalize(self, abandon, list(ranks))
        atexit.register(self._finalizer)

    @classmethod
    def start(cls, spec: RankSpec, load_timeout_s: float = 600.0) -> TensorParallelGroup:
        """Spawn ranks 1..size-1 and join the group with them (rank 0 is this process)."""
        import torch.distributed as dist
        if dist.is_initialized():
            raise TensorParallelError(
                "tensor_parallel_size > 1: this process is already in a torch.distributed process group "
                "(another tensor-parallel Session is open, or the program made one); close that first")
        ctx = multiprocessing.get_context("spawn")
        ranks = []
        select_device(spec.device_type, 0)        # before the group, as nccl and hccl want
        store = open_store(spec, 0)
        spec = dataclasses.replace(spec, store_port=store.port)
        try:
            for r in range(1, spec.size):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=main, args=(r, spec, theirs), daemon=True, name=f"qwen-npu-rank-{r}")
                p.start()
                theirs.close()
                ranks.append(Rank(r, p, ours))
        except BaseException:
            stop(ranks)
            raise
        group = cls(spec, ranks, store, None)
        try:
            for rank in ranks:          # a worker that cannot even import says so here, not in a timeout
                group._answer(rank, load_timeout_s, "start")
            try:
                _, group.cpu_group = init_group(spec, 0, store)
            except Exception as e:
                raise group._lost(f"joining the process group ({str(e).splitlines()[0]})") from None
            for rank in ranks:
                kind, arg = group._answer(rank, load_timeout_s, "load its shard")
                if kind != "ready":
                    raise TensorParallelError(f"rank {rank.index} could not start:\n{arg}")
        except TensorParallelError as e:
            group.close()
            raise TensorParallelError(f"{e}".replace(STATE_TAIL, "") + START_HINT) from None
        except BaseException:
            group.close()
            raise
        return group

    @contextlib.contextmanager
    def exchange(self, what: str):
        """One exchange with the workers at a time, whole: a lock (another thread waits at most
        ``timeout_s``), and Ctrl-C held back until the exchange is over, so no answer is left
        unread and no rank is left in a collective (a step already holds it back). An exchange
        begun inside another on the same thread (a cache read from a hook during a step's
        forward, while the workers wait in a collective) is refused at once."""
        held = hold_interrupts()
        acquired = False
        try:
            if self._owner == threading.get_ident():
                raise TensorParallelError(
                    f"{what}: the other ranks are inside a step's forward, which this call was made from (a "
                    f"hook or a callback); read the cache after the step, or capture the hook point instead")
            acquired = self._lock.acquire(timeout=self.spec.timeout_s)
            if not acquired:
                raise TensorParallelError(f"{what}: another thread has been talking to the workers for "
                                          f"{self.spec.timeout_s:g} s")
            self._owner = threading.get_ident()
            yield
        finally:
            if acquired:
                self._owner = None
                self._lock.release()
            release_interrupts(held)

    # ---- steps --------------------------------------------------------------------------------------
    def send_step(self, message: dict) -> None:
        """Hand step ``message`` (``plan_message``) to every rank."""
        self.check()
        for rank in self.ranks:
            self._send(rank, ("step", message))

    def confirm(self, plan: dict) -> list[int]:
        """Every rank's digest of the plan it holds (rank 0's from ``plan``)."""
        try:
            return confirm_plan(plan, self.cpu_group, self.size)
        except Exception as e:
            raise self._lost(f"confirming the plan ({str(e).splitlines()[0]})") from None

    def finish_step(self, index: int) -> list[tuple[int, str, object]]:
        """Every worker's answer to step ``index``: (rank, kind, detail), kind done/mismatch/error."""
        return self._answers(f"finish step {index}")

    def rollback(self, index: int) -> None:
        """Every worker puts back the K/V it copied before step ``index`` (no-op where none)."""
        if self.broken or self.closed:
            return
        with self.exchange("rollback"):
            for rank in self.ranks:
                self._send(rank, ("rollback", index))
            for rank in self.ranks:
                self._answer(rank, self.spec.timeout_s, f"roll back step {index}")

    def ask(self, kind: str, arg=None) -> list:
        """Send one command to every worker; their answers in rank order (errors raised)."""
        with self.exchange(kind):
            self.send_all(kind, arg)
            return self.collect(kind)

    def send_all(self, kind: str, arg=None) -> None:
        """Send one command to every worker (``collect`` its answers; rank 0 may work meanwhile)."""
        self.check()
        for rank in self.ranks:
            self._send(rank, (kind, arg))

    def collect(self, what: str) -> list:
        """Every worker's answer to a command, in rank order; an answer other than ok raises."""
        answers = self._answers(what)
        bad = [(r, arg) for r, kind, arg in answers if kind != "ok"]
        if bad:
            raise TensorParallelError("; ".join(f"rank {r}: {arg}" for r, arg in bad))
        return [arg for _, _, arg in answers]

    def _answers(self, what: str) -> list[tuple[int, str, object]]:
        """(rank, kind, detail) of every worker's next answer; a fatal one loses the group."""
        out = []
        for rank in self.ranks:
            kind, arg = self._answer(rank, self.spec.timeout_s, what)
            if kind == "fatal":
                raise self._lost(arg)
            out.append((rank.index, kind, arg))
        return out

    # ---- inspection ---------------------------------------------------------------------------------
    def read_slots(self, local, layers: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [layers, slots, all kv_heads, head_dim] on the host, rank 0's heads first
        (``local``: rank 0's KVCache)."""
        answers = self.ask("read", (layers, slots))
        k0, v0 = local.rows(layers, slots)
        return (torch.cat([k0.cpu()] + [a[0] for a in answers], dim=2),
                torch.cat([v0.cpu()] + [a[1] for a in answers], dim=2))

    def layer(self, local, layer: int, kind: str) -> torch.Tensor:
        """One layer's whole key (``kind="key"``) or value cache, every rank's heads (host copy)."""
        answers = self.ask("layer", layer)
        mine = (local.keys if kind == "key" else local.values)[layer].cpu()
        return torch.cat([mine] + [a[0 if kind == "key" else 1] for a in answers], dim=2)

    # ---- lifetime -----------------------------------------------------------------------------------
    def check(self) -> None:
        if self.closed:
            raise TensorParallelError("the tensor-parallel group is closed")
        if self.broken:
            raise TensorParallelError(self.broken)

    def close(self) -> None:
        """Stop every worker and leave the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        abandon(self.ranks)

    def runner(self, model, kv_cache, buffers, *, sync_timings: bool = False):
        """The engine's model runner on rank 0: it runs every step on every rank."""
        from .runner import ParallelRunner
        return ParallelRunner(model, kv_cache, buffers, self, sync_timings=sync_timings)

    def pids(self) -> list[int]:
        return [r.process.pid for r in self.ranks]

    def _send(self, rank: Rank, msg) -> None:
        try:
            rank.conn.send(msg)
        except (OSError, ValueError) as e:
            raise self._lost(f"sending to rank {rank.index} ({e})") from None

    def _answer(self, rank: Rank, timeout_s: float, what: str):
        """Rank ``rank``'s next answer within ``timeout_s``, its process watched meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not rank.conn.poll(0.05):
            if not rank.process.is_alive():
                raise self._lost(f"waiting for rank {rank.index} to {what}")
            if time.monotonic() > deadline:
                raise self._lost(f"rank {rank.index} did not {what} within {timeout_s:g} s")
        try:
            return rank.conn.recv()
        except (EOFError, OSError) as e:
            raise self._lost(f"rank {rank.index} closed its pipe before it could {what}"
                             + (f" ({e})" if str(e) else "")) from None

    def lost_during(self, what: str, error: BaseException) -> TensorParallelError:
        """The group broke while rank 0 was doing ``what``: the error to raise, naming first the
        failure a worker reported, if any (its collectives then broke rank 0's)."""
        reports = []
        for rank in self.ranks:
            try:
                if rank.conn.poll(0.5):
                    kind, arg = rank.conn.recv()
                    if kind == "fatal":
                        reports.append(arg)
            except (EOFError, OSError):
                pass
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        return self._lost("; ".join(reports) if reports else f"{what} did not complete on every rank ({first})")

    def _lost(self, why: str) -> TensorParallelError:
        """The group cannot go on: remember why, stop the workers, and return the error to raise."""
        time.sleep(0.05)                     # a peer's broken connection can arrive before its exit code
        seen = [rank_state(r) for r in self.ranks]
        named = [s for s in seen if s is not None]
        if not named and "timed out" in why.lower():            # a collective's own timeout (gloo, nccl)
            named = [f"rank {r.index} (pid {r.process.pid}) is running but did not take part in time (busy or stuck)"
                     for r in self.ranks]
        self.broken = ("the tensor-parallel group is lost: " + (", ".join(named) + "; found while " if named else "")
                       + why[:300] + STATE_TAIL)
        stop(self.ranks, grace_s=1.0)
        return TensorParallelError(self.broken)


def worker_pids(sess) -> list[int]:
    """The process ids of ranks 1..N-1 of a tensor-parallel Session, in rank order ([] for one rank)."""
    group = sess._engine.parallel
    return [] if group is None else group.pids()


def inject_rank_fault(sess, fault: str, rank: int = 1) -> None:
    """Arm a test fault on worker ``rank`` of a tensor-parallel Session for its next step:
    "corrupt_plan" (its slot mapping's first entry shifted by one: the digests catch it),
    "fail_after_forward" (an error after its forward: the step rolls back on every rank), or
    "exit_in_forward" (a failure inside the forward: the group is lost)."""
    group = sess._engine.parallel
    if group is None:
        raise TensorParallelError("inject_rank_fault needs a Session with tensor_parallel_size > 1")
    if not 0 < rank < group.size:
        raise TensorParallelError(f"inject_rank_fault: rank {rank!r} is not a worker (ranks 1..{group.size - 1})")
    group.check()
    target = group.ranks[rank - 1]
    with group.exchange("inject_rank_fault"):
        group._send(target, ("fault", [fault]))
        kind, why = group._answer(target, group.spec.timeout_s, "arm a fault")
    if kind != "ok":
        raise TensorParallelError(f"rank {rank}: {why}")


def refuse_with_ranks(engine, what: str, instead: str = "") -> None:
    """Refuse ``what`` on a tensor-parallel engine, before anything runs (it needs one rank)."""
    if engine.parallel is not None:
        raise TensorParallelError(f"{what} is not available with tensor_parallel_size="
                                  f"{engine.config.tensor_parallel_size} yet: it needs the whole model on one rank"
                                  + (f"; {instead}" if instead else ""))
