"""Looking at the tiered tree without changing it (a snapshot as events, its contents by
tier, a dump), and the invariants ``check_integrity`` holds it to (with ``HostTier.check``):

* Every node holds its run in L1, in L2, or in both; a run in neither leaves the tree.
* L1 is prefix-closed: the parent of an L1 node is in L1. So a match is an L1 prefix
  followed by an L2 continuation, and L1 eviction takes L1 leaves (nodes with no L1 child).
* A slot of either pool is in exactly one place: its free list, one node, or (L1 only) a
  request. ``evictable_size + protected_size == total_size`` counts L1 tokens only (the
  scheduler's ``free + evictable`` accounting is unchanged).
* ``lock_ref`` (running requests, L1) and ``pin_ref`` (transfers) both count the node and its
  descendants. A locked node cannot leave L1; a pinned node cannot leave the tree nor lose
  its L2 copy. Pins are taken only inside a call, since every copy is synchronous on return
  (an asynchronous backend would release them in ``poll``), so none is left between calls.
* Every eviction candidate of either tier is queued in its LRU queue; deferred loads read
  only L2 slots the tree still holds.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Sequence, Tuple

from ..events import STORED, CacheEvent
from ..packed import unpack
from ..radix_introspect import dump as _dump
from ..tree import RadixTree
from .node import HiNode

__all__ = ["snapshot_events", "tier_contents", "dump", "check_tier_rules"]


def snapshot_events(t: RadixTree) -> List[CacheEvent]:
    """See :meth:`.hiradix.HiRadixCache.snapshot_events`."""
    return [CacheEvent(STORED, salt, path, len(node.key) >> 2, tier) for salt, path, node in t.iter_paths()
            for tier in (("L2",) if node.value is None else ("L2", "L1"))]


def tier_contents(t: RadixTree, salt: Hashable = None) -> Dict[str, set]:
    """See :meth:`.hiradix.HiRadixCache.tier_contents`."""
    out: Dict[str, set] = {"L1": set(), "L2": set()}
    for s, path, node in t.iter_paths():
        if s != salt:
            continue
        toks = tuple(unpack(path))
        for i in range(len(toks) - node.num_tokens + 1, len(toks) + 1):
            out["L2"].add(toks[:i])
            if node.value is not None:
                out["L1"].add(toks[:i])
    return out


def dump(t: RadixTree, max_tokens: int = 8) -> str:
    """One line per node: id, edge tokens, tiers, slots of both pools, lock, pin, hits, stamp."""

    def extra(c: HiNode, fmt) -> str:
        l2 = fmt(c.host.tolist()) if c.host is not None else ""
        return f" tiers={c.tiers or '-'}{'+L3' if c.in_l3 else ''} l2=[{l2}] pin={c.pin_ref}"

    return _dump(t, max_tokens, extra)


def check_tier_rules(roots: Iterable[Tuple[Hashable, HiNode]], nodes: Sequence[HiNode]) -> List[HiNode]:
    """The per-node tier rules above (roots hold nothing, L1 prefix-closed, every run in some
    tier, locks only in L1, no pin between calls); returns the nodes in L1."""
    for salt, root in roots:
        if (root.value is not None and len(root.value)) or root.host is not None:
            raise AssertionError("a root holds slots")
        if root.pin_ref or root.lock_ref:
            raise AssertionError(f"root of salt {salt!r} pinned/locked outside a call")
    in_l1 = []
    for node in nodes:
        if node.value is not None:
            in_l1.append(node)
            parent = node.parent
            if parent.parent is not None and parent.value is None:
                raise AssertionError(f"{node!r}: in L1 under a parent that is not")
        elif node.host is None:
            raise AssertionError(f"{node!r}: in no tier")
        elif node.lock_ref:
            raise AssertionError(f"{node!r}: locked but not in L1")
        if node.pin_ref:
            raise AssertionError(f"{node!r}: pinned outside a call")
    return in_l1
