import pytest

from qwen_npu.cache.manager import KVCacheManager, PrefixCacheStats
from qwen_npu.errors import InvalidRequestError, OutOfBlocksError


def admit(mgr, rid, tokens, num_computed=None):
    """match_prefix + allocate + (the step runs) + commit; returns the cached token count."""
    cached = mgr.match_prefix(rid, tokens)
    assert mgr.allocate(rid, len(tokens))
    mgr.commit(rid, tokens, len(tokens) if num_computed is None else num_computed)
    return cached


def test_first_admission_allocates_in_id_order():
    mgr = KVCacheManager(8, 4)
    assert not mgr.has(1) and mgr.block_table(1) == []
    assert mgr.match_prefix(1, list(range(10))) == 0
    assert mgr.has(1) and mgr.block_table(1) == []
    assert mgr.blocks_needed(1, 10) == 3
    assert mgr.allocate(1, 10)
    assert mgr.block_table(1) == [0, 1, 2]
    assert mgr.blocks_needed(1, 12) == 0 and mgr.blocks_needed(1, 13) == 1
    assert mgr.allocate(1, 13) and mgr.block_table(1) == [0, 1, 2, 3]
    assert (mgr.num_free_blocks, mgr.num_used_blocks, mgr.num_cached_blocks) == (4, 4, 0)
    table = mgr.block_table(1)
    table.append(99)
    assert mgr.block_table(1) == [0, 1, 2, 3]   # a copy
    assert mgr.check() == []


def test_block_is_matchable_only_after_commit():
    mgr = KVCacheManager(8, 4)
    prompt = [5, 6, 7, 8, 1, 2, 3, 4, 9]
    mgr.match_prefix(1, prompt)
    mgr.allocate(1, len(prompt))
    assert mgr.match_prefix(2, prompt) == 0          # step not run yet: nothing published
    mgr.commit(1, prompt, 4)                          # a chunk of 4 tokens ran
    assert mgr.match_prefix(3, prompt) == 4 and mgr.block_table(3) == [0]
    mgr.commit(1, prompt, 9)
    assert mgr.match_prefix(4, prompt) == 8 and mgr.block_table(4) == [0, 1]
    assert mgr.allocate(4, len(prompt)) and mgr.block_table(4) == [0, 1, 3]
    assert mgr.owners(0) == [1, 3, 4] and mgr.owners(1) == [1, 4] and mgr.owners(2) == [1]
    assert mgr.pool.ref_count(0) == 3
    assert mgr.check() == []


def test_last_token_rule():
    mgr = KVCacheManager(16, 4)
    two_blocks = [1, 2, 3, 4, 5, 6, 7, 8]
    admit(mgr, 1, two_blocks)
    assert mgr.num_computed_tokens(1) == 8
    assert mgr.match_prefix(2, two_blocks) == 4      # exactly 2 full blocks: reuse only 1
    assert mgr.block_table(2) == [0]
    assert mgr.allocate(2, 8) and mgr.block_table(2) == [0, 2]
    assert mgr.match_prefix(3, two_blocks + [9]) == 8
    assert mgr.match_prefix(4, [1, 2, 3]) == 0       # shorter than a block
    assert mgr.match_prefix(5, [1, 2, 3, 4]) == 0    # one block exactly: its last token is computed
    assert mgr.match_prefix(6, []) == 0
    assert mgr.check() == []


def test_equal_blocks_under_different_prefixes_do_not_match():
    mgr = KVCacheManager(16, 2)
    admit(mgr, 1, [1, 2, 3, 4, 5])
    assert mgr.match_prefix(2, [9, 9, 3, 4, 5]) == 0
    assert mgr.match_prefix(3, [3, 4, 5]) == 0
    assert mgr.match_prefix(4, [1, 2, 9, 9, 5]) == 2 and mgr.block_table(4) == [0]
    assert mgr.match_prefix(5, [1, 2, 3, 4, 0]) == 4 and mgr.block_table(5) == [0, 1]


