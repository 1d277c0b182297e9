"""The tiered tree's value types: a node, a match across L1 and L2, a prefetch handle."""

from __future__ import annotations

from typing import Any, Dict, Hashable, NamedTuple, Optional

import numpy as np
import torch

from radixserve.storage import PrefetchJob

__all__ = ["HiNode", "HiMatchResult", "PrefetchHandle", "path_bytes", "salt_of"]


class HiNode:
    """One edge of the tiered tree: its tokens and where their KV is."""

    __slots__ = (
        "key",  # bytes: tokens of the edge, packed uint32 (b"" for a root); None once dead
        "value",  # np.ndarray[int64] of L1 slots, or None (not in L1)
        "host",  # np.ndarray[int64] of L2 slots, or None (not in L2)
        "children",
        "parent",
        "lock_ref",  # locks on this node or a descendant (L1 protection)
        "pin_ref",  # pins on this node or a descendant (tree + L2 protection)
        "last_access",  # logical clock of the last match/insert through it (LRU order)
        "used_time",  # monotonic time of the last insert/admission through it (ages)
        "hit_count",  # admissions through it (write_through_selective)
        "id",
        "in_heap1",  # has an entry in the L1 eviction heap
        "in_heap2",  # has an entry in the L2 eviction heap
        "salt",  # namespace (roots only)
        "in_l3",  # the storage pages ending inside this run are stored (or queued)
    )

    def __init__(self, key: bytes, parent: Optional["HiNode"], stamp: int, nid: int, now: float = 0.0) -> None:
        self.key = key
        self.value: Optional[np.ndarray] = None
        self.host: Optional[np.ndarray] = None
        self.children: Dict[Any, HiNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.pin_ref = 0
        self.last_access = stamp
        self.used_time = now
        self.hit_count = 0
        self.id = nid
        self.in_heap1 = False
        self.in_heap2 = False
        self.salt = None
        self.in_l3 = False

    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2 if self.key else 0

    @property
    def tiers(self) -> str:
        return ("L1" if self.value is not None else "") + ("L2" if self.host is not None else "")

    def __repr__(self) -> str:
        if self.key is None:
            return f"HiNode#{self.id}(dead)"
        return (f"HiNode#{self.id}(len={self.num_tokens}, tiers={self.tiers or '-'}, lock={self.lock_ref}, "
                f"pin={self.pin_ref}, last={self.last_access}, children={len(self.children)})")


class HiMatchResult(NamedTuple):
    """A match across L1 and L2.

    ``indices``/``length``/``node`` are the L1 part, exactly what :class:`MatchResult` holds
    (callers that only read those three see a plain radix cache). ``host_length`` tokens
    more are in L2, ending at ``host_node`` (== ``node`` when there are none);
    :meth:`HiRadixCache.load_back` moves them into L1. ``loaded`` is how many of ``length``
    tokens the load_back that returned this result brought in from L2 (0 from match_prefix).
    """

    indices: torch.Tensor
    length: int
    node: Any
    host_length: int = 0
    host_node: Any = None
    loaded: int = 0

    @property
    def total_length(self) -> int:
        return self.length + self.host_length


class PrefetchHandle:
    """A request's prefetch from L3: returned by :meth:`HiRadixCache.prefetch`."""

    __slots__ = ("job", "tokens", "salt", "start", "finished", "status", "inserted", "fetched",
                 "present", "created")

    def __init__(self, job: PrefetchJob, tokens: bytes, salt: Hashable, start: int) -> None:
        self.job = job
        self.tokens = tokens  # packed ids of the whole pages asked for
        self.salt = salt
        self.start = start  # token where the first asked page begins
        self.finished = False
        self.status = "pending"  # pending | done | timed_out | cut (best_effort) | cancelled
        self.inserted: Optional[tuple] = None  # (first, end) tokens added to the tree from L3
        self.fetched = 0  # pages read
        self.present: Optional[int] = None  # pages storage said it holds
        self.created: Optional[float] = None  # unix write time of the oldest page used

    def __repr__(self) -> str:
        return (f"PrefetchHandle(start={self.start}, status={self.status}, fetched={self.fetched}, "
                f"present={self.present}, inserted={self.inserted})")



def path_bytes(node: HiNode) -> bytes:
    """Packed tokens from the root through ``node`` (events, the ghost memory)."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return b"".join(reversed(keys))


def salt_of(node: HiNode) -> Hashable:
    """The namespace of ``node`` (its root's salt)."""
    while node.parent is not None:
        node = node.parent
    return node.salt
