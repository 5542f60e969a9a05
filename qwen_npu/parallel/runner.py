"""Rank 0's dispatch of a tensor-parallel step: the same plan on every rank, or on none.

    send_step     the plan (ids, positions, slot mapping, block tables, lengths), the blocks the
                  step's KVGuard copies, and the hook points wanted, to every rank
    confirm       every rank's digest of the plan it holds, gathered on the CPU group: a rank that
                  holds another plan refuses the step on every rank, before any K/V is written
    forward       rank 0's shard, with its collectives; the other ranks run theirs
    finish_step   every rank says done (or why not); an error anywhere fails the step

The step then commits on rank 0 (``engine/step.py``), and the workers keep what they wrote. Any
way out before the commit runs ``ParallelKVGuard.restore``: rank 0 puts back its guarded blocks
and every worker its own, so the step is committed everywhere or nowhere. Ctrl-C never lands in
the forward (``interruptible = False``): every rank must finish the collectives it started, so a
Ctrl-C held back lands at the commit's checkpoint instead, and the step rolls back on every rank.
"""
from __future__ import annotations

from ..engine.runner import ModelRunner
from ..engine.transaction import KVGuard
from ..model.hooks import capture_names
from .collectives import RANK0_POINTS, Collectives, GatheringHook, TensorParallelError


def plan_message(plan) -> dict:
    """The facts of a step every rank needs, as plain lists (what the ranks' digests cover)."""
    return {"kind": plan.kind, "index": plan.index, "input_ids": list(plan.input_ids),
            "positions": list(plan.positions), "slot_mapping": list(plan.slot_mapping),
            "query_lens": list(plan.query_lens), "seq_lens": list(plan.seq_lens),
            "block_tables": [list(t) for t in plan.block_tables]}


class ParallelKVGuard(KVGuard):
    """A KVGuard whose restore also rolls the step back on every other rank."""

    def __init__(self, kv_cache, blocks, staging, group, step_index: int):
        super().__init__(kv_cache, blocks, staging)
        self.group, self.step_index = group, step_index

    def restore(self) -> None:
        super().restore()
        self.group.rollback(self.step_index)


class ParallelRunner(ModelRunner):
    interruptible = False        # see the module docstring

    def __init__(self, model, kv_cache, buffers, group, *, sync_timings: bool = False):
        super().__init__(model, kv_cache, buffers, sync_timings=sync_timings)
        self.group = group
        self.comms = Collectives(0, group.size)
        self.names = capture_names(model.config.num_hidden_layers)

    def guard(self, blocks, staging, plan) -> ParallelKVGuard:
        return ParallelKVGuard(self.kv_cache, blocks, staging, self.group, plan.index)

    def dispatch(self, plan, timings, transfers, *, hook=None, guard=None, greedy=False):
        with self.group.exchange(f"step {plan.index}"):
            return self._dispatch(plan, timings, transfers, hook, guard, greedy)

    def _dispatch(self, plan, timings, transfers, hook, guard, greedy):
        wanted = frozenset(n for n in self.names if hook.wants(n)) if hook is not None else frozenset()
        message = plan_message(plan)
        self.group.send_step({"index": plan.index, "plan": message, "wanted": sorted(wanted - set(RANK0_POINTS)),
                              "guard_blocks": list(guard.blocks) if guard is not None else []})
        hashes = self.group.confirm(message)
        if len(set(hashes)) > 1:
            answers = self.group.finish_step(plan.index)
            raise TensorParallelError(describe_mismatch(plan.index, message, hashes, answers))
        gathering = GatheringHook(hook, wanted, self.comms) if wanted else None
        try:
            out = super().dispatch(plan, timings, transfers, hook=gathering, greedy=greedy)
        except Exception as e:
            raise self.group.lost_during(f"the forward of step {plan.index}", e) from e
        failed = [(r, why) for r, kind, why in self.group.finish_step(plan.index) if kind != "done"]
        if failed:
            raise TensorParallelError(f"step {plan.index} failed on " + "; ".join(
                f"rank {r}: {why}" for r, why in failed) + "; every rank rolled back, nothing was committed")
        if gathering is not None and gathering.error is not None:
            raise gathering.error
        return out


def describe_mismatch(index: int, mine: dict, hashes: list[int], answers) -> str:
    """Which ranks hold another plan than rank 0's, and the first field and entry that differ."""
    parts = []
    for r, kind, theirs in answers:
        if kind != "mismatch" or hashes[r] == hashes[0]:
            continue
        for key in mine:
            a, b = mine[key], theirs.get(key)
            if a != b:
                where = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) \
                    if isinstance(a, list) and isinstance(b, list) else None
                at = f" at entry {where}: {b[where]!r} where rank 0 has {a[where]!r}" if where is not None else ""
                parts.append(f"rank {r}'s {key} differs{at}")
                break
        else:
            parts.append(f"rank {r}'s plan digest differs")
    return (f"step {index} refused before any rank wrote K/V: the ranks do not hold the same plan ("
            + "; ".join(parts) + "); the step would corrupt the K/V of one shard only")
