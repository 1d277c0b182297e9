"""TableCache (flat-table ablation) and NoCache: unit tests and a stateful model check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache import NoCache, TableCache


def test_table_matches_whole_entries_only():
    cache = TableCache()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 4
    assert cache.match_prefix([1, 2, 3]).length == 0  # a partial entry is never reused
    # Diverging sequence: stored as a new entry with its own copy of the shared part.
    assert cache.insert([1, 2, 9], [20, 21, 22]) == 0
    assert cache.total_size == 7 and cache.num_nodes == 2
    r = cache.match_prefix([1, 2, 9, 9])
    assert r.length == 3 and r.indices.tolist() == [20, 21, 22] and r.indices.dtype == torch.int64
    cache.check_integrity()


def test_table_extension_replaces_an_unlocked_prefix_entry():
    cache = TableCache()
    cache.insert([1, 2], [10, 11])
    assert cache.insert([1, 2, 3, 4], [20, 21, 12, 13]) == 2  # caller frees 20, 21
    assert cache.entries() == [(1, 2, 3, 4)]
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == [10, 11, 12, 13]
    assert cache.total_size == 4
    assert cache.insert([1, 2, 3, 4], [7, 7, 7, 7]) == 4  # identical: all duplicates
    cache.check_integrity()


def test_table_locked_prefix_entry_is_kept_and_shared():
    freed = []
    cache = TableCache(on_free=lambda t: freed.extend(t.tolist()))
    cache.insert([1, 2], [10, 11])
    r = cache.match_prefix([1, 2, 3, 4])
    assert r.length == 2
    cache.lock(r.node)
    assert cache.insert([1, 2, 3, 4], r.indices.tolist() + [12, 13]) == 2
    assert cache.entries() == [(1, 2), (1, 2, 3, 4)]  # the locked entry stays
    assert cache.total_size == 4 and cache.protected_size == 2 and cache.evictable_size == 2
    assert cache.evict(4) == 2 and sorted(freed) == [12, 13]  # shared slots stay
    cache.unlock(r.node)
    assert cache.evict(4) == 2 and sorted(freed) == [10, 11, 12, 13]
    cache.check_integrity()


def test_table_interleaved_requests_keep_ownership():
    """R1 matches entry E and holds it; R2 extends E; R1 then inserts a diverging sequence.
    Entries are immutable, so E is still a prefix of R1's sequence and no slot is owned twice."""
    cache = TableCache()
    cache.insert([1, 2], [10, 11])
    r1 = cache.match_prefix([1, 2, 5])
    cache.lock(r1.node)
    r2 = cache.match_prefix([1, 2, 3])
    cache.lock(r2.node)
    assert cache.insert([1, 2, 3], r2.indices.tolist() + [12]) == 2
    cache.unlock(r2.node)
    assert cache.insert([1, 2, 5], r1.indices.tolist() + [13]) == 2
    cache.unlock(r1.node)
    assert sorted(cache.entries()) == [(1, 2), (1, 2, 3), (1, 2, 5)]
    assert cache.total_size == 4
    cache.check_integrity()
    with pytest.raises(ValueError, match="already holds"):
        cache.insert([1, 2, 7], [10, 11, 12])  # slot 12 belongs to the cache


def test_table_lru_eviction_of_whole_entries_respects_locks():
    freed = []
    cache = TableCache(on_free=lambda t: freed.append(sorted(t.tolist())))
    cache.insert([1, 1], [1, 2])
    cache.insert([2, 2, 2], [3, 4, 5])
    cache.insert([3], [6])
    r = cache.match_prefix([1, 1])  # refresh + lock the oldest
    cache.lock(r.node)
    assert cache.evict(1) == 3 and freed[-1] == [3, 4, 5]
    assert cache.evict(1) == 1 and freed[-1] == [6]
    assert cache.evict(1) == 0
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(r.node)
    cache.reset()
    assert freed[-1] == [1, 2] and cache.total_size == 0
    with pytest.raises(ValueError):
        cache.lock(r.node)  # evicted/reset handle


def test_table_page_size_and_salt():
    cache = TableCache(page_size=2)
    assert cache.insert([1, 2, 3], [1, 2, 3]) == 0
    assert cache.total_size == 2  # caller frees slot 3
    assert cache.match_prefix([1, 2, 3]).length == 2
    assert cache.match_prefix([1, 2], salt="x").length == 0
    assert cache.insert([1, 2], [5, 6], salt="x") == 0
    assert cache.match_prefix([1, 2], salt="x").indices.tolist() == [5, 6]
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2], [1])
    with pytest.raises(ValueError, match="page_size"):
        TableCache(page_size=0)
    cache.check_integrity()


def test_nocache():
    freed = []
    cache = NoCache(on_free=freed.append)
    assert cache.insert([1, 2, 3], torch.tensor([1, 2, 3])) == 0
    assert cache.cacheable_length(3) == 0  # the caller frees every index it passed
    r = cache.match_prefix([1, 2, 3])
    assert r.length == 0 and r.indices.dtype == torch.int64 and r.indices.numel() == 0
    cache.lock(r.node)
    cache.unlock(r.node)
    assert cache.evict(10) == 0 and cache.total_size == 0
    cache.reset()
    cache.check_integrity()
    assert not freed
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2], [1])
    assert cache.stats()["num_nodes"] == 0


