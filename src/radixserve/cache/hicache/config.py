"""Configuration of the tiered cache (HiCache): off unless ``l2_tokens > 0``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixserve.config import HICACHE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES

__all__ = ["HiCacheConfig", "WRITE_POLICIES", "PREFETCH_POLICIES"]

#: SGLang's names. write_through: copy a run to L2 when it enters the tree;
#: write_through_selective: once it has been reused ``write_through_threshold`` times;
#: write_back: only when it is evicted from L1.
WRITE_POLICIES = HICACHE_WRITE_POLICIES
#: best_effort: admit the request whenever the scheduler gets to it, with whatever pages have
#: arrived; wait_complete: admit only once the prefetch has finished; timeout: wait for it at
#: most ``prefetch_timeout_s``, then admit with what has arrived.
PREFETCH_POLICIES = HICACHE_PREFETCH_POLICIES


def _int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _float(name: str, v, lo: float, strict: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or (v <= lo if strict else v < lo):
        raise ValueError(f"{name} must be a number {'>' if strict else '>='} {lo}, got {v!r}")


@dataclass(frozen=True)
class HiCacheConfig:
    #: Host-memory (L2) capacity in tokens; 0 turns the tiers off (a plain RadixCache).
    l2_tokens: int = 0
    #: L3: ``file:///path`` or ``redis://host:port/db``; None for no storage tier.
    storage: Optional[str] = None
    write_policy: str = "write_through"
    #: Reuses (admissions through a node) before write_through_selective copies it to L2.
    write_through_threshold: int = 2
    prefetch_policy: str = "timeout"
    #: How long a request may wait for its prefetch under the "timeout" policy.
    prefetch_timeout_s: float = 1.0
    #: Skip prefetching when storage could add fewer tokens than this.
    prefetch_min_tokens: int = 1
    #: Tokens per storage object; a multiple of the KV page size. Pages are aligned from the
    #: first token, so a prefix shorter than one page is never stored.
    storage_page_tokens: int = 64
    #: Pages waiting to be written to L3 before new ones are dropped (and counted).
    write_queue_pages: int = 256
    #: Socket timeout of one storage call (Redis); a failed call backs off for retry_s.
    storage_timeout_s: float = 1.0
    storage_retry_s: float = 5.0
    #: Model name in the storage fingerprint (pages are shared only between equal fingerprints).
    model_name: str = "model"
    #: Evicted prefixes remembered to tell "evicted" from "never seen" in miss telemetry.
    ghost_entries: int = 32768

    def __post_init__(self) -> None:
        _int("l2_tokens", self.l2_tokens, 0)
        if self.storage is not None:
            from radixserve.storage import check_storage_url

            check_storage_url(self.storage, "storage")
            if self.l2_tokens == 0:
                raise ValueError("storage needs l2_tokens > 0 (L2 stages every L3 transfer)")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {list(WRITE_POLICIES)}, got {self.write_policy!r}")
        _int("write_through_threshold", self.write_through_threshold, 1)
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"prefetch_policy must be one of {list(PREFETCH_POLICIES)}, got {self.prefetch_policy!r}")
        _float("prefetch_timeout_s", self.prefetch_timeout_s, 0.0)
        _int("prefetch_min_tokens", self.prefetch_min_tokens, 1)
        _int("storage_page_tokens", self.storage_page_tokens, 1)
        _int("write_queue_pages", self.write_queue_pages, 1)
        _float("storage_timeout_s", self.storage_timeout_s, 0.0, strict=True)
        _float("storage_retry_s", self.storage_retry_s, 0.0)
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        _int("ghost_entries", self.ghost_entries, 0)

    @property
    def enabled(self) -> bool:
        """Whether the tiers are on (else the engine builds a plain RadixCache)."""
        return self.l2_tokens > 0
