"""The KV slots of requests: taking them, putting the written ones into the prefix cache,
giving everything back.

Kept apart from admission and batching (which requests run): every slot a request holds
comes from and goes back through here, and this is where memory pressure is met: taking
slots evicts least-recently-used leaves of the tree, then sheds the KV sessions keep.
"""

from __future__ import annotations

import time

import torch

from radixserve.cache import PrefixCache
from radixserve.request import Req
from radixserve.memory import SlotAllocator
from radixserve.sched.batch import SchedulerStats
from radixserve.sched.sessions import SessionTable
from radixserve.sched.window import WindowKV

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class RequestSlots:
    """Slots for the scheduler's requests, out of one pool shared with the prefix cache."""

    def __init__(self, allocator: SlotAllocator, cache: PrefixCache, swa: WindowKV,
                 sessions: SessionTable, stats: SchedulerStats):
        self.allocator = allocator
        self.cache = cache
        self.swa = swa
        self.sessions = sessions
        self.stats = stats
        self.page_size = allocator.page_size

    def tree_time(self, t0: float) -> None:
        """Count the time since ``t0`` as prefix-cache time (``SchedulerStats.tree_seconds``)."""
        self.stats.tree_seconds += time.perf_counter() - t0

    def _alloc(self, n: int) -> torch.Tensor | None:
        """``n`` fresh slots (whole pages), evicting LRU leaves of the tree if needed."""
        if n == 0:
            return EMPTY_SLOTS
        self.make_room(self.allocator.pages_for(n) * self.page_size)
        return self.allocator.alloc(n)

    def make_room(self, need: int) -> bool:
        """Evict until ``need`` slots (and, for a hybrid model, SWA slots) are free; sessions
        give way when eviction cannot; whether they are."""
        t0 = time.perf_counter()
        while True:
            ok = self.swa.make_room(need)
            if ok or not self.sessions.shed_one():  # sessions keep KV only while nobody needs it
                break
        self.tree_time(t0)
        return ok

    def take(self, req: Req, n: int) -> bool:
        """Append ``n`` slots to the request: leftovers of its last page first, then new pages."""
        spare = req.spare_slots
        use = min(n, int(spare.numel()))
        rest = n - use
        fresh = self._alloc(rest)  # EMPTY_SLOTS for none
        if fresh is None:
            return False
        req.kv_slots = torch.cat([req.kv_slots, spare[:use], fresh[:rest]])
        req.spare_slots = torch.cat([spare[use:], fresh[rest:]])
        return True

    def drop_tail(self, req: Req, keep: int) -> None:
        """Give back the request's slots past its first ``keep`` (positions a step computed
        for draft tokens that were not accepted; they were never marked written). Whole pages
        go to the free list now; the rest of the page the kept part ends in stays the
        request's spare, as after any ``take``."""
        tail = req.kv_slots[keep:]
        if not tail.numel():
            return
        if keep < req.kv_written:
            raise RuntimeError(f"request {req.rid}: dropping written slots ({keep} < {req.kv_written})")
        req.kv_slots = req.kv_slots[:keep]
        loose = torch.cat([tail, req.spare_slots])
        ps = self.page_size
        if ps == 1:
            self.allocator.free(loose)
            req.spare_slots = EMPTY_SLOTS
            return
        pages = loose // ps
        last = int(req.kv_slots[-1]) // ps if keep else -1
        stay = pages == last
        req.spare_slots = torch.sort(loose[stay]).values
        self.allocator.free(torch.sort(loose[~stay]).values)

    def needed(self, req: Req, n: int) -> int:
        """Free slots that taking ``n`` more tokens would consume (page granularity)."""
        rest = n - min(n, int(req.spare_slots.numel()))
        return self.allocator.pages_for(rest) * self.page_size

    def cache_written(self, req: Req, keep_lock: bool) -> None:
        """Put the request's written tokens into the cache, freeing the request's duplicates of
        tokens the cache already had. With ``keep_lock`` the request's slots are re-pointed at
        the cache's and its lock moves to the new node (its whole cached part stays protected
        while it runs); otherwise the lock is released and everything private (unwritten slots
        included) is freed."""
        t0 = time.perf_counter()
        w = req.kv_written
        key = req.cache_key(w)
        low = req.low_priority_from
        # With a hint, what the request did not find (it computed it) enters on probation.
        prob = req.cached_tokens if low is not None and req.cached_tokens >= 0 else None
        n = self.cache.insert(key, req.kv_slots[:w], salt=req.salt, low_priority_from=low,
                              probation_from=prob)
        if n > req.prefix_len:
            self.allocator.free(req.kv_slots[req.prefix_len : n])
        held = self.cache.cacheable_length(w)  # kv_slots[:held] are the cache's now
        if keep_lock:
            m = self.cache.match_inserted(key, salt=req.salt, low_priority_from=low, probation_from=prob)
            if m.length < held:  # a prompt enters with its window KV, so it matches whole
                raise RuntimeError(f"the cache serves {m.length} of the {held} tokens just inserted")
            self.cache.lock(m.node)
            if req.last_node is not None:
                self.cache.unlock(req.last_node)
            req.kv_slots = torch.cat([m.indices, req.kv_slots[m.length :]])
            req.prefix_len, req.last_node, req.kv_written = m.length, m.node, max(w, m.length)
        else:
            private = torch.cat([req.kv_slots[held:], req.spare_slots])
            if req.last_node is not None:
                self.cache.unlock(req.last_node)
            self.allocator.free(private)
            req.kv_slots = req.spare_slots = EMPTY_SLOTS
            req.prefix_len, req.last_node, req.kv_written = 0, None, 0
        self.tree_time(t0)

    def release(self, req: Req) -> None:
        """Give back everything the request holds: written KV goes to the cache, the rest is freed."""
        if req.computed_len or req.spare_slots.numel() or req.last_node is not None:
            self.cache_written(req, keep_lock=False)
