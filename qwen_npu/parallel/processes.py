"""The worker processes of a tensor-parallel group: what each is, what is wrong with one, and
stopping them so that none outlives its group.
"""
from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class Rank:
    index: int
    process: object
    conn: object


def rank_state(rank: Rank) -> str | None:
    """What is wrong with a worker's process, or None when it runs."""
    if not rank.process.is_alive():
        return f"rank {rank.index} (pid {rank.process.pid}) exited with code {rank.process.exitcode}"
    try:
        with open(f"/proc/{rank.process.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    if state in ("T", "t"):
        return f"rank {rank.index} (pid {rank.process.pid}) is stopped (a signal or a debugger)"
    return None


def abandon(ranks: list[Rank]) -> None:
    """A group dropped without ``close`` (its Session garbage collected, or lost half way through
    its start): stop its workers and leave the process group, so a new Session can form one."""
    stop(ranks)
    import torch.distributed as dist
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def stop(ranks: list[Rank], grace_s: float = 5.0) -> None:
    """Ask every worker to leave, then join, terminate and kill: none outlives this call."""
    for r in ranks:
        try:
            r.conn.send(("close", None))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for r in ranks:
        r.process.join(max(0.0, deadline - time.monotonic()))
    for r in ranks:
        if r.process.is_alive():
            r.process.terminate()
            r.process.join(2.0)
        if r.process.is_alive():
            r.process.kill()
            r.process.join(2.0)
    for r in ranks:
        try:
            r.conn.close()
        except OSError:
            pass
