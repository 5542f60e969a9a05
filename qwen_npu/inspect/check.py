"""``sess.check()``: a full invariant sweep over the cache, the requests, the ledger and the K/V.

    blocks       free + used = total; each block's ref count = the block tables that hold it
                 (``KVCacheManager.check``), no block written while shared or published
    requests     a running request's table covers its computed tokens and no more than its tokens;
                 waiting, finished and aborted requests hold no blocks
    append_only  a request's block table only grows between steps (unless it was preempted)
    slots        no slot holds two live (request, position) pairs: a block shared by two tables sits
                 at the same table index with the same tokens before it (a prefix block); every live
                 token's slot was last written by that token (or the identical token of a prefix
                 sharer) according to the ledger, and not as a draft that verification rejected
    collisions   every step that wrote one slot more than once, as the ledger recorded it
    values       no NaN or inf in the K/V of any live slot (checked on the device; one small copy)

It reads bookkeeping and the cache; it changes nothing.
"""
from __future__ import annotations

import dataclasses

import torch

from ..cache.block_table import blocks_needed
from ..cache.slot_check import ProblemReport
from ..cache.slot_check import ranges_text as runs
from ..engine.request import DECODING, PREFILLING

SECTIONS = ("blocks", "requests", "append_only", "slots", "collisions", "values")
RUNNING = (PREFILLING, DECODING)
SHOWN = 20      # problems per section shown in the text and HTML views (all are in .problems)


