"""What the tiered cache counts: hits by tier, misses by reason, bytes moved, ages.

The hit rate says how much a tier serves, not why a request missed, so for the uncached part
of each admitted request the cache names one reason:

* ``page_boundary``: the tail shorter than one KV page (the tree stores whole pages only);
* ``l1_full``: the run was in L2 but L1 could not take it all (the load was capped);
* ``prefetch_timeout``: storage held pages the request stopped waiting for;
* ``evicted_L1`` / ``evicted_L2``: the run was cached and has been evicted; the tier is the
  one it was last held in (``L1``: dropped without an L2 copy);
* ``salt``: the same tokens are cached under another namespace (salt) only;
* ``never_seen``: none of the above.

"Evicted" is known from a bounded memory of evicted prefixes (:class:`Ghost`): digests of
the token path at the start of each evicted run and at every ``stride``-aligned position
inside it. A miss is looked up at its first page and the first aligned position after it,
so a run evicted whole is always recognised, and one evicted then partly re-cached when the
miss covers an aligned position of it. What the memory forgot counts as ``never_seen``.

Ages pair up per tier: the age of content at a hit (since it was last inserted or admitted
through) against its age when the tier evicted it; hits at ages near or above the eviction
ages mean the tier is too small for the traffic's reuse window.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Histogram", "Ghost", "MISS_REASONS", "TIERS", "AGE_BUCKETS_S", "LATENCY_BUCKETS_S"]

TIERS = ("L1", "L2", "L3")
MISS_REASONS = ("never_seen", "evicted_L1", "evicted_L2", "salt", "page_boundary",
                "prefetch_timeout", "l1_full")
AGE_BUCKETS_S = (0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 14400.0, 86400.0)
LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus' shape): ``le`` bounds, count and sum."""

    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last: +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        if v != v:
            return
        v = max(0.0, v)
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.count += 1
        self.sum += v

    def as_dict(self) -> dict:
        cum = itertools.accumulate(self.counts)
        return {"buckets": list(zip(self.bounds + (math.inf,), cum)), "count": self.count, "sum": self.sum}


class Ghost:
    """Bounded memory of evicted token paths: digest -> (tier, time of eviction)."""

    def __init__(self, entries: int, page_size: int, stride: int) -> None:
        self.entries = entries
        self.page_size = page_size
        self.stride = stride
        self._d: "OrderedDict[bytes, Tuple[str, float]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def _positions(self, start: int, end: int) -> List[int]:
        first = start + self.page_size
        if first > end:
            return []
        g = self.stride
        return [first, *range((first // g + 1) * g, end + 1, g)]

    def record(self, salt_b: bytes, path: bytes, start: int, tier: str, now: float) -> None:
        """``path``: the evicted run's packed tokens from the root; the run begins at token
        ``start`` and ends at the end of ``path``."""
        if not self.entries:
            return
        positions = self._positions(start, len(path) >> 2)
        if not positions:
            return
        h = hashlib.blake2b(salt_b, digest_size=16)
        done = 0
        d = self._d
        for p in positions:
            h.update(path[done << 2 : p << 2])
            done = p
            k = h.copy().digest()
            d[k] = (tier, now)
            d.move_to_end(k)
        while len(d) > self.entries:
            d.popitem(last=False)

    def lookup(self, salt_b: bytes, q: bytes, pos: int, end: int) -> Optional[Tuple[str, float]]:
        """Was a run starting at token ``pos`` of ``q`` (packed) evicted? Checks the first page
        after ``pos`` and the first stride-aligned position after it, up to ``end``."""
        if not self._d:
            return None
        first = pos + self.page_size
        if first > end:
            return None
        h = hashlib.blake2b(salt_b, digest_size=16)
        h.update(q[: first << 2])
        hit = self._d.get(h.copy().digest())
        if hit is not None:
            return hit
        g = self.stride
        p = (first // g + 1) * g
        if p <= end:
            h.update(q[first << 2 : p << 2])
            return self._d.get(h.digest())
        return None

    def clear(self) -> None:
        self._d.clear()


def new_counters() -> Dict[str, int]:
    names = ["requests", *(f"hit_{t}" for t in TIERS), *(f"miss_{r}" for r in MISS_REASONS),
             "backup_tokens", "loaded_tokens", "demoted_tokens", "dropped_tokens_L1", "evicted_tokens_L2",
             "deleted_tokens_L2", "bytes_L1_to_L2", "bytes_L2_to_L1", "bytes_L2_to_L3", "bytes_L3_to_L2",
             "load_back_calls", "prefetch_started", "prefetch_completed", "prefetch_timeouts", "prefetch_cut",
             "prefetch_cancelled", "prefetch_pages", "prefetch_tokens", "prefetch_discarded", "prefetch_no_room",
             "prefetch_skipped", "l3_pages_enqueued", "l3_pages_dropped", "l3_pages_stored", "l3_pages_failed"]
    return dict.fromkeys(names, 0)
