"""A pool's draft reads the live pool through overlays of its own changes (cache/overlay.py): every
sequence of operations on a draft, adopted, leaves exactly the state the same operations leave on
the pool itself, and the live pool does not change before the adoption."""
from __future__ import annotations

import copy
import random

import pytest

from qwen_npu.cache.block_pool import BlockPool


def state(pool: BlockPool):
    return (tuple(pool.free_queue()), tuple(pool.blocks()), pool.num_cached, pool.num_free, pool.num_used,
            tuple(sorted(pool._by_hash.items())))


def random_ops(pool: BlockPool, rng: random.Random, held: dict, n: int) -> None:
    """``n`` random allocations, releases, acquisitions of cached blocks and publications; ``held``
    (block -> times held by the script) is kept in step with the pool."""
    size = pool.block_size
    for _ in range(n):
        op = rng.random()
        if op < 0.35 and pool.num_free:
            for b in pool.allocate(rng.randint(1, min(3, pool.num_free))):
                held[b] = held.get(b, 0) + 1
        elif op < 0.6 and held:
            b = rng.choice(sorted(held))
            pool.release([b])
            held[b] -= 1
            if not held[b]:
                del held[b]
        elif op < 0.8 and held:
            b = rng.choice(sorted(held))
            if pool.block_hash(b) is None:
                pool.publish(b, rng.choice([None, 1, 2]), [rng.randint(0, 3) for _ in range(size)])
        else:
            cached = [b.block_id for b in pool.blocks() if b.is_cached and b.ref_count == 0]
            if cached:
                b = rng.choice(cached)
                pool.acquire(b)
                held[b] = held.get(b, 0) + 1


@pytest.mark.parametrize("seed", range(40))
def test_a_draft_adopted_leaves_what_the_same_operations_leave_on_the_pool(seed):
    rng = random.Random(seed)
    direct, live = BlockPool(12, 2), BlockPool(12, 2)
    held_direct, held_live = {}, {}
    for _ in range(6):                                  # several steps, each its own draft
        ops_seed = rng.randrange(1 << 30)
        before, held_before = state(live), dict(held_live)
        random_ops(direct, random.Random(ops_seed), held_direct, 25)
        draft = live.clone()
        random_ops(draft, random.Random(ops_seed), held_live, 25)
        assert state(live) == before                    # nothing live changed
        assert state(draft) == state(direct) and not draft.check()
        if rng.random() < 0.25:                         # a failed step: the draft is dropped
            direct, held_direct, held_live = copy.deepcopy(live), dict(held_before), dict(held_before)
            continue
        live.adopt(draft)
        assert state(live) == state(direct) and not live.check()


def test_adopting_a_stale_draft_is_refused_and_changes_nothing():
    live = BlockPool(4, 2)
    first, second = live.clone(), live.clone()
    first.allocate(1)
    second.allocate(2)
    live.adopt(first)
    before = state(live)
    with pytest.raises(ValueError, match="not a clone of this pool's current state"):
        live.adopt(second)
    assert state(live) == before


def test_a_draft_cloned_before_a_reset_is_refused():
    live = BlockPool(4, 2)
    draft = live.clone()
    draft.allocate(1)
    live.reset()
    with pytest.raises(ValueError, match="not a clone of this pool's current state"):
        live.adopt(draft)
    assert live.free_queue() == [0, 1, 2, 3] and type(live._free).__name__ == "OrderedDict"


def test_a_reset_draft_hands_over_its_own_state():
    live = BlockPool(4, 2)
    live.allocate(3)
    draft = live.clone()
    draft.reset()
    draft.allocate(1)
    live.adopt(draft)
    assert live.free_queue() == [1, 2, 3] and live.num_used == 1 and not live.check()


@pytest.mark.parametrize("seed", range(30))
def test_the_overlays_read_as_the_changed_containers_would(seed):
    """MapOverlay and QueueOverlay against a copy of the container changed directly: every read the
    pool makes (get, in, len, iteration, items) agrees after every operation, and merging writes
    the same into the live container."""
    from collections import OrderedDict

    from qwen_npu.cache.overlay import MapOverlay, QueueOverlay
    rng = random.Random(seed)
    live_map = {k: rng.randrange(100) for k in rng.sample(range(40), 20)}
    live_queue = OrderedDict.fromkeys(rng.sample(range(40), 20))
    want_map, want_queue = dict(live_map), OrderedDict(live_queue)
    got_map, got_queue = MapOverlay(live_map), QueueOverlay(live_queue)
    for _ in range(60):
        k = rng.randrange(40)
        op = rng.randrange(6)
        if op == 0:
            v = rng.randrange(100)
            want_map[k] = v
            got_map[k] = v
        elif op == 1 and k in want_map:
            del want_map[k]
            del got_map[k]
        elif op == 2 and want_queue:
            assert got_queue.popitem(last=False) == want_queue.popitem(last=False)
        elif op == 3 and k in want_queue:
            del want_queue[k]
            del got_queue[k]
        elif op == 4 and k not in want_queue:
            want_queue[k] = None
            got_queue[k] = None
            if rng.random() < 0.5:
                want_queue.move_to_end(k, last=False)
                got_queue.move_to_end(k, last=False)
        probe = rng.randrange(40)
        assert (got_map.get(probe, "none"), probe in got_map) == (want_map.get(probe, "none"), probe in want_map)
        assert sorted(got_map.items()) == sorted(want_map.items()) and len(got_map) == len(want_map)
        assert list(got_queue) == list(want_queue) and len(got_queue) == len(want_queue)
        assert (probe in got_queue) == (probe in want_queue)
    assert got_map.merged_into(live_map) is live_map and live_map == want_map
    assert got_queue.merged_into(live_queue) is live_queue and list(live_queue) == list(want_queue)
