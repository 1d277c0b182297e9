"""HiRadixCache: one radix tree whose nodes record where their KV lives, in three tiers.

* **L1** — the attention pool (:class:`~radixserve.memory.kv_pool.KVPool`): ``node.value``,
  slots from the engine's allocator. Only L1 is read by the model.
* **L2** — host memory (:class:`~radixserve.memory.host_pool.HostKVPool`): ``node.host``.
* **L3** — shared storage (:mod:`radixserve.storage`): whole pages of ``storage_page_tokens``
  tokens under hash-chain keys; ``node.in_l3`` says this cache has stored (or fetched) the
  pages that end inside the node. Storage is not mirrored in the tree: it is asked, page by
  page along a request's key chain, when a request arrives (``prefetch``).

Invariants (``check_integrity`` checks them all)
-----------------------------------------------
* Every node holds its run in L1, in L2, or in both; a run in neither leaves the tree.
* L1 is prefix-closed: the parent of an L1 node is in L1. So a match is an L1 prefix
  followed by an L2 continuation, and L1 eviction takes L1 leaves (nodes with no L1 child).
* A slot of either pool is in exactly one place: its free list, one node, or (L1 only) a
  request. ``evictable_size + protected_size == total_size`` counts L1 tokens only, so the
  scheduler's memory accounting (``free + evictable``) is unchanged.
* ``lock_ref`` (running requests, L1) and ``pin_ref`` (transfers) both count the node and its
  descendants, like RadixCache's lock. A locked node cannot leave L1; a pinned node cannot
  leave the tree and its L2 copy cannot be freed. Pins are taken only inside a call here,
  because every copy is synchronous on return; an asynchronous device backend would hold
  them until its copy completes and release them in ``poll``.

Movement
--------
* L1 eviction (``evict``) demotes a run that has an L2 copy (frees the L1 slots, keeps the
  node); a run without one is copied down first under ``write_back`` (and always when the
  node has L2-only children or is pinned, which would otherwise be orphaned); otherwise it is
  dropped. L2 is made room for by its own LRU (``evict_host``): L2-only leaves leave the tree,
  L2 copies of L1 runs are just freed.
* ``write_through`` copies a run to L2 when ``insert`` adds it; ``write_through_selective``
  once ``load_back`` has counted ``write_through_threshold`` admissions through it;
  ``write_back`` on L1 eviction. Whenever a run gets an L2 copy and storage is configured,
  the pages ending in it are gathered (from L1 or L2, on the calling thread: the slots may be
  reused at the next step) and queued for the background writer.
* ``load_back`` moves an L2 continuation into L1 (allocating L1 slots, evicting L1 if needed);
  the copies of all load_backs since the last ``flush_loads`` are issued as one gather and one
  scatter. Anything that could free or reuse those slots (``evict``, ``evict_host``,
  ``reset``, ``poll``) flushes first, so deferring is never unsafe.
* ``prefetch`` hands the keys of the pages beyond the local match to the prefetcher thread;
  ``poll``/``prefetch_ready`` insert what arrived as an L2 run.

Integration (what the scheduler calls; the scheduler thread is the only caller)
------------------------------------------------------------------------------
Construction::

    cache = HiRadixCache.from_config(hicache_cfg, allocator, kv_pool)  # on_free=allocator.free

On arrival of a request::

    req.prefetch = cache.prefetch(req.cache_key(), salt=req.salt)     # None without storage

Every step, before admission::

    cache.poll()             # finish prefetches that completed, L3 write results, loads

Admission of one request (replaces ``m = cache.match_prefix(...)``)::

    if not cache.prefetch_ready(req.prefetch):   # policy: best_effort/wait_complete/timeout
        continue                                 # leave it waiting this step
    m = cache.match_prefix(key, salt=req.salt)   # HiMatchResult; .indices/.length/.node = L1
    m = cache.load_back(m)                       # L2 continuation -> L1; call it for every
                                                 # admission (counts write_through_selective hits)
    cache.lock(m.node)                           # as before; the rest of admission is unchanged
    ...
    if first admission: req.tier_report = cache.record_admission(key, m, req.salt, req.prefetch)

After the admission loop, before the forward::

    cache.flush_loads()      # the L2 -> L1 copies of this step's load_backs

Everything else (``insert``, ``unlock``, ``evict``, ``reset``, ``check_integrity``) keeps the
:class:`~radixserve.cache.base.PrefixCache` contract. A request aborted while its prefetch is
in flight calls ``cache.cancel_prefetch(req.prefetch)``. ``cache.close()`` stops the storage
threads at shutdown.

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
from array import array
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional

import numpy as np
import torch

from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from radixserve.storage import (
    ModelFingerprint,
    PrefetchJob,
    Prefetcher,
    StorageClient,
    WriteItem,
    Writer,
    encode_salt,
    open_storage,
    page_keys,
)

from ..base import (
    FreeCallback,
    PrefixCache,
    SlotIndices,
    TokenIds,
    as_index_array,
    check_num_tokens,
    empty_indices,
)
from ..events import CLEARED, REMOVED, STORED, CacheEvent, CacheListener
from ..radix import _common_prefix_tokens, _pack, _unpack
from .config import HiCacheConfig
from .telemetry import AGE_BUCKETS_S, LATENCY_BUCKETS_S, MISS_REASONS, TIERS, Ghost, Histogram, new_counters

__all__ = ["HiRadixCache", "HiNode", "HiMatchResult", "PrefetchHandle"]

_heappush = heapq.heappush
_heappop = heapq.heappop
_EMPTY = np.empty(0, dtype=np.int64)


class HiNode:
    """One edge of the tiered tree: its tokens and where their KV is."""

    __slots__ = (
        "key",  # bytes: tokens of the edge, packed uint32 (b"" for a root); None once dead
        "value",  # np.ndarray[int64] of L1 slots, or None (not in L1)
        "host",  # np.ndarray[int64] of L2 slots, or None (not in L2)
        "children",
        "parent",
        "lock_ref",  # locks on this node or a descendant (L1 protection)
        "pin_ref",  # pins on this node or a descendant (tree + L2 protection)
        "last_access",  # logical clock of the last match/insert through it (LRU order)
        "used_time",  # monotonic time of the last insert/admission through it (ages)
        "hit_count",  # admissions through it (write_through_selective)
        "id",
        "in_heap1",  # has an entry in the L1 eviction heap
        "in_heap2",  # has an entry in the L2 eviction heap
        "salt",  # namespace (roots only)
        "in_l3",  # the storage pages ending inside this run are stored (or queued)
    )

    def __init__(self, key: bytes, parent: Optional["HiNode"], stamp: int, nid: int, now: float = 0.0) -> None:
        self.key = key
        self.value: Optional[np.ndarray] = None
        self.host: Optional[np.ndarray] = None
        self.children: Dict[Any, HiNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.pin_ref = 0
        self.last_access = stamp
        self.used_time = now
        self.hit_count = 0
        self.id = nid
        self.in_heap1 = False
        self.in_heap2 = False
        self.salt = None
        self.in_l3 = False

    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2 if self.key else 0

    @property
    def tiers(self) -> str:
        return ("L1" if self.value is not None else "") + ("L2" if self.host is not None else "")

    def __repr__(self) -> str:
        if self.key is None:
            return f"HiNode#{self.id}(dead)"
        return (f"HiNode#{self.id}(len={self.num_tokens}, tiers={self.tiers or '-'}, lock={self.lock_ref}, "
                f"pin={self.pin_ref}, last={self.last_access}, children={len(self.children)})")


class HiMatchResult(NamedTuple):
    """A match across L1 and L2.

    ``indices``/``length``/``node`` are the L1 part, exactly what :class:`MatchResult` holds
    (callers that only read those three see a plain radix cache). ``host_length`` tokens
    more are in L2, ending at ``host_node`` (== ``node`` when there are none);
    :meth:`HiRadixCache.load_back` moves them into L1. ``loaded`` is how many of ``length``
    tokens the load_back that returned this result brought in from L2 (0 from match_prefix).
    """

    indices: torch.Tensor
    length: int
    node: Any
    host_length: int = 0
    host_node: Any = None
    loaded: int = 0

    @property
    def total_length(self) -> int:
        return self.length + self.host_length


class PrefetchHandle:
    """A request's prefetch from L3: returned by :meth:`HiRadixCache.prefetch`."""

    __slots__ = ("job", "tokens", "salt", "start", "finished", "status", "inserted", "fetched",
                 "present", "created")

    def __init__(self, job: PrefetchJob, tokens: bytes, salt: Hashable, start: int) -> None:
        self.job = job
        self.tokens = tokens  # packed ids of the whole pages asked for
        self.salt = salt
        self.start = start  # token where the first asked page begins
        self.finished = False
        self.status = "pending"  # pending | done | timed_out | cut (best_effort) | cancelled
        self.inserted: Optional[tuple] = None  # (first, end) tokens added to the tree from L3
        self.fetched = 0  # pages read
        self.present: Optional[int] = None  # pages storage said it holds
        self.created: Optional[float] = None  # unix write time of the oldest page used

    def __repr__(self) -> str:
        return (f"PrefetchHandle(start={self.start}, status={self.status}, fetched={self.fetched}, "
                f"present={self.present}, inserted={self.inserted})")