def test_allocate_failure_changes_nothing():
    mgr = KVCacheManager(4, 2)
    admit(mgr, 1, [1, 2, 3, 4, 5])                    # blocks 0 1 2
    mgr.match_prefix(2, [1, 2, 7, 7, 7])               # acquires block 0
    before = (mgr.block_table(1), mgr.block_table(2), mgr.pool.free_queue(),
              [b.ref_count for b in mgr.pool.blocks()])
    assert not mgr.allocate(2, 5)                      # needs 2 more, 1 free
    assert not mgr.allocate(1, 9)
    assert not mgr.allocate(3, 3)
    assert not mgr.has(3)
    after = (mgr.block_table(1), mgr.block_table(2), mgr.pool.free_queue(),
             [b.ref_count for b in mgr.pool.blocks()])
    assert after == before
    mgr.free(2)                                        # give the matched block back, retry later
    assert mgr.pool.ref_count(0) == 1 and mgr.check() == []


def test_free_releases_tail_first_so_tail_is_evicted_first():
    mgr = KVCacheManager(4, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    admit(mgr, 1, prompt)                              # [0 1 2 3]; 0 1 2 published, 3 partial
    mgr.free(1)
    assert not mgr.has(1)
    assert mgr.pool.free_queue() == [3, 2, 1, 0]       # uncached 3 at head; cached tail-first
    assert (mgr.num_free_blocks, mgr.num_cached_blocks) == (4, 3)
    assert mgr.allocate(2, 3) and mgr.block_table(2) == [3, 2]   # block 2 evicted
    assert mgr.num_cached_blocks == 2
    assert mgr.match_prefix(3, prompt) == 4 and mgr.block_table(3) == [0, 1]
    assert mgr.pool.free_queue() == [] and mgr.num_cached_blocks == 0
    mgr.free(2)
    mgr.free(3)
    assert mgr.pool.free_queue() == [3, 2, 1, 0]          # uncached 2 then 3 to the head; 1 0 cached
    assert mgr.check() == []


def test_fork_shares_full_blocks_and_copies_partial_block():
    mgr = KVCacheManager(6, 4)
    admit(mgr, 1, list(range(6)))                      # table [0 1], block 1 holds 2 of 4 tokens
    assert mgr.fork(1, 2) == [(1, 2)]
    assert mgr.block_table(2) == [0, 2]
    assert mgr.num_computed_tokens(2) == 6
    assert [mgr.pool.ref_count(b) for b in range(3)] == [2, 1, 1]
    assert mgr.owners(0) == [1, 2]
    assert mgr.check() == []
    mgr.commit(2, list(range(6)) + [42, 43], 8)        # child fills its own block 2
    assert mgr.pool.block(2).token_ids == (4, 5, 42, 43)
    assert mgr.pool.block(1).block_hash is None        # the parent's partial block is untouched
    assert mgr.check() == []


def test_fork_on_block_boundary_copies_nothing():
    mgr = KVCacheManager(6, 4)
    admit(mgr, 1, list(range(8)))
    assert mgr.allocate(1, 9) and mgr.block_table(1) == [0, 1, 2]   # lookahead block stays private
    assert mgr.fork(1, 2) == []
    assert mgr.block_table(2) == [0, 1]
    assert [mgr.pool.ref_count(b) for b in range(3)] == [2, 2, 1]
    assert mgr.allocate(2, 9) and mgr.block_table(2) == [0, 1, 3]
    assert mgr.check() == []


def test_fork_without_free_block_changes_nothing():
    mgr = KVCacheManager(2, 4)
    admit(mgr, 1, list(range(6)))
    with pytest.raises(OutOfBlocksError, match="cannot fork request 1 into 2"):
        mgr.fork(1, 2)
    assert not mgr.has(2)
    assert [mgr.pool.ref_count(b) for b in range(2)] == [1, 1]
    with pytest.raises(InvalidRequestError):
        mgr.fork(7, 8)
    mgr.match_prefix(3, [1])
    with pytest.raises(InvalidRequestError, match="already holds"):
        mgr.fork(1, 3)
    assert mgr.check() == []


def test_stats():
    mgr = KVCacheManager(16, 4)
    assert mgr.stats == PrefixCacheStats(0, 0, 0, 0, 0) and mgr.stats.hit_rate == 0.0
    admit(mgr, 1, list(range(10)))                     # eligible 2, hits 0
    assert mgr.stats == PrefixCacheStats(queries=1, hit_blocks=0, miss_blocks=2, hit_tokens=0, miss_tokens=8)
    admit(mgr, 2, list(range(8)) + [7, 7, 7, 7, 7])    # eligible 3, hits 2
    assert mgr.stats == PrefixCacheStats(2, 2, 3, 8, 12)
    admit(mgr, 3, [1, 2])                               # eligible 0
    assert mgr.stats == PrefixCacheStats(3, 2, 3, 8, 12)
    assert mgr.stats.hit_rate == pytest.approx(8 / 20)
    mgr.reset()
    assert mgr.stats == PrefixCacheStats()


def test_prefix_cache_off():
    mgr = KVCacheManager(8, 2, enable_prefix_cache=False)
    admit(mgr, 1, [1, 2, 3, 4, 5])
    assert mgr.match_prefix(2, [1, 2, 3, 4, 5]) == 0 and mgr.block_table(2) == []
    assert mgr.stats == PrefixCacheStats()
    mgr.free(1)
    assert mgr.num_cached_blocks == 0 and mgr.pool.free_queue()[:3] == [0, 1, 2]
    assert mgr.check() == []


def test_misuse_is_refused():
    mgr = KVCacheManager(8, 2)
    mgr.match_prefix(1, [1, 2, 3])
    with pytest.raises(InvalidRequestError, match="runs once"):
        mgr.match_prefix(1, [1, 2, 3])
    with pytest.raises(InvalidRequestError, match="allocate first"):
        mgr.commit(1, [1, 2, 3], 3)
    mgr.allocate(1, 3)
    mgr.commit(1, [1, 2, 3], 2)
    with pytest.raises(InvalidRequestError, match="between"):
        mgr.commit(1, [1, 2, 3], 1)
    with pytest.raises(InvalidRequestError, match="between"):
        mgr.commit(1, [1, 2, 3], 4)
    with pytest.raises(InvalidRequestError, match="holds no blocks"):
        mgr.commit(9, [1], 1)
    mgr.free(9)                                         # unknown: nothing to do
    assert mgr.check() == []


def test_check_reports_problems():
    mgr = KVCacheManager(4, 2)
    admit(mgr, 1, [1, 2, 3])
    mgr.pool.acquire(0)                                 # a reference no table accounts for
    problems = mgr.check()
    assert problems == ["block 0 has ref_count 2 but 1 block tables hold it (requests [1])"]


def test_reset():
    mgr = KVCacheManager(4, 2)
    admit(mgr, 1, [1, 2, 3])
    mgr.reset()
    assert not mgr.has(1) and mgr.num_free_blocks == 4 and mgr.num_cached_blocks == 0
    assert mgr.match_prefix(2, [1, 2, 3]) == 0
    assert mgr.check() == []


def test_allocate_answers_within_the_table_and_refuses_a_negative_count():
    mgr = KVCacheManager(8, 4)
    assert mgr.allocate(1, 5) and mgr.block_table(1) == [0, 1]
    assert mgr.allocate(1, 8) and mgr.allocate(1, 0) and mgr.block_table(1) == [0, 1]   # no new block
    assert mgr.allocate(1, 9) and mgr.block_table(1) == [0, 1, 2]
    with pytest.raises(ValueError, match="num_tokens >= 0"):
        mgr.allocate(1, -3)
    assert mgr.block_table(1) == [0, 1, 2] and mgr.check() == []
