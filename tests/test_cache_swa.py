"""The hybrid (sliding-window) radix cache: a stateful property test against what each slot
must hold, and the rules of the module docstring on small hand-made cases.

The "model" is a pair of tables: the full KV of token ``i`` of ``seq`` is the prefix
``seq[:i+1]`` itself, written into ``full_kv[slot]``; its SWA KV is the same prefix written
into ``swa_kv[swa_map[slot]]``. Any slot the cache serves can so be checked against the
prefix it must stand for, in both pools.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixserve.cache.swa import SWARadixCache
from radixserve.memory.swa_pool import HybridAllocator

FULL, SWA = 64, 24
seqs = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=20)


class SWAMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2]), window=st.sampled_from([2, 3, 5]))
    def setup(self, page: int, window: int) -> None:
        self.ps, self.W = page, window
        self.alloc = HybridAllocator(FULL, SWA, page)
        self.cache = SWARadixCache(self.alloc, window)
        self.full_kv: dict[int, tuple] = {}
        self.swa_kv: dict[int, tuple] = {}
        self.running: list = []  # (seq, node, slots, prefix_len)

    def _check_served(self, seq: list, m) -> None:
        slots = m.indices.tolist()
        assert len(slots) == m.length and m.length % self.ps == 0
        for i, f in enumerate(slots):
            assert self.full_kv.get(f) == tuple(seq[: i + 1]), "full KV of a served slot is wrong"
        for i in range(max(0, m.length - self.W + 1), m.length):
            s = int(self.alloc.swa_map[slots[i]])
            assert s >= 0, "a served window position has no SWA KV"
            assert self.swa_kv.get(s) == tuple(seq[: i + 1]), "SWA KV of a served slot is wrong"

    @rule(seq=seqs, finish=st.booleans())
    def start(self, seq, finish):
        m = self.cache.match_prefix(seq[:-1])
        self._check_served(seq, m)
        self.cache.lock(m.node)
        need = len(seq) - m.length
        got = self.alloc.alloc(need)
        if got is None:
            self.cache.evict_swa(need)
            self.cache.evict(need)
            got = self.alloc.alloc(need)
        if got is None:
            self.cache.unlock(m.node)
            return
        slots = torch.cat([m.indices, got])  # whole pages: the last may run past the sequence
        for i in range(m.length, len(seq)):  # "compute" the new tokens
            f = int(slots[i])
            self.full_kv[f] = tuple(seq[: i + 1])
            self.swa_kv[int(self.alloc.swa_map[f])] = tuple(seq[: i + 1])
        # The request frees the SWA KV that fell out of its window (its own pages only).
        lo = m.length
        hi = max(lo, (len(seq) - self.W + 1) // self.ps * self.ps)
        self.alloc.free_swa(slots[lo:hi])
        self.running.append((seq, m.node, slots, m.length))
        if finish:
            self.finish(len(self.running) - 1)

    @rule(i=st.integers(0, 50))
    def finish(self, i):
        if not self.running:
            return
        seq, node, slots, prefix = self.running.pop(i % len(self.running))
        n = self.cache.insert(seq, slots[: len(seq)])
        A = self.cache.cacheable_length(len(seq))
        if n > prefix:
            self.alloc.free(slots[prefix:n])
        self.alloc.free(slots[A:])
        self.cache.unlock(node)
        m = self.cache.match_prefix(seq)
        self._check_served(seq, m)

    @rule(k=st.integers(0, FULL))
    def evict(self, k):
        self.cache.evict(k)

    @rule(k=st.integers(0, SWA))
    def evict_swa(self, k):
        before = self.cache.swa_evictable_size
        freed = self.cache.evict_swa(k)
        assert freed >= min(k, before) or freed == before

    @rule(seq=seqs)
    def match(self, seq):
        self._check_served(seq, self.cache.match_prefix(seq))

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        a = self.alloc
        mapped = a.swa_map[: a.capacity]
        live = mapped[mapped >= 0]
        assert len(set(live.tolist())) == live.numel(), "an SWA slot is mapped twice"
        assert live.numel() + a.swa.available == a.swa.capacity, "SWA slots leaked"
        held = self.cache.held_slots().numel()
        private = sum(len(s) - p for _, _, s, p in self.running)
        assert a.available + held + private == a.capacity, "full slots leaked"


SWAMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
TestSWACacheStateful = SWAMachine.TestCase


def _serve(cache, alloc, seq, W):
    m = cache.match_prefix(seq)
    cache.lock(m.node)
    got = alloc.alloc(len(seq) - m.length)
    slots = torch.cat([m.indices, got])
    alloc.free_swa(slots[m.length : max(m.length, len(seq) - W + 1)])
    n = cache.insert(seq, slots)
    alloc.free(slots[m.length : n])
    cache.unlock(m.node)
    return m.length


def test_a_tombstone_in_the_window_stops_the_match_and_insert_revives_it():
    alloc = HybridAllocator(256, 256)
    cache = SWARadixCache(alloc, window=4)
    seq = list(range(1, 21))
    assert _serve(cache, alloc, seq, 4) == 0
    # The request kept SWA KV for its last 3 tokens only: tokens 0..16 are a tombstone.
    assert cache.swa_size == 3
    assert cache.match_prefix(seq).length == 20
    assert cache.match_prefix(seq[:12]).length == 0  # its window (tokens 9..11) is gone
    cache.check_integrity()
    # A request for the first 12 tokens recomputes them and revives its window there.
    assert _serve(cache, alloc, seq[:12], 4) == 0
    assert cache.match_prefix(seq[:12]).length == 12
    cache.check_integrity()


def test_window_locks_cover_only_the_last_window_before_the_node():
    alloc = HybridAllocator(256, 256)
    cache = SWARadixCache(alloc, window=4)
    seq = list(range(1, 21))
    m = cache.match_prefix(seq)
    slots = alloc.alloc(20)
    cache.insert(seq, slots)
    m = cache.match_prefix(seq)
    cache.lock(m.node)
    assert cache.swa_kv.protected == 3 and cache.swa_evictable_size == 17
    assert cache.evict_swa(100) == 17
    assert cache.match_prefix(seq).length == 20  # the locked window is still there
    cache.unlock(m.node)
    cache.check_integrity()
    assert cache.evict_swa(100) == 3 and cache.match_prefix(seq).length == 0
    assert cache.evict(100) == 20 and alloc.available == 256 and alloc.swa_available == 256


def test_window_recency_is_where_matches_end_not_what_they_walk_through():
    """Two conversations of two turns each, then a third turn of A: its match walks through
    A's first turn but ends after its second. SWA eviction of two windows must take the two
    first-turn windows (no match ends there), not B's windows (B's next turn needs B2's)."""
    W = 4
    alloc = HybridAllocator(256, 256)
    cache = SWARadixCache(alloc, window=W)
    a1, b1 = list(range(1, 7)), list(range(101, 107))
    a2, b2 = a1 + list(range(7, 13)), b1 + list(range(107, 113))
    for seq in (a1, b1):
        assert _serve(cache, alloc, seq, W) == 0
    assert _serve(cache, alloc, a2, W) == 6 and _serve(cache, alloc, b2, W) == 6
    assert cache.match_prefix(a2 + [13]).length == 12  # A's third turn
    assert cache.swa_size == 4 * (W - 1)  # a window at the end of every turn
    assert cache.evict_swa(2 * (W - 1)) == 2 * (W - 1)
    cache.check_integrity()
    assert cache.match_prefix(a2 + [13]).length == 12
    assert cache.match_prefix(b2 + [113]).length == 12
    assert cache.match_prefix(a1 + [99]).length == 0 and cache.match_prefix(b1 + [99]).length == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="allocator"):
        SWARadixCache(object(), 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        SWARadixCache(HybridAllocator(8, 8), 1)
