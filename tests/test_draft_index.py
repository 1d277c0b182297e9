"""The draft index of speculative decoding (``radixserve/cache/draft_index.py``): what follows
a suffix in a real radix tree, kept by the tree's own events through splits and evictions,
one namespace per salt, never holding an entry for a node the tree let go."""

from __future__ import annotations

from array import array

import torch

from radixserve.cache.draft_index import MAX_FORK, TreeDraftIndex
from radixserve.cache.events import fan_out
from radixserve.cache.radix import RadixCache


def _packed(ids: list[int]) -> bytes:
    return array("I", ids).tobytes()


def _cache() -> tuple[RadixCache, TreeDraftIndex, list]:
    freed: list = []
    cache = RadixCache(on_free=freed.append)
    index = TreeDraftIndex(cache, 2, 4)
    cache.listener = fan_out(cache.listener, index.on_event)
    return cache, index, freed


def _insert(cache: RadixCache, ids: list[int], salt: str | None = None, base: int = 0) -> None:
    cache.insert(ids, torch.arange(base, base + len(ids)), salt=salt)


def test_index_follows_the_tree() -> None:
    cache, index, _ = _cache()
    _insert(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert index.lookup(None, _packed([9, 3, 4]), 3) == (2, [5, 6, 7])  # the longest suffix found
    assert index.lookup(None, _packed([2, 3, 4]), 10) == (3, [5, 6, 7, 8])
    assert index.lookup(None, _packed([8]), 3) == (0, [])  # shorter than min_ngram
    assert index.lookup(None, _packed([7, 8]), 3) == (0, [])  # nothing follows
    # A branch splits the node; positions above the split still resolve, and the draft
    # continues down the child used last.
    _insert(cache, [1, 2, 3, 4, 50, 51], base=100)
    assert index.lookup(None, _packed([2, 3]), 4) == (2, [4, 50, 51])  # the newest occurrence
    cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert index.lookup(None, _packed([1, 2, 3]), 4) == (3, [4, 5, 6, 7])
    assert index.lookup(None, _packed([5, 6]), 4) == (2, [7, 8])


def test_index_is_per_salt_and_forgets_what_the_tree_evicts() -> None:
    cache, index, freed = _cache()
    _insert(cache, [1, 2, 3, 4, 5], salt="alice")
    assert not freed
    assert index.lookup("bob", _packed([2, 3]), 3) == (0, [])
    assert index.lookup(None, _packed([2, 3]), 3) == (0, [])
    assert index.lookup("alice", _packed([2, 3]), 3) == (2, [4, 5])
    _insert(cache, [9, 2, 3, 7, 7, 7], salt="bob", base=10)
    assert index.lookup("bob", _packed([2, 3]), 3) == (2, [7, 7, 7])
    assert index.lookup("alice", _packed([2, 3]), 3) == (2, [4, 5])
    assert index.num_entries() == 9 + 11  # [7, 7] ends twice in bob's run: one entry
    cache.evict(100)
    assert index.num_entries() == 0 and index.salts() == []
    assert sum(int(f.numel()) for f in freed) == 11
    _insert(cache, [1, 2, 3, 4, 5])
    cache.reset()  # cleared: everything goes
    assert index.num_entries() == 0


def test_index_keeps_other_occurrences_when_a_leaf_goes() -> None:
    """Evicting one branch drops the entries pointing into it, not an entry for the same
    tokens pointing at a live occurrence elsewhere, and no entry outlives its node."""
    cache, index, _ = _cache()
    _insert(cache, [1, 2, 9, 5, 6, 8])
    _insert(cache, [1, 2, 3, 4, 5, 6, 7], base=10)  # [5, 6] again, newer: the entry points here
    assert index.lookup(None, _packed([5, 6]), 2) == (2, [7])
    assert index.lookup(None, _packed([2, 9]), 2) == (2, [5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    cache.lock(m.node)
    assert cache.evict(4) == 4  # the [9, 5, 6, 8] branch: the only unlocked leaf
    assert index.lookup(None, _packed([2, 9]), 2) == (0, [])
    assert index.lookup(None, _packed([6, 8]), 2) == (0, [])
    assert index.lookup(None, _packed([5, 6]), 2) == (2, [7])
    cache.unlock(m.node)
    cache.evict(100)
    assert index.num_entries() == 0


def test_index_stops_at_a_wide_fork() -> None:
    cache, index, _ = _cache()
    _insert(cache, [1, 2, 3])
    for i in range(MAX_FORK + 1):
        _insert(cache, [1, 2, 3, 100 + i, 7], base=10 * (i + 1))
    assert index.lookup(None, _packed([1, 2]), 4) == (2, [3])
