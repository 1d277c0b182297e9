"""Movement between L1 (the KV pool) and L2 (host memory): eviction, demotion, write
policies and load_back. :class:`Tiers` is owned by the tree and changes it through the tree's
structural operations (split, delete, candidate queues, pins, locks).

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
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, List, Optional, Sequence

import numpy as np
import torch

from radixserve.storage import encode_salt

from ..base import check_num_tokens, empty_indices
from ..events import CLEARED, REMOVED, STORED, CacheEvent
from .node import HiMatchResult, HiNode

if TYPE_CHECKING:
    from .tree import HiRadixCache

__all__ = ["Tiers"]

_heappush = heapq.heappush
_heappop = heapq.heappop


class Tiers:
    """L1 <-> L2 movement for one :class:`~.tree.HiRadixCache`; owns the deferred loads.

    It is the tree's :class:`~..tree.Component` for the L2 copy a node may carry."""

    def __init__(self, tree: "HiRadixCache") -> None:
        self.tree = tree
        self.allocator = tree.allocator
        self.kv_pool = tree.kv_pool
        self.host_pool = tree.host_pool
        self.counters = tree.counters
        policy = tree.config.write_policy
        self.write_back = policy == "write_back"
        self.selective = policy == "write_through_selective"
        self.through = policy == "write_through"
        #: (host slots, device slots) of load_backs not yet copied (see ``flush_loads``).
        self.pending: List[tuple] = []

    # ------------------------------------------------------------------ component
    def split(self, upper: HiNode, lower: HiNode, m: int) -> None:
        """The L2 copy, pins, L3 mark and age divide with the edge (every pin on the lower
        half covers the upper one too)."""
        h = lower.host
        if h is not None:
            upper.host = h[:m]
            lower.host = h[m:]
        upper.pin_ref = lower.pin_ref
        upper.in_l3 = lower.in_l3
        upper.used_time = lower.used_time
        self.tree._push2(upper)

    @staticmethod
    def served(path: Sequence[HiNode]) -> int:
        """Leading nodes of ``path`` in L1 (L1 is prefix-closed: the rest are in L2 only)."""
        k = 0
        for nd in path:
            if nd.value is None:
                break
            k += 1
        return k

    # ------------------------------------------------------------------ L2 slots
    def alloc_host(self, n: int) -> Optional[np.ndarray]:
        idx = self.host_pool.alloc(n)
        if idx is None:
            self.evict_host(n - self.host_pool.available)
            idx = self.host_pool.alloc(n)
        return None if idx is None else idx.numpy()

    def free_host(self, arrays: List[np.ndarray]) -> None:
        if self.pending:
            self.flush_loads()
        self.host_pool.free(torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays)))

    def backup(self, nodes: List[HiNode]) -> int:
        """Give L1 runs an L2 copy (one copy for all); return how many got one."""
        done: List[HiNode] = []
        for nd in nodes:
            if nd.host is not None or nd.value is None or nd.key is None:
                continue
            h = self.alloc_host(len(nd.value))
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
        t = self.tree
        t._host_size += len(dev)
        self.counters["backup_tokens"] += len(dev)
        self.counters["bytes_L1_to_L2"] += nbytes
        for nd in done:
            t._push2(nd)
        if t._storage is not None:
            t._storage.write_l3(done)
        return len(done)

    # ------------------------------------------------------------------ L2 -> L1
    def load_back(self, m: HiMatchResult, max_tokens: Optional[int] = None) -> HiMatchResult:
        """See :meth:`.tree.HiRadixCache.load_back`."""
        if not isinstance(m, HiMatchResult):
            raise ValueError(f"m must be the HiMatchResult of match_prefix, got {type(m).__name__}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        t = self.tree
        target = m.host_node if m.host_node is not None else m.node
        if m.host_length and target.key is None:
            raise ValueError("m is stale: its node was evicted since match_prefix")
        if m.host_length == 0 or target.parent is None:
            if self.selective and m.node.key is not None:
                self.count_hit(m.node)
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
        want = total if max_tokens is None else min(total, max_tokens - max_tokens % t.page_size)
        loaded = 0
        last = frontier
        if want > 0:
            t._pin(target)
            if frontier.parent is not None:
                t.lock(frontier)
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
                            load.append(t._split(nd, r))
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
                    self.pending.append((hosts[0] if len(hosts) == 1 else np.concatenate(hosts), s))
                    t._evictable += loaded
                    self.counters["loaded_tokens"] += loaded
                    self.counters["bytes_L2_to_L1"] += loaded * self.host_pool.bytes_per_token
                    last = load[-1]
                    if t.listener is not None:
                        self._emit(STORED, last, loaded, "L1")
            finally:
                if frontier.parent is not None:
                    t.unlock(frontier)
                t._unpin(target)
            if loaded:
                t._push1(last)
                for nd in load:
                    t._push2(nd)
        node = last if loaded else m.node
        if self.selective:
            self.count_hit(node)
        idx = _path_values(node) if loaded else m.indices
        return HiMatchResult(idx, m.length + loaded, node, m.host_length - loaded, target, loaded)

    def flush_loads(self) -> int:
        """Issue the deferred L2 -> L1 copies (one gather and one scatter for all of them);
        return the tokens copied."""
        if not self.pending:
            return 0
        pend = self.pending
        self.pending = []
        if len(pend) == 1:
            host, dev = pend[0]
        else:
            host = np.concatenate([h for h, _ in pend])
            dev = np.concatenate([d for _, d in pend])
        dev_t = torch.from_numpy(dev)
        self.host_pool.load_to(self.kv_pool, torch.from_numpy(host), dev_t)
        on_written = self.tree.on_written
        if on_written is not None:
            on_written(dev_t)
        return len(dev)

    def count_hit(self, node: HiNode) -> None:
        """One admission through ``node``'s path (write_through_selective copies runs to L2
        once they reach the threshold)."""
        th = self.tree.config.write_through_threshold
        todo = []
        while node.parent is not None:
            node.hit_count += 1
            if node.hit_count >= th and node.host is None and node.value is not None:
                todo.append(node)
            node = node.parent
        if todo:
            todo.reverse()
            self.backup(todo)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """See :meth:`.tree.HiRadixCache.evict`."""
        num_tokens = check_num_tokens(num_tokens)
        if not num_tokens:
            return 0
        self.flush_loads()
        t = self.tree
        heap = t._heap1
        freed = 0
        arrays: List[np.ndarray] = []
        skipped: List[HiNode] = []
        now = t._now()
        age = t.hist["age_at_eviction_s/L1"]
        has_l1_child = t._has_l1_child
        while freed < num_tokens and heap:
            stamp, _, node = _heappop(heap)
            node.in_heap = False
            if node.key is None or node.value is None or node.lock_ref or has_l1_child(node):
                continue
            if stamp != node.last_access:
                node.in_heap = True
                _heappush(heap, (node.last_access, node.id, node))
                continue
            L = len(node.value)
            if node.host is None and (self.write_back or node.children or node.pin_ref):
                if not self.backup([node]):
                    if node.pin_ref:
                        skipped.append(node)
                        continue
                    self._drop_descendants(node, now)
            parent = node.parent
            arrays.append(node.value)
            freed += L
            age.observe(now - node.used_time)
            if t.listener is not None:
                self._emit(REMOVED, node, L, "L1")
            node.value = None
            if node.host is not None:
                self.counters["demoted_tokens"] += L
                t._push2(node)
            else:
                self.counters["dropped_tokens_L1"] += L
                self._delete(node, "L1", now)
            t._push1(parent)
        for nd in skipped:
            t._push1(nd)
        if freed:
            t._evictable -= freed
            t.evicted_tokens += freed
            t.on_free(torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays)))
        return freed

    def _drop_descendants(self, node: HiNode, now: float) -> None:
        """Delete every node below ``node`` (all L2-only, none pinned), freeing their L2 slots."""
        t = self.tree
        order: List[HiNode] = []
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        arrays = []
        age = t.hist["age_at_eviction_s/L2"]
        for x in reversed(order):  # children before parents
            L = len(x.host)
            arrays.append(x.host)
            t._host_size -= L
            self.counters["deleted_tokens_L2"] += L
            self.counters["evicted_tokens_L2"] += L
            age.observe(now - x.used_time)
            x.host = None
            self._delete(x, "L2", now)
        if arrays:
            self.free_host(arrays)

    def evict_host(self, num_tokens: int) -> int:
        """See :meth:`.tree.HiRadixCache.evict_host`."""
        num_tokens = check_num_tokens(num_tokens)
        if not num_tokens:
            return 0
        self.flush_loads()
        t = self.tree
        heap = t._heap2
        freed = 0
        arrays: List[np.ndarray] = []
        now = t._now()
        age = t.hist["age_at_eviction_s/L2"]
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
            t._host_size -= freed
            self.free_host(arrays)
        return freed

    def drop_all(self) -> None:
        """Empty L1 and L2 (the tree's ``reset``; the caller checked nothing is locked): every
        node dies, pending loads are dropped (their L1 slots are freed with the rest)."""
        t = self.tree
        self.pending = []
        l1, l2 = [], []
        for node in t._detach_all():
            if node.value is not None:
                l1.append(node.value)
            if node.host is not None:
                l2.append(node.host)
            node.value = None
            node.host = None
        t.ghost.clear()
        if t.listener is not None:
            t.listener(CacheEvent(CLEARED, None, b"", 0, "L1"))
            t.listener(CacheEvent(CLEARED, None, b"", 0, "L2"))
        if l2:
            self.host_pool.free(torch.from_numpy(np.concatenate(l2)))
        if l1:
            t.on_free(torch.from_numpy(np.concatenate(l1)))

    # ------------------------------------------------------------------ leaving the tree
    def _emit(self, kind: str, node: HiNode, length: int, tier: str) -> None:
        t = self.tree
        if t.listener is not None:
            t.listener(CacheEvent(kind, t.salt_of(node), t.path_bytes(node), length, tier))

    def _delete(self, node: HiNode, tier: str, now: float) -> None:
        """Remove a childless node that holds nothing any more (its slots are already taken);
        the ghost memory records it as evicted from ``tier``."""
        t = self.tree
        if t.listener is not None or t.ghost.entries:
            path = t.path_bytes(node)
            salt = t.salt_of(node)
            if t.listener is not None:
                t.listener(CacheEvent(REMOVED, salt, path, len(node.key) >> 2, "L2"))
            t.ghost.record(encode_salt(salt), path, (len(path) - len(node.key)) >> 2, tier, now)
        node.host = None
        parent = t._unlink(node)
        if parent.parent is not None:
            t._push2(parent)


def _path_values(node: HiNode) -> torch.Tensor:
    """L1 slots of the path root..node (all of it must be in L1), as a fresh tensor."""
    vals = []
    while node.parent is not None:
        vals.append(node.value)
        node = node.parent
    if not vals:
        return empty_indices()
    vals.reverse()
    return torch.from_numpy(np.concatenate(vals))
