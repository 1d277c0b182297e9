"""What an admission reports (cached tokens by tier, a reason for the rest) and the tiered
cache's ``stats()``: :class:`TierAccounting` owns the counters, histograms and the ghost
memory of evictions behind them (the reasons are defined in :mod:`.telemetry`)."""

from __future__ import annotations

import time
from typing import Callable, Dict, Hashable, Optional

from radixserve.storage import encode_salt

from .node import HiMatchResult, HiNode, PrefetchHandle
from .telemetry import (AGE_BUCKETS_S, LATENCY_BUCKETS_S, MISS_REASONS, TIERS, Ghost, Histogram,
                        new_counters)

__all__ = ["TierAccounting"]

#: ``reach(q, salt, pos, end)``: how far, from token ``pos``, ``q[:end]`` (packed) is held
#: under a namespace other than ``salt`` (the tree answers; ``pos`` if nowhere).
ReachElsewhere = Callable[[bytes, Hashable, int, int], int]


class TierAccounting:
    """Counters, histograms and the ghost memory of one tiered cache, and the per-admission
    report built from them."""

    def __init__(self, page_size: int, ghost_entries: int) -> None:
        self.page_size = ps = page_size
        self.counters = new_counters()
        self.hist: Dict[str, Histogram] = {"prefetch_latency_s": Histogram(LATENCY_BUCKETS_S)}
        for t in TIERS:
            self.hist[f"age_at_hit_s/{t}"] = Histogram(AGE_BUCKETS_S)
        for t in ("L1", "L2"):
            self.hist[f"age_at_eviction_s/{t}"] = Histogram(AGE_BUCKETS_S)
        self.ghost = Ghost(ghost_entries, ps, ps * max(1, -(-64 // ps)))

    def record_admission(self, q: bytes, m: HiMatchResult, salt: Hashable, prefetch: Optional[PrefetchHandle],
                         now: float, storage_page_tokens: int, reach: ReachElsewhere) -> dict:
        """See :meth:`.hiradix.HiRadixCache.record_admission` (``q``: the request's ids packed)."""
        if not isinstance(m, HiMatchResult):
            raise ValueError(f"m must be a HiMatchResult, got {type(m).__name__}")
        c = self.counters
        c["requests"] += 1
        l1, l2, l3 = self._hits(m, prefetch)
        cached = {"L1": l1, "L2": l2, "L3": l3}
        for t, k in cached.items():
            c[f"hit_{t}"] += k
        self._observe_ages(m, l1, l2, l3, prefetch, now)
        uncached = self._uncached(q, m, salt, prefetch, storage_page_tokens, reach)
        for r, k in uncached.items():
            c[f"miss_{r}"] += k
        return {"cached": cached, "uncached": uncached}

    @staticmethod
    def _hits(m: HiMatchResult, prefetch: Optional[PrefetchHandle]) -> tuple[int, int, int]:
        """The match's tokens by the tier they came from: L1, loaded from L2, or loaded from
        what the prefetch brought in from L3."""
        length, loaded = m.length, m.loaded
        l1 = length - loaded
        l3 = 0
        if prefetch is not None and prefetch.inserted is not None and loaded:
            a, b = prefetch.inserted
            l3 = max(0, min(length, b) - max(l1, a))
        return l1, loaded - l3, l3

    def _observe_ages(self, m: HiMatchResult, l1: int, l2: int, l3: int,
                      prefetch: Optional[PrefetchHandle], now: float) -> None:
        """Ages at hit of each tier's part, then the path's "last used" time refreshed."""
        hist = self.hist
        node = m.node if type(m.node) is HiNode and m.node.key is not None else None
        if node is not None and node.parent is not None:
            depth = m.length
            l1_node = l2_node = None
            x = node
            while x.parent is not None:
                if depth <= l1:
                    l1_node = x
                    break
                if l2_node is None:
                    l2_node = x
                depth -= len(x.key) >> 2
                x = x.parent
            if l1 and l1_node is not None:
                hist["age_at_hit_s/L1"].observe(now - l1_node.used_time)
            if l2 and l2_node is not None:
                hist["age_at_hit_s/L2"].observe(now - l2_node.used_time)
            x = node
            while x.parent is not None:
                x.used_time = now
                x = x.parent
        if l3 and prefetch is not None and prefetch.created is not None:
            hist["age_at_hit_s/L3"].observe(max(0.0, time.time() - prefetch.created))

    def _uncached(self, q: bytes, m: HiMatchResult, salt: Hashable, prefetch: Optional[PrefetchHandle],
                  storage_page_tokens: int, reach: ReachElsewhere) -> Dict[str, int]:
        """Reasons for the tokens the match does not serve: a partial last page, L1 too full
        to load the L2 part, a prefetch that timed out, then :meth:`_classify_miss`."""
        N = len(q) >> 2
        uncached: Dict[str, int] = {}
        aligned = N - N % self.page_size
        if N > aligned:
            uncached["page_boundary"] = N - aligned
        rest = aligned - m.length
        if m.host_length and rest > 0:
            k = min(rest, m.host_length)
            uncached["l1_full"] = k
            rest -= k
        pos = m.length + m.host_length
        if rest > 0 and prefetch is not None and prefetch.status in ("timed_out", "cut") and prefetch.present:
            P = storage_page_tokens
            got_end = prefetch.start + prefetch.fetched * P
            k = min(rest, max(0, prefetch.start + prefetch.present * P - max(pos, got_end)))
            if k:
                uncached["prefetch_timeout"] = k
                rest -= k
        if rest > 0:
            for r, k in self._classify_miss(q, salt, aligned - rest, aligned, reach).items():
                uncached[r] = uncached.get(r, 0) + k
        return uncached

    def _classify_miss(self, q: bytes, salt: Hashable, pos: int, end: int, reach: ReachElsewhere) -> Dict[str, int]:
        """Reasons for tokens ``[pos, end)`` of ``q`` that no local tier holds: evicted (the
        ghost memory knows the run), held under another salt (as far as the other namespace
        goes; what follows is classified again), or never seen."""
        out: Dict[str, int] = {}
        salt_b = encode_salt(salt)
        checked_salts = False
        while pos < end:
            hit = self.ghost.lookup(salt_b, q, pos, end)
            if hit is not None:
                out["evicted_" + hit[0]] = out.get("evicted_" + hit[0], 0) + end - pos
                break
            if not checked_salts:
                checked_salts = True
                best = reach(q, salt, pos, end)
                if best > pos:
                    out["salt"] = best - pos
                    pos = best
                    continue
            out["never_seen"] = out.get("never_seen", 0) + end - pos
            break
        return out

    def stats(self, out: dict, l1: dict, l2: dict, policies: dict, in_flight: int,
              l3_pending: Optional[int], storage: Optional[dict]) -> dict:
        """``out`` (the PrefixCache stats) plus the tiers' sizes (``l1``, ``l2``), the
        policies, hits by tier, misses by reason, bytes and tokens moved, prefetch and L3
        write counters, ages."""
        c = self.counters
        out["l1"] = l1
        out["l2"] = l2
        out.update(policies)
        out["requests"] = c["requests"]
        out["hit_tokens"] = {tier: c[f"hit_{tier}"] for tier in TIERS}
        out["miss_tokens"] = {r: c[f"miss_{r}"] for r in MISS_REASONS}
        out["bytes_moved"] = {"L1->L2": c["bytes_L1_to_L2"], "L2->L1": c["bytes_L2_to_L1"],
                              "L2->L3": c["bytes_L2_to_L3"], "L3->L2": c["bytes_L3_to_L2"]}
        out["tokens_moved"] = {"backup": c["backup_tokens"], "load_back": c["loaded_tokens"],
                               "demoted": c["demoted_tokens"], "dropped_L1": c["dropped_tokens_L1"],
                               "evicted_L2": c["evicted_tokens_L2"], "deleted_L2": c["deleted_tokens_L2"]}
        out["prefetch"] = {k.removeprefix("prefetch_"): c[k] for k in c if k.startswith("prefetch_")}
        out["prefetch"]["in_flight"] = in_flight
        out["prefetch"]["latency_s"] = self.hist["prefetch_latency_s"].as_dict()
        out["l3_writes"] = {k.removeprefix("l3_pages_"): c[k] for k in c if k.startswith("l3_pages_")}
        if l3_pending is not None:
            out["l3_writes"]["pending"] = l3_pending
        out["storage"] = storage
        out["age_at_hit_s"] = {tier: self.hist[f"age_at_hit_s/{tier}"].as_dict() for tier in TIERS}
        out["age_at_eviction_s"] = {tier: self.hist[f"age_at_eviction_s/{tier}"].as_dict() for tier in ("L1", "L2")}
        out["ghost_entries"] = len(self.ghost)
        return out
