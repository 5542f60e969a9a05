"""``child = sess.fork()``: a second Session that branches from this one's state.

Design: parent and child share ONE engine — model, KV cache tensors, block pool and manager (ref
counts), slot ledger, dispatch buffers — and each has its own requests, scheduler, step history
and random generators. Forking copies every unfinished request of the parent into a new request
of the child (new id; same tokens, status and computed count) and forks its block table::

    block_size 4, parent request 0 computed 10 tokens, table [5, 2, 7]
    positions   0 1 2 3 | 4 5 6 7 | 8 9 . .
    parent 0    5       | 2       | 7            blocks 5, 2: ref count 2 (shared, full, never written again)
    child  3    5       | 2       | 9 <- copy of 7 (the partial block: copied now, so each branch
                                                   writes its own next slots)

Shared blocks are full and lie before every position either branch still computes, so writes
never leak from one branch into the other; the ledger records the copied slots under the child
request. Blocks return to the pool as each branch's requests finish (ref counts).

Request ids are unique across the branches (the engine hands them out). While branches exist:
slot checks and ``check()`` see the requests of every branch; ``reset()`` of one branch aborts
only its own requests; steps of the branches may interleave, but a step's logits are only valid
until the next step of any branch reuses the output buffer (clone them to keep them); a step of
the parent is not one of the child's (each history and step counter is its own, the child's
starting where the parent's was).

A branch owns its requests: ``branch.close()`` aborts them and frees their blocks (only theirs),
and so does dropping the last reference to a branch (its finalizer queues the requests on the
engine; the next call on any branch aborts them — a finalizer may run in the middle of a step,
so it never changes state itself). ``close()`` of the session that created the cache closes
every branch. A branch is never given a sibling's blocks by preemption: when its waiting
requests need blocks that other branches hold, its step is refused naming those requests.
"""
from __future__ import annotations

import weakref

from ..engine import sampler
from ..engine.request import ABORTED, SamplingParams
from ..engine.step import Commit, check_not_pending, commit
from ..engine.transaction import KVGuard, StepDraft, fault_point
from ..errors import InvalidRequestError, OutOfBlocksError


class Branches:
    """The Sessions that share one engine (weak references: a dropped branch simply goes away)."""

    def __init__(self, *sessions):
        self._refs = [weakref.ref(s) for s in sessions]

    def add(self, sess) -> None:
        self._refs.append(weakref.ref(sess))

    def remove(self, sess) -> None:
        self._refs = [r for r in self._refs if r() is not None and r() is not sess]

    def sessions(self) -> list:
        alive = [s for s in (r() for r in self._refs) if s is not None]
        self._refs = [weakref.ref(s) for s in alive]
        return alive

    def requests(self) -> dict:
        """Every branch's requests by id (ids are unique across branches)."""
        out = {}
        for s in self.sessions():
            out.update(s.state.requests)
        return out


def visible_requests(sess) -> dict:
    """The requests a whole-cache check must know: every branch's, or just this session's."""
    return sess.state.visible_requests()


def _sampling_for(sess, req, sampling):
    if sampling is None:
        return req.sampling
    sp = SamplingParams(**sampling) if isinstance(sampling, dict) else sampling
    if not isinstance(sp, SamplingParams):
        raise InvalidRequestError(f"fork: sampling must be a SamplingParams, a dict or None, not "
                                  f"{type(sampling).__name__}")
    sp.validate_for(sess.model_config.vocab_size, has_tokenizer=sess.tokenizer is not None)
    done = len(req.output_token_ids)
    if sp.max_new_tokens <= done:
        raise InvalidRequestError(f"fork: request {req.id} already has {done} output tokens, so "
                                  f"max_new_tokens={sp.max_new_tokens} leaves nothing to generate")
    total = len(req.prompt_token_ids) + sp.max_new_tokens
    if total > sess.config.max_model_len:
        raise InvalidRequestError(f"fork: request {req.id}: prompt ({len(req.prompt_token_ids)}) + "
                                  f"max_new_tokens ({sp.max_new_tokens}) exceeds max_model_len="
                                  f"{sess.config.max_model_len}")
    return sp


