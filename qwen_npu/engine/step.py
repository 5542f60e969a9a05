"""One step, top to bottom: schedule, plan, check, dispatch, book, sample, commit.

    run_step(sess, schedule)                          every kind of step (prefill, decode, mixed)
      1 schedule   admissions, allocations, preemptions on a StepDraft (live state untouched)
      2 plan       rows -> positions, slots, block tables: the StepPlan, the step's one record
      3 check      slot checks on the plan (refused or warned before anything is written)
      4 dispatch   KVGuard copies the committed blocks the plan overwrites; the forward writes K/V
                   and the spare pair of output buffers (the only place Ctrl-C lands at once, but
                   with tensor parallelism, where every rank must finish its collectives)
      5 book       computed tokens and prefix hashes on the draft; the ledger's writes prepared
      6 sample     on the device, on copies of the generators; tokens staged on the drafts
      7 commit     ``commit(engine, Commit(...))``: plain assignments, the one place state changes
      8 after      user callbacks (streamed captures) and warnings, with the state whole

Any way out before 7 restores the guarded K/V and drops the draft, so the Session is exactly as
it was. The whole call runs with Ctrl-C held back (``interrupts.py``). ``sample_step`` is 6-8
for a step sampled by hand. Forks, aborts, resets, closes and added requests also end in
``commit``, with the parts of a ``Commit`` they change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from ..cache.ledger import LedgerWrites
from ..cache.slot_check import check_step_writes, raise_or_warn
from ..errors import InvalidRequestError, warn
from . import sampler, verify
from .interrupts import held_interrupts
from .plan import StepPlan, StepResult, buffer_set, build_plan
from .runner import DeviceLogits
from .transaction import DONE, StepDraft, fault_point

HEALTH = {1: "non-finite logits", 2: "all-zero logits", 3: "all-equal logits"}


class StreamHealthWarning(UserWarning):
    """A row's logits are all zero, all equal or non-finite: its stream is broken."""


class NoGrad:
    """``torch.no_grad()`` for the step's forward without its Python layers, which cost more
    than the rest of entering the forward. Entered and left with Ctrl-C held back."""
    __slots__ = ("was",)

    def __enter__(self) -> None:
        self.was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc) -> None:
        torch._C._set_grad_enabled(self.was)


@dataclasses.dataclass
class Sampled:
    """What sampling a step staged: token ids (host and device), unhealthy rows, bytes moved, seconds."""
    tokens: list                          # one int per row
    ids: torch.Tensor                     # [rows] on the device
    health: list
    h2d: int
    d2h: int
    seconds: float
    accepted: dict | None = None          # a verify step's: request id -> drafts kept (verify.py)
    rolled_back: tuple = ()               # a verify step's: the slots of its rejected drafts


@dataclasses.dataclass
class Commit:
    """Every change one call makes, applied by ``commit`` (plain assignments, in this order)."""
    draft: StepDraft | None = None        # request fields, the cache manager, generator copies
    ledger: LedgerWrites | None = None    # who wrote which slot
    outputs: str | None = None            # the output buffer set whose spare pair becomes current
    step: StepResult | None = None        # the step, appended to ``session.history``
    sampled: Sampled | None = None        # its tokens
    session: object = None                # the Session whose own fields change
    requests: dict | None = None          # new requests by id (added, forked)
    generators: dict | None = None        # their generators
    seed_rng: object = None               # the session's seed stream after drawing from it
    next_request_id: int | None = None
    hooks_step: int | None = None         # captures publish what they staged for this step
    faults: list = dataclasses.field(default_factory=list)   # emulated faults to warn about after
    then: tuple = ()                      # further plain assignments of a fork, reset or close


