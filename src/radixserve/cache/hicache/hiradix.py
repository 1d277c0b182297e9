"""HiRadixCache: one radix tree whose nodes record where their KV lives, in three tiers.

* **L1** — the attention pool (:class:`~radixserve.memory.kv_pool.KVPool`), the only tier the
  model reads: ``node.value``, slots from the engine's allocator.
* **L2** — host memory (:class:`~radixserve.memory.host_pool.HostKVPool`): ``node.host``.
* **L3** — shared storage (:mod:`radixserve.storage`): whole pages of ``storage_page_tokens``
  tokens under hash-chain keys, asked for when a request arrives.

:class:`HiRadixCache` is :class:`..radix.RadixCache` (one walk, one insert, one lock, one L1
queue, one reset) with L1 refined through the plain cache's hooks: a node may hold no L1
slots (its run is in L2 only), and an evicted L1 run is demoted to L2 instead of dropped
when it has a copy there. Its parts (listed in :mod:`radixserve.cache.hicache`, with how the
scheduler uses it) hold the rest; :mod:`.introspect` states the invariants.

L1 eviction (``evict``) demotes a run with an L2 copy (frees its L1 slots, keeps the node);
one without is copied down first under ``write_back`` (and always when the node has L2-only
children or is pinned, which would otherwise be orphaned), else dropped. ``write_through``
copies a run to L2 when ``insert`` adds it, ``write_through_selective`` once ``load_back``
has counted ``write_through_threshold`` admissions through it.

Events (``listener``) carry a tier (:mod:`..events`): ``L1`` events describe L1; ``L2`` ones
the worker's whole tree, L1 *or* L2 (unlike L2 alone prefix-closed, and exactly the "tokens
servable without recomputation" a router scores a worker by); ``L3`` ones are STORED only,
one per page written (storage is shared, one L3 view for all workers, evictions unseen).
"""

from __future__ import annotations

import time
from array import array
from typing import Callable, Dict, Hashable, List, Optional

import numpy as np
import torch

from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from radixserve.storage import StorageClient, encode_salt

from ..base import FreeCallback, TokenIds, check_num_tokens, match_of_runs
from ..events import CLEARED, REMOVED, STORED, CacheEvent
from ..packed import pack
from ..radix import RadixCache
from . import introspect
from .accounting import TierAccounting
from .config import HiCacheConfig
from .loads import LoadBack
from .node import HiMatchResult, HiNode, PrefetchHandle
from .storage_side import StorageSide, open_client
from .tiers import HostTier

__all__ = ["HiRadixCache", "HiNode", "HiMatchResult", "PrefetchHandle"]


