"""KVCacheManager: requests kept private publish nothing (forks too); prefix_limit caps reuse."""
import pytest

from qwen_npu import InvalidRequestError
from qwen_npu.cache.manager import KVCacheManager

TOKENS = list(range(100, 113))          # 13 tokens: 3 full blocks of 4 are shareable


def run(m: KVCacheManager, rid: int, tokens=TOKENS, limit=None) -> int:
    cached = m.match_prefix(rid, tokens, limit)
    assert m.allocate(rid, len(tokens))
    m.commit(rid, tokens, len(tokens))
    return cached


def test_a_private_request_publishes_nothing_and_its_fork_neither():
    m = KVCacheManager(32, 4)
    m.match_prefix(0, TOKENS)
    assert m.allocate(0, len(TOKENS))
    m.keep_private(0, "request 0 was edited")
    m.keep_private(0, "a second reason is ignored")
    m.commit(0, TOKENS, len(TOKENS))
    assert m.private_reason(0) == "request 0 was edited" and m.num_cached_blocks == 0
    assert m.cached_prefix_tokens(TOKENS) == 0
    m.fork(0, 1)
    assert m.private_reason(1) == "request 0 was edited"
    m.free(0)
    m.free(1)
    assert m.private_reason(0) is None and m.cached_prefix_tokens(TOKENS) == 0
    assert run(m, 2) == 0 and m.cached_prefix_tokens(TOKENS) == 12     # a clean run publishes again
    assert m.check() == []
    with pytest.raises(InvalidRequestError, match="cannot keep private request 9"):
        m.keep_private(9, "x")


def test_prefix_limit_caps_what_match_prefix_takes_per_request():
    m = KVCacheManager(32, 4)
    run(m, 0)
    assert run(m, 1, limit=0) == 0         # recomputes everything
    assert run(m, 2, limit=9) == 8         # position 9 and on: blocks 0 and 1 reused
    assert run(m, 3) == 12                 # no cap
    assert m.stats.hit_blocks == 2 + 3 and m.check() == []
