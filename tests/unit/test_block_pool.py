import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_npu.cache import block_pool
from qwen_npu.cache.block_pool import BlockInfo, BlockPool, hash_block
from qwen_npu.errors import OutOfBlocksError


def test_fresh_pool():
    pool = BlockPool(4, 2)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (4, 0, 0)
    assert pool.free_queue() == [0, 1, 2, 3]
    assert [b.ref_count for b in pool.blocks()] == [0, 0, 0, 0]
    assert pool.block(2) == BlockInfo(2, 0, None, None, ())
    assert pool.check() == []


def test_allocate_from_head_in_id_order():
    pool = BlockPool(5, 2)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(0) == []
    assert pool.allocate(1) == [2]
    assert pool.free_queue() == [3, 4]
    assert [pool.ref_count(i) for i in range(5)] == [1, 1, 1, 0, 0]
    assert pool.check() == []


def test_allocate_failure_allocates_nothing():
    pool = BlockPool(3, 2)
    pool.allocate(2)
    assert not pool.can_allocate(2) and pool.can_allocate(1)
    with pytest.raises(OutOfBlocksError, match="need 2 free blocks but only 1 of 3"):
        pool.allocate(2)
    assert pool.free_queue() == [2]
    assert pool.check() == []


def test_uncached_freed_blocks_go_to_head_most_recent_first():
    pool = BlockPool(5, 2)
    pool.allocate(3)                 # 0 1 2 used, queue [3, 4]
    pool.release([1, 0])             # 1 to head, then 0 to head
    assert pool.free_queue() == [0, 1, 3, 4]
    assert pool.allocate(3) == [0, 1, 3]
    assert pool.check() == []


def test_cached_blocks_go_to_tail_and_are_evicted_least_recently_freed_first():
    pool = BlockPool(5, 2)
    assert pool.allocate(4) == [0, 1, 2, 3]
    h0 = pool.publish(0, None, [1, 2])
    h1 = pool.publish(1, h0, [3, 4])
    pool.publish(2, None, [5, 6])
    pool.release([2])                # cached, freed first
    pool.release([1, 0])             # cached, freed later: 1 then 0
    pool.release([3])                # uncached: head
    assert pool.free_queue() == [3, 4, 2, 1, 0]
    assert (pool.num_free, pool.num_cached) == (5, 3)
    assert pool.allocate(2) == [3, 4]            # uncached ones first
    assert pool.num_cached == 3
    assert pool.allocate(1) == [2]               # least recently freed cached block
    assert pool.lookup(None, [5, 6]) is None     # evicted: its hash left the table
    assert pool.block(2) == BlockInfo(2, 1, None, None, ())
    assert pool.lookup(h0, [3, 4]) == 1 and pool.lookup(None, [1, 2]) == 0
    assert pool.block(1).block_hash == h1
    assert pool.allocate(1) == [1]
    assert pool.lookup(h0, [3, 4]) is None and pool.lookup(None, [1, 2]) == 0
    assert pool.num_cached == 1
    assert pool.check() == []


def test_acquire_cached_block_takes_it_out_of_the_queue():
    pool = BlockPool(3, 2)
    pool.allocate(2)
    h = pool.publish(1, None, [7, 7])
    pool.release([0, 1])
    assert pool.free_queue() == [0, 2, 1]
    pool.acquire(1)
    assert pool.free_queue() == [0, 2]
    assert (pool.ref_count(1), pool.num_cached) == (1, 0)
    pool.acquire(1)
    assert pool.ref_count(1) == 2
    assert pool.block(1).block_hash == h
    pool.release([1, 1])
    assert pool.free_queue() == [0, 2, 1] and pool.num_cached == 1
    assert pool.check() == []


def test_acquire_free_uncached_block_is_an_error():
    pool = BlockPool(2, 2)
    with pytest.raises(ValueError, match="block 1 is free and caches nothing"):
        pool.acquire(1)
    with pytest.raises(ValueError, match="does not exist"):
        pool.acquire(2)


