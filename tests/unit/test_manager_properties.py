"""Random add / grow / commit / free / fork / reset sequences on tiny pools keep every invariant.

Besides ``check()``, the test simulates the KV cache: computing position ``p`` of a request writes
``tuple(tokens[:p + 1])`` (everything the K/V of that position depends on) into its slot. So a
prefix hit or a fork that hands a request wrong K/V, a write into a shared or cached block, or a
cached block overwritten while a request still reads it, all show up as a content mismatch.
"""
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen_npu.cache.block_table import blocks_needed, slot_mapping
from qwen_npu.cache.manager import KVCacheManager
from qwen_npu.errors import OutOfBlocksError

OPS = ["add", "add", "add", "grow", "commit", "commit", "commit", "free", "free", "fork", "reset"]


class Harness:
    def __init__(self, num_blocks, block_size, prefix_cache):
        self.mgr = KVCacheManager(num_blocks, block_size, prefix_cache)
        self.size = block_size
        self.tokens: dict[int, list[int]] = {}   # live requests
        self.kv: dict[int, tuple] = {}           # slot -> what was written there
        self.next_id = 0
        self.seen: list[list[int]] = []          # computed token lists, to draw repeating prefixes from

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def snapshot(self):
        return ({rid: self.mgr.block_table(rid) for rid in self.mgr.request_ids()},
                self.mgr.pool.free_queue(), list(self.mgr.pool.blocks()))

    def write(self, rid, start, end):
        tokens, pool = self.tokens[rid], self.mgr.pool
        for pos, slot in zip(range(start, end), slot_mapping(self.mgr.block_table(rid), start, end, self.size)):
            block = slot // self.size
            assert pool.ref_count(block) == 1, f"request {rid} writes shared block {block}"
            assert pool.block_hash(block) is None, f"request {rid} writes cached block {block}"
            self.kv[slot] = tuple(tokens[:pos + 1])

    def verify(self, rid, num_tokens):
        tokens, table = self.tokens[rid], self.mgr.block_table(rid)
        for pos, slot in enumerate(slot_mapping(table, 0, num_tokens, self.size)):
            assert self.kv.get(slot) == tuple(tokens[:pos + 1]), f"request {rid} position {pos} slot {slot}"

    def check(self):
        mgr = self.mgr
        assert mgr.check() == []
        assert sorted(mgr.request_ids()) == sorted(self.tokens)
        for rid, tokens in self.tokens.items():
            assert len(mgr.block_table(rid)) >= blocks_needed(len(tokens), self.size)
            self.verify(rid, mgr.num_computed_tokens(rid))
        assert mgr.num_free_blocks + mgr.num_used_blocks == mgr.num_blocks

    # ---- operations (rnd: a hypothesis-controlled random.Random) -------------------------------
    def tokens_of(self, rnd, n):
        return [rnd.randint(0, 1) for _ in range(n)]        # a tiny alphabet, so blocks repeat

    def add(self, rnd):
        if self.seen and rnd.random() < 0.6:                 # mostly a prefix seen before
            base = rnd.choice(self.seen)
            prompt = base[:rnd.randint(0, len(base))] + self.tokens_of(rnd, rnd.randint(1, self.size))
        else:
            prompt = self.tokens_of(rnd, rnd.randint(1, 3 * self.size))
        rid = self.new_id()
        cached = self.mgr.match_prefix(rid, prompt)
        assert cached % self.size == 0 and cached <= len(prompt) - 1
        assert len(self.mgr.block_table(rid)) == cached // self.size
        self.tokens[rid] = prompt
        self.verify(rid, cached)
        before = self.snapshot()
        if not self.mgr.allocate(rid, len(prompt)):
            assert self.snapshot() == before
            self.mgr.free(rid)
            del self.tokens[rid]
        elif rnd.random() < 0.7:
            self.commit(rnd, rid)                            # the first prefill chunk runs

    def grow(self, rnd, rid):
        extra = self.tokens_of(rnd, rnd.randint(1, self.size))
        before = self.snapshot()
        if self.mgr.allocate(rid, len(self.tokens[rid]) + len(extra)):
            assert self.mgr.block_table(rid)[:len(before[0][rid])] == before[0][rid]   # append-only
            self.tokens[rid] += extra
        else:
            assert self.snapshot() == before

    def commit(self, rnd, rid):
        done, total = self.mgr.num_computed_tokens(rid), len(self.tokens[rid])
        if done < total:
            end = rnd.randint(done + 1, total)
            self.write(rid, done, end)
            self.mgr.commit(rid, self.tokens[rid], end)
            self.seen.append(self.tokens[rid][:end])

    def fork(self, rid):
        child, before = self.new_id(), self.snapshot()
        try:
            copies = self.mgr.fork(rid, child)
        except OutOfBlocksError:
            assert self.snapshot() == before
            return
        for src, dst in copies:
            assert self.mgr.pool.ref_count(dst) == 1
            for offset in range(self.size):
                if src * self.size + offset in self.kv:
                    self.kv[dst * self.size + offset] = self.kv[src * self.size + offset]
        self.tokens[child] = self.tokens[rid][:self.mgr.num_computed_tokens(rid)]

    def free_all(self):
        for rid in list(self.tokens):
            self.mgr.free(rid)
            del self.tokens[rid]
        mgr = self.mgr
        assert mgr.check() == []
        assert mgr.num_free_blocks == mgr.num_blocks and mgr.num_used_blocks == 0
        assert all(b.ref_count == 0 for b in mgr.pool.blocks())
        assert mgr.num_cached_blocks == sum(b.is_cached for b in mgr.pool.blocks())


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(2, 8), block_size=st.integers(1, 4), prefix_cache=st.sampled_from([True, True, False]),
       ops=st.lists(st.sampled_from(OPS), min_size=8, max_size=40), rnd=st.randoms(use_true_random=True))
def test_random_operations_keep_invariants(num_blocks, block_size, prefix_cache, ops, rnd):
    h = Harness(num_blocks, block_size, prefix_cache)
    for op in ops:
        live = sorted(h.tokens)
        if op == "add":
            h.add(rnd)
        elif op == "reset":
            h.mgr.reset()
            h.tokens.clear()
            h.kv.clear()
        elif live:
            rid = rnd.choice(live)
            if op == "grow":
                h.grow(rnd, rid)
            elif op == "commit":
                h.commit(rnd, rid)
            elif op == "fork":
                h.fork(rid)
            else:
                h.mgr.free(rid)
                del h.tokens[rid]
        h.check()
    h.free_all()
