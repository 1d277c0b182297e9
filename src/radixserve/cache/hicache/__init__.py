"""HiCache: the radix tree across memory tiers (L1 KV pool, L2 host memory, L3 storage).

See :mod:`.tree` for the design, the invariants and the integration API the scheduler uses.
"""

from __future__ import annotations

from .config import PREFETCH_POLICIES, WRITE_POLICIES, HiCacheConfig
from .telemetry import MISS_REASONS, TIERS
from .tree import HiMatchResult, HiNode, HiRadixCache, PrefetchHandle

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