class HiRadixCache(PrefixCache):
    """Radix tree over L1 (KV pool), L2 (host pool) and optionally L3 (storage)."""

    can_share_partial_prefix = True

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
        super().__init__(allocator.page_size, on_free if on_free is not None else allocator.free)
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
        self._write_back = config.write_policy == "write_back"
        self._selective = config.write_policy == "write_through_selective"
        self._through = config.write_policy == "write_through"
        self._next_id = 0
        self.counters = new_counters()
        self.hist: Dict[str, Histogram] = {"prefetch_latency_s": Histogram(LATENCY_BUCKETS_S)}
        for t in TIERS:
            self.hist[f"age_at_hit_s/{t}"] = Histogram(AGE_BUCKETS_S)
        for t in ("L1", "L2"):
            self.hist[f"age_at_eviction_s/{t}"] = Histogram(AGE_BUCKETS_S)
        ps = self.page_size
        self.ghost = Ghost(config.ghost_entries, ps, ps * max(1, -(-64 // ps)))
        self._prefetching: Dict[int, PrefetchHandle] = {}
        self._prefetcher: Optional[Prefetcher] = None
        self._writer: Optional[Writer] = None
        if storage is not None:
            if not isinstance(storage, StorageClient):
                raise ValueError(f"storage must be a StorageClient, got {type(storage).__name__}")
            fp = storage.fingerprint
            if fp.page_tokens % ps:
                raise ValueError(f"storage_page_tokens ({fp.page_tokens}) must be a multiple of the "
                                 f"KV page size ({ps})")
            want = (kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim,
                    str(kv_pool.dtype).removeprefix("torch."))
            have = (fp.num_layers, fp.num_kv_heads, fp.head_dim, fp.dtype)
            if want != have:
                raise ValueError(f"storage fingerprint (layers, kv_heads, head_dim, dtype) {have} "
                                 f"does not match the KV pool's {want}")
            self._prefetcher = Prefetcher(storage)
            self._writer = Writer(storage, config.write_queue_pages)
        self._init_state()

    @classmethod
    def from_config(cls, config: HiCacheConfig, allocator: SlotAllocator, kv_pool: KVPool,
                    on_free: Optional[FreeCallback] = None) -> "HiRadixCache":
        """Build the host pool (``l2_tokens``) and, if ``config.storage`` is set, the storage
        client for ``config.model_name``, then the cache."""
        if not isinstance(config, HiCacheConfig) or not config.enabled:
            raise ValueError("config must be a HiCacheConfig with l2_tokens > 0")
        host = HostKVPool.like(kv_pool, config.l2_tokens, allocator.page_size)
        storage = None
        if config.storage is not None:
            if config.storage_page_tokens % allocator.page_size:
                raise ValueError(f"storage_page_tokens ({config.storage_page_tokens}) must be a "
                                 f"multiple of page_size ({allocator.page_size})")
            backend = open_storage(config.storage, config.storage_timeout_s)
            fp = ModelFingerprint.for_pool(config.model_name, kv_pool, config.storage_page_tokens)
            storage = StorageClient(backend, fp, config.storage_retry_s)
        return cls(allocator, kv_pool, host, config, storage, on_free)

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._host_size = 0
        self._num_nodes = 0
        self._heap1: List[tuple] = []
        self._heap2: List[tuple] = []
        self._pending: List[tuple] = []  # (host slots, device slots) of deferred L2 -> L1 copies
        self._default_root = self._make_root(None)
        self._roots: Dict[Hashable, HiNode] = {None: self._default_root}

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _make_root(self, salt: Hashable) -> HiNode:
        root = HiNode(b"", None, 0, self._new_id())
        root.salt = salt
        return root

    def _root_for_insert(self, salt: Hashable) -> HiNode:
        root = self._roots.get(salt)
        if root is None:
            hash(salt)
            root = self._roots[salt] = self._make_root(salt)
        return root

    def _child_key(self, key: bytes):
        if self.page_size == 1:
            return array("I", key[:4])[0]
        return tuple(array("I", key[: 4 * self.page_size]))

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    @property
    def host_size(self) -> int:
        """Tokens with an L2 copy."""
        return self._host_size

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def root(self) -> HiNode:
        return self._default_root

    # ------------------------------------------------------------------ candidates
    @staticmethod
    def _has_l1_child(node: HiNode) -> bool:
        for c in node.children.values():
            if c.value is not None:
                return True
        return False

    def _push1(self, node: HiNode) -> None:
        """Queue ``node`` for L1 eviction if it is a candidate (an unlocked L1 leaf)."""
        if (not node.in_heap1 and node.parent is not None and node.value is not None
                and node.lock_ref == 0 and not self._has_l1_child(node)):
            node.in_heap1 = True
            _heappush(self._heap1, (node.last_access, node.id, node))

    def _push2(self, node: HiNode) -> None:
        """Queue ``node`` for L2 eviction if it is a candidate (an unpinned L2 copy whose loss
        orphans nothing: the node is in L1 too, or has no children)."""
        if (not node.in_heap2 and node.parent is not None and node.host is not None
                and node.pin_ref == 0 and (node.value is not None or not node.children)):
            node.in_heap2 = True
            _heappush(self._heap2, (node.last_access, node.id, node))

    # ------------------------------------------------------------------ split / walk
    def _split(self, child: HiNode, m: int) -> HiNode:
        """``parent -> child[0:N]`` becomes ``parent -> new[0:m] -> child[m:N]``; tiers, locks
        and pins are the child's (every lock/pin on child covers new too)."""
        ck = child.key
        mb = 4 * m
        new = HiNode(ck[:mb], child.parent, child.last_access, self._new_id(), child.used_time)
        if child.value is not None:
            new.value = child.value[:m]
            child.value = child.value[m:]
        if child.host is not None:
            new.host = child.host[:m]
            child.host = child.host[m:]
        new.lock_ref = child.lock_ref
        new.pin_ref = child.pin_ref
        new.hit_count = child.hit_count
        new.in_l3 = child.in_l3
        child.key = rest = ck[mb:]
        child.parent.children[self._child_key(ck)] = new
        new.children[self._child_key(rest)] = child
        child.parent = new
        self._num_nodes += 1
        self._push2(new)
        return new

    def _walk(self, root: HiNode, ids, q: bytes, n: int, stamp: int) -> tuple:
        """Descend along ``ids[:n]``, stamping each node passed and splitting an edge the query
        leaves midway. Returns ``(last node, tokens matched, nodes passed)``."""
        ps = self.page_size
        node = root
        children = root.children
        pos = 0
        path: List[HiNode] = []
        while pos < n:
            child = children.get(ids[pos] if ps == 1 else tuple(ids[pos : pos + ps]))
            if child is None:
                break
            ck = child.key
            end = pos + (len(ck) >> 2)
            if end <= n and q.startswith(ck, pos << 2):
                child.last_access = stamp
                path.append(child)
                node = child
                children = child.children
                pos = end
                continue
            m = _common_prefix_tokens(ck, q, pos << 2, len(ck) if end <= n else (n - pos) << 2)
            m -= m % ps
            node = self._split(child, m)
            node.last_access = stamp
            path.append(node)
            pos += m
            break
        return node, pos, path

    def _peek(self, root: HiNode, ids, q: bytes, n: int) -> int:
        """Tokens of ``ids[:n]`` the tree holds (any tier), without touching it."""
        ps = self.page_size
        children = root.children
        pos = 0
        while pos < n:
            child = children.get(ids[pos] if ps == 1 else tuple(ids[pos : pos + ps]))
            if child is None:
                break
            ck = child.key
            end = pos + (len(ck) >> 2)
            if end <= n and q.startswith(ck, pos << 2):
                children = child.children
                pos = end
                continue
            m = _common_prefix_tokens(ck, q, pos << 2, len(ck) if end <= n else (n - pos) << 2)
            pos += m - m % ps
            break
        return pos

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        return self._clock_fn()

    @staticmethod
    def _path_bytes(node: HiNode) -> bytes:
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return b"".join(reversed(keys))

    @staticmethod
    def _salt_of(node: HiNode) -> Hashable:
        while node.parent is not None:
            node = node.parent
        return node.salt

    def _emit(self, kind: str, node: HiNode, length: int, tier: str, path: Optional[bytes] = None) -> None:
        if self.listener is not None:
            self.listener(CacheEvent(kind, self._salt_of(node),
                                     self._path_bytes(node) if path is None else path, length, tier))

    def _path_values(self, node: HiNode) -> torch.Tensor:
        """L1 slots of the path root..node (all of it must be in L1), as a fresh tensor."""
        vals = []
        while node.parent is not None:
            vals.append(node.value)
            node = node.parent
        if not vals:
            return empty_indices()
        vals.reverse()
        return torch.from_numpy(np.concatenate(vals))

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
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None) -> HiMatchResult:
        """Longest cached prefix across L1 and L2: the L1 part in ``indices/length/node``, the
        L2 continuation in ``host_length/host_node``. Refreshes LRU stamps on the whole path
        and splits an edge the match ends inside of (as RadixCache does)."""
        ids, q = _pack(token_ids)
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            r = self._default_root
            return HiMatchResult(empty_indices(), 0, r, 0, r, 0)
        n = len(ids)
        n -= n % self.page_size
        self._clock = stamp = self._clock + 1
        node, pos, path = self._walk(root, ids, q, n, stamp)
        vals = []
        l1 = 0
        l1_node = root
        for nd in path:
            v = nd.value
            if v is None:
                break
            vals.append(v)
            l1 += len(v)
            l1_node = nd
        if not vals:
            idx = empty_indices()
        elif len(vals) == 1:
            idx = torch.from_numpy(vals[0].copy())
        else:
            idx = torch.from_numpy(np.concatenate(vals))
        return HiMatchResult(idx, l1, l1_node, pos - l1, node, 0)

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None) -> int:
        """Cache ``token_ids`` with L1 slots ``indices`` (whole pages only).

        Returns how many leading tokens were in **L1** before the call: the caller frees
        ``indices[m:n]`` as duplicates exactly as with RadixCache. Tokens the tree held in L2
        only take the caller's slots (the run is in L1 again without a copy), like new ones."""
        ids, q = _pack(token_ids)
        n = len(ids)
        arr = as_index_array(indices, n)
        ps = self.page_size
        n -= n % ps
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            root = self._root_for_insert(salt)
        self._clock = stamp = self._clock + 1
        now = self._now()
        node, pos, path = self._walk(root, ids, q, n, stamp)
        a = 0
        k = 0
        for nd in path:
            nd.used_time = now
            if nd.value is None:
                continue
            a += len(nd.value)
            k += 1
        off = a
        for nd in path[k:]:  # in L2 only: take the caller's freshly computed slots
            L = len(nd.key) >> 2
            nd.value = arr[off : off + L].copy()
            self._evictable += L
            off += L
        deepest = node
        leaf = None
        if pos < n:
            leaf = HiNode(q[pos << 2 : n << 2], node, stamp, self._new_id(), now)
            leaf.value = arr[pos:n].copy()
            node.children[ids[pos] if ps == 1 else tuple(ids[pos : pos + ps])] = leaf
            self._evictable += n - pos
            self._num_nodes += 1
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
            self._backup([leaf])
        return a

    # ------------------------------------------------------------------ locks
    @staticmethod
    def _check_handle(node: Any) -> None:
        if type(node) is not HiNode:
            raise ValueError(f"node must be a HiNode handle from match_prefix, got {type(node).__name__}")
        if node.key is None:
            raise ValueError("node has been evicted or reset; its handle is no longer valid")

    def lock(self, node: HiNode) -> None:
        """Protect ``node`` and its ancestors in L1 (they must be in L1: lock ``m.node``)."""
        self._check_handle(node)
        if node.parent is not None and node.value is None:
            raise ValueError("node is not in L1; lock the L1 node (match_prefix().node) or load_back first")
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                delta += len(node.value)
            node.lock_ref += 1
            node = node.parent
        self._evictable -= delta
        self._protected += delta

    def unlock(self, node: HiNode) -> None:
        self._check_handle(node)
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r} without a matching lock")
        delta = 0
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.value)
                self._push1(node)
            node = node.parent
        self._evictable += delta
        self._protected -= delta

    # ------------------------------------------------------------------ L1 <-> L2
    def _alloc_host(self, n: int) -> Optional[np.ndarray]:
        idx = self.host_pool.alloc(n)
        if idx is None:
            self.evict_host(n - self.host_pool.available)
            idx = self.host_pool.alloc(n)
        return None if idx is None else idx.numpy()

    def _free_host(self, arrays: List[np.ndarray]) -> None:
        if self._pending:
            self.flush_loads()
        self.host_pool.free(torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays)))

    def _backup(self, nodes: List[HiNode]) -> int:
        """Give L1 runs an L2 copy (one copy for all); return how many got one."""
        done: List[HiNode] = []
        for nd in nodes:
            if nd.host is not None or nd.value is None or nd.key is None:
                continue
            h = self._alloc_host(len(nd.value))
            if h is None:
                break
            nd.host = h
            done.append(nd)
        if not done:
            return 0
        if len(done) == 1:
            dev, host = done[0].value, done[0].host
        else:
            dev = np.concatenate([nd.value for nd in done])
            host = np.concatenate([nd.host for nd in done])
        nbytes = self.host_pool.backup_from(self.kv_pool, torch.from_numpy(dev), torch.from_numpy(host))
        self._host_size += len(dev)
        self.counters["backup_tokens"] += len(dev)
        self.counters["bytes_L1_to_L2"] += nbytes
        for nd in done:
            self._push2(nd)
        if self._writer is not None:
            self._write_l3(done)
        return len(done)

    def load_back(self, m: HiMatchResult, max_tokens: Optional[int] = None) -> HiMatchResult:
        """Move ``m``'s L2 continuation into L1 (at most ``max_tokens``, whole pages), evicting
        L1 if needed; return the match as it is now (``length`` covers what was loaded,
        ``loaded`` says how much). Call it right after ``match_prefix`` and lock the returned
        ``node`` before anything else can evict. The copy itself is issued by ``flush_loads``
        (or any call that needs the slots), so the loads of one step go out together.

        Call it for every admission: it also counts the hit ``write_through_selective`` uses."""
        if not isinstance(m, HiMatchResult):
            raise ValueError(f"m must be the HiMatchResult of match_prefix, got {type(m).__name__}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        target = m.host_node if m.host_node is not None else m.node
        if m.host_length and target.key is None:
            raise ValueError("m is stale: its node was evicted since match_prefix")
        if m.host_length == 0 or target.parent is None:
            if self._selective and m.node.key is not None:
                self._count_hit(m.node)
            return m
        self.counters["load_back_calls"] += 1
        chain: List[HiNode] = []
        x = target
        while x.parent is not None and x.value is None:
            chain.append(x)
            x = x.parent
        chain.reverse()
        frontier = x
        total = sum(len(nd.key) >> 2 for nd in chain)
        want = total if max_tokens is None else min(total, max_tokens - max_tokens % self.page_size)
        loaded = 0
        last = frontier
        if want > 0:
            self._pin(target)
            if frontier.parent is not None:
                self.lock(frontier)
            try:
                short = want - self.allocator.available
                if short > 0:
                    self.evict(short)
                want = min(want, self.allocator.available)
                if want > 0:
                    load: List[HiNode] = []
                    for nd in chain:
                        L = len(nd.key) >> 2
                        if loaded + L <= want:
                            load.append(nd)
                            loaded += L
                            continue
                        r = want - loaded
                        if r > 0:
                            load.append(self._split(nd, r))
                            loaded += r
                        break
                    slots = self.allocator.alloc(loaded)
                    if slots is None:  # cannot happen: available was checked
                        raise RuntimeError("L1 allocation failed after eviction")
                    s = slots.numpy()
                    off = 0
                    hosts = []
                    for nd in load:
                        L = len(nd.host)
                        nd.value = s[off : off + L]
                        hosts.append(nd.host)
                        off += L
                    self._pending.append((hosts[0] if len(hosts) == 1 else np.concatenate(hosts), s))
                    self._evictable += loaded
                    self.counters["loaded_tokens"] += loaded
                    self.counters["bytes_L2_to_L1"] += loaded * self.host_pool.bytes_per_token
                    last = load[-1]
                    if self.listener is not None:
                        self._emit(STORED, last, loaded, "L1")
            finally:
                if frontier.parent is not None:
                    self.unlock(frontier)
                self._unpin(target)
            if loaded:
                self._push1(last)
                for nd in load:
                    self._push2(nd)
        node = last if loaded else m.node
        if self._selective:
            self._count_hit(node)
        idx = self._path_values(node) if loaded else m.indices
        return HiMatchResult(idx, m.length + loaded, node, m.host_length - loaded, target, loaded)

    def flush_loads(self) -> int:
        """Issue the L2 -> L1 copies of the load_backs since the last flush (one gather and one
        scatter for all of them); return the tokens copied. The scheduler calls it once per
        step after admission, before the forward reads the slots."""
        if not self._pending:
            return 0
        pend = self._pending
        self._pending = []
        if len(pend) == 1:
            host, dev = pend[0]
        else:
            host = np.concatenate([h for h, _ in pend])
            dev = np.concatenate([d for _, d in pend])
        dev_t = torch.from_numpy(dev)
        self.host_pool.load_to(self.kv_pool, torch.from_numpy(host), dev_t)
        if self.on_written is not None:
            self.on_written(dev_t)
        return len(dev)

    def _count_hit(self, node: HiNode) -> None:
        """One admission through ``node``'s path (write_through_selective copies runs to L2
        once they reach the threshold)."""
        th = self.config.write_through_threshold
        todo = []
        while node.parent is not None:
            node.hit_count += 1
            if node.hit_count >= th and node.host is None and node.value is not None:
                todo.append(node)
            node = node.parent
        if todo:
            todo.reverse()
            self._backup(todo)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L1 slots if possible, LRU L1 leaves first: a run with
        an L2 copy is demoted (stays in the tree), one without is copied down first under
        write_back (or when dropping it would orphan L2 runs below it), else dropped."""
        num_tokens = check_num_tokens(num_tokens)
        if not num_tokens:
            return 0
        self.flush_loads()
        heap = self._heap1
        freed = 0
        arrays: List[np.ndarray] = []
        skipped: List[HiNode] = []
        now = self._now()
        age = self.hist["age_at_eviction_s/L1"]
        while freed < num_tokens and heap:
            stamp, _, node = _heappop(heap)
            node.in_heap1 = False
            if node.key is None or node.value is None or node.lock_ref or self._has_l1_child(node):
                continue
            if stamp != node.last_access:
                node.in_heap1 = True
                _heappush(heap, (node.last_access, node.id, node))
                continue
            L = len(node.value)
            if node.host is None and (self._write_back or node.children or node.pin_ref):
                if not self._backup([node]):
                    if node.pin_ref:
                        skipped.append(node)
                        continue
                    self._drop_descendants(node, now)
            parent = node.parent
            arrays.append(node.value)
            freed += L
            age.observe(now - node.used_time)
            if self.listener is not None:
                self._emit(REMOVED, node, L, "L1")
            node.value = None
            if node.host is not None:
                self.counters["demoted_tokens"] += L
                self._push2(node)
            else:
                self.counters["dropped_tokens_L1"] += L
                self._delete(node, "L1", now)
            self._push1(parent)
        for nd in skipped:
            self._push1(nd)
        if freed:
            self._evictable -= freed
            self.evicted_tokens += freed
            self.on_free(torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays)))
        return freed

    def _delete(self, node: HiNode, tier: str, now: float) -> None:
        """Remove a childless node that holds nothing any more (its slots are already taken)."""
        parent = node.parent
        path = None
        if self.listener is not None or self.ghost.entries:
            path = self._path_bytes(node)
            salt = self._salt_of(node)
            if self.listener is not None:
                self.listener(CacheEvent(REMOVED, salt, path, len(node.key) >> 2, "L2"))
            self.ghost.record(encode_salt(salt), path, (len(path) - len(node.key)) >> 2, tier, now)
        del parent.children[self._child_key(node.key)]
        node.key = None
        node.parent = None
        node.children = {}
        node.value = None
        node.host = None
        self._num_nodes -= 1
        if parent.parent is not None:
            self._push2(parent)
        elif not parent.children and parent.salt is not None and not parent.pin_ref:
            del self._roots[parent.salt]  # empty salted namespace: do not accumulate roots

    def _drop_descendants(self, node: HiNode, now: float) -> None:
        """Delete every node below ``node`` (all L2-only, none pinned), freeing their L2 slots."""
        order: List[HiNode] = []
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        arrays = []
        for x in reversed(order):  # children before parents
            L = len(x.host)
            arrays.append(x.host)
            self._host_size -= L
            self.counters["deleted_tokens_L2"] += L
            self.counters["evicted_tokens_L2"] += L
            self.hist["age_at_eviction_s/L2"].observe(now - x.used_time)
            x.host = None
            self._delete(x, "L2", now)
        if arrays:
            self._free_host(arrays)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` L2 slots if possible, LRU first: L2-only leaves leave
        the tree, L2 copies of runs still in L1 are just freed. Returns slots freed."""
        num_tokens = check_num_tokens(num_tokens)
        if not num_tokens:
            return 0
        self.flush_loads()
        heap = self._heap2
        freed = 0
        arrays: List[np.ndarray] = []
        now = self._now()
        age = self.hist["age_at_eviction_s/L2"]
        while freed < num_tokens and heap:
            stamp, _, node = _heappop(heap)
            node.in_heap2 = False
            if (node.key is None or node.host is None or node.pin_ref
                    or (node.value is None and node.children)):
                continue
            if stamp != node.last_access:
                node.in_heap2 = True
                _heappush(heap, (node.last_access, node.id, node))
                continue
            L = len(node.host)
            arrays.append(node.host)
            freed += L
            node.host = None
            age.observe(now - node.used_time)
            self.counters["evicted_tokens_L2"] += L
            if node.value is None:
                self.counters["deleted_tokens_L2"] += L
                self._delete(node, "L2", now)
        if freed:
            self._host_size -= freed
            self._free_host(arrays)
        return freed

    def reset(self) -> None:
        """Drop both local tiers (L3 is shared and stays). Raises while anything is locked."""
        if self._protected:
            raise RuntimeError(f"reset() while {self._protected} tokens are locked by running requests")
        self._pending = []
        l1, l2 = [], []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if node.value is not None:
                    l1.append(node.value)
                if node.host is not None:
                    l2.append(node.host)
                stack.extend(node.children.values())
                node.key = None
                node.parent = None
                node.children = {}
                node.value = None
                node.host = None
        self._init_state()
        self.ghost.clear()
        if self.listener is not None:
            self.listener(CacheEvent(CLEARED, None, b"", 0, "L1"))
            self.listener(CacheEvent(CLEARED, None, b"", 0, "L2"))
        if l2:
            self.host_pool.free(torch.from_numpy(np.concatenate(l2)))
        if l1:
            self.on_free(torch.from_numpy(np.concatenate(l1)))

    # ------------------------------------------------------------------ L3: writes
    def _write_l3(self, nodes: List[HiNode]) -> None:
        """Queue the storage pages that end inside ``nodes`` (gathered now, written by the
        writer thread). A node whose pages were all queued is marked ``in_l3``."""
        storage = self.storage
        assert storage is not None and self._writer is not None
        P = storage.page_tokens
        fp = storage.fingerprint
        for node in nodes:
            if node.in_l3 or node.key is None:
                continue
            path_nodes: List[HiNode] = []
            x = node
            while x.parent is not None:
                path_nodes.append(x)
                x = x.parent
            salt = x.salt
            path_nodes.reverse()
            e = sum(len(nd.key) for nd in path_nodes) >> 2
            s = e - (len(node.key) >> 2)
            first, last = s // P, e // P
            if first >= last:
                node.in_l3 = True
                continue
            path = b"".join(nd.key for nd in path_nodes)
            keys = page_keys(path[: last * P * 4], salt, fp)[first:]
            data = self._gather(path_nodes, first * P, last * P)
            # Page-first and contiguous here, so the writer thread only reads bytes: a torch
            # op on a second thread competes for the intra-op thread pool with the scheduler.
            L, _, T, H, D = data.shape
            pages = data.view(L, 2, T // P, P, H, D).permute(2, 0, 1, 3, 4, 5).contiguous()
            ok = True
            for j, key in enumerate(keys):
                page = pages[j]
                if self._writer.submit(WriteItem(key, page, (salt, path, (first + j + 1) * P))):
                    self.counters["l3_pages_enqueued"] += 1
                    self.counters["bytes_L2_to_L3"] += page.numel() * page.element_size()
                else:
                    self.counters["l3_pages_dropped"] += 1
                    ok = False
            node.in_l3 = ok

    def _gather(self, path_nodes: List[HiNode], a: int, b: int) -> torch.Tensor:
        """KV of tokens ``[a, b)`` of a root path, from whichever local tier holds each run,
        as a CPU tensor (what the storage writer encodes)."""
        parts = []
        pos = 0
        for nd in path_nodes:
            L = len(nd.key) >> 2
            lo, hi = max(a, pos), min(b, pos + L)
            if lo < hi:
                if nd.value is not None:
                    kv = self.kv_pool.kv
                    idx = torch.from_numpy(nd.value[lo - pos : hi - pos]).to(kv.device)
                    parts.append(kv.index_select(2, idx).cpu())
                else:
                    parts.append(self.host_pool.read(torch.from_numpy(nd.host[lo - pos : hi - pos])))
            pos += L
            if pos >= b:
                break
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    # ------------------------------------------------------------------ L3: prefetch
    def prefetch(self, token_ids: TokenIds, salt: Hashable = None) -> Optional[PrefetchHandle]:
        """Start fetching, in the background, the storage pages of ``token_ids`` beyond what
        L1+L2 hold; None when there is nothing to ask for (no storage, too short, storage
        known to be down). Pass the handle to ``prefetch_ready``/``record_admission``."""
        if self._prefetcher is None:
            return None
        ids, q = _pack(token_ids)
        P = self.storage.page_tokens
        n_pages = len(ids) // P
        if not n_pages:
            return None
        root = self._default_root if salt is None else self._roots.get(salt)
        local = 0 if root is None else self._peek(root, ids, q, n_pages * P)
        j0 = local // P
        if n_pages * P - local < self.config.prefetch_min_tokens or j0 >= n_pages:
            return None
        if not self.storage.healthy:
            self.counters["prefetch_skipped"] += 1
            return None
        tokens = q[: n_pages * P * 4]
        keys = page_keys(tokens, salt, self.storage.fingerprint)[j0:]
        job = PrefetchJob(keys)
        h = PrefetchHandle(job, tokens, salt, j0 * P)
        if not self._prefetcher.submit(job):
            self.counters["prefetch_skipped"] += 1
            h.finished = True
            h.status = "cancelled"
            return None
        self._prefetching[id(h)] = h
        self.counters["prefetch_started"] += 1
        return h

    def prefetch_ready(self, handle: Optional[PrefetchHandle]) -> bool:
        """Whether the request may be admitted now, per the prefetch policy. When it may, the
        pages fetched so far are in the tree (L2) and any rest is cancelled."""
        if handle is None or handle.finished:
            return True
        job = handle.job
        if job.done.is_set():
            self._finish_prefetch(handle, "done")
            return True
        policy = self.config.prefetch_policy
        if policy == "best_effort":
            self._finish_prefetch(handle, "cut")
            return True
        if policy == "timeout" and time.monotonic() - job.t_submit >= self.config.prefetch_timeout_s:
            self._finish_prefetch(handle, "timed_out")
            return True
        return False

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
            self._finish_prefetch(handle, "cancelled")

    def _finish_prefetch(self, h: PrefetchHandle, status: str) -> None:
        job = h.job
        done = job.done.is_set()
        if not done:
            job.cancelled = True
        pages = job.pages[: len(job.pages)]
        h.finished = True
        h.status = status if not done or status == "cancelled" else "done"
        h.fetched = len(pages)
        h.present = job.present
        self._prefetching.pop(id(h), None)
        end_t = job.t_done if done and job.t_done is not None else time.monotonic()
        self.hist["prefetch_latency_s"].observe(end_t - job.t_submit)
        c = self.counters
        if h.status == "done":
            c["prefetch_completed"] += 1
        elif h.status == "timed_out":
            c["prefetch_timeouts"] += 1
        elif h.status == "cut":
            c["prefetch_cut"] += 1
        elif h.status == "cancelled":
            c["prefetch_cancelled"] += 1
        c["prefetch_pages"] += len(pages)
        if pages:
            self._insert_fetched(h, pages)

    def _insert_fetched(self, h: PrefetchHandle, pages: list) -> None:
        P = self.storage.page_tokens
        start = h.start
        end = start + len(pages) * P
        q = h.tokens[: end << 2]
        ids = array("I", q)
        root = self._root_for_insert(h.salt)
        self._clock = stamp = self._clock + 1
        node, pos, _ = self._walk(root, ids, q, end, stamp)
        if pos < start:
            self.counters["prefetch_discarded"] += 1  # the local prefix it extends is gone
            if node is root and not root.children and root.salt is not None:
                del self._roots[root.salt]
            return
        if pos >= end:
            return  # computed or fetched by someone else meanwhile
        L = end - pos
        self._pin(node)  # making room in L2 must not drop the path the pages hang from
        try:
            hidx = self._alloc_host(L)
            if hidx is None:  # L2 cannot take it all: keep the leading part that fits
                L = self.host_pool.available
                if L >= self.page_size:
                    hidx = self._alloc_host(L)
            if hidx is None:
                self.counters["prefetch_no_room"] += 1
                return
            end = pos + L
            data = pages[0].data if len(pages) == 1 else torch.cat([p.data for p in pages], dim=2)
            nbytes = self.host_pool.write(torch.from_numpy(hidx), data[:, :, pos - start : end - start])
            leaf = HiNode(q[pos << 2 : end << 2], node, stamp, self._new_id(), self._now())
            leaf.host = hidx
            leaf.in_l3 = True
            ps = self.page_size
            node.children[ids[pos] if ps == 1 else tuple(ids[pos : pos + ps])] = leaf
            self._num_nodes += 1
            self._host_size += L
            self._push2(leaf)
        finally:
            self._unpin(node)
        self.counters["prefetch_tokens"] += L
        self.counters["bytes_L3_to_L2"] += nbytes
        h.inserted = (pos, end)
        h.created = min(p.created for p in pages)
        if self.listener is not None:
            self.listener(CacheEvent(STORED, h.salt, q[: end << 2], L, "L2"))

    # ------------------------------------------------------------------ per step
    def poll(self) -> None:
        """Background work that must touch the tree, done on the scheduler thread: insert
        finished prefetches, account L3 write results, issue pending loads. Call once per
        step (cheap when idle)."""
        self.flush_loads()
        if self._prefetching:
            for h in list(self._prefetching.values()):
                if h.job.done.is_set():
                    self._finish_prefetch(h, "done")
        w = self._writer
        if w is not None:
            done = w.done
            while done:
                (salt, path, end), ok = done.popleft()
                if ok:
                    self.counters["l3_pages_stored"] += 1
                    if self.listener is not None:
                        self.listener(CacheEvent(STORED, salt, path[: end << 2],
                                                 self.storage.page_tokens, "L3"))
                else:
                    self.counters["l3_pages_failed"] += 1

    def wait_storage_idle(self, timeout: float = 30.0) -> bool:
        """Block until queued L3 writes are done, then ``poll`` (tests, shutdown, benches)."""
        ok = True
        if self._writer is not None:
            ok = self._writer.wait_idle(timeout)
        self.poll()
        return ok

    def close(self) -> None:
        """Stop the storage threads (queued writes get ``timeout`` to finish) and disconnect."""
        for h in list(self._prefetching.values()):
            h.job.cancelled = True
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._writer is not None:
            self._writer.close()
        if self.storage is not None:
            self.storage.close()

    # ------------------------------------------------------------------ telemetry
    def record_admission(self, token_ids: TokenIds, m: HiMatchResult, salt: Hashable = None,
                         prefetch: Optional[PrefetchHandle] = None) -> dict:
        """Account one admitted request (call once, at its first admission, with the result of
        ``load_back``): cached tokens by tier and a reason for the rest. Returns
        ``{"cached": {"L1", "L2", "L3"}, "uncached": {reason: tokens}}`` for the response's
        meta_info; the counters behind ``stats()`` add it up."""
        if not isinstance(m, HiMatchResult):
            raise ValueError(f"m must be a HiMatchResult, got {type(m).__name__}")
        ids, q = _pack(token_ids)
        N = len(ids)
        now = self._now()
        c = self.counters
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
                self.hist["age_at_hit_s/L1"].observe(now - l1_node.used_time)
            if l2 and l2_node is not None:
                self.hist["age_at_hit_s/L2"].observe(now - l2_node.used_time)
            x = node
            while x.parent is not None:
                x.used_time = now
                x = x.parent
        if l3 and prefetch is not None and prefetch.created is not None:
            self.hist["age_at_hit_s/L3"].observe(max(0.0, time.time() - prefetch.created))
        # Reasons for the uncached part.
        uncached: Dict[str, int] = {}
        aligned = N - N % self.page_size
        if N > aligned:
            uncached["page_boundary"] = N - aligned
        rest = aligned - length
        if m.host_length and rest > 0:
            k = min(rest, m.host_length)
            uncached["l1_full"] = k
            rest -= k
        pos = length + m.host_length
        if rest > 0 and prefetch is not None and prefetch.status in ("timed_out", "cut") and prefetch.present:
            P = self.storage.page_tokens if self.storage is not None else 0
            avail_end = prefetch.start + prefetch.present * P
            got_end = prefetch.start + prefetch.fetched * P
            k = min(rest, max(0, avail_end - max(pos, got_end)))
            if k:
                uncached["prefetch_timeout"] = k
                rest -= k
        if rest > 0:
            for r, k in self._classify_miss(q, salt, aligned - rest, aligned).items():
                uncached[r] = uncached.get(r, 0) + k
        for r, k in uncached.items():
            c[f"miss_{r}"] += k
        return {"cached": {"L1": l1, "L2": l2, "L3": l3}, "uncached": uncached}

    def _classify_miss(self, q: bytes, salt: Hashable, pos: int, end: int) -> Dict[str, int]:
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
                ids = array("I", q[: end << 2])
                best = pos
                for i, (s, root) in enumerate(self._roots.items()):
                    if i >= 16:  # bounded work per admission; more tenants count as never_seen
                        break
                    if s != salt and root.children:
                        best = max(best, self._peek(root, ids, q, end))
                if best > pos:
                    out["salt"] = best - pos
                    pos = best
                    continue
            out["never_seen"] = out.get("never_seen", 0) + end - pos
            break
        return out

    def stats(self) -> dict:
        out = super().stats()
        c = self.counters
        out["l1"] = {"tokens": self.total_size, "evictable": self._evictable, "protected": self._protected}
        out["l2"] = {"tokens": self._host_size, "capacity": self.host_pool.capacity,
                     "free": self.host_pool.available}
        out["write_policy"] = self.config.write_policy
        out["prefetch_policy"] = self.config.prefetch_policy
        out["requests"] = c["requests"]
        out["hit_tokens"] = {t: c[f"hit_{t}"] for t in TIERS}
        out["miss_tokens"] = {r: c[f"miss_{r}"] for r in MISS_REASONS}
        out["bytes_moved"] = {"L1->L2": c["bytes_L1_to_L2"], "L2->L1": c["bytes_L2_to_L1"],
                              "L2->L3": c["bytes_L2_to_L3"], "L3->L2": c["bytes_L3_to_L2"]}
        out["tokens_moved"] = {"backup": c["backup_tokens"], "load_back": c["loaded_tokens"],
                               "demoted": c["demoted_tokens"], "dropped_L1": c["dropped_tokens_L1"],
                               "evicted_L2": c["evicted_tokens_L2"], "deleted_L2": c["deleted_tokens_L2"]}
        out["prefetch"] = {k.removeprefix("prefetch_"): c[k] for k in c if k.startswith("prefetch_")}
        out["prefetch"]["in_flight"] = len(self._prefetching)
        out["prefetch"]["latency_s"] = self.hist["prefetch_latency_s"].as_dict()
        out["l3_writes"] = {k.removeprefix("l3_pages_"): c[k] for k in c if k.startswith("l3_pages_")}
        if self._writer is not None:
            out["l3_writes"]["pending"] = self._writer.pending
        out["storage"] = self.storage.stats() if self.storage is not None else None
        out["age_at_hit_s"] = {t: self.hist[f"age_at_hit_s/{t}"].as_dict() for t in TIERS}
        out["age_at_eviction_s"] = {t: self.hist[f"age_at_eviction_s/{t}"].as_dict() for t in ("L1", "L2")}
        out["ghost_entries"] = len(self.ghost)
        return out

    # ------------------------------------------------------------------ introspection
    def held_slots(self) -> torch.Tensor:
        """Every L1 slot the tree holds (for the scheduler's integrity check)."""
        self.flush_loads()
        vals = [n.value for n in self._iter_nodes() if n.value is not None]
        return torch.from_numpy(np.concatenate(vals)) if vals else empty_indices()

    def _iter_nodes(self):
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    def snapshot_events(self) -> List[CacheEvent]:
        """STORED events (parents first, tiers L1 and L2) that rebuild a mirror from empty."""
        out: List[CacheEvent] = []
        for salt, root in self._roots.items():
            stack = [(c, b"") for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                path = prefix + node.key
                L = len(node.key) >> 2
                out.append(CacheEvent(STORED, salt, path, L, "L2"))
                if node.value is not None:
                    out.append(CacheEvent(STORED, salt, path, L, "L1"))
                stack.extend((c, path) for c in node.children.values())
        return out

    def tier_contents(self, salt: Hashable = None) -> Dict[str, set]:
        """``{"L1": {...}, "L2": {...}}``: every cached token prefix (as a tuple) by tier, where
        "L2" means L1 or L2 as in the events. O(tokens^2): tests only."""
        out = {"L1": set(), "L2": set()}
        root = self._roots.get(salt)
        if root is None:
            return out
        stack = [(c, ()) for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            toks = tuple(_unpack(node.key))
            for i in range(1, len(toks) + 1):
                out["L2"].add(prefix + toks[:i])
                if node.value is not None:
                    out["L1"].add(prefix + toks[:i])
            stack.extend((c, prefix + toks) for c in node.children.values())
        return out

    def dump(self, max_tokens: int = 8) -> str:
        lines = [repr(self)]

        def fmt(seq: list) -> str:
            s = ",".join(map(str, seq[:max_tokens]))
            return s + (",..." if len(seq) > max_tokens else "")

        def rec(node: HiNode, depth: int) -> None:
            for c in sorted(node.children.values(), key=lambda x: x.id):
                lines.append(
                    f"{'  ' * depth}#{c.id} [{fmt(_unpack(c.key))}] len={c.num_tokens} "
                    f"tiers={c.tiers or '-'}{'+L3' if c.in_l3 else ''} "
                    f"l1=[{fmt(c.value.tolist()) if c.value is not None else ''}] "
                    f"l2=[{fmt(c.host.tolist()) if c.host is not None else ''}] lock={c.lock_ref} "
                    f"pin={c.pin_ref} hits={c.hit_count} last={c.last_access}")
                rec(c, depth + 1)

        for salt, root in self._roots.items():
            if root.children or salt is None:
                lines.append(f"root salt={salt!r}")
                rec(root, 1)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"HiRadixCache(page_size={self.page_size}, l1={self.total_size}, "
                f"evictable={self._evictable}, protected={self._protected}, l2={self._host_size}, "
                f"nodes={self._num_nodes}, write_policy={self.config.write_policy})")

    def check_integrity(self) -> None:
        """Structure, tier rules, sizes, locks/pins, slot uniqueness in both pools, heaps."""
        ps = self.page_size
        evictable = protected = host = count = 0
        l1_vals, l2_vals = [], []
        live = set()
        if self._roots.get(None) is not self._default_root:
            raise AssertionError("default root missing")
        for salt, root in self._roots.items():
            if root.parent is not None or root.key != b"" or root.salt != salt:
                raise AssertionError(f"bad root for salt {salt!r}")
            if root.value is not None or root.host is not None:
                raise AssertionError("a root holds slots")
            if root.pin_ref or root.lock_ref:
                raise AssertionError(f"root of salt {salt!r} pinned/locked outside a call")
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = child_pins = 0
                for ck, child in node.children.items():
                    if child.parent is not node:
                        raise AssertionError(f"{child!r}: parent pointer broken")
                    if not child.key:
                        raise AssertionError(f"{child!r}: empty/dead key in the tree")
                    if ck != self._child_key(child.key):
                        raise AssertionError(f"{child!r}: stored under the wrong child key")
                    if node.parent is not None and child.last_access > node.last_access:
                        raise AssertionError(f"{child!r}: newer than its parent")
                    if child.value is not None and node.parent is not None and node.value is None:
                        raise AssertionError(f"{child!r}: in L1 under a parent that is not")
                    child_locks += child.lock_ref
                    child_pins += child.pin_ref
                    stack.append(child)
                if node.parent is None:
                    continue
                n = len(node.key) >> 2
                if type(node.key) is not bytes or len(node.key) % 4 or n % ps:
                    raise AssertionError(f"{node!r}: key not whole pages")
                if node.value is None and node.host is None:
                    raise AssertionError(f"{node!r}: in no tier")
                for name, v in (("value", node.value), ("host", node.host)):
                    if v is not None and (v.dtype != np.int64 or v.ndim != 1 or len(v) != n):
                        raise AssertionError(f"{node!r}: {name} must be 1-D int64 of {n}")
                if node.lock_ref < child_locks or node.pin_ref < child_pins:
                    raise AssertionError(f"{node!r}: lock/pin below the sum of its children's")
                if node.lock_ref and node.value is None:
                    raise AssertionError(f"{node!r}: locked but not in L1")
                if node.pin_ref:
                    raise AssertionError(f"{node!r}: pinned outside a call")
                if node.value is not None:
                    l1_vals.append(node.value)
                    if node.lock_ref:
                        protected += n
                    else:
                        evictable += n
                        if not self._has_l1_child(node) and not node.in_heap1:
                            raise AssertionError(f"{node!r}: L1 eviction candidate not queued")
                if node.host is not None:
                    l2_vals.append(node.host)
                    host += n
                    if (node.value is not None or not node.children) and not node.in_heap2:
                        raise AssertionError(f"{node!r}: L2 eviction candidate not queued")
                count += 1
                live.add(node.id)
        if evictable != self._evictable or protected != self._protected:
            raise AssertionError(f"L1 accounting: tree has evictable={evictable} protected={protected}, "
                                 f"counters say {self._evictable}/{self._protected}")
        if host != self._host_size:
            raise AssertionError(f"L2 accounting: tree holds {host}, counter says {self._host_size}")
        if host != self.host_pool.used:
            raise AssertionError(f"L2 slots: tree holds {host}, host pool has {self.host_pool.used} in use")
        if count != self._num_nodes:
            raise AssertionError(f"num_nodes {self._num_nodes} != {count}")
        for name, vals, free in (("L1", l1_vals, self.allocator.free_slot_set),
                                 ("L2", l2_vals, self.host_pool.allocator.free_slot_set)):
            if vals:
                allv = np.concatenate(vals)
                if len(np.unique(allv)) != len(allv):
                    raise AssertionError(f"an {name} slot is held by two tree positions")
                if free() & set(allv.tolist()):
                    raise AssertionError(f"an {name} slot is both in the tree and free")
        for heap, flag in ((self._heap1, "in_heap1"), (self._heap2, "in_heap2")):
            seen = set()
            for stamp, nid, node in heap:
                if node.key is None:
                    continue  # dead nodes' entries are dropped lazily
                if nid in seen:
                    raise AssertionError(f"{node!r}: two entries in one heap")
                seen.add(nid)
                if not getattr(node, flag) or stamp > node.last_access:
                    raise AssertionError(f"{node!r}: bad heap entry")
            flagged = {n.id for n in self._iter_nodes() if getattr(n, flag)}
            if flagged != seen:
                raise AssertionError(f"{flag} flags disagree with the heap")
        for h, _ in self._pending:
            if len(h) and not np.isin(h, np.concatenate(l2_vals) if l2_vals else _EMPTY).all():
                raise AssertionError("a pending load reads an L2 slot the tree no longer holds")