def commit(engine, c: Commit, *, undo: bool = False) -> None:
    """Apply ``c``. Plain assignments only (nothing here can fail), under the call's hold on Ctrl-C;
    a Ctrl-C held back until now lands first, before anything changes — except for an ``undo``
    (taking back what a failing call added), which must run whatever arrives."""
    if not undo:
        held_interrupts().checkpoint()
    if c.draft is not None:
        c.draft.apply(c.session._generators if c.session is not None else {})
    if c.ledger is not None:
        engine.ledger.apply(c.ledger)
    if c.outputs is not None:
        engine.buffers.publish(c.outputs)
    if c.sampled is not None:
        s, step = c.sampled, c.step
        step.sampled_tokens, step.health = s.tokens, s.health
        step.transfers["h2d"] += s.h2d
        step.transfers["d2h"] += s.d2h
        step.timings["sample"] = s.seconds
        if s.accepted is not None:
            step.accepted = s.accepted
        if s.rolled_back:
            engine.ledger.roll_back(s.rolled_back, step.index)
        engine.buffers.publish("sample")
    sess = c.session
    if c.requests:
        sess._requests.update(c.requests)
    if c.generators:
        sess._generators.update(c.generators)
    if c.seed_rng is not None:
        sess._seed_rng = c.seed_rng
    if c.next_request_id is not None:
        engine.next_request_id = c.next_request_id
    if c.hooks_step is not None and engine.hook is not None:
        engine.hook.commit_step(c.hooks_step)
    if c.step is not None and c.outputs is not None:
        sess.history.append(c.step)
        sess._step_index = c.step.index + 1
        if engine.faults is not None and c.ledger is not None and c.ledger.collisions:
            c.faults = engine.faults.apply(c.step.index, c.ledger.collisions, engine.kv_cache, warn=False)
    for assign in c.then:
        assign()


def run_step(sess, schedule, action: str, *, sample: bool, force: dict | None = None) -> StepResult:
    """Run one step as a transaction. ``schedule(draft) -> (kind, [(request, tokens)])`` picks
    its rows; ``sample``: also sample it (``step``, ``generate``); ``force``: request id ->
    token for teacher forcing. The caller holds the call gate (``transaction.exclusive``)."""
    engine, cfg = sess._engine, sess._engine.config
    t0 = time.perf_counter()
    hooks = engine.hook
    draft = StepDraft(engine.manager, sess._requests, hooks)
    kind, rows = schedule(draft)                                                     # 1 schedule
    fault_point("planned")
    if not rows:
        raise InvalidRequestError(sess._nothing_to_run(action))
    pad = cfg.max_batch if kind == "decode" and cfg.decode_padding == "replicate" else None
    tables = {r.id: draft.manager.block_table(r.id) for r, _ in rows}
    plan = build_plan(kind, sess._step_index, rows, tables, cfg.block_size, pad_to=pad)   # 2 plan
    timings, transfers = {"schedule": time.perf_counter() - t0}, {"h2d": 0, "d2h": 0}
    problems = check(engine, plan, sess._visible_requests(), draft, timings)         # 3 check
    fault_point("validated")
    step_hook = hooks.begin_step(plan) if hooks is not None else None
    guard = engine.runner.guard(engine.manager.committed_blocks(written_blocks(plan, cfg.block_size)),
                                engine.buffers.staging(buffer_set(plan.kind)), plan)
    engine.calls.stepping = plan.index
    try:
        region = held_interrupts().interruptible() if engine.runner.interruptible else contextlib.nullcontext()
        with NoGrad(), region:                                          # entered in this order, left whole
            logits_buf, hidden_buf, greedy = engine.runner.dispatch(                   # 4 dispatch
                plan, timings, transfers, hook=step_hook, guard=guard, greedy=sample and not plan.num_drafts)
        fault_point("dispatched")
        t1 = time.perf_counter()
        writes = book(engine, plan, draft, step_hook)                                # 5 book
        step = result(engine, plan, draft, logits_buf, hidden_buf, problems, timings, transfers)
        timings["bookkeeping"] = time.perf_counter() - t1
        sampled = None
        if sample and step.logits is not None:
            sampled = sample_rows(step, draft, sess._generators, force, engine.model.kernels,   # 6 sample
                                  engine.buffers, greedy)
        fault_point("commit")
        c = Commit(draft=draft, ledger=writes, outputs=buffer_set(plan.kind), step=step, sampled=sampled,
                   session=sess, hooks_step=plan.index)
        commit(engine, c)                                                            # 7 commit
    except BaseException:
        guard.restore()                  # any way out before the commit's first assignment
        raise
    finally:
        engine.calls.stepping = None
    after(engine, c)                                                                 # 8 after
    return step


