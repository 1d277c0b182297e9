"""Prefix caches: the RadixAttention tree and its ablations behind one interface.

``make_cache("radix" | "table" | "none", page_size, on_free)`` is how the engine picks one.
Ownership rules for ``insert``/``evict``/``reset`` are in :mod:`radixserve.cache.base`.
The tiered tree (L1 KV pool, L2 host memory, L3 storage) is :class:`HiRadixCache`
(:mod:`radixserve.cache.hicache`), built from a :class:`HiCacheConfig` and the KV pool.
"""

from __future__ import annotations

from typing import Optional

from .base import FreeCallback, MatchResult, PrefixCache
from .none import NoCache
from .radix import RadixCache
from .table import TableCache, TableEntry
from .hicache import HiCacheConfig, HiMatchResult, HiRadixCache

__all__ = [
    "CACHE_KINDS",
    "HiCacheConfig",
    "HiMatchResult",
    "HiRadixCache",
    "MatchResult",
    "NoCache",
    "PrefixCache",
    "RadixCache",
    "TableCache",
    "TableEntry",
    "make_cache",
]

CACHE_KINDS = {"radix": RadixCache, "table": TableCache, "none": NoCache}


def make_cache(kind: str, page_size: int = 1, on_free: Optional[FreeCallback] = None) -> PrefixCache:
    """Build the prefix cache named by ``kind`` ("radix", "table" or "none")."""
    cls = CACHE_KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"kind must be one of {sorted(CACHE_KINDS)}, got {kind!r}")
    return cls(page_size=page_size, on_free=on_free)
