"""The tiered tree's value types: its node, its match result, a prefetch handle."""

from __future__ import annotations

from typing import Hashable, Optional

import numpy as np
from radixserve.storage import PrefetchJob

from ..base import MatchResult
from ..tree import Node

__all__ = ["HiNode", "HiMatchResult", "PrefetchHandle"]


class HiNode(Node):
    """One edge of the tiered tree: the tree's node plus where else its KV is (``value``, the
    L1 slots, is None when the run is not in L1)."""

    __slots__ = (
        "host",  # np.ndarray[int64] of L2 slots, or None (not in L2)
        "pin_ref",  # pins on this node or a descendant (tree + L2 protection)
        "used_time",  # monotonic time of the last insert/admission through it (ages)
        "in_l3",  # the storage pages ending inside this run are stored (or queued)
    )

    def __init__(self, key: bytes, parent: Optional["HiNode"], stamp: int, nid: int, now: float = 0.0) -> None:
        Node.__init__(self, key, parent, stamp, nid)
        self.host: Optional[np.ndarray] = None
        self.pin_ref = 0
        self.used_time = now
        self.in_l3 = False

    @property
    def tiers(self) -> str:
        return ("L1" if self.value is not None else "") + ("L2" if self.host is not None else "")

    def __repr__(self) -> str:
        if self.key is None:
            return f"HiNode#{self.id}(dead)"
        return (f"HiNode#{self.id}(len={self.num_tokens}, tiers={self.tiers or '-'}, lock={self.lock_ref}, "
                f"pin={self.pin_ref}, last={self.last_access}, children={len(self.children)})")


#: A match across L1 and L2 is the cache's one match result: ``indices/length/node`` are the
#: L1 part, ``host_length/host_node`` the L2 continuation, ``loaded`` what load_back moved.
HiMatchResult = MatchResult


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