CAPACITY = 40
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class TableMachine(RuleBasedStateMachine):
    """Reference: {(salt, tuple): slots} of stored entries and their lock counts, updated by
    the table's documented rules; evictions are read back from ``entries()`` and checked
    against what ``on_free`` reported.  Requests may interleave (start ... finish)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = None

    @initialize(page_size=st.sampled_from([1, 2]))
    def setup(self, page_size):
        self.ps = page_size
        self.free = set(range(CAPACITY))
        self.entries: dict = {}  # (salt, tuple) -> list of slots
        self.locks: dict = {}  # (salt, tuple) -> lock count
        self.pending: list = []  # (seq, salt, match result, key or None, idx)
        self.seen: list = []
        self.freed_now: list = []
        self.cache = TableCache(page_size=page_size, on_free=self.on_free)

    def on_free(self, idx):
        self.freed_now.extend(idx.tolist())

    def held(self) -> set:
        return {s for v in self.entries.values() for s in v}

    def sync(self, before_held: set) -> None:
        """Drop evicted entries from the model; check what was freed."""
        present = {(salt, k) for salt in (None, 1) for k in self.cache.entries(salt)}
        for key in list(self.entries):
            if key not in present:
                assert not self.locks.get(key), "a locked entry was evicted"
                del self.entries[key]
        assert set(self.entries) == present
        freed = self.freed_now
        self.freed_now = []
        assert len(set(freed)) == len(freed), "slot freed twice"
        assert set(freed) == before_held - self.held()
        assert not (set(freed) & self.free)
        self.free |= set(freed)

    def ref_longest(self, seq, salt):
        n = len(seq) - len(seq) % self.ps
        best = None
        for (s, k) in self.entries:
            if s == salt and 0 < len(k) <= n and tuple(seq[: len(k)]) == k:
                if best is None or len(k) > len(best):
                    best = k
        return best

    def _start(self, seq, salt):
        self.seen.append((seq, salt))
        r = self.cache.match_prefix(seq, salt=salt)
        best = self.ref_longest(seq, salt)
        assert r.length == (len(best) if best else 0)
        key = (salt, best) if best else None
        if best:
            assert r.indices.tolist() == self.entries[key]
            self.locks[key] = self.locks.get(key, 0) + 1
        self.cache.lock(r.node)
        need = len(seq) - r.length
        if len(self.free) < need:
            before = self.held()
            self.cache.evict(need - len(self.free))
            self.sync(before)
        if len(self.free) < need:
            self._release(r, key)
            return None
        fresh = sorted(self.free)[:need]
        self.free -= set(fresh)
        return (seq, salt, r, key, r.indices.tolist() + fresh)

    def _release(self, r, key):
        self.cache.unlock(r.node)
        if key:
            self.locks[key] -= 1

    def _finish(self, req):
        seq, salt, r, key, idx = req
        best = self.ref_longest(seq, salt)
        n = self.cache.insert(seq, idx, salt=salt)
        assert n == (len(best) if best else 0) and n >= r.length
        A = self.cache.cacheable_length(len(seq))
        if A > n:
            prefix = self.entries[(salt, best)] if best else []
            self.entries[(salt, tuple(seq[:A]))] = prefix + idx[n:A]
            if best and not self.locks.get((salt, best)):
                del self.entries[(salt, best)]  # replaced
        self.free |= set(idx[r.length : n] + idx[A:])
        self._release(r, key)
        assert not self.freed_now

    @rule(seq=seqs, salt=st.sampled_from([None, 1]))
    def serve(self, seq, salt):
        req = self._start(seq, salt)
        if req:
            self._finish(req)

    @rule(seq=seqs, salt=st.sampled_from([None, 1]))
    def start(self, seq, salt):
        req = self._start(seq, salt)
        if req:
            self.pending.append(req)

    @precondition(lambda self: self.pending)
    @rule(i=st.integers(0, 50))
    def finish(self, i):
        self._finish(self.pending.pop(i % len(self.pending)))

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 50))
    def rematch(self, i):
        seq, salt = self.seen[i % len(self.seen)]
        best = self.ref_longest(seq, salt)
        assert self.cache.match_prefix(seq, salt=salt).length == (len(best) if best else 0)

    @rule(k=st.integers(0, CAPACITY))
    def evict(self, k):
        before_evictable = self.cache.evictable_size
        before = self.held()
        freed = self.cache.evict(k)
        assert freed == len(self.freed_now)
        self.sync(before)
        assert freed >= k if before_evictable >= k else freed == before_evictable

    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        c = self.cache
        c.check_integrity()
        held = self.held()
        private = sum(len(p[4]) - p[2].length for p in self.pending)
        assert c.total_size == len(held) and len(self.free) + len(held) + private == CAPACITY
        locked = {s for k, cnt in self.locks.items() if cnt and k in self.entries for s in self.entries[k]}
        assert c.protected_size == len(locked)


TableMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestTableCacheStateful = TableMachine.TestCase
