"""Looking at a :class:`~.radix.RadixCache` without changing it: a snapshot as events, the
slots it holds, its leaves, nested dicts, a dump, and ``check_integrity``. Full scans, kept out
of the tree's module so the hot path reads alone; the cache's methods of the same names call
these."""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Iterator, List

import numpy as np
import torch

from .base import empty_indices
from .events import STORED, CacheEvent
from .packed import unpack

if TYPE_CHECKING:
    from .radix import RadixCache, TreeNode

__all__ = ["snapshot_events", "held_slots", "iter_nodes", "as_dict", "dump",
           "check_integrity"]


def snapshot_events(t: "RadixCache") -> List[CacheEvent]:
    """``stored`` events that rebuild the current contents from empty (parents first):
    what a mirror that (re)connects replays before the live stream."""
    out: List[CacheEvent] = []
    for salt, root in t._roots.items():
        stack = [(c, b"") for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            out.append(CacheEvent(STORED, salt, path, len(node.value)))
            stack.extend((c, path) for c in node.children.values())
    return out


def held_slots(t: "RadixCache") -> torch.Tensor:
    values = [n.value for n in iter_nodes(t)]
    return torch.from_numpy(np.concatenate(values)) if values else empty_indices()


def iter_nodes(t: "RadixCache") -> Iterator["TreeNode"]:
    """Yield every non-root node (DFS)."""
    for root in t._roots.values():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def as_dict(t: "RadixCache", salt: Hashable = None) -> dict:
    """The tree of one namespace as nested ``{tuple(edge tokens): {...children}}``."""

    def rec(node: TreeNode) -> dict:
        return {tuple(unpack(c.key)): rec(c) for c in node.children.values()}

    root = t._roots.get(salt)
    return {} if root is None else rec(root)


def dump(t: "RadixCache", max_tokens: int = 8) -> str:
    """One line per node: id, edge tokens (abbreviated), slots, lock, hits, stamp."""
    lines = [repr(t)]

    def fmt(seq: list) -> str:
        s = ",".join(map(str, seq[:max_tokens]))
        return s + (",..." if len(seq) > max_tokens else "")

    def rec(node: TreeNode, depth: int) -> None:
        for c in sorted(node.children.values(), key=lambda x: x.id):
            lines.append(
                f"{'  ' * depth}#{c.id} [{fmt(unpack(c.key))}] len={len(c.value)} "
                f"slots=[{fmt(c.value.tolist())}] lock={c.lock_ref} hits={c.hit_count} "
                f"last={c.last_access}"
            )
            rec(c, depth + 1)

    for salt, root in t._roots.items():
        if root.children or salt is None:
            lines.append(f"root salt={salt!r}")
            rec(root, 1)
    return "\n".join(lines)


def check_integrity(t: "RadixCache") -> None:
    """Verify structure, sizes, lock counts, slot uniqueness and the eviction heap."""
    ps = t.page_size
    evictable = protected = count = 0
    values = []
    live_ids = set()
    if t._roots.get(None) is not t._default_root:
        raise AssertionError("default root missing")
    for salt, root in t._roots.items():
        if root.parent is not None or root.key != b"" or root.salt != salt:
            raise AssertionError(f"bad root for salt {salt!r}")
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for ck, child in node.children.items():
                if child.parent is not node:
                    raise AssertionError(f"{child!r}: parent pointer broken")
                if child.key is None or not child.key:
                    raise AssertionError(f"{child!r}: empty/dead key in the tree")
                if ck != t._child_key(child.key):
                    raise AssertionError(f"{child!r}: stored under the wrong child key {ck!r}")
                if node.parent is not None and child.last_access > node.last_access:
                    raise AssertionError(f"{child!r}: newer than its parent {node!r}")
                child_locks += child.lock_ref
                stack.append(child)
            if node.parent is None:
                continue
            if type(node.key) is not bytes or len(node.key) != 4 * len(node.value):
                raise AssertionError(f"{node!r}: key/value length mismatch")
            if len(node.value) % ps:
                raise AssertionError(f"{node!r}: length not a multiple of page_size")
            if node.value.dtype != np.int64 or node.value.ndim != 1:
                raise AssertionError(f"{node!r}: value must be 1-D int64")
            if node.lock_ref < child_locks:
                raise AssertionError(f"{node!r}: lock_ref below the sum of its children's")
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
                if not node.children and not node.in_heap:
                    raise AssertionError(f"{node!r}: evictable leaf missing from the heap")
            count += 1
            live_ids.add(node.id)
            values.append(node.value)
    if evictable != t._evictable or protected != t._protected:
        raise AssertionError(
            f"size accounting: tree has evictable={evictable} protected={protected}, "
            f"counters say {t._evictable}/{t._protected}"
        )
    if count != t._num_nodes:
        raise AssertionError(f"num_nodes {t._num_nodes} != {count}")
    if values:
        allv = np.concatenate(values)
        if len(np.unique(allv)) != len(allv):
            raise AssertionError("a KV slot is held by two tree positions")
    seen = set()
    for node in t._fresh:
        if node.id in seen:
            raise AssertionError(f"{node!r}: two candidate entries")
        seen.add(node.id)
        if not node.in_heap or node.id not in live_ids:
            raise AssertionError(f"{node!r}: bad pending candidate")
    for stamp, nid, node in t._heap:
        if nid in seen:
            raise AssertionError(f"{node!r}: two heap entries")
        seen.add(nid)
        if not node.in_heap or nid not in live_ids or stamp > node.last_access:
            raise AssertionError(f"{node!r}: bad heap entry")
    in_heap = sum(1 for n in iter_nodes(t) if n.in_heap)
    if in_heap != len(t._heap) + len(t._fresh):
        raise AssertionError("in_heap flags disagree with the heap")
