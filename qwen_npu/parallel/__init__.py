"""Tensor parallelism: one Session whose model spans several devices through ``torch.distributed``.

    sharding.py     which slice of every weight a rank holds, and what is refused before any start
    collectives.py  the model's all-reduce and the gathers that show hook points whole, every wait bounded
    worker.py       the process of a rank other than 0: its shard, its KV cache, its loop
    group.py        rank 0's side: starts the workers, hands each step's plan to them, rolls back,
                    gathers slots and audits, stops them
    processes.py    the worker processes: what is wrong with one, stopping them all
"""
from .collectives import TensorParallelError
from .group import inject_rank_fault, worker_pids

__all__ = ["TensorParallelError", "inject_rank_fault", "worker_pids"]