def sample_step(sess, step: StepResult, force: dict | None = None) -> torch.Tensor:
    """Sample the last step (6-8 of ``run_step``); returns the token ids on the device."""
    engine = sess._engine
    draft = StepDraft(engine.manager, sess._requests)
    sampled = sample_rows(step, draft, sess._generators, force, engine.model.kernels, engine.buffers)
    c = Commit(draft=draft, step=step, sampled=sampled, session=sess)
    commit(engine, c)
    after(engine, c)
    return sampled.ids


def check(engine, plan: StepPlan, requests: dict, draft: StepDraft | None, timings: dict | None = None):
    """The slot checks of ``plan`` against the draft's block tables and the ledger; raises or
    warns as ``slot_check`` says and returns the problems."""
    mode = engine.config.slot_check
    if mode == "off":
        return []
    t0 = time.perf_counter()
    bs = engine.config.block_size
    manager = draft.manager if draft is not None else engine.manager

    def is_live(request_id: int, position: int, slot: int) -> bool:
        """Does (request, position) still hold ``slot`` with a computed token?"""
        req = requests.get(request_id)
        if req is not None and draft is not None:
            req = draft.drafts.get(request_id, req)
        if req is None or req.is_done or position >= req.num_computed_tokens:
            return False
        table = manager.block_table(request_id)
        return position // bs < len(table) and table[position // bs] * bs + position % bs == slot

    problems = check_step_writes(plan, block_size=bs, num_blocks=engine.config.num_blocks,
                                 ref_count=manager.pool.ref_count, ledger=engine.ledger, is_live=is_live)
    if timings is not None:
        timings["check"] = time.perf_counter() - t0
    raise_or_warn(problems, mode)
    return problems


def book(engine, plan: StepPlan, draft: StepDraft, step_hook) -> LedgerWrites:
    """What the forward computed, on the draft: tokens computed, full blocks hashed (unless an
    edit made the K/V private); the ledger's writes prepared."""
    manager = draft.manager
    if step_hook is not None:
        for rid, why in step_hook.private_requests().items():    # K/V computed under a research edit
            manager.keep_private(rid, why)
    for row in plan.rows[:plan.num_active]:       # drafts are not computed tokens until accepted
        req, computed = row.request, row.end - len(row.drafts)
        req.num_computed_tokens = computed
        manager.commit(req.id, req.token_ids, computed)
    writes = engine.ledger.prepare(plan.index, plan.slot_mapping, plan.token_request_ids, plan.positions,
                                   plan.token_rows, plan.token_kinds)
    fault_point("booked")
    return writes


def result(engine, plan, draft, logits_buf, hidden_buf, problems, timings, transfers) -> StepResult:
    """The StepResult of a dispatched plan (its logits a view of the spare output pair)."""
    n = len(plan.logits_rows)
    gen = logits_buf.generation + 1                        # what the commit makes it
    logits = DeviceLogits(logits_buf, n, transfers, plan.index, generation=gen) if n else None
    host_logits = None
    if logits is not None and not engine.config.device_outputs:
        host_logits = logits.view_unchecked().to("cpu", copy=True)
        transfers["d2h"] += host_logits.nbytes
        fault_point("d2h")
    m = draft.manager
    return StepResult(plan=plan, logits=logits, host_logits_copy=host_logits, max_blocks=engine.max_blocks,
                      hidden_rows=(hidden_buf, n) if n else None, timings=timings, transfers=transfers,
                      slot_problems=problems, block_size=engine.config.block_size,
                      cache_usage={"used": m.num_used_blocks, "cached": m.num_cached_blocks,
                                   "free": m.num_free_blocks - m.num_cached_blocks},
                      row_preemptions=[r.request.num_preemptions for r in plan.rows[:plan.num_active]])


