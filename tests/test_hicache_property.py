"""Stateful property test of the tiered tree (HiRadixCache) against simple references.

References, all independent of the tree's structure:

* per tier, a mirror trie fed by the cache's events (``Mirror`` of test_cache_events): what
  L1 holds and what L1+L2 hold. Every match must equal the longest prefix in the mirrors,
  and the mirrors must equal the tree's contents after every operation;
* the data: the KV of token ``i`` of any sequence is a fixed function of its prefix
  (``hicache_helpers.token_kv``). After every operation every slot the tree holds, in L1 and
  in L2, must hold exactly the KV of the prefix it stands for; so must every slot a match
  hands out, whichever tiers (and, with storage, which objects) it went through;
* slot accounting: L1 slots are free, in the tree, or private to a running request; L2 slots
  are free or in the tree (``check_integrity`` also checks both pools against the tree).

Operations: serve a request, start/finish interleaved requests (they lock, allocate, evict),
match, load_back alone, evict L1, evict L2, lock/unlock, prefetch from storage (a real
directory) and reset, under each write policy and page sizes 1 and 2.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache_helpers import expected_kv, make_cache, token_kv
from test_cache_events import Mirror

L1_CAP, L2_CAP = 20, 28
SALTS = [None, "s"]
# Sequences are made of a few fixed blocks, so that requests share prefixes and diverge at
# many depths (long L2 chains, splits inside L2 runs); ids differ in their highest byte
# (0 vs 2**24) or in every byte, since the tree compares packed uint32 keys bitwise.
BLOCKS = [(0,), (2**24, 0), (2**32 - 1, 5, 5), (7, 7, 0, 2**24), (5,)]
seqs = st.lists(st.sampled_from(range(len(BLOCKS))), max_size=6).map(
    lambda bs: [t for b in bs for t in BLOCKS[b]][:14])


class HiCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = None
        self.tmp = None

    @initialize(page=st.sampled_from([1, 2]),
                policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
                storage=st.booleans())
    def setup(self, page, policy, storage):
        self.page = page
        self.tmp = tempfile.mkdtemp(prefix="rxtest-hiprop-") if storage else None
        url = f"file://{self.tmp}" if storage else None
        self.cache = make_cache(l1=L1_CAP, l2=L2_CAP, page=page, storage=url, write_policy=policy,
                                write_through_threshold=2, storage_page_tokens=2 * page)
        self.mirrors = {"L1": Mirror(page), "L2": Mirror(page)}
        self.l3_events = []
        self.cache.listener = self._on_event
        self.pending = []  # started requests: (seq, salt, match, idx, fresh)
        self.loose = []  # nodes locked by the lock rule
        self.seen = []

    def teardown(self):
        if self.cache is not None:
            self.cache.close()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _on_event(self, ev):
        if ev.tier == "L3":
            self.l3_events.append(ev)
        else:
            self.mirrors[ev.tier].apply(ev)

    # ------------------------------------------------------------------ references
    def held(self, tier, salt):
        return self.mirrors[tier].held.get(salt, set())

    def longest(self, tier, seq, salt):
        held = self.held(tier, salt)
        best = 0
        for k in range(self.page, len(seq) + 1, self.page):
            if tuple(seq[:k]) in held:
                best = k
        return best

    def check_data(self, idx, seq, salt, n):
        got = self.cache.kv_pool.kv[:, :, idx]
        assert torch.equal(got, expected_kv(salt, seq, n)), "a matched slot holds the wrong KV"

    # ------------------------------------------------------------------ request flow
    def _start(self, seq, salt):
        c = self.cache
        self.seen.append((seq, salt))
        h = c.prefetch(seq, salt)
        if h is not None:
            assert h.job.wait(10)
            assert c.prefetch_ready(h)
        m = c.match_prefix(seq, salt)
        assert m.length == self.longest("L1", seq, salt)
        assert m.total_length == self.longest("L2", seq, salt)
        m = c.load_back(m)
        c.flush_loads()
        self.check_data(m.indices, seq, salt, m.length)
        c.lock(m.node)
        k = len(seq) - m.length
        need = c.allocator.pages_for(k) * self.page
        if c.allocator.available < need:
            c.evict(need - c.allocator.available)
        fresh = c.allocator.alloc(k) if k else torch.empty(0, dtype=torch.int64)
        if fresh is None:
            c.unlock(m.node)
            return None
        c.kv_pool.kv[:, :, fresh[:k]] = expected_kv(salt, seq, len(seq))[:, :, m.length :]
        c.record_admission(seq, m, salt, h)
        return (seq, salt, m, torch.cat([m.indices, fresh[:k]]), fresh)

    def _finish(self, req):
        seq, salt, m, idx, fresh = req
        c = self.cache
        n = c.insert(seq, idx, salt)
        assert n >= m.length
        A = c.cacheable_length(len(seq))
        for k in range(self.page, A + 1, self.page):
            assert tuple(seq[:k]) in self.held("L1", salt)
        k = len(seq) - m.length
        give = [idx[m.length : n], idx[A:], fresh[k:]]
        give = torch.cat(give)
        if give.numel():
            c.allocator.free(give)
        c.unlock(m.node)

    def private(self):
        return sum(int(r[4].numel()) for r in self.pending)

    # ------------------------------------------------------------------ rules
    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def serve(self, seq, salt):
        req = self._start(seq, salt)
        if req:
            self._finish(req)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), extra=st.lists(st.sampled_from([0, 7]), max_size=4))
    def serve_again(self, i, extra):
        """Reuse: an earlier request, maybe extended (multi-turn)."""
        seq, salt = self.seen[i % len(self.seen)]
        self.serve(seq + extra, salt)

    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def start(self, seq, salt):
        req = self._start(seq, salt)
        if req:
            self.pending.append(req)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self._finish(self.pending.pop(i % len(self.pending)))

    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def match(self, seq, salt):
        m = self.cache.match_prefix(seq, salt)
        assert m.length == self.longest("L1", seq, salt)
        assert m.total_length == self.longest("L2", seq, salt)
        self.check_data(m.indices, seq, salt, m.length)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), cut=st.integers(0, 3), cap=st.none() | st.integers(0, 8))
    def load_only(self, i, cut, cap):
        """match + load_back, no request: the loaded run stays in L1 as evictable cache."""
        seq, salt = self.seen[i % len(self.seen)]
        seq = seq[: len(seq) - cut] if cut else seq
        c = self.cache
        m = c.match_prefix(seq, salt)
        before = m.length
        m = c.load_back(m, max_tokens=cap)
        assert m.length == before + m.loaded
        if cap is not None:
            assert m.loaded <= cap
        c.flush_loads()
        self.check_data(m.indices, seq, salt, m.length)

    @rule(seq=seqs, salt=st.sampled_from(SALTS))
    def lock(self, seq, salt):
        m = self.cache.match_prefix(seq, salt)
        self.cache.lock(m.node)
        self.loose.append(m.node)

    @precondition(lambda self: self.loose)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        self.cache.unlock(self.loose.pop(i % len(self.loose)))

    @rule(k=st.integers(0, L1_CAP))
    def evict(self, k):
        c = self.cache
        before = c.evictable_size
        freed = c.evict(k)
        assert c.evictable_size == before - freed
        if freed < k:  # whole nodes go; stopping short means nothing evictable is left
            assert c.evictable_size == 0

    @rule(k=st.integers(0, L2_CAP))
    def evict_host(self, k):
        c = self.cache
        before = c.host_size
        freed = c.evict_host(k)
        assert c.host_size == before - freed

    @precondition(lambda self: self.cache is not None and self.cache.storage is not None)
    @rule()
    def drain_storage(self):
        assert self.cache.wait_storage_idle(10)
        for ev in self.l3_events:
            assert ev.length == self.cache.storage.page_tokens

    @rule()
    def reset(self):
        c = self.cache
        if c.protected_size:
            with pytest.raises(RuntimeError):
                c.reset()
        else:
            c.reset()
            assert c.total_size == 0 and c.host_size == 0
            self.loose = []  # only roots could be locked: harmless no-ops

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        c = self.cache
        if c is None:
            return
        c.check_integrity()
        alloc = c.allocator
        assert alloc.available + c.total_size + self.private() == alloc.capacity
        for salt in SALTS:
            tc = c.tier_contents(salt)
            assert tc["L1"] == self.held("L1", salt), "L1 events disagree with the tree"
            assert tc["L2"] == self.held("L2", salt), "L2 events disagree with the tree"
        # Every slot the tree holds, in either tier, holds its prefix's KV.
        kv, host = c.kv_pool.kv, c.host_pool.kv
        for salt, root in c._roots.items():
            stack = [(ch, ()) for ch in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                toks = prefix + tuple(int(x) for x in memoryview(node.key).cast("I"))
                want = torch.stack([token_kv(salt, toks[: len(prefix) + i + 1])
                                    for i in range(len(toks) - len(prefix))], dim=2)
                if node.value is not None and not c._pending:
                    assert torch.equal(kv[:, :, torch.from_numpy(node.value)], want), "bad L1 data"
                if node.host is not None:
                    assert torch.equal(host[:, :, torch.from_numpy(node.host)], want), "bad L2 data"
                stack.extend((ch, toks) for ch in node.children.values())


HiCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHiCacheMachine = HiCacheMachine.TestCase
