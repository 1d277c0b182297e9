"""The router's mirror of a hybrid model's tree: with the tree's tombstone events and its
window, the mirror holds the same tokens with the same sliding-window state and predicts
exactly the prefix the tree serves (the stateful machine of test_cache_swa, mirrored)."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from radixserve.cache.events import REVIVED, STORED, TOMBSTONED, CacheEvent
from radixserve.cache.swa import SWARadixCache
from radixserve.kv_events import Batch, Snapshot
from radixserve.memory.swa_pool import HybridAllocator
from radixserve.placement.mirror import TokenTree, WorkerMirror, pack
from test_cache_swa import SWAMachine, _serve, seqs


def token_states(tree) -> dict:  # noqa: ANN001 - a cache or a mirror tree
    """Every held page as ``(salt, prefix through it) -> has its sliding-window KV``."""
    out = {}
    ps = tree.page_size
    for salt, path, nd in tree.iter_paths():
        toks = tuple(array("I", path))
        for k in range(len(toks) - (len(nd.key) >> 2) + ps, len(toks) + 1, ps):
            out[(salt, toks[:k])] = nd.swa
    return out


class MirroredSWAMachine(SWAMachine):
    @initialize(page=st.sampled_from([1, 2]), window=st.sampled_from([2, 3, 5]))
    def setup(self, page: int, window: int) -> None:
        super().setup(page, window)
        self.mirror = WorkerMirror(self.ps)
        self.mirror.apply_message(Snapshot("w", 1, 0, self.ps, 0.0, [], None, self.W))
        self.misfits: list = []
        self.kinds: set = set()

        def listen(ev: CacheEvent) -> None:
            self.kinds.add(ev.kind)
            if not self.mirror.apply_event(ev):
                self.misfits.append(ev)

        self.cache.listener = listen

    @rule(seq=seqs)
    def probe(self, seq):
        want = self.cache.match_prefix(seq).length
        assert self.mirror.match(pack(seq)).get("L1", 0) == want

    @invariant()
    def mirrored(self):
        if not hasattr(self, "mirror"):
            return
        assert not self.misfits, self.misfits[:3]
        tree = self.mirror.tree()
        assert token_states(tree) == token_states(self.cache)
        assert tree.tombstoned == self.cache.total_size - self.cache.swa_size
        # A mirror (re)built from a snapshot is the same mirror.
        fresh = WorkerMirror(self.ps)
        assert not fresh.apply_message(Snapshot("w", 2, 0, self.ps, 0.0, self.cache.snapshot_events(), None,
                                                self.W))
        assert token_states(fresh.tree()) == token_states(tree)


MirroredSWAMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
TestMirroredSWACache = MirroredSWAMachine.TestCase


def _mirrored(window: int, page: int = 1):
    alloc = HybridAllocator(256, 256, page)
    cache = SWARadixCache(alloc, window)
    mirror = WorkerMirror(page)
    mirror.apply_message(Snapshot("w", 1, 0, page, 0.0, [], None, window))
    events: list = []

    def listen(ev: CacheEvent) -> None:
        events.append(ev)
        assert mirror.apply_event(ev), ev

    cache.listener = listen
    return alloc, cache, mirror, events


def test_tombstones_reach_the_mirror_and_stop_its_match():
    alloc, cache, mirror, events = _mirrored(4)
    seq = list(range(1, 21))
    _serve(cache, alloc, seq, 4)
    # The request kept SWA KV for its last 3 tokens: it entered with a tombstone before them.
    assert [e.kind for e in events] == [STORED, TOMBSTONED]
    assert events[1].length == 17
    tree = mirror.tree()
    assert tree.tombstoned == 17
    assert mirror.match(pack(seq[:12]))["L1"] == 0 == cache.match_prefix(seq[:12]).length
    assert tree.held_prefix(pack(seq[:12])) == 12  # full KV held, window gone
    assert mirror.match(pack(seq))["L1"] == 20
    # Recomputing the first 12 tokens revives their window, in the tree and in the mirror.
    _serve(cache, alloc, seq[:12], 4)
    assert REVIVED in [e.kind for e in events]
    assert mirror.match(pack(seq[:12]))["L1"] == 12 == cache.match_prefix(seq[:12]).length
    # The SWA LRU tombstones everything unlocked; the mirror follows.
    cache.evict_swa(100)
    assert tree.tombstoned == cache.total_size == 20
    assert mirror.match(pack(seq))["L1"] == 0 == cache.match_prefix(seq).length
    assert token_states(tree) == token_states(cache)
    cache.evict(100)
    assert tree.num_tokens == tree.tombstoned == 0


def test_window_events_that_do_not_fit_ask_for_a_snapshot():
    tree = TokenTree(1, window=4)
    q = pack(range(1, 9))
    assert not tree.set_window_kv(q, 4, None, False)  # not held
    tree.insert(q)
    assert not tree.set_window_kv(q, 9, None, False)  # longer than the path
    assert not tree.set_window_kv(q, 4, None, True)  # already live
    assert tree.set_window_kv(q, 4, None, False)
    assert not tree.set_window_kv(q, 2, None, False)  # already a tombstone
    assert tree.tombstoned == 4
    assert not TokenTree(1).set_window_kv(q, 4, None, False)  # no window: no tombstones
    m = WorkerMirror(1)
    m.apply_message(Snapshot("w", 1, 0, 1, 0.0, [], None, 4))
    assert m.apply_message(Batch("w", 1, 1, 1, 0.0, [CacheEvent(TOMBSTONED, None, q, 4)], None, 4))
    assert not m.synced


def test_a_changed_window_is_a_resync():
    m = WorkerMirror(1)
    m.apply_message(Snapshot("w", 1, 0, 1, 0.0, [CacheEvent(STORED, None, pack([1, 2, 3]), 3)], None, 4))
    assert m.window == 4 and m.tree().window == 4
    assert m.apply_message(Batch("w", 1, 1, 1, 0.0, [], None, 8))  # a batch of another window
    assert not m.synced
    assert not m.apply_message(Snapshot("w", 1, 1, 1, 0.0, [], None, 8))
    assert m.window == 8 and m.tree().window == 8 and m.synced


@pytest.mark.parametrize("window", [-1, 1, True, 2.0])
def test_publisher_window_must_be_a_window(window):
    from radixserve.kv_events import KVEventPublisher

    with pytest.raises(ValueError, match="window"):
        KVEventPublisher("tcp://127.0.0.1:0", "w", 1, window=window)