def sample_rows(step: StepResult, draft: StepDraft, generators: dict, force: dict | None, kernels,
                buffers, greedy: tuple[torch.Tensor, torch.Tensor] | None = None) -> Sampled:
    """Sample every logits row of ``step`` on the device and stage the tokens on ``draft``.
    ``greedy``: the rows' argmax and packed words, [rows] each (``pack_greedy``), when the
    forward made them (``dispatch(greedy=True)``); otherwise they are read from the logits here.

    The one host sync: a single int64 per row, the token id with the row's health code in its
    upper 32 bits (``2 + k`` int64 when a row records log-probabilities, see ``logprobs.py``).
    Random generators advance on copies that the commit puts in place. The per-row parameters
    go through ``buffers``' "sample" staging (its spare set on an accelerator; the commit
    publishes it). A step that verifies drafts is sampled by ``verify.sample_verified``
    (acceptance and rollback on the draft)."""
    if step.plan.num_drafts:
        s = verify.sample_verified(step, draft, generators, buffers)
        s["health"] = [(rid, HEALTH[c]) for rid, c in s["health"]]
        return Sampled(**s)
    t0 = time.perf_counter()
    reqs = [draft.of(draft.requests[i]) for i in step.logits_request_ids]
    logits = step.logits.view_unchecked()                                           # [rows, vocab]
    pinned = buffers.staging("sample")
    with buffers.writing("sample"):
        allowed, h2d_mask = sampler.mask_early_stops(logits, reqs, pinned)
        greedy_ids = codes = words = None
        if greedy is not None:                               # made by the forward, as it wrote the logits
            greedy_ids, words = greedy
            if words.shape[0] != logits.shape[0]:            # the rows exposed (not replicate padding)
                greedy_ids, words = greedy_ids[:logits.shape[0]], words[:logits.shape[0]]
            if allowed is not logits:
                greedy_ids = None
        elif allowed is logits and getattr(kernels, "greedy_health", None) is not None:
            greedy_ids, codes = kernels.greedy_health(logits) or (None, None)   # a set's argmax and health, one read
        gens = [draft.generator(r.id, generators) for r in reqs]
        ids, h2d = sampler.sample(allowed, [r.sampling for r in reqs], gens, greedy_ids, pinned)
        fault_point("sampled")
        h2d += h2d_mask
        if force:
            forced = torch.tensor([force.get(r.id, -1) for r in reqs], dtype=torch.int64)
            h2d += forced.nbytes
            forced = sampler.to_device(forced, ids.device, pinned, "sample.forced")
            ids = torch.where(forced >= 0, forced, ids)
    if words is not None and ids is not greedy_ids:          # forced or sampled rows: the codes only
        words, codes = None, words >> 32
    packed, unpack = sampler.pack(ids, logits, [r.sampling.logprobs for r in reqs], codes, words)
    host = packed.cpu()                                      # on the CPU: read at once, not kept
    fault_point("d2h")
    tokens, codes, lps = unpack(host)
    for req, tok, lp in zip(reqs, tokens, lps):
        if not req.is_done:                      # aborted between the forward and this sample
            draft.stage_token(req, tok, lp)
    fault_point("staged")
    health = [(reqs[i].id, HEALTH[c]) for i, c in enumerate(codes) if c]
    return Sampled(tokens, ids, health, h2d, host.nbytes, time.perf_counter() - t0)


def after(engine, c: Commit) -> None:
    """Once the state is whole: user callbacks (Ctrl-C lands at once there), then warnings."""
    try:
        if c.hooks_step is not None and engine.hook is not None:
            with held_interrupts().interruptible():
                engine.hook.after_commit()
    finally:
        warn_about(c)


def warn_about(c: Commit) -> None:
    """The step's warnings: emulated faults, broken streams (pointing at the caller's line)."""
    if c.faults:
        from .faults import warn_faults
        warn_faults(c.faults)
    if c.sampled is not None and c.sampled.health:
        warn(f"step {c.step.index}: " + "; ".join(f"request {rid}: {why}" for rid, why in c.sampled.health),
             StreamHealthWarning)


def written_blocks(plan: StepPlan, block_size: int) -> dict[int, int]:
    """block -> the request whose row writes it in ``plan`` (active rows)."""
    out: dict[int, int] = {}
    ids, active = plan.request_ids, plan.num_active
    for slot, row in zip(plan.slot_mapping, plan.token_rows):
        if row >= active:
            break
        if slot >= 0:
            out.setdefault(slot // block_size, ids[row])
    return out


def check_not_pending(last: StepResult | None, action: str, requests: dict | None = None) -> None:
    """Refuse ``action`` while the last step has unsampled logits rows of unfinished requests
    (a step whose rows all belong to requests aborted since needs no sample)."""
    if last is not None and not last.sampled:
        if requests is not None and all(
                rid not in requests or requests[rid].status in DONE for rid in last.logits_request_ids):
            return
        raise InvalidRequestError(
            f"cannot {action}: step {last.index} ({last.kind}) has unsampled rows for requests "
            f"{last.logits_request_ids}; call sess.sample() first")