class HiRadixCache(RadixCache):
    """Radix cache over L1 (KV pool), L2 (host pool) and optionally L3 (storage): the plain
    cache with :class:`.tiers.HostTier` as its component."""

    tiered = True
    node_type = HiNode
    priorities = False

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
        for name, v, cls in (("allocator", allocator, SlotAllocator), ("kv_pool", kv_pool, KVPool),
                             ("host_pool", host_pool, HostKVPool)):
            if not isinstance(v, cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {type(v).__name__}")
        ps = allocator.page_size
        if host_pool.page_size != ps:
            raise ValueError(f"host_pool page_size {host_pool.page_size} != allocator page_size {ps}")
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
        self._now = clock
        #: Called with the L1 slots a flush_loads filled from L2 (they now hold K/V).
        self.on_written: Optional[Callable[[torch.Tensor], None]] = None
        self.report = TierAccounting(ps, config.ghost_entries)
        self.counters = self.report.counters
        self.hist = self.report.hist
        self.ghost = self.report.ghost
        self._storage: Optional[StorageSide] = None
        if storage is not None:
            self._storage = StorageSide(storage, kv_pool, host_pool, ps, config, self.counters,
                                        self.hist["prefetch_latency_s"], self._insert_fetched, self._emit)
        self._tiers = HostTier(host_pool, kv_pool, self.counters, self.hist["age_at_eviction_s/L2"],
                               self._leave, clock, self._storage)
        self.components = (self._tiers,)
        self._write_back = config.write_policy == "write_back"
        self._through = config.write_policy == "write_through"
        selective = config.write_policy == "write_through_selective"
        self._loads = LoadBack(self, allocator, self._tiers, self.counters,
                               config.write_through_threshold if selective else None)
        RadixCache.__init__(self, ps, on_free if on_free is not None else allocator.free)

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

    @property
    def host_size(self) -> int:
        """Tokens with an L2 copy."""
        return self._tiers.size

    @property
    def _pending(self) -> List[tuple]:
        """Deferred L2 -> L1 copies (host slots, device slots) not yet issued."""
        return self._tiers.pending

    # ------------------------------------------------------------------ hooks of the plain cache
    def _l1_candidate(self, node: HiNode) -> bool:
        """An unlocked L1 leaf: it holds L1 slots and no child does (its children, if any,
        are in L2 only)."""
        return (node.key is not None and node.value is not None and not node.lock_ref
                and all(c.value is None for c in node.children.values()))

    def _root_in_use(self, root: HiNode) -> bool:
        return root.pin_ref > 0

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
                if not node.pin_ref and not node.children:
                    self._drop_root(node)
                return
            if node.pin_ref == 0:
                self._tiers.offer(node)
            node = node.parent

    def _leave(self, node: HiNode, tier: str, now: float) -> None:
        """Remove a childless node that holds nothing any more (its slots are already taken);
        the ghost memory records it as evicted from ``tier``."""
        if self.listener is not None or self.ghost.entries:
            path, salt = self.path_bytes(node), self.salt_of(node)
            self._emit(CacheEvent(REMOVED, salt, path, len(node.key) >> 2, "L2"))
            self.ghost.record(encode_salt(salt), path, (len(path) - len(node.key)) >> 2, tier, now)
        node.host = None
        self._lru.discard(node)
        self._tiers.queue.discard(node)
        parent = self._unlink(node)
        if parent.parent is not None:
            self._tiers.offer(parent)

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> HiMatchResult:
        """Longest cached prefix across L1 (``indices/length/node``) and L2 (``host_length/
        host_node``); refreshes stamps and splits an edge the match ends inside, as RadixCache."""
        runs, l1, end, pos, node = self._match_served(token_ids, salt, False, self._tiers)
        return match_of_runs(runs, l1, end, pos - l1, node)

    def _inserted(self, salt: Hashable, q: bytes, n: int, arr: np.ndarray, path: List[HiNode],
                  pos: int, leaf: Optional[HiNode], stamp: int) -> int:
        """Runs the tree held in L2 only take the caller's slots (in L1 again without a copy),
        like new ones. Returns the leading tokens that were in **L1** before the call: the
        caller frees ``indices[m:n]`` as duplicates exactly as with RadixCache."""
        now = self._now()
        for nd in path:
            nd.used_time = now
        k = self._tiers.served(path)
        a = off = sum(len(nd.value) for nd in path[:k])
        for nd in path[k:]:
            L = len(nd.key) >> 2
            nd.value = arr[off : off + L].copy()
            self._evictable += L
            off += L
        if self.listener is not None:
            if n > a:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - a, "L1"))
            if leaf is not None:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - pos, "L2"))
        for nd in path[k:]:
            self._tiers.offer(nd)  # in L1 and L2 now: its L2 copy may be evicted alone
        if leaf is not None:
            leaf.used_time = now
            if self._through:
                self._tiers.backup([leaf])
        elif path:
            self._lru.offer(path[-1])
        return a

    def lock(self, node: HiNode) -> None:
        """Protect ``node`` and its ancestors in L1 (they must be in L1: lock ``m.node``)."""
        self._check_handle(node)
        if node.parent is not None and node.value is None:
            raise ValueError("node is not in L1; lock the L1 node (match_prefix().node) or load_back first")
        RadixCache.lock(self, node)

    def reset(self) -> None:
        """Drop both local tiers (L3 is shared and stays). Raises while anything is locked."""
        RadixCache.reset(self)
        self.ghost.clear()
        self._emit(CacheEvent(CLEARED, None, b"", 0, "L2"))

    # ------------------------------------------------------------------ L1 eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L1 slots if possible, LRU L1 leaves first (demoted,
        copied down or dropped: see the module docstring)."""
        if check_num_tokens(num_tokens):
            self.flush_loads()
        return RadixCache.evict(self, num_tokens)

    def _evict_node(self, node: HiNode, freed: List[np.ndarray]) -> int:
        now = self._now()
        tiers = self._tiers
        L = len(node.value)
        if node.host is None and (self._write_back or node.children or node.pin_ref):
            if not tiers.backup([node]):
                if node.pin_ref:
                    return 0
                tiers.drop_below(node, now)
        parent = node.parent
        freed.append(node.value)
        self.hist["age_at_eviction_s/L1"].observe(now - node.used_time)
        self._emit_node(REMOVED, node, L, "L1")
        node.value = None
        if node.host is not None:
            self.counters["demoted_tokens"] += L
            tiers.offer(node)
        else:
            self.counters["dropped_tokens_L1"] += L
            self._leave(node, "L1", now)
        if parent.parent is not None:
            self._lru.offer(parent)
        return L

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L2 slots if possible, LRU first: L2-only leaves leave
        the tree, L2 copies of runs still in L1 are just freed. Returns slots freed."""
        return self._tiers.evict_host(num_tokens)

    # ------------------------------------------------------------------ L2 -> L1 (loads.py)
    def load_back(self, m: HiMatchResult, max_tokens: Optional[int] = None) -> HiMatchResult:
        """Move ``m``'s L2 continuation into L1 (at most ``max_tokens``, whole pages), evicting
        L1 if needed; return the match as it is now (``length`` covers what was loaded,
        ``loaded`` says how much). Call it for every admission (it also counts the hit
        ``write_through_selective`` uses), right after ``match_prefix``, and lock the returned
        ``node`` before anything else can evict. The copy is issued by ``flush_loads`` (or any
        call that needs the slots), so the loads of one step go out together."""
        return self._loads.load(m, max_tokens)

    def _loaded(self, load: List[HiNode], n: int) -> None:
        """``load`` (runs of one path, root side first, ``n`` tokens) was just given L1 slots."""
        self._evictable += n
        self._emit_node(STORED, load[-1], n, "L1")
        self._lru.offer(load[-1])
        for nd in load:
            self._tiers.offer(nd)

    def flush_loads(self) -> int:
        """Issue the L2 -> L1 copies of the load_backs since the last flush (one gather, one
        scatter); return the tokens copied. Once per step, before the forward reads the slots."""
        dev = self._tiers.flush_loads()
        if dev is None:
            return 0
        if self.on_written is not None:
            self.on_written(dev)
        return len(dev)

    # ------------------------------------------------------------------ L3 (storage_side.py)
    def prefetch(self, token_ids: TokenIds, salt: Hashable = None) -> Optional[PrefetchHandle]:
        """Start fetching, in the background, the storage pages of ``token_ids`` beyond what
        L1+L2 hold; None when there is nothing to ask for (no storage, too short, storage
        known to be down). Pass the handle to ``prefetch_ready``/``record_admission``."""
        if self._storage is None:
            return None
        ids, q = pack(token_ids)
        n = len(ids) - len(ids) % self._storage.page_tokens
        if not n:
            return None
        root = self._default_root if salt is None else self._roots.get(salt)
        local = 0 if root is None else self._peek(root, ids, q, n)[1]
        return self._storage.prefetch(q, salt, local)

    def prefetch_ready(self, handle: Optional[PrefetchHandle]) -> bool:
        """Whether the request may be admitted now, per the prefetch policy (then the pages
        fetched so far are in the tree, L2, and any rest is cancelled)."""
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

    def _insert_fetched(self, h: PrefetchHandle, pages: list) -> None:
        """The pages a prefetch brought enter the tree as an L2 run below the request's local
        prefix (as far as L2 can take them)."""
        P = self._storage.page_tokens
        start = h.start
        end = start + len(pages) * P
        q = h.tokens[: end << 2]
        ids = array("I", q)
        root = self._root_for_insert(h.salt)
        self._clock = stamp = self._clock + 1
        node, pos, _ = self._descend(root, ids, q, end, stamp)
        if pos < start:
            self.counters["prefetch_discarded"] += 1  # the local prefix it extends is gone
            if node is root and not root.children:
                self._drop_root(root)
            return
        if pos >= end:
            return  # computed or fetched by someone else meanwhile
        self._pin(node)  # making room in L2 must not drop the path the pages hang from
        try:
            stored = self._tiers.store_fetched(end - pos, pages, pos - start, self.page_size)
            if stored is None:
                self.counters["prefetch_no_room"] += 1
                return
            hidx, L, nbytes = stored
            end = pos + L
            leaf = self._attach(node, ids, q, pos, end, stamp)
            leaf.used_time = self._now()
            leaf.host = hidx
            leaf.in_l3 = True
            self._tiers.adopt(leaf)
        finally:
            self._unpin(node)
        self.counters["prefetch_tokens"] += L
        self.counters["bytes_L3_to_L2"] += nbytes
        h.inserted = (pos, end)
        h.created = min(p.created for p in pages)
        self._emit(CacheEvent(STORED, h.salt, q[: end << 2], L, "L2"))

    def poll(self) -> None:
        """Background work that must touch the tree, on the scheduler thread (once per step,
        cheap when idle): insert finished prefetches, account L3 writes, issue pending loads."""
        self.flush_loads()
        if self._storage is not None:
            self._storage.poll()

    def wait_background(self, timeout_s: float) -> None:
        """See :meth:`.base.PrefixCache.wait_background`: waits on the oldest pending prefetch."""
        if self._storage is not None:
            self._storage.wait_any(timeout_s)

    def wait_storage_idle(self, timeout: float = 30.0) -> bool:
        """Block until queued L3 writes are done, then ``poll`` (tests, shutdown, benches)."""
        ok = self._storage is None or self._storage.writer.wait_idle(timeout)
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
        """Account one admitted request (once, at its first admission, with ``load_back``'s
        result): ``{"cached": {"L1", "L2", "L3"}, "uncached": {reason: tokens}}`` for the
        response's meta_info; the counters behind ``stats()`` add it up."""
        q = pack(token_ids)[1]
        P = self.storage.page_tokens if self.storage is not None else 0
        return self.report.record_admission(q, m, salt, prefetch, self._now(), P, self.reach_elsewhere)

    def stats(self) -> dict:
        side = self._storage
        return self.report.stats(
            super().stats(),
            l1={"tokens": self.total_size, "evictable": self._evictable, "protected": self._protected},
            l2={"tokens": self._tiers.size, "capacity": self.host_pool.capacity, "free": self.host_pool.available},
            policies={"write_policy": self.config.write_policy, "prefetch_policy": self.config.prefetch_policy},
            in_flight=len(side.prefetching) if side is not None else 0,
            l3_pending=side.writer.pending if side is not None else None,
            storage=self.storage.stats() if self.storage is not None else None)

    # ------------------------------------------------------------------ introspection
    def held_slots(self) -> torch.Tensor:
        """Every L1 slot the tree holds (for the scheduler's integrity check)."""
        self.flush_loads()
        return RadixCache.held_slots(self)

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
        """The invariants of :mod:`.introspect`: structure, tier rules, L1 sizes and queue,
        locks and pins, slot uniqueness in both pools, the L2 tier's own checks."""
        nodes = self.check_structure()
        in_l1 = introspect.check_tier_rules(self.namespaces(), nodes)
        self._check_l1(nodes, in_l1)
        if in_l1 and self.allocator.free_slot_set() & set(np.concatenate([n.value for n in in_l1]).tolist()):
            raise AssertionError("an L1 slot is both in the tree and free")
        self._tiers.check(nodes)

    def __repr__(self) -> str:
        return (f"HiRadixCache(page_size={self.page_size}, l1={self.total_size}, "
                f"evictable={self._evictable}, protected={self._protected}, l2={self._tiers.size}, "
                f"nodes={self._num_nodes}, write_policy={self.config.write_policy})")

