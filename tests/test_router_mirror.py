"""The router's mirror tree: exact against a real RadixCache (events replayed), and its
reference-counted use (in-flight prompts) against a plain list of sequences."""

from __future__ import annotations

from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import RadixCache
from radixserve.cache.events import CLEARED, REMOVED, STORED, CacheEvent
from radixserve.kv_events import Batch, Load, Snapshot
from radixserve.placement.mirror import TokenTree, WorkerMirror, leaf_paths_of_events, pack


def held_set(tree: TokenTree) -> dict:
    """Every held page-aligned prefix per salt (reference representation)."""
    out: dict = {}
    p = tree.page_size
    for salt, path in tree.leaf_paths():
        toks = tuple(array("I", path))
        s = out.setdefault(salt, set())
        for k in range(p, len(toks) + 1, p):
            s.add(toks[:k])
    return out


def cache_held(cache: RadixCache) -> dict:
    out: dict = {}
    p = cache.page_size
    for salt, root in cache._roots.items():
        s = set()
        stack = [(c, ()) for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            toks = prefix + tuple(array("I", node.key))
            for k in range(len(prefix) + p, len(toks) + 1, p):
                s.add(toks[:k])
            stack.extend((c, toks) for c in node.children.values())
        if s:
            out[salt] = s
    return out


def cache_match(cache: RadixCache, ids, salt) -> int:
    """Longest held prefix without touching the cache (match_prefix would split/stamp)."""
    held = cache_held(cache).get(salt, set())
    p = cache.page_size
    best = 0
    for k in range(p, len(ids) + 1, p):
        if tuple(ids[:k]) in held:
            best = k
    return best


ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 3), min_size=1, max_size=12),
                  st.sampled_from([None, "a"])),
        st.tuples(st.just("match"), st.lists(st.integers(0, 3), min_size=1, max_size=12),
                  st.sampled_from([None, "a"])),
        st.tuples(st.just("evict"), st.integers(1, 10), st.none()),
        st.tuples(st.just("reset"), st.none(), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, page=st.sampled_from([1, 2, 3]),
       probes=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=12), st.sampled_from([None, "a"])),
                       max_size=6))
def test_mirror_equals_tree(ops, page, probes):
    cache = RadixCache(page_size=page)
    mirror = WorkerMirror(page)
    bad: list = []
    cache.listener = lambda ev: bad.append(ev) if not mirror.apply_event(ev) else None
    slot = 0
    for kind, a, salt in ops:
        if kind == "insert":
            cache.insert(a, torch.arange(slot, slot + len(a)), salt=salt)
            slot += len(a)
        elif kind == "match":
            cache.match_prefix(a, salt=salt)  # splits the worker's nodes, never the mirror's
        elif kind == "evict":
            cache.evict(a)
        else:
            cache.reset()
        assert not bad
        assert held_set(mirror.tree("L1")) == cache_held(cache)
        assert mirror.held_tokens() == cache.total_size
        for q, s in probes:
            assert mirror.match(pack(q), s).get("L1", 0) == cache_match(cache, q, s)
    # The independent leaf computation over the worker's snapshot agrees with the mirror.
    snap = cache.snapshot_events()
    assert leaf_paths_of_events(snap).get("L1", set()) == mirror.tree("L1").leaf_paths()


@settings(max_examples=200, deadline=None)
@given(seq=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=9),
                              st.sampled_from([None, "s"])), max_size=30),
       page=st.sampled_from([1, 2]),
       probe=st.lists(st.integers(0, 2), max_size=9))
def test_refcounted_multiset(seq, page, probe):
    """insert/discard as a multiset: match is the longest page-aligned common prefix with
    any sequence still in it."""
    tree = TokenTree(page)
    live: list = []
    for add, toks, salt in seq:
        if add or not live:
            tree.insert(pack(toks), salt)
            live.append((salt, toks))
        else:
            s, t = live.pop(0)
            tree.discard(pack(t), s)
        for salt in (None, "s"):
            want = 0
            for s, t in live:
                if s != salt:
                    continue
                k = 0
                while k < min(len(t), len(probe)) and t[k] == probe[k]:
                    k += 1
                want = max(want, k - k % page)
            # Only whole pages of what was inserted are held.
            assert tree.match(pack(probe), salt) == want
    for s, t in live:
        tree.discard(pack(t), s)
    assert tree.num_tokens == 0 and tree.num_nodes == 0 and not tree.roots


def _ev(kind, toks, length, salt=None, tier="L1"):
    return CacheEvent(kind, salt, pack(toks), length, tier)


def test_remove_must_fit():
    m = WorkerMirror(1)
    assert m.apply_event(_ev(STORED, [1, 2, 3], 3))
    assert m.apply_event(_ev(STORED, [1, 2, 3, 4, 5], 2))
    assert not m.apply_event(_ev(REMOVED, [1, 2, 3], 3))  # not a leaf
    assert not m.apply_event(_ev(REMOVED, [7], 1))  # not held
    assert not m.apply_event(_ev(STORED, [9, 9, 9], 1))  # prefix missing
    assert m.apply_event(_ev(REMOVED, [1, 2, 3, 4, 5], 2))
    assert m.match(pack([1, 2, 3, 4]), None) == {"L1": 3}


def test_tiers_are_separate():
    m = WorkerMirror(1)
    m.apply_event(_ev(STORED, [1, 2], 2))
    m.apply_event(_ev(STORED, [1, 2, 3, 4], 4, tier="L2"))
    assert m.match(pack([1, 2, 3, 4, 5]), None) == {"L1": 2, "L2": 4}
    m.apply_event(_ev(CLEARED, [], 0))
    assert m.match(pack([1, 2, 3, 4, 5]), None) == {"L2": 4}


def _batch(seq, events=(), epoch=7, page=1):
    return Batch("w", epoch, seq, page, 0.0, list(events), Load(0, 0, 10, 10))


def test_sequencing():
    m = WorkerMirror(1)
    assert not m.synced
    assert not m.apply_message(_batch(1, [_ev(STORED, [1], 1)]))  # ignored before a snapshot
    assert m.held_tokens() == 0
    snap = Snapshot("w", 7, 3, 1, 0.0, [_ev(STORED, [5, 6], 2)], None)
    assert not m.apply_message(snap) and m.synced
    assert not m.apply_message(_batch(4, [_ev(STORED, [5, 6, 7], 1)]))
    assert m.match(pack([5, 6, 7]), None) == {"L1": 3}
    assert m.apply_message(_batch(6))  # gap: needs a snapshot
    assert not m.synced and m.status.gaps == 1
    assert not m.apply_message(Snapshot("w", 7, 6, 1, 0.0, [], None))
    assert m.held_tokens() == 0 and m.status.resyncs == 1
    assert m.apply_message(_batch(7, epoch=8))  # the worker restarted
    # A snapshot with another page size rebuilds the trees at that granularity.
    assert not m.apply_message(Snapshot("w", 8, 0, 2, 0.0, [_ev(STORED, [1, 2, 3, 4], 4)], None))
    assert m.page_size == 2 and m.match(pack([1, 2, 3, 5]), None) == {"L1": 2}


def test_mismatching_event_asks_for_snapshot():
    m = WorkerMirror(1)
    m.apply_message(Snapshot("w", 1, 0, 1, 0.0, [], None))
    assert m.apply_message(_batch(1, [_ev(REMOVED, [1, 2], 2)], epoch=1))
    assert not m.synced and m.status.mismatches == 1


def test_bad_page_size():
    with pytest.raises(ValueError, match="page_size"):
        TokenTree(0)
