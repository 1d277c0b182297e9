"""Looking at a radix tree holding KV (:class:`~.radix.RadixCache` and its extensions) without
changing it: nested dicts and a dump. Full scans, kept out of the cache's module so the hot
path reads alone."""

from __future__ import annotations

from typing import Callable, Hashable, Optional

from .packed import unpack
from .tree import Node, RadixTree

__all__ = ["as_dict", "dump"]


def as_dict(t: RadixTree, salt: Hashable = None) -> dict:
    """The tree of one namespace as nested ``{tuple(edge tokens): {...children}}``."""

    def rec(node: Node) -> dict:
        return {tuple(unpack(c.key)): rec(c) for c in node.children.values()}

    root = dict(t.namespaces()).get(salt)
    return {} if root is None else rec(root)


def dump(t: RadixTree, max_tokens: int = 8,
         extra: Optional[Callable[[Node, Callable], str]] = None) -> str:
    """One line per node: id, edge tokens (abbreviated), slots, lock, hits, stamp, and what
    ``extra(node)`` adds (the tiered tree's tiers and pins)."""
    lines = [repr(t)]

    def fmt(seq: list) -> str:
        s = ",".join(map(str, seq[:max_tokens]))
        return s + (",..." if len(seq) > max_tokens else "")

    def rec(node: Node, depth: int) -> None:
        for c in sorted(node.children.values(), key=lambda x: x.id):
            slots = fmt(c.value.tolist()) if c.value is not None else ""
            more = extra(c, fmt) if extra is not None else ""
            lines.append(f"{'  ' * depth}#{c.id} [{fmt(unpack(c.key))}] len={c.num_tokens} "
                         f"slots=[{slots}]{more} lock={c.lock_ref} hits={c.hit_count} "
                         f"last={c.last_access}")
            rec(c, depth + 1)

    for salt, root in t.namespaces():
        if root.children or salt is None:
            lines.append(f"root salt={salt!r}")
            rec(root, 1)
    return "\n".join(lines)
