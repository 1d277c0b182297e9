"""Looking at the tiered tree without changing it: the slots it holds, a snapshot as events,
its contents by tier, a dump, and ``check_integrity``, which checks these invariants:

* Every node holds its run in L1, in L2, or in both; a run in neither leaves the tree.
* L1 is prefix-closed: the parent of an L1 node is in L1. So a match is an L1 prefix
  followed by an L2 continuation, and L1 eviction takes L1 leaves (nodes with no L1 child).
* A slot of either pool is in exactly one place: its free list, one node, or (L1 only) a
  request. ``evictable_size + protected_size == total_size`` counts L1 tokens only, so the
  scheduler's memory accounting (``free + evictable``) is unchanged.
* ``lock_ref`` (running requests, L1) and ``pin_ref`` (transfers) both count the node and its
  descendants, like RadixCache's lock. A locked node cannot leave L1; a pinned node cannot
  leave the tree and its L2 copy cannot be freed. Pins are taken only inside a call, because
  every copy is synchronous on return (an asynchronous device backend would hold them until
  its copy completes and release them in ``poll``), so none is left between calls.
* Every eviction candidate of either tier is queued in its heap, once; deferred loads read
  only L2 slots the tree still holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Hashable, List

import numpy as np
import torch

from ..base import empty_indices
from ..events import STORED, CacheEvent
from ..packed import unpack
from ..radix_introspect import dump as _dump

if TYPE_CHECKING:
    from .node import HiNode
    from .tree import HiRadixCache

__all__ = ["held_slots", "snapshot_events", "tier_contents", "dump", "check_integrity"]

_EMPTY = np.empty(0, dtype=np.int64)


def held_slots(t: "HiRadixCache") -> torch.Tensor:
    """Every L1 slot the tree holds (for the scheduler's integrity check)."""
    vals = [n.value for n in t.iter_nodes() if n.value is not None]
    return torch.from_numpy(np.concatenate(vals)) if vals else empty_indices()


def snapshot_events(t: "HiRadixCache") -> List[CacheEvent]:
    """STORED events (parents first, tiers L1 and L2) that rebuild a mirror from empty."""
    out: List[CacheEvent] = []
    for salt, path, node in t.iter_paths():
        L = len(node.key) >> 2
        out.append(CacheEvent(STORED, salt, path, L, "L2"))
        if node.value is not None:
            out.append(CacheEvent(STORED, salt, path, L, "L1"))
    return out


def tier_contents(t: "HiRadixCache", salt: Hashable = None) -> Dict[str, set]:
    """``{"L1": {...}, "L2": {...}}``: every cached token prefix (as a tuple) by tier, where
    "L2" means L1 or L2 as in the events. O(tokens^2): tests only."""
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


def dump(t: "HiRadixCache", max_tokens: int = 8) -> str:
    """One line per node: id, edge tokens, tiers, slots of both pools, lock, pin, hits, stamp."""

    def extra(c: "HiNode", fmt) -> str:
        l2 = fmt(c.host.tolist()) if c.host is not None else ""
        return f" tiers={c.tiers or '-'}{'+L3' if c.in_l3 else ''} l2=[{l2}] pin={c.pin_ref}"

    return _dump(t, max_tokens, extra)


def check_integrity(t: "HiRadixCache") -> None:
    """The invariants above: structure, tier rules, sizes, locks/pins, slot uniqueness in both
    pools, heaps, deferred loads."""
    evictable = protected = host = 0
    l1_vals, l2_vals = [], []
    nodes = t.check_structure()
    for salt, root in t._roots.items():
        if root.value is not None or root.host is not None:
            raise AssertionError("a root holds slots")
        if root.pin_ref or root.lock_ref:
            raise AssertionError(f"root of salt {salt!r} pinned/locked outside a call")
    for node in nodes:
        n = len(node.key) >> 2
        parent = node.parent
        if node.value is not None and parent.parent is not None and parent.value is None:
            raise AssertionError(f"{node!r}: in L1 under a parent that is not")
        if node.pin_ref < sum(c.pin_ref for c in node.children.values()):
            raise AssertionError(f"{node!r}: pin below the sum of its children's")
        if node.value is None and node.host is None:
            raise AssertionError(f"{node!r}: in no tier")
        for name, v in (("value", node.value), ("host", node.host)):
            if v is not None and (v.dtype != np.int64 or v.ndim != 1 or len(v) != n):
                raise AssertionError(f"{node!r}: {name} must be 1-D int64 of {n}")
        if node.lock_ref and node.value is None:
            raise AssertionError(f"{node!r}: locked but not in L1")
        if node.pin_ref:
            raise AssertionError(f"{node!r}: pinned outside a call")
        if node.value is not None:
            l1_vals.append(node.value)
            if node.lock_ref:
                protected += n
            else:
                evictable += n
                if not t._has_l1_child(node) and not node.in_heap:
                    raise AssertionError(f"{node!r}: L1 eviction candidate not queued")
        if node.host is not None:
            l2_vals.append(node.host)
            host += n
            if (node.value is not None or not node.children) and not node.in_heap2:
                raise AssertionError(f"{node!r}: L2 eviction candidate not queued")
    if evictable != t._evictable or protected != t._protected:
        raise AssertionError(f"L1 accounting: tree has evictable={evictable} protected={protected}, "
                             f"counters say {t._evictable}/{t._protected}")
    if host != t._host_size:
        raise AssertionError(f"L2 accounting: tree holds {host}, counter says {t._host_size}")
    if host != t.host_pool.used:
        raise AssertionError(f"L2 slots: tree holds {host}, host pool has {t.host_pool.used} in use")
    for name, vals, free in (("L1", l1_vals, t.allocator.free_slot_set),
                             ("L2", l2_vals, t.host_pool.allocator.free_slot_set)):
        if vals:
            allv = np.concatenate(vals)
            if len(np.unique(allv)) != len(allv):
                raise AssertionError(f"an {name} slot is held by two tree positions")
            if free() & set(allv.tolist()):
                raise AssertionError(f"an {name} slot is both in the tree and free")
    for heap, flag in ((t._heap1, "in_heap"), (t._heap2, "in_heap2")):
        seen = set()
        for stamp, nid, node in heap:
            if node.key is None:
                continue  # dead nodes' entries are dropped lazily
            if nid in seen:
                raise AssertionError(f"{node!r}: two entries in one heap")
            seen.add(nid)
            if not getattr(node, flag) or stamp > node.last_access:
                raise AssertionError(f"{node!r}: bad heap entry")
        flagged = {n.id for n in nodes if getattr(n, flag)}
        if flagged != seen:
            raise AssertionError(f"{flag} flags disagree with the heap")
    for h, _ in t._tiers.pending:
        if len(h) and not np.isin(h, np.concatenate(l2_vals) if l2_vals else _EMPTY).all():
            raise AssertionError("a pending load reads an L2 slot the tree no longer holds")