@dataclasses.dataclass(frozen=True)
class CheckProblem:
    section: str        # one of SECTIONS
    message: str

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass(frozen=True)
class CheckReport(ProblemReport):
    """What ``sess.check()`` found: ``.ok``, ``.problems`` (sentences), ``.items`` (with sections)."""

    items: tuple[CheckProblem, ...]
    num_running: int
    num_live_slots: int
    num_blocks_used: int
    num_blocks: int
    num_layers: int
    num_collisions: int

    def section(self, name: str) -> tuple[str, ...]:
        """The problems of one section (see SECTIONS)."""
        if name not in SECTIONS:
            raise ValueError(f"section {name!r}: choose one of {', '.join(SECTIONS)}")
        return tuple(p.message for p in self.items if p.section == name)

    def _summary(self) -> str:
        return (f"{self.num_running} running requests, {self.num_blocks_used} of {self.num_blocks} blocks used, "
                f"{self.num_live_slots} live slots x {self.num_layers} layers checked")

    def __repr__(self) -> str:
        if self.ok:
            return f"CheckReport: ok ({self._summary()})"
        n = len(self.items)
        lines = [f"CheckReport: {n} problem{'s' * (n != 1)} ({self._summary()})"]
        for name in SECTIONS:
            msgs = self.section(name)
            if msgs:
                lines.append(f"  {name} ({len(msgs)}):")
                lines += [f"    - {m}" for m in msgs[:SHOWN]]
                if len(msgs) > SHOWN:
                    lines.append(f"    ... and {len(msgs) - SHOWN} more (see .problems)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:  # deterministic: inline styles, no ids, no scripts
        from .report_views import check_html
        return check_html(self)


def check_session(engine, requests: dict, history) -> CheckReport:
    """Sweep every invariant of a Session's engine, requests and step ``history`` (oldest first)."""
    manager, ledger, cache = engine.manager, engine.ledger, engine.kv_cache
    items: list[CheckProblem] = []

    def add(section, messages):
        items.extend(CheckProblem(section, m) for m in messages)

    add("blocks", _blocks(manager))
    add("requests", _requests(manager, requests))
    add("append_only", _append_only(history, manager, requests))
    problems, live = _slots(manager, ledger, requests)
    add("slots", problems)
    add("collisions", _collisions(ledger, engine.faults, manager.block_size))
    add("values", _values(engine, live, manager.block_size))
    running = sum(1 for r in requests.values() if r.status in RUNNING)
    return CheckReport(tuple(items), running, len(live), manager.num_used_blocks, manager.num_blocks,
                       cache.num_layers, ledger.num_collisions)


def _blocks(manager) -> list[str]:
    out = list(manager.check())
    free, used, total = manager.num_free_blocks, manager.num_used_blocks, manager.num_blocks
    if free + used != total:
        out.append(f"{free} free + {used} used blocks = {free + used}, but the cache has {total} blocks")
    return out


def _requests(manager, requests) -> list[str]:
    out = []
    bs = manager.block_size
    for req in requests.values():
        held = manager.has(req.id)
        if req.status not in RUNNING:
            if held:
                out.append(f"request {req.id} is {req.status} but still holds blocks "
                           f"{manager.block_table(req.id)}")
            continue
        if not held:
            out.append(f"request {req.id} is {req.status} but holds no block table")
            continue
        table, n = manager.block_table(req.id), req.num_computed_tokens
        if manager.num_computed_tokens(req.id) != n:
            out.append(f"request {req.id} has computed {n} tokens but its block bookkeeping says "
                       f"{manager.num_computed_tokens(req.id)}")
        if blocks_needed(n, bs) > len(table):
            out.append(f"request {req.id} has computed {n} tokens, which need {blocks_needed(n, bs)} blocks of "
                       f"{bs}, but its block table {table} has only {len(table)}")
        drafts = len(req.draft_token_ids)        # staged or being verified: their blocks may be held
        if len(table) > blocks_needed(req.num_tokens + drafts, bs):
            also = f" and {drafts} drafts" if drafts else ""
            out.append(f"request {req.id} has {req.num_tokens} tokens{also} (at most "
                       f"{blocks_needed(req.num_tokens + drafts, bs)} blocks) but its block table {table} "
                       f"has {len(table)}")
    for rid in manager.request_ids():
        if rid not in requests:
            out.append(f"blocks {manager.block_table(rid)} are held for request {rid}, which the session does "
                       f"not know")
    return out


def _append_only(history, manager, requests) -> list[str]:
    """Between two steps of one request, its table only grows, unless it restarted (preempted)."""
    out = []
    last: dict[int, tuple[int, list[int], int]] = {}     # request -> (step, table, end position)
    restarts: dict[int, int] = {}                        # request -> num_preemptions at its last step
    for step in history:
        qls = step.query_lens.tolist()
        pos = step.positions.tolist()
        ids = step.request_ids
        preempted = getattr(step, "row_preemptions", None) or [None] * step.num_active
        t = 0
        for row in range(step.num_active):
            start, end = pos[t], pos[t + qls[row] - 1] + 1     # every row computes at least one token
            t += qls[row]
            rid = ids[row]
            table = [b for b in step.block_tables[row].tolist() if b >= 0]
            prev = last.get(rid)
            restarted = preempted[row] is not None and restarts.get(rid, preempted[row]) != preempted[row]
            if prev is not None and not restarted and start >= prev[2] and table[:len(prev[1])] != prev[1]:
                out.append(f"request {rid}: its block table was {prev[1]} in step {prev[0]} but {table} in "
                           f"step {step.index} (tables are append-only while a request runs)")
            last[rid] = (step.index, table, end)
            restarts[rid] = preempted[row]
    for rid, (index, table, end) in last.items():
        req = requests.get(rid)
        if req is None or req.status not in RUNNING or req.num_computed_tokens < end:
            continue
        if restarts.get(rid) is not None and restarts[rid] != req.num_preemptions:
            continue                                     # preempted since its last step
        now = manager.block_table(rid)
        if now[:len(table)] != table:
            out.append(f"request {rid}: its block table was {table} in step {index} but is {now} now "
                       f"(tables are append-only while a request runs)")
    return out


def _slots(manager, ledger, requests) -> tuple[list[str], dict[int, tuple[int, int]]]:
    """Problems, and every live slot -> (request id, position) of one of its holders."""
    out: list[str] = []
    live: dict[int, tuple[int, int]] = {}
    bs = manager.block_size
    holders: dict[int, list[tuple[int, int]]] = {}      # block -> [(request, table index)]
    running = [r for r in requests.values() if r.status in RUNNING and manager.has(r.id)]
    rejected = ledger.rolled_back()                      # slot -> the step that rejected its last write
    for req in running:
        table = manager.block_table(req.id)
        n = min(req.num_computed_tokens, len(table) * bs)
        for j in range(blocks_needed(n, bs)):
            holders.setdefault(table[j], []).append((req.id, j))
    for block, held in holders.items():
        if len(held) < 2:
            continue
        (r0, j0), tokens0 = held[0], requests[held[0][0]].all_token_ids
        for rid, j in held[1:]:
            where = f"block {block} (slots {block * bs}..{block * bs + bs - 1})"
            if j != j0:
                out.append(f"{where} is held by request {r0} as positions {j0 * bs}..{j0 * bs + bs - 1} and by "
                           f"request {rid} as positions {j * bs}..{j * bs + bs - 1}: two live tokens share "
                           f"each of its slots")
                continue
            k = _first_difference(tokens0, requests[rid].all_token_ids, (j + 1) * bs)
            if k is not None:
                out.append(f"{where} is shared by requests {r0} and {rid} at positions {j * bs}..{j * bs + bs - 1}, "
                           f"but their tokens differ at position {k}: one of them reads the other's K/V")
    for req in running:
        table = manager.block_table(req.id)
        n = min(req.num_computed_tokens, len(table) * bs)
        never: list[int] = []
        others: dict[int, list[int]] = {}                 # another writer (a prefix sharer) -> positions
        for p in range(n):
            slot = table[p // bs] * bs + p % bs
            live.setdefault(slot, (req.id, p))
            last = ledger.last_raw(slot)                  # (request id, position, step)
            if last is None:
                never.append(p)
            elif last[1] != p:
                out.append(f"request {req.id} position {p} lives in slot {slot} (block {slot // bs}, offset "
                           f"{slot % bs}), but the slot was last written by request {last[0]} at position "
                           f"{last[1]} in step {last[2]}: request {req.id} now reads another token's K/V")
            elif last[0] != req.id:
                others.setdefault(last[0], []).append(p)
            elif slot in rejected:
                out.append(f"request {req.id} position {p} lives in slot {slot} (block {slot // bs}, offset "
                           f"{slot % bs}), whose last write is its draft that step {rejected[slot]} rejected: "
                           f"the rollback left a rejected draft in the request's context")
        for wid, positions in others.items():            # same position: the tokens before it must agree
            writer = requests.get(wid)
            k = None if writer is None else _first_difference(writer.all_token_ids, req.all_token_ids,
                                                              positions[-1] + 1)
            bad = [p for p in positions if k is not None and p >= k]
            if bad:
                out.append(f"request {req.id} position{'s' * (len(bad) > 1)} {runs(bad)} read slots last "
                           f"written by request {wid} at the same positions, but their tokens differ at "
                           f"position {k}: request {req.id} reads K/V computed for other tokens")
        if never:
            one = len(never) == 1
            out.append(f"request {req.id} position{'' if one else 's'} {runs(never)} {'is' if one else 'are'} "
                       f"computed, but the ledger has no write to {'its slot' if one else 'their slots'}")
    return out, live


def _first_difference(a, b, n) -> int | None:
    """The first k < n where token lists ``a`` and ``b`` differ (or one ends), else None."""
    if len(a) >= n and len(b) >= n and a[:n] == b[:n]:
        return None
    for k in range(n):
        if k >= len(a) or k >= len(b) or a[k] != b[k]:
            return k
    return None


def _collisions(ledger, faults, bs) -> list[str]:
    out = []
    for c in ledger.collisions:
        rows = f"rows {runs(c.rows)}" if c.rows is not None else f"{len(c.positions)} tokens"
        if getattr(c, "kinds", None) is not None and len(set(c.kinds)) > 1:
            rows += f" ({', '.join(c.kinds)}: a mixed step)"
        reqs = sorted(set(c.request_ids))
        who = ", ".join(f"request {r} @ {p}" for r, p in dict.fromkeys(zip(c.request_ids, c.positions)))
        text = (f"step {c.step}: {rows} (request{'s' * (len(reqs) > 1)} {', '.join(map(str, reqs))}) wrote slot "
                f"{c.slot} (block {c.slot // bs}, offset {c.slot % bs}) {len(c.positions)} times in one step: {who}")
        fault = faults.find(c.step, c.slot) if faults is not None else None
        if fault is not None:
            text += f"; then an EMULATED fault ({fault.model}) overwrote the slot"
        out.append(text)
    dropped = ledger.num_collisions - len(ledger.collisions)
    if dropped > 0:
        out.append(f"... and {dropped} earlier collisions the ledger no longer keeps")
    return out


def _values(engine, live: dict[int, tuple[int, int]], bs: int) -> list[str]:
    if not live:
        return []
    slots = sorted(live)
    layers = engine.kv_cache.num_layers
    k, v = engine.kv_rows(range(layers), slots)                                    # [layers, n, kv_heads, hd]
    bad = (~torch.isfinite(torch.cat([k, v])).flatten(2).all(dim=2)).cpu()         # [2 * layers, n] (the one copy)
    out = []
    for i in bad.any(dim=0).nonzero().flatten().tolist():
        slot = slots[i]
        rid, p = live[slot]
        k_layers = [l for l in range(layers) if bad[l, i]]
        v_layers = [l for l in range(layers) if bad[layers + l, i]]
        parts = [f"K in layer{'s' * (len(k_layers) > 1)} {runs(k_layers)}"] if k_layers else []
        parts += [f"V in layer{'s' * (len(v_layers) > 1)} {runs(v_layers)}"] if v_layers else []
        out.append(f"slot {slot} (block {slot // bs}, offset {slot % bs}; request {rid} position {p}) holds "
                   f"non-finite values: {' and '.join(parts)}")
    return out
