"""A manager clone (a step's draft) is independent until adopted, and adopting takes all of it."""
from __future__ import annotations

from qwen_npu.cache.manager import KVCacheManager


def state(m: KVCacheManager):
    pool = m.pool
    return (tuple((rid, tuple(m.block_table(rid)), m.num_computed_tokens(rid)) for rid in sorted(m.request_ids())),
            tuple(pool.free_queue()), tuple(pool.blocks()), m.stats, pool.num_cached)


def busy(m: KVCacheManager) -> None:
    """Admissions with prefix hits, growth, publication, frees (cached blocks), evictions."""
    for rid, tokens in ((10, [1, 2, 3, 4, 5, 6, 7, 8, 9]), (11, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0])):
        m.match_prefix(rid, tokens)
        assert m.allocate(rid, len(tokens))
        m.commit(rid, tokens, len(tokens))
    m.free(10)
    m.match_prefix(12, [1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert m.allocate(12, 9)


def test_changes_on_a_clone_never_reach_the_manager_until_adopted():
    live = KVCacheManager(num_blocks=6, block_size=4)
    live.match_prefix(1, [1, 2, 3, 4, 5])
    assert live.allocate(1, 5)
    live.commit(1, [1, 2, 3, 4, 5], 5)
    before = state(live)
    draft = live.clone()
    busy(draft)
    assert state(live) == before and not live.check()
    assert not draft.check()
    after = state(draft)
    live.adopt(draft)
    assert state(live) == after and not live.check()
    busy_again = live.clone()
    busy_again.free(11)
    assert state(live) == after                        # the adopted state is the live one's own now
    live.free(12)
    assert not live.check()


def test_a_clone_copies_nothing_and_adopting_writes_only_its_changes():
    live = KVCacheManager(num_blocks=4, block_size=2)
    queue, table = live.pool._free, live.pool._by_hash
    draft = live.clone()
    assert draft.cached_prefix_tokens([1, 2, 3]) == 0 and draft.num_free_blocks == 4
    assert draft.allocate(5, 3)
    assert draft.num_free_blocks == 2 and live.num_free_blocks == 4 and live.pool.free_queue() == [0, 1, 2, 3]
    live.adopt(draft)
    assert live.pool._free is queue and live.pool._by_hash is table      # written in place
    assert live.pool.free_queue() == [2, 3] and live.block_table(5) == [0, 1] and not live.check()
