"""One radix tree under every prefix structure: the caches, the router's mirror and the
scheduler's DFS order are the same tree class, and the DFS order built on it equals the one
a plain per-token trie (the simple reference) gives."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache import HiRadixCache, RadixCache
from radixserve.cache.tree import RadixTree
from radixserve.placement.mirror import TokenTree
from radixserve.sched.policy import order_dfs_weight


def test_every_prefix_structure_is_the_one_tree():
    for cls in (RadixCache, HiRadixCache, TokenTree):
        assert issubclass(cls, RadixTree)
        for name in ("_descend", "_split", "_peek", "_lock_path", "_unlock_path", "_unlink"):
            assert getattr(cls, name) is getattr(RadixTree, name), (cls.__name__, name)


@dataclass
class _Req:
    seq_no: int
    fill_ids: list = field(default_factory=list)


def _trie_order(reqs: list) -> list:
    """Reference: DFS over a per-token trie, heavier children first, ties by first arrival."""
    root: dict = {"kids": {}, "reqs": [], "w": 0}
    for r in sorted(reqs, key=lambda r: r.seq_no):
        node = root
        node["w"] += 1
        for t in r.fill_ids:
            node = node["kids"].setdefault(t, {"kids": {}, "reqs": [], "w": 0})
            node["w"] += 1
        node["reqs"].append(r)
    out: list = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(node["reqs"])
        stack.extend(sorted(node["kids"].values(), key=lambda c: c["w"]))
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from([1, 2, 3, 2**31]), max_size=7), max_size=12))
def test_dfs_weight_order_equals_the_token_trie(seqs):
    reqs = [_Req(i, s) for i, s in enumerate(seqs)]
    assert [r.seq_no for r in order_dfs_weight(reqs)] == [r.seq_no for r in _trie_order(reqs)]