def test_release_errors_change_nothing():
    pool = BlockPool(3, 2)
    pool.allocate(2)
    with pytest.raises(ValueError, match="block 2 1 time"):
        pool.release([0, 2])
    with pytest.raises(ValueError, match="block 0 2 time"):
        pool.release([0, 0])
    assert [pool.ref_count(i) for i in range(3)] == [1, 1, 0]
    assert pool.free_queue() == [2]
    assert pool.check() == []


def test_chained_hash():
    assert hash_block(None, [1, 2]) == hash_block(None, (1, 2))
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [9, 9]), [1, 2])
    pool = BlockPool(4, 2)
    pool.allocate(3)
    ha = pool.publish(0, None, [1, 2])
    hb = pool.publish(1, ha, [3, 4])
    assert pool.lookup(None, [1, 2]) == 0
    assert pool.lookup(ha, [3, 4]) == 1
    assert pool.lookup(None, [3, 4]) is None          # same tokens, other prefix
    assert pool.lookup(hb, [1, 2]) is None
    assert pool.lookup(ha, [3, 5]) is None
    info = pool.block(1)
    assert (info.block_hash, info.parent_hash, info.token_ids, info.is_cached) == (hb, ha, (3, 4), True)


def test_hash_is_deterministic_across_processes():
    # Fresh interpreters with other str-hash salts compute the same hashes. A bare 'qwen_npu'
    # package is registered so the child skips the package __init__ (and its torch import).
    code = ("import sys, types; pkg = types.ModuleType('qwen_npu'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['qwen_npu'] = pkg; from qwen_npu.cache.block_pool import hash_block; "
            "print(hash_block(hash_block(None, [1, 2]), [3, 4]))")
    package_dir = str(Path(block_pool.__file__).parents[1])
    outs = {subprocess.run([sys.executable, "-c", code, package_dir], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {f"{hash_block(hash_block(None, [1, 2]), [3, 4])}\n"}


def test_publish_duplicate_keeps_existing_mapping():
    pool = BlockPool(3, 2)
    pool.allocate(2)
    h = pool.publish(0, None, [1, 2])
    assert pool.publish(1, None, [1, 2]) == h
    assert pool.lookup(None, [1, 2]) == 0
    assert pool.block(1).block_hash is None
    assert pool.publish(0, None, [1, 2]) == h       # publishing again is a no-op
    pool.release([0, 1])
    assert pool.free_queue() == [1, 2, 0]           # the duplicate stays uncached: head
    assert pool.check() == []


def test_publish_errors():
    pool = BlockPool(3, 2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="only a full block"):
        pool.publish(0, None, [1])
    with pytest.raises(ValueError, match="not held"):
        pool.publish(1, None, [1, 2])
    pool.publish(0, None, [1, 2])
    with pytest.raises(ValueError, match="cannot change its content"):
        pool.publish(0, None, [1, 3])


def test_prefix_cache_off():
    pool = BlockPool(3, 2, enable_prefix_cache=False)
    pool.allocate(2)
    h = pool.publish(0, None, [1, 2])
    assert h == hash_block(None, [1, 2])
    assert pool.lookup(None, [1, 2]) is None
    assert pool.block(0).block_hash is None
    pool.release([0, 1])
    assert pool.free_queue() == [1, 0, 2] and pool.num_cached == 0
    assert pool.check() == []


def test_reset():
    pool = BlockPool(3, 2)
    pool.allocate(2)
    pool.publish(0, None, [1, 2])
    pool.release([0])
    pool.reset()
    assert pool.free_queue() == [0, 1, 2]
    assert (pool.num_free, pool.num_cached) == (3, 0)
    assert pool.lookup(None, [1, 2]) is None
    assert pool.check() == []


def test_snapshot_does_not_change():
    pool = BlockPool(2, 2)
    pool.allocate(1)
    before = pool.block(0)
    pool.release([0])
    assert before.ref_count == 1 and pool.block(0).ref_count == 0


def test_bad_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, 2)
    with pytest.raises(ValueError):
        BlockPool(2, 0)
    with pytest.raises(ValueError):
        BlockPool(2, 2).allocate(-1)