def fork_session(sess, sampling=None):
    """Branch ``sess`` (see the module docstring). ``sampling`` (SamplingParams or dict) replaces
    every forked request's sampling from its next token on (``max_new_tokens`` still counts all of
    the request's output); None keeps each request's own, and its random stream continues exactly
    where the parent's is, so an unchanged child samples what the parent samples.
    Refused with tensor parallelism (the fork's block copy would run on rank 0 only).

    A transaction like a step: the block copies are planned on a draft of the cache manager, and
    nothing the parent or the engine holds changes unless the whole fork succeeds."""
    from ..parallel.group import refuse_with_ranks
    refuse_with_ranks(sess._engine, "fork", "open a second Session to compare branches")
    st = sess.state
    check_not_pending(sess.last_step, "fork", st.requests)
    engine = st.engine
    bs = sess.config.block_size
    live = [r for r in sess.requests if not r.is_done]
    plans = [(r, _sampling_for(sess, r, sampling)) for r in live]
    draft = StepDraft(engine.manager, {})
    manager = draft.manager
    copies_needed = sum(1 for r in live if manager.has(r.id) and manager.num_computed_tokens(r.id) % bs)
    if copies_needed > manager.num_free_blocks:
        raise OutOfBlocksError(f"fork needs {copies_needed} free blocks to copy the partly filled last block "
                               f"of each request, but only {manager.num_free_blocks} are free")
    child = type(sess)(sess.model, sess.config, path=sess.path, tokenizer=sess.tokenizer, engine=engine)
    child._step_index = sess.state.step_index
    first = engine.next_request_id
    last_step = max(sess.state.step_index - 1, 0)
    made, gens, copies, writes = {}, {}, [], ([], [], [])
    for k, (r, sp) in enumerate(plans):
        cid = first + k
        c = made[cid] = child._new_request(cid, list(r.prompt_token_ids), r.prompt_text, sp)
        _copy_state(r, c)
        g = st.generators.get(r.id)
        if sampling is None and g is not None:
            gens[cid] = sampler.copy_generator(g)
        elif not sp.greedy:
            seed = sp.seed if sp.seed is not None else child._seed_rng.getrandbits(63)
            gens[cid] = sampler.new_generator(sess.model.device, seed)
        if manager.has(r.id):
            for src, dst in manager.fork(r.id, cid):
                copies.append((src, dst, cid))
                start = (c.num_computed_tokens // bs) * bs
                for p in range(start, c.num_computed_tokens):
                    writes[0].append(dst * bs + p - start)
                    writes[1].append(cid)
                    writes[2].append(p)
    fault_point("planned")
    guard = KVGuard(engine.kv_cache, engine.manager.committed_blocks({dst: cid for _, dst, cid in copies}))
    try:
        for src, dst, _ in copies:
            engine.kv_cache.copy_block(src, dst)
        ledger = engine.ledger.prepare(last_step, *writes)
        fault_point("commit")
    except BaseException:
        guard.restore()
        raise
    def join() -> None:
        if engine.branches is None:
            engine.branches = Branches(sess)
        engine.branches.add(child)
        child._finalizer = weakref.finalize(child, engine.dropped.append, child._requests)

    commit(engine, Commit(draft=draft, ledger=ledger, session=child, requests=made, generators=gens,
                          next_request_id=first + len(plans), then=(join,)))
    return child


def sibling_holders(sess) -> str:
    """For a refusal: which requests of other branches hold the blocks this session waits for."""
    mine = sess.state.requests
    held = [(rid, len(r.block_table)) for rid, r in sess.state.visible_requests().items()
            if rid not in mine and not r.is_done and r.block_table]
    if not held:
        return ""
    who = ", ".join(f"request {rid} ({n} blocks)" for rid, n in held)
    return (f"; its requests need blocks that other branches of this fork hold: {who}. "
            f"Finish, abort or close those branches (branch.close()) first")


def branch_closing(sess):
    """What ``close()`` of a branch that does not own the cache changes: a draft aborting its
    unfinished requests (their blocks freed) and the assignments that take it out of the
    branches. Changes nothing itself; ``close_session`` commits both."""
    engine = sess.state.engine
    draft = StepDraft(engine.manager, sess.state.requests)
    for r in sess.requests:
        if not r.is_done:
            draft.finish(draft.of(r), "abort", ABORTED)

    def leave() -> None:
        fin = getattr(sess, "_finalizer", None)
        if fin is not None:
            fin.detach()
        if engine.branches is not None:
            engine.branches.remove(sess)
    return draft, leave


def _copy_state(src, dst) -> None:
    dst.output_token_ids = list(src.output_token_ids)
    dst.status = src.status
    dst.num_computed_tokens = src.num_computed_tokens
    dst.num_cached_tokens = src.num_cached_tokens
    if src.logprobs is not None and dst.logprobs is not None:
        dst.logprobs = list(src.logprobs)
    if dst.stop_strings is not None:
        for t in dst.output_token_ids:
            dst.stop_strings.push(t, search=False)


def reset_branch(sess) -> bool:
    """``reset()`` of a Session that shares its engine: abort its own requests and forget its
    steps, leaving the cache to the other branches. Returns False when no other branch is left
    (then the caller resets the engine as usual)."""
    engine = sess.state.engine
    if not any(s is not sess for s in engine.branches.sessions()):
        engine.branches = None
        return False
    draft, _ = branch_closing(sess)
    index = sess.state.step_index

    def forget() -> None:
        sess._init_state()
        sess._step_index = index
    commit(engine, Commit(draft=draft, session=sess, then=(forget,)))
    return True
