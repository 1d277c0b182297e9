"""The scheduler's side of a hybrid model's sliding-window (SWA) KV: making room in both
pools, admitting a chunk only if its SWA slots fit, and giving back the window KV a request's
own tokens no longer need. For a full-attention model every call is the plain one."""

from __future__ import annotations

from radixserve.cache.base import PrefixCache
from radixserve.cache.swa import SWARadixCache
from radixserve.request import Req
from radixserve.memory import SlotAllocator
from radixserve.memory.swa_pool import HybridAllocator

__all__ = ["WindowKV"]


class WindowKV:
    def __init__(self, allocator: SlotAllocator, cache: PrefixCache, chunk: int) -> None:
        self.allocator = allocator
        self.cache = cache
        #: The window (0: a full-attention model), the SWA-aware tree (None without a cache).
        self.window = allocator.window if isinstance(allocator, HybridAllocator) else 0
        self.swa_cache = cache if isinstance(cache, SWARadixCache) else None
        #: Tokens per prefill chunk. A hybrid model's chunk holds SWA slots for all its tokens
        #: until it enters the tree, next to the window before it: both must fit the SWA pool.
        self.chunk_cap = chunk
        if self.window:
            ps = allocator.page_size
            room = allocator.swa.capacity - self.window - 2 * ps
            if room < ps:
                raise ValueError(f"swa_kv_cache_tokens ({allocator.swa.capacity}) must exceed the "
                                 f"sliding window ({self.window}) by more than two pages")
            self.chunk_cap = min(chunk, room - room % ps)

    def make_room(self, need: int) -> bool:
        """Evict until ``need`` slots are free (and ``need`` SWA slots: tombstones first, then
        whole leaves); whether they are."""
        a = self.allocator
        if a.available < need:
            self.cache.evict(need - a.available)
        if not self.window:
            return a.available >= need
        while a.swa_available < need:
            short = need - a.swa_available
            if not ((self.swa_cache is not None and self.swa_cache.evict_swa(short)) or self.cache.evict(short)):
                break
        return a.available >= need and a.swa_available >= need

    def admits(self, chunk: int) -> bool:
        """Whether a prefill chunk's SWA slots can be had (free or by tombstoning)."""
        evictable = self.swa_cache.swa_evictable_size if self.swa_cache is not None else 0
        return chunk + self.allocator.page_size <= self.allocator.swa_available + evictable

    def release_window(self, req: Req) -> None:
        """Give back the SWA slots of the request's own tokens that its next token's window
        no longer covers (whole pages); the tree's part is the tree's to tombstone. The window
        kept is that of the last whole page, so the request's tokens enter the tree with the
        SWA KV a match at their cacheable end needs."""
        ps = self.allocator.page_size
        hi = (req.computed_len - req.computed_len % ps - self.window + 1) // ps * ps
        lo = max(req.prefix_len, req.swa_released)
        if hi > lo:
            self.allocator.free_swa(req.kv_slots[lo:hi])
            req.swa_released = hi
