"""HiRadixCache: one radix tree whose nodes record where their KV lives, in three tiers.

* **L1** — the attention pool (:class:`~radixserve.memory.kv_pool.KVPool`): ``node.value``,
  slots from the engine's allocator. Only L1 is read by the model.
* **L2** — host memory (:class:`~radixserve.memory.host_pool.HostKVPool`): ``node.host``.
* **L3** — shared storage (:mod:`radixserve.storage`): whole pages of ``storage_page_tokens``
  tokens under hash-chain keys, asked for when a request arrives.

The tree's structure (walk, split, roots, locks) is :class:`..tree.RadixTree`'s, the same
code the plain cache and the router's mirror run; this module adds the tiers' state (sizes,
candidate queues, pins) and the public API; how the scheduler uses it is in the package
docstring (:mod:`radixserve.cache.hicache`). :class:`.tiers.Tiers` is the tree's component
for the L2 copy and moves runs between L1 and L2 (eviction, write policies, load_back),
:class:`.storage_side.StorageSide` talks to L3 (writes, prefetch), :mod:`.accounting` reports
admissions and stats, and :mod:`.introspect` states and checks the invariants.

Events (``listener``) carry a tier. ``L1`` events describe what is in L1. ``L2`` events
describe what the worker holds in L1 *or* L2 (its whole tree), which, unlike L2 alone, is
prefix-closed, so a mirror replays both streams with the rules of :mod:`..events`; a router
that scores a worker by "tokens servable without recomputation" wants exactly that set.
``L3`` events are STORED only, one per page this worker wrote: storage is shared, so a router
keeps one L3 view for all workers, and storage evictions are not observable.
"""

from __future__ import annotations

import heapq
import time
from typing import Callable, Dict, Hashable, List, Optional

import torch

from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from radixserve.storage import StorageClient

from ..base import FreeCallback, PrefixCache, SlotIndices, TokenIds, as_index_array
from ..events import STORED, CacheEvent, CacheListener
from ..packed import pack
from ..tree import RadixTree
from . import accounting, introspect
from .config import HiCacheConfig
from .node import HiMatchResult, HiNode, PrefetchHandle
from .storage_side import StorageSide, open_client
from .telemetry import AGE_BUCKETS_S, LATENCY_BUCKETS_S, TIERS, Ghost, Histogram, new_counters
from .tiers import Tiers

__all__ = ["HiRadixCache", "HiNode", "HiMatchResult", "PrefetchHandle"]

_heappush = heapq.heappush


