"""What an admission reports (cached tokens by tier, a reason for the rest) and the cache's
``stats()``: functions over a :class:`~.tree.HiRadixCache` and its counters (the reasons are
defined in :mod:`.telemetry`)."""

from __future__ import annotations

import time
from array import array
from typing import TYPE_CHECKING, Dict, Hashable, Optional

from radixserve.storage import encode_salt

from ..base import TokenIds
from ..packed import pack
from .node import HiMatchResult, HiNode, PrefetchHandle
from .telemetry import MISS_REASONS, TIERS

if TYPE_CHECKING:
    from .tree import HiRadixCache

__all__ = ["record_admission", "stats"]


def record_admission(t: "HiRadixCache", token_ids: TokenIds, m: HiMatchResult, salt: Hashable = None,
                     prefetch: Optional[PrefetchHandle] = None) -> dict:
    """See :meth:`.tree.HiRadixCache.record_admission`."""
    if not isinstance(m, HiMatchResult):
        raise ValueError(f"m must be a HiMatchResult, got {type(m).__name__}")
    ids, q = pack(token_ids)
    N = len(ids)
    now = t._now()
    c = t.counters
    c["requests"] += 1
    length, loaded = m.length, m.loaded
    l1 = length - loaded
    l3 = 0
    if prefetch is not None and prefetch.inserted is not None and loaded:
        a, b = prefetch.inserted
        l3 = max(0, min(length, b) - max(l1, a))
    l2 = loaded - l3
    c["hit_L1"] += l1
    c["hit_L2"] += l2
    c["hit_L3"] += l3
    # Ages at hit, then refresh the path's "last used" time.
    node = m.node if type(m.node) is HiNode and m.node.key is not None else None
    if node is not None and node.parent is not None:
        depth = length
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
            t.hist["age_at_hit_s/L1"].observe(now - l1_node.used_time)
        if l2 and l2_node is not None:
            t.hist["age_at_hit_s/L2"].observe(now - l2_node.used_time)
        x = node
        while x.parent is not None:
            x.used_time = now
            x = x.parent
    if l3 and prefetch is not None and prefetch.created is not None:
        t.hist["age_at_hit_s/L3"].observe(max(0.0, time.time() - prefetch.created))
    # Reasons for the uncached part.
    uncached: Dict[str, int] = {}
    aligned = N - N % t.page_size
    if N > aligned:
        uncached["page_boundary"] = N - aligned
    rest = aligned - length
    if m.host_length and rest > 0:
        k = min(rest, m.host_length)
        uncached["l1_full"] = k
        rest -= k
    pos = length + m.host_length
    if rest > 0 and prefetch is not None and prefetch.status in ("timed_out", "cut") and prefetch.present:
        P = t.storage.page_tokens if t.storage is not None else 0
        avail_end = prefetch.start + prefetch.present * P
        got_end = prefetch.start + prefetch.fetched * P
        k = min(rest, max(0, avail_end - max(pos, got_end)))
        if k:
            uncached["prefetch_timeout"] = k
            rest -= k
    if rest > 0:
        for r, k in _classify_miss(t, q, salt, aligned - rest, aligned).items():
            uncached[r] = uncached.get(r, 0) + k
    for r, k in uncached.items():
        c[f"miss_{r}"] += k
    return {"cached": {"L1": l1, "L2": l2, "L3": l3}, "uncached": uncached}


def _classify_miss(t: "HiRadixCache", q: bytes, salt: Hashable, pos: int, end: int) -> Dict[str, int]:
    """Reasons for tokens ``[pos, end)`` of ``q`` that no local tier holds: evicted (the
    ghost memory knows the run), held under another salt (as far as the other namespace
    goes; what follows is classified again), or never seen."""
    out: Dict[str, int] = {}
    salt_b = encode_salt(salt)
    checked_salts = False
    while pos < end:
        hit = t.ghost.lookup(salt_b, q, pos, end)
        if hit is not None:
            out["evicted_" + hit[0]] = out.get("evicted_" + hit[0], 0) + end - pos
            break
        if not checked_salts:
            checked_salts = True
            ids = array("I", q[: end << 2])
            best = pos
            for i, (s, root) in enumerate(t._roots.items()):
                if i >= 16:  # bounded work per admission; more tenants count as never_seen
                    break
                if s != salt and root.children:
                    best = max(best, t._peek(root, ids, q, end)[1])
            if best > pos:
                out["salt"] = best - pos
                pos = best
                continue
        out["never_seen"] = out.get("never_seen", 0) + end - pos
        break
    return out


def stats(t: "HiRadixCache", base: dict) -> dict:
    """``base`` (the PrefixCache stats) plus tiers, hits by tier, misses by reason, bytes and
    tokens moved, prefetch and L3 write counters, ages."""
    out = base
    c = t.counters
    out["l1"] = {"tokens": t.total_size, "evictable": t._evictable, "protected": t._protected}
    out["l2"] = {"tokens": t._host_size, "capacity": t.host_pool.capacity,
                 "free": t.host_pool.available}
    out["write_policy"] = t.config.write_policy
    out["prefetch_policy"] = t.config.prefetch_policy
    out["requests"] = c["requests"]
    out["hit_tokens"] = {tier: c[f"hit_{tier}"] for tier in TIERS}
    out["miss_tokens"] = {r: c[f"miss_{r}"] for r in MISS_REASONS}
    out["bytes_moved"] = {"L1->L2": c["bytes_L1_to_L2"], "L2->L1": c["bytes_L2_to_L1"],
                          "L2->L3": c["bytes_L2_to_L3"], "L3->L2": c["bytes_L3_to_L2"]}
    out["tokens_moved"] = {"backup": c["backup_tokens"], "load_back": c["loaded_tokens"],
                           "demoted": c["demoted_tokens"], "dropped_L1": c["dropped_tokens_L1"],
                           "evicted_L2": c["evicted_tokens_L2"], "deleted_L2": c["deleted_tokens_L2"]}
    side = t._storage
    out["prefetch"] = {k.removeprefix("prefetch_"): c[k] for k in c if k.startswith("prefetch_")}
    out["prefetch"]["in_flight"] = len(side.prefetching) if side is not None else 0
    out["prefetch"]["latency_s"] = t.hist["prefetch_latency_s"].as_dict()
    out["l3_writes"] = {k.removeprefix("l3_pages_"): c[k] for k in c if k.startswith("l3_pages_")}
    if side is not None:
        out["l3_writes"]["pending"] = side.writer.pending
    out["storage"] = t.storage.stats() if t.storage is not None else None
    out["age_at_hit_s"] = {tier: t.hist[f"age_at_hit_s/{tier}"].as_dict() for tier in TIERS}
    out["age_at_eviction_s"] = {tier: t.hist[f"age_at_eviction_s/{tier}"].as_dict() for tier in ("L1", "L2")}
    out["ghost_entries"] = len(t.ghost)
    return out
