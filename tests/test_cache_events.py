"""Cache events replayed into a mirror give exactly the token sequences the tree holds."""

from __future__ import annotations

from array import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import RadixCache
from radixserve.cache.events import CLEARED, REMOVED, STORED, CacheEvent


class Mirror:
    """The simplest exact mirror: a trie of pages per salt (nested dicts). Page granularity,
    because two page-aligned runs may share their first tokens and still be siblings."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.roots: dict = {}

    def apply(self, ev: CacheEvent) -> None:
        if ev.kind == CLEARED:
            self.roots.clear()
            return
        raw = list(array("I", ev.tokens))
        p = self.page
        assert len(raw) % p == 0 and ev.length % p == 0
        toks = [tuple(raw[i : i + p]) for i in range(0, len(raw), p)]
        node = self.roots.setdefault(ev.salt, {})
        keep = len(toks) - ev.length // p
        for t in toks[:keep]:
            assert t in node, "event under a prefix the mirror does not hold"
            node = node[t]
        if ev.kind == STORED:
            for t in toks[keep:]:
                node = node.setdefault(t, {})
            return
        assert ev.kind == REMOVED
        run = toks[keep:]
        path = [node]
        for t in run:
            path.append(path[-1][t])
        assert not path[-1], "removed a run that still has children"
        del node[run[0]]

    @property
    def held(self) -> dict:
        out = {}
        for salt, root in self.roots.items():
            s = set()
            stack = [(root, ())]
            while stack:
                node, prefix = stack.pop()
                for t, child in node.items():
                    for k in range(1, len(t) + 1):
                        s.add(prefix + t[:k])
                    stack.append((child, prefix + t))
            out[salt] = s
        return out


def tree_prefixes(cache: RadixCache) -> dict:
    out: dict = {}
    for salt, root in cache._roots.items():
        s = set()
        stack = [(c, ()) for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            toks = tuple(array("I", node.key))
            for k in range(1, len(toks) + 1):
                s.add(prefix + toks[:k])
            stack.extend((c, prefix + toks) for c in node.children.values())
        if s:
            out[salt] = s
    return out


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


@settings(max_examples=150, deadline=None)
@given(ops=ops, page=st.sampled_from([1, 2]))
def test_mirror_replays_tree(ops, page):
    cache = RadixCache(page_size=page)
    mirror = Mirror(page)
    cache.listener = mirror.apply
    slot = 0
    for kind, a, salt in ops:
        if kind == "insert":
            idx = torch.arange(slot, slot + len(a))
            slot += len(a)
            cache.insert(a, idx, salt=salt)
        elif kind == "match":
            cache.match_prefix(a, salt=salt)  # may split nodes: no event, same contents
        elif kind == "evict":
            cache.evict(a)
        else:
            cache.reset()
        assert {k: v for k, v in mirror.held.items() if v} == tree_prefixes(cache)
    # A fresh mirror built from a snapshot agrees too.
    fresh = Mirror(page)
    for ev in cache.snapshot_events():
        fresh.apply(ev)
    assert {k: v for k, v in fresh.held.items() if v} == tree_prefixes(cache)