class HiRadixCache(RadixTree, PrefixCache):
    """Radix tree over L1 (KV pool), L2 (host pool) and optionally L3 (storage): the tree of
    :mod:`..tree` with :class:`.tiers.Tiers` as its component."""

    can_share_partial_prefix = True
    tiered = True
    node_type = HiNode

    def __init__(
        self,
        allocator: SlotAllocator,
        kv_pool: KVPool,
        host_pool: HostKVPool,
        config: Optional[HiCacheConfig] = None,
        storage: Optional[StorageClient] = None,
        on_free: Optional[FreeCallback] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(allocator, SlotAllocator):
            raise ValueError(f"allocator must be a SlotAllocator, got {type(allocator).__name__}")
        if not isinstance(kv_pool, KVPool):
            raise ValueError(f"kv_pool must be a KVPool, got {type(kv_pool).__name__}")
        if not isinstance(host_pool, HostKVPool):
            raise ValueError(f"host_pool must be a HostKVPool, got {type(host_pool).__name__}")
        PrefixCache.__init__(self, allocator.page_size, on_free if on_free is not None else allocator.free)
        if host_pool.page_size != allocator.page_size:
            raise ValueError(f"host_pool page_size {host_pool.page_size} != allocator page_size "
                             f"{allocator.page_size}")
        host_pool.check_compatible(kv_pool)
        if config is None:
            config = HiCacheConfig(l2_tokens=host_pool.capacity)
        if not isinstance(config, HiCacheConfig):
            raise ValueError(f"config must be a HiCacheConfig, got {type(config).__name__}")
        self.config = config
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.storage = storage
        self._clock_fn = clock
        self.listener: Optional[CacheListener] = None
        #: Called with the L1 slots a flush_loads filled from L2 (they now hold K/V).
        self.on_written: Optional[Callable[[torch.Tensor], None]] = None
        self._through = config.write_policy == "write_through"
        self.counters = new_counters()
        self.hist: Dict[str, Histogram] = {"prefetch_latency_s": Histogram(LATENCY_BUCKETS_S)}
        for t in TIERS:
            self.hist[f"age_at_hit_s/{t}"] = Histogram(AGE_BUCKETS_S)
        for t in ("L1", "L2"):
            self.hist[f"age_at_eviction_s/{t}"] = Histogram(AGE_BUCKETS_S)
        ps = self.page_size
        self.ghost = Ghost(config.ghost_entries, ps, ps * max(1, -(-64 // ps)))
        self._tiers = Tiers(self)
        self.components = (self._tiers,)
        self._storage: Optional[StorageSide] = None if storage is None else StorageSide(self, storage)
        RadixTree.__init__(self, allocator.page_size)

    @classmethod
    def from_config(cls, config: HiCacheConfig, allocator: SlotAllocator, kv_pool: KVPool,
                    on_free: Optional[FreeCallback] = None) -> "HiRadixCache":
        """Build the host pool (``l2_tokens``) and, if ``config.storage`` is set, the storage
        client for ``config.model_name``, then the cache."""
        if not isinstance(config, HiCacheConfig) or not config.enabled:
            raise ValueError("config must be a HiCacheConfig with l2_tokens > 0")
        host = HostKVPool.like(kv_pool, config.l2_tokens, allocator.page_size)
        storage = open_client(config, kv_pool, allocator.page_size) if config.storage is not None else None
        return cls(allocator, kv_pool, host, config, storage, on_free)

    # ------------------------------------------------------------------ state
    def _init_tree(self) -> None:
        RadixTree._init_tree(self)
        self._evictable = 0
        self._protected = 0
        self._host_size = 0
        self._heap1: List[tuple] = []
        self._heap2: List[tuple] = []

    # ------------------------------------------------------------------ sizes

    @property
    def host_size(self) -> int:
        """Tokens with an L2 copy."""
        return self._host_size

    # ------------------------------------------------------------------ candidates
    @staticmethod
    def _has_l1_child(node: HiNode) -> bool:
        for c in node.children.values():
            if c.value is not None:
                return True
        return False

    def _push1(self, node: HiNode) -> None:
        """Queue ``node`` for L1 eviction if it is a candidate (an unlocked L1 leaf)."""
        if (not node.in_heap and node.parent is not None and node.value is not None
                and node.lock_ref == 0 and not self._has_l1_child(node)):
            node.in_heap = True
            _heappush(self._heap1, (node.last_access, node.id, node))

    def _push2(self, node: HiNode) -> None:
        """Queue ``node`` for L2 eviction if it is a candidate (an unpinned L2 copy whose loss
        orphans nothing: the node is in L1 too, or has no children)."""
        if (not node.in_heap2 and node.parent is not None and node.host is not None
                and node.pin_ref == 0 and (node.value is not None or not node.children)):
            node.in_heap2 = True
            _heappush(self._heap2, (node.last_access, node.id, node))

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        return self._clock_fn()

    def _pin(self, node: HiNode) -> None:
        """Pin ``node``, its ancestors and its root (a pinned root is not dropped when its
        namespace empties: something is about to hang from it)."""
        while True:
            node.pin_ref += 1
            if node.parent is None:
                return
            node = node.parent

    def _unpin(self, node: HiNode) -> None:
        while True:
            node.pin_ref -= 1
            if node.parent is None:
                if (not node.pin_ref and not node.children and node.salt is not None
                        and self._roots.get(node.salt) is node):
                    del self._roots[node.salt]
                return
            if node.pin_ref == 0:
                self._push2(node)
            node = node.parent

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> HiMatchResult:
        """Longest cached prefix across L1 and L2: the L1 part in ``indices/length/node``, the
        L2 continuation in ``host_length/host_node``. Refreshes LRU stamps on the whole path
        and splits an edge the match ends inside of (as RadixCache does)."""
        idx, l1, end, pos, node = self._match_served(token_ids, salt, False, self._tiers)
        return HiMatchResult(idx, l1, end, pos - l1, node, 0)

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None,
               low_priority_from: Optional[int] = None,
               probation_from: Optional[int] = None) -> int:
        """Cache ``token_ids`` with L1 slots ``indices`` (whole pages only).

        Returns how many leading tokens were in **L1** before the call: the caller frees
        ``indices[m:n]`` as duplicates exactly as with RadixCache. Tokens the tree held in L2
        only take the caller's slots (the run is in L1 again without a copy), like new ones."""
        ids, q = pack(token_ids)
        n = len(ids)
        arr = as_index_array(indices, n)
        ps = self.page_size
        n -= n % ps
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            root = self._root_for_insert(salt)
        self._clock = stamp = self._clock + 1
        now = self._now()
        node, pos, path = self._descend(root, ids, q, n, stamp, False)
        for nd in path:
            nd.used_time = now
        k = self._tiers.served(path)
        a = sum(len(nd.value) for nd in path[:k])
        off = a
        for nd in path[k:]:  # in L2 only: take the caller's freshly computed slots
            L = len(nd.key) >> 2
            nd.value = arr[off : off + L].copy()
            self._evictable += L
            off += L
        deepest = node
        leaf = None
        if pos < n:
            leaf = self._attach(node, ids, q, pos, n, stamp)
            leaf.used_time = now
            leaf.value = arr[pos:n].copy()
            self._evictable += n - pos
            deepest = leaf
        if self.listener is not None:
            if n > a:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - a, "L1"))
            if leaf is not None:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - pos, "L2"))
        if deepest.parent is not None:
            self._push1(deepest)
            for nd in path[k:]:
                self._push2(nd)  # in L1 and L2 now: its L2 copy may be evicted alone
        if leaf is not None and self._through:
            self._tiers.backup([leaf])
        return a

    # ------------------------------------------------------------------ locks
    def lock(self, node: HiNode) -> None:
        """Protect ``node`` and its ancestors in L1 (they must be in L1: lock ``m.node``)."""
        self._check_handle(node)
        if node.parent is not None and node.value is None:
            raise ValueError("node is not in L1; lock the L1 node (match_prefix().node) or load_back first")
        delta = self._lock_path(node)
        self._evictable -= delta
        self._protected += delta

    def unlock(self, node: HiNode) -> None:
        self._check_handle(node)
        released: List[HiNode] = []
        delta = self._unlock_path(node, released)
        for nd in released:
            self._push1(nd)
        self._evictable += delta
        self._protected -= delta

    def reset(self) -> None:
        """Drop both local tiers (L3 is shared and stays). Raises while anything is locked."""
        if self._protected:
            raise RuntimeError(f"reset() while {self._protected} tokens are locked by running requests")
        self._tiers.drop_all()

    # ------------------------------------------------------------------ tiers (tiers.py)
    @property
    def _pending(self) -> List[tuple]:
        """Deferred L2 -> L1 copies (host slots, device slots) not yet issued."""
        return self._tiers.pending

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L1 slots if possible, LRU L1 leaves first: a run with
        an L2 copy is demoted (stays in the tree), one without is copied down first under
        write_back (or when dropping it would orphan L2 runs below it), else dropped."""
        return self._tiers.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L2 slots if possible, LRU first: L2-only leaves leave
        the tree, L2 copies of runs still in L1 are just freed. Returns slots freed."""
        return self._tiers.evict_host(num_tokens)

    def load_back(self, m: HiMatchResult, max_tokens: Optional[int] = None) -> HiMatchResult:
        """Move ``m``'s L2 continuation into L1 (at most ``max_tokens``, whole pages), evicting
        L1 if needed; return the match as it is now (``length`` covers what was loaded,
        ``loaded`` says how much). Call it right after ``match_prefix`` and lock the returned
        ``node`` before anything else can evict. The copy itself is issued by ``flush_loads``
        (or any call that needs the slots), so the loads of one step go out together.

        Call it for every admission: it also counts the hit ``write_through_selective`` uses."""
        return self._tiers.load_back(m, max_tokens)

    def flush_loads(self) -> int:
        """Issue the L2 -> L1 copies of the load_backs since the last flush (one gather and one
        scatter for all of them); return the tokens copied. The scheduler calls it once per
        step after admission, before the forward reads the slots."""
        return self._tiers.flush_loads()

    # ------------------------------------------------------------------ L3 (storage_side.py)
    def prefetch(self, token_ids: TokenIds, salt: Hashable = None) -> Optional[PrefetchHandle]:
        """Start fetching, in the background, the storage pages of ``token_ids`` beyond what
        L1+L2 hold; None when there is nothing to ask for (no storage, too short, storage
        known to be down). Pass the handle to ``prefetch_ready``/``record_admission``."""
        return None if self._storage is None else self._storage.prefetch(token_ids, salt)

    def prefetch_ready(self, handle: Optional[PrefetchHandle]) -> bool:
        """Whether the request may be admitted now, per the prefetch policy. When it may, the
        pages fetched so far are in the tree (L2) and any rest is cancelled."""
        if handle is None or handle.finished:
            return True
        return self._storage.ready(handle)

    def prefetch_status(self, handle: Optional[PrefetchHandle]) -> str:
        """"none", "pending", "done", "timed_out", "cut" or "cancelled"."""
        if handle is None:
            return "none"
        if not handle.finished and handle.job.done.is_set():
            return "done"
        return handle.status

    def cancel_prefetch(self, handle: Optional[PrefetchHandle]) -> None:
        """The request is gone: stop its prefetch (pages already read still enter L2)."""
        if handle is not None and not handle.finished:
            self._storage.finish(handle, "cancelled")

    def poll(self) -> None:
        """Background work that must touch the tree, done on the scheduler thread: insert
        finished prefetches, account L3 write results, issue pending loads. Call once per
        step (cheap when idle)."""
        self._tiers.flush_loads()
        if self._storage is not None:
            self._storage.poll()

    def wait_background(self, timeout_s: float) -> None:
        """See :meth:`.base.PrefixCache.wait_background`: waits on the oldest pending prefetch."""
        if self._storage is not None:
            self._storage.wait_any(timeout_s)

    def wait_storage_idle(self, timeout: float = 30.0) -> bool:
        """Block until queued L3 writes are done, then ``poll`` (tests, shutdown, benches)."""
        ok = True
        if self._storage is not None:
            ok = self._storage.writer.wait_idle(timeout)
        self.poll()
        return ok

    def close(self, drain_timeout: float = 30.0) -> None:
        """Let queued L3 writes finish (up to ``drain_timeout``: pages still queued at shutdown
        would otherwise be lost to the next server), stop the storage threads, disconnect."""
        if self._storage is not None:
            self.wait_storage_idle(drain_timeout)
            self._storage.close()

    # ------------------------------------------------------------------ accounting.py
    def record_admission(self, token_ids: TokenIds, m: HiMatchResult, salt: Hashable = None,
                         prefetch: Optional[PrefetchHandle] = None) -> dict:
        """Account one admitted request (call once, at its first admission, with the result of
        ``load_back``): cached tokens by tier and a reason for the rest. Returns
        ``{"cached": {"L1", "L2", "L3"}, "uncached": {reason: tokens}}`` for the response's
        meta_info; the counters behind ``stats()`` add it up."""
        return accounting.record_admission(self, token_ids, m, salt, prefetch)

    def stats(self) -> dict:
        return accounting.stats(self, super().stats())

    # ------------------------------------------------------------------ introspect.py
    def held_slots(self) -> torch.Tensor:
        """Every L1 slot the tree holds (for the scheduler's integrity check)."""
        self.flush_loads()
        return introspect.held_slots(self)

    def snapshot_events(self) -> List[CacheEvent]:
        """STORED events (parents first, tiers L1 and L2) that rebuild a mirror from empty."""
        return introspect.snapshot_events(self)

    def tier_contents(self, salt: Hashable = None) -> Dict[str, set]:
        """``{"L1": {...}, "L2": {...}}``: every cached token prefix (as a tuple) by tier, where
        "L2" means L1 or L2 as in the events. O(tokens^2): tests only."""
        return introspect.tier_contents(self, salt)

    def dump(self, max_tokens: int = 8) -> str:
        return introspect.dump(self, max_tokens)

    def check_integrity(self) -> None:
        """Structure, tier rules, sizes, locks/pins, slot uniqueness in both pools, heaps."""
        introspect.check_integrity(self)

    def __repr__(self) -> str:
        return (f"HiRadixCache(page_size={self.page_size}, l1={self.total_size}, "
                f"evictable={self._evictable}, protected={self._protected}, l2={self._host_size}, "
                f"nodes={self._num_nodes}, write_policy={self.config.write_policy})")
