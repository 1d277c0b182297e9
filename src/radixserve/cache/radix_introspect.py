"""Looking at a :class:`~.radix.RadixCache` without changing it: nested dicts, a dump, and
``check_integrity``. Full scans, kept out of the tree's module so the hot path reads alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable

import numpy as np

from .packed import unpack

if TYPE_CHECKING:
    from .radix import RadixCache
    from .tree import Node

__all__ = ["as_dict", "dump", "check_integrity"]


def as_dict(t: "RadixCache", salt: Hashable = None) -> dict:
    """The tree of one namespace as nested ``{tuple(edge tokens): {...children}}``."""

    def rec(node: "Node") -> dict:
        return {tuple(unpack(c.key)): rec(c) for c in node.children.values()}

    root = t._roots.get(salt)
    return {} if root is None else rec(root)


def dump(t: "RadixCache", max_tokens: int = 8, extra=None) -> str:
    """One line per node: id, edge tokens (abbreviated), slots, lock, hits, stamp, and what
    ``extra(node)`` adds (the tiered tree's tiers and pins)."""
    lines = [repr(t)]

    def fmt(seq: list) -> str:
        s = ",".join(map(str, seq[:max_tokens]))
        return s + (",..." if len(seq) > max_tokens else "")

    def rec(node: "Node", depth: int) -> None:
        for c in sorted(node.children.values(), key=lambda x: x.id):
            slots = fmt(c.value.tolist()) if c.value is not None else ""
            more = extra(c, fmt) if extra is not None else ""
            lines.append(f"{'  ' * depth}#{c.id} [{fmt(unpack(c.key))}] len={c.num_tokens} "
                         f"slots=[{slots}]{more} lock={c.lock_ref} hits={c.hit_count} "
                         f"last={c.last_access}")
            rec(c, depth + 1)

    for salt, root in t._roots.items():
        if root.children or salt is None:
            lines.append(f"root salt={salt!r}")
            rec(root, 1)
    return "\n".join(lines)


def check_integrity(t: "RadixCache") -> None:
    """Verify structure, sizes, lock counts, slot uniqueness and the eviction heap."""
    ps = t.page_size
    evictable = protected = 0
    values = []
    nodes = t.check_structure()
    live_ids = set()
    for node in nodes:
        v = node.value
        if v is None or len(node.key) != 4 * len(v):
            raise AssertionError(f"{node!r}: key/value length mismatch")
        if len(v) % ps:
            raise AssertionError(f"{node!r}: length not a multiple of page_size")
        if v.dtype != np.int64 or v.ndim != 1:
            raise AssertionError(f"{node!r}: value must be 1-D int64")
        if node.lock_ref:
            protected += len(v)
        else:
            evictable += len(v)
            if not node.children and not node.in_heap:
                raise AssertionError(f"{node!r}: evictable leaf missing from the heap")
        live_ids.add(node.id)
        values.append(v)
    if evictable != t._evictable or protected != t._protected:
        raise AssertionError(
            f"size accounting: tree has evictable={evictable} protected={protected}, "
            f"counters say {t._evictable}/{t._protected}"
        )
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
    if sum(1 for n in nodes if n.in_heap) != len(t._heap) + len(t._fresh):
        raise AssertionError("in_heap flags disagree with the heap")
