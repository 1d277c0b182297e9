"""HiCache: the radix tree across memory tiers (L1 KV pool, L2 host memory, L3 storage).

Modules: :mod:`.hiradix` (:class:`HiRadixCache`: the plain radix cache extended to tiers, and
its public API), :mod:`.node` (the tree's node with tier fields, prefetch handle),
:mod:`.tiers` (L2 as the tree's component: host slots, L2 LRU, copies between the pools),
:mod:`.loads` (L2 -> L1 load-back), :mod:`.storage_side` (L3 writes and prefetch),
:mod:`.accounting` (per-admission tier report, miss reasons, stats), :mod:`.introspect`
(invariants, snapshots, dumps), :mod:`.telemetry` (histograms, the ghost memory of
evictions), :mod:`.config`.

Integration (what the scheduler calls; the scheduler thread is the only caller)
------------------------------------------------------------------------------
``HiRadixCache.tiered`` is True: besides the :class:`~radixserve.cache.base.PrefixCache`
calls it implements :class:`~radixserve.cache.base.TieredCache`, called only for such a cache.

Construction, a request's arrival, and every step before admission::

    cache = HiRadixCache.from_config(hicache_cfg, allocator, kv_pool)  # on_free=allocator.free
    cache.on_written = allocator.mark_written       # slots filled by L2 -> L1 loads hold K/V
    req.prefetch = cache.prefetch(req.cache_key(), salt=req.salt)     # None without storage
    cache.poll()             # finish prefetches that completed, L3 write results, loads

Admission of one request (replaces ``m = cache.match_prefix(...)``)::

    if not cache.prefetch_ready(req.prefetch):   # policy: best_effort/wait_complete/timeout
        continue                                 # leave it waiting this step
    m = cache.match_prefix(key, salt=req.salt)   # HiMatchResult; .indices/.length/.node = L1
    m = cache.load_back(m)                       # L2 continuation -> L1 (for every admission)
    cache.lock(m.node)                           # as before; the rest of admission is unchanged
    ...
    if first admission: req.tier_report = cache.record_admission(key, m, req.salt, req.prefetch)

After the admission loop, before the forward, ``cache.flush_loads()`` issues the L2 -> L1
copies of this step's load_backs. Everything else (``insert``, ``unlock``, ``evict``,
``reset``, ``check_integrity``) keeps the :class:`~radixserve.cache.base.PrefixCache`
contract. A request aborted while its prefetch is in flight calls
``cache.cancel_prefetch(req.prefetch)``; ``cache.close()`` stops the storage threads.
"""

from __future__ import annotations

from .config import PREFETCH_POLICIES, WRITE_POLICIES, HiCacheConfig
from .telemetry import MISS_REASONS, TIERS
from .hiradix import HiMatchResult, HiNode, HiRadixCache, PrefetchHandle

__all__ = [
    "HiCacheConfig",
    "HiMatchResult",
    "HiNode",
    "HiRadixCache",
    "MISS_REASONS",
    "PREFETCH_POLICIES",
    "PrefetchHandle",
    "TIERS",
    "WRITE_POLICIES",
]
