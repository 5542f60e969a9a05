"""KVCacheManager.truncate: hand back blocks appended by allocate, never computed ones."""
import pytest

from qwen_npu.cache.manager import KVCacheManager
from qwen_npu.errors import InvalidRequestError


def test_truncate_releases_the_tail_for_reuse():
    mgr = KVCacheManager(6, 4)
    mgr.match_prefix(1, list(range(6)))
    assert mgr.allocate(1, 6)
    mgr.commit(1, list(range(6)), 6)
    assert mgr.allocate(1, 13) and mgr.block_table(1) == [0, 1, 2, 3]
    mgr.truncate(1, 2)
    assert mgr.block_table(1) == [0, 1]
    assert (mgr.num_used_blocks, mgr.num_free_blocks) == (2, 4)
    assert mgr.check() == []
    assert mgr.allocate(1, 9) and len(mgr.block_table(1)) == 3      # the blocks come back


def test_truncate_refuses_computed_blocks_and_unknown_requests():
    mgr = KVCacheManager(6, 4)
    mgr.match_prefix(1, list(range(6)))
    assert mgr.allocate(1, 6)
    mgr.commit(1, list(range(6)), 6)
    with pytest.raises(InvalidRequestError, match="6 computed tokens"):
        mgr.truncate(1, 1)
    assert mgr.block_table(1) == [0, 1] and mgr.check() == []
    with pytest.raises(InvalidRequestError, match="request 7"):
        mgr.truncate(7, 0)
