"""Stateful property test of the radix tree against a brute-force reference model, as the
plain cache (RadixCache), with tiers below it (HiRadixCache, whose L1 must behave the same)
and as the hybrid model's tree (SWARadixCache, whose full KV must behave the same).

The reference is driven only by what the cache reports: every slot the tree holds is mapped
to the (salt, token prefix ending at that slot) it stands for.  A prefix is cached iff its
last token's slot is live in the tree.  ``on_free`` callbacks remove slots, so the model
follows evictions without knowing the tree's shape.  A simulated allocator checks that
every slot is in exactly one place (free list, tree, or briefly private to a request).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache import HiCacheConfig, HiRadixCache, RadixCache
from radixserve.cache.swa import SWARadixCache
from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.swa_pool import HybridAllocator

CAPACITY = 48
SALTS = [None, "s"]
# Three token values that differ in their highest byte (0 vs 2**24) or in every byte: the
# tree packs ids as uint32 and finds mismatches bitwise, so both must be exercised.
seqs = st.lists(st.sampled_from([0, 2**24, 2**32 - 1]), min_size=0, max_size=14)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache: RadixCache | None = None

    @initialize(page_size=st.sampled_from([1, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.free = set(range(CAPACITY))
        self.tree: dict[int, tuple] = {}  # slot -> (salt, prefix tuple ending at that token)
        self.locks: list = []  # (node, frozenset of slots of the locked path)
        self.seen: list = []  # (seq, salt) served so far: re-matching them hits whole leaves
        self.pending: list = []  # started requests: (seq, salt, match, slots)
        self.loose: list = []  # handles locked by the ``lock`` rules (not by a request)
        self.cache = self.make_cache(page_size)

    def make_cache(self, page_size: int):
        return RadixCache(page_size=page_size, on_free=self.on_free)

    # ------------------------------------------------------------------ model
    def on_free(self, idx: torch.Tensor) -> None:
        assert idx.dtype == torch.int64 and idx.dim() == 1
        protected = set().union(*(s for _, s in self.locks)) if self.locks else set()
        for s in idx.tolist():
            assert s in self.tree, f"freed slot {s} that the tree does not hold"
            assert s not in self.free, f"slot {s} freed twice"
            assert s not in protected, f"locked slot {s} was evicted"
            del self.tree[s]
            self.free.add(s)

    def present(self) -> set:
        return set(self.tree.values())

    def ref_match(self, seq: list, salt) -> int:
        present = self.present()
        best = 0
        for k in range(self.ps, len(seq) + 1, self.ps):
            if (salt, tuple(seq[:k])) in present:
                best = k
        return best

    def check_match(self, seq: list, salt, r) -> None:
        assert r.indices.dtype == torch.int64 and r.indices.dim() == 1
        assert r.length == len(r.indices) == self.ref_match(seq, salt)
        for i, s in enumerate(r.indices.tolist()):
            assert self.tree[s] == (salt, tuple(seq[: i + 1]))

    # ------------------------------------------------------------------ rules
    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def match(self, seq, salt):
        r = self.cache.match_prefix(seq, salt=salt)
        self.check_match(seq, salt, r)

    def _start(self, seq, salt):
        """Scheduler admission: match, lock, allocate the uncached tail (evicting if needed)."""
        cache = self.cache
        self.seen.append((seq, salt))
        r = cache.match_prefix(seq, salt=salt)
        self.check_match(seq, salt, r)
        cache.lock(r.node)
        self.locks.append((r.node, frozenset(r.indices.tolist())))
        need = len(seq) - r.length
        if len(self.free) < need:
            before, want = cache.evictable_size, need - len(self.free)
            freed = cache.evict(want)
            assert freed >= want if before >= want else freed == before
        if len(self.free) < need:
            self._unlock_handle(r.node)
            return None
        fresh = sorted(self.free)[:need]
        self.free -= set(fresh)
        return (seq, salt, r, r.indices.tolist() + fresh)

    def _unlock_handle(self, node):
        for i, (h, _) in enumerate(self.locks):
            if h is node:
                del self.locks[i]
                break
        self.cache.unlock(node)

    def _finish(self, req):
        """Request done: insert input+output, free duplicates and the unaligned tail, unlock."""
        seq, salt, r, idx = req
        expect = self.ref_match(seq, salt)
        assert expect >= r.length  # the locked prefix cannot have been evicted
        n = self.cache.insert(seq, torch.tensor(idx, dtype=torch.int64), salt=salt)
        assert n == expect, (n, expect)
        A = self.cache.cacheable_length(len(seq))
        assert A == len(seq) - len(seq) % self.ps
        for i in range(n, A):
            assert idx[i] not in self.tree
            self.tree[idx[i]] = (salt, tuple(seq[: i + 1]))
        for s in idx[r.length : n] + idx[A:]:
            assert s not in self.tree and s not in self.free
            self.free.add(s)
        self._unlock_handle(r.node)

    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def serve_request(self, seq, salt):
        req = self._start(seq, salt)
        if req:
            self._finish(req)

    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def start_request(self, seq, salt):
        """Requests interleave: others run (and evict/split) between start and finish."""
        req = self._start(seq, salt)
        if req:
            self.pending.append(req)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def finish_request(self, i):
        self._finish(self.pending.pop(i % len(self.pending)))

    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def lock(self, seq, salt):
        r = self.cache.match_prefix(seq, salt=salt)
        self.check_match(seq, salt, r)
        self.cache.lock(r.node)
        self.locks.append((r.node, frozenset(r.indices.tolist())))
        self.loose.append(r.node)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), cut=st.integers(0, 3))
    def lock_seen(self, i, cut):
        """Lock a (possibly shortened) earlier request: often ends exactly at a leaf."""
        seq, salt = self.seen[i % len(self.seen)]
        self.lock(seq[: len(seq) - cut] if cut else seq, salt)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100))
    def rematch_seen(self, i):
        self.match(*self.seen[i % len(self.seen)])

    @precondition(lambda self: self.loose)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self._unlock_handle(self.loose.pop(i % len(self.loose)))

    @rule(k=st.integers(0, CAPACITY))
    def evict(self, k):
        before_evictable = self.cache.evictable_size
        before_tree = len(self.tree)
        freed = self.cache.evict(k)
        assert freed == before_tree - len(self.tree)
        if before_evictable >= k:
            assert freed >= k
        else:
            assert freed == before_evictable

    @rule()
    def reset(self):
        if self.cache.protected_size:
            before = dict(self.tree)
            with pytest.raises(RuntimeError):
                self.cache.reset()
            assert self.tree == before
        else:  # any locks held are on roots (misses): no-ops, still valid after reset
            self.cache.reset()
            assert not self.tree

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        c = self.cache
        c.check_integrity()
        assert c.evictable_size + c.protected_size == c.total_size == len(self.tree)
        private = sum(len(p[3]) - p[2].length for p in self.pending)
        assert len(self.free) + len(self.tree) + private == CAPACITY
        assert not (self.free & set(self.tree))
        protected = set().union(*(s for _, s in self.locks)) if self.locks else set()
        assert c.protected_size == len(protected)
        if not self.locks:
            assert c.protected_size == 0


RadixMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheStateful = RadixMachine.TestCase


class TieredRadixMachine(RadixMachine):
    """The same rules and reference against the tiered tree: what it evicts from L1 is
    demoted to L2 (write_back) or dropped when L2 is full, and a re-served sequence takes
    fresh L1 slots for the runs held in L2 only, so its L1 must match the plain cache's."""

    def make_cache(self, page_size: int):
        alloc = SlotAllocator(CAPACITY, page_size)
        assert alloc.alloc(CAPACITY) is not None  # the machine hands out the L1 slots itself
        kv = KVPool(1, CAPACITY, 1, 2)
        host = HostKVPool.like(kv, CAPACITY, page_size)
        cfg = HiCacheConfig(l2_tokens=CAPACITY, write_policy="write_back")
        return HiRadixCache(alloc, kv, host, cfg, on_free=self.on_free)


TieredRadixMachine.TestCase.settings = RadixMachine.TestCase.settings
TestTieredRadixStateful = TieredRadixMachine.TestCase


class SWARadixMachine(RadixMachine):
    """The same rules and reference against the hybrid (sliding-window) tree: with every
    slot's window KV kept (this machine never calls ``evict_swa``), its full KV must behave
    as the plain cache's, while window locks split nodes at their spans' starts."""

    def make_cache(self, page_size: int):
        alloc = HybridAllocator(CAPACITY, CAPACITY, page_size)
        assert alloc.alloc(CAPACITY) is not None  # every slot has its SWA slot, handed out by the machine
        cache = SWARadixCache(alloc, window=3)
        cache.on_free = self.on_free  # the machine, not the allocator, keeps the free list
        return cache


SWARadixMachine.TestCase.settings = RadixMachine.TestCase.settings
TestSWARadixStateful = SWARadixMachine.TestCase
