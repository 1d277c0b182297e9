"""L2, the host-memory tier, as a component of the tiered tree: a node's L2 copy
(``node.host``), the L2 budget and its LRU, the copies between the pools.

* ``backup`` gives L1 runs an L2 copy; whenever a run gets one and storage is configured,
  the pages ending in it are gathered (from L1 or L2, on the calling thread: the slots may
  be reused at the next step) and queued for the background writer.
* L2 is made room for by its own LRU (``evict_host``): L2-only leaves leave the tree, L2
  copies of runs still in L1 are just freed.
* The copies of load_backs (L2 -> L1) are deferred: ``queue_load`` collects them and
  ``flush_loads`` issues them as one gather and one scatter. Anything that could free or
  reuse those slots (``evict``, ``evict_host``, ``reset``, ``poll``) flushes first.

The tree (:class:`~.hiradix.HiRadixCache`) decides what moves when; a node this tier removes
from the tree goes through the tree's ``leave`` callback.
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch

from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool

from ..base import check_num_tokens
from ..lru import LruQueue
from .node import HiNode
from .storage_side import StorageSide
from .telemetry import Histogram

__all__ = ["HostTier"]

_last_access = operator.attrgetter("last_access")


def _cat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def _l2_candidate(node: HiNode) -> bool:
    """An L2 copy may go when nothing pins it and its loss orphans nothing: the run is in L1
    too, or has no children."""
    return (node.key is not None and node.host is not None and not node.pin_ref
            and (node.value is not None or not node.children))


class HostTier:
    """The L2 copies of one tiered tree (its :class:`~..tree.Component`)."""

    def __init__(self, host_pool: HostKVPool, kv_pool: KVPool, counters: Dict[str, int],
                 age_at_eviction: Histogram, leave: Callable[[HiNode, str, float], None],
                 clock: Callable[[], float], storage: Optional[StorageSide] = None) -> None:
        self.host_pool = host_pool
        self.kv_pool = kv_pool
        self.counters = counters
        self.age_at_eviction = age_at_eviction
        self.storage = storage
        self._leave = leave
        self._now = clock
        self.queue: LruQueue[HiNode] = LruQueue(_last_access, _l2_candidate)
        #: Tokens with an L2 copy.
        self.size = 0
        #: (host slots, device slots) of load_backs not yet copied (see ``flush_loads``).
        self.pending: List[tuple] = []

    # ------------------------------------------------------------------ component
    def split(self, upper: HiNode, lower: HiNode, m: int) -> None:
        """The L2 copy, pins, L3 mark and age divide with the edge (pins cover both halves)."""
        h = lower.host
        if h is not None:
            upper.host = h[:m]
            lower.host = h[m:]
        upper.pin_ref = lower.pin_ref
        upper.in_l3 = lower.in_l3
        upper.used_time = lower.used_time
        self.queue.offer(upper)

    @staticmethod
    def served(path: Sequence[HiNode]) -> int:
        """Leading nodes of ``path`` in L1 (prefix-closed: the rest are in L2 only), served
        without a load."""
        return next((i for i, nd in enumerate(path) if nd.value is None), len(path))

    def dropped(self, node: HiNode) -> None:
        """``node`` left the tree: free its L2 copy, if any."""
        self.queue.discard(node)
        h = node.host
        if h is not None:
            node.host = None
            self.size -= len(h)
            self.free([h])

    def clear(self, dead: Sequence[HiNode]) -> None:
        """The tree was reset: every L2 copy and pending load goes (L1 slots go with the rest)."""
        self.pending = []
        hosts = [nd.host for nd in dead if nd.host is not None]
        for nd in dead:
            nd.host = None
        self.queue.clear()
        self.size = 0
        if hosts:
            self.host_pool.free(torch.from_numpy(np.concatenate(hosts)))

    def offer(self, node: HiNode) -> None:
        """``node`` may have become an L2 eviction candidate."""
        if node.parent is not None:
            self.queue.offer(node)

    # ------------------------------------------------------------------ L2 slots
    def alloc(self, n: int) -> Optional[np.ndarray]:
        """``n`` L2 slots, evicting L2 if needed; None if they cannot be had."""
        idx = self.host_pool.alloc(n)
        if idx is None:
            self.evict_host(n - self.host_pool.available)
            idx = self.host_pool.alloc(n)
        return None if idx is None else idx.numpy()

    def adopt(self, node: HiNode) -> None:
        """``node`` entered the tree holding L2 slots of its own (``alloc``'d: a prefetch)."""
        self.size += len(node.host)
        self.queue.offer(node)

    def free(self, arrays: List[np.ndarray]) -> None:
        if self.pending:
            self.flush_loads()
        self.host_pool.free(torch.from_numpy(_cat(arrays)))

    def backup(self, nodes: List[HiNode]) -> int:
        """Give L1 runs an L2 copy (one copy for all); return how many got one."""
        done: List[HiNode] = []
        for nd in nodes:
            if nd.host is not None or nd.value is None or nd.key is None:
                continue
            h = self.alloc(len(nd.value))
            if h is None:
                break
            nd.host = h
            done.append(nd)
        if not done:
            return 0
        dev, host = _cat([nd.value for nd in done]), _cat([nd.host for nd in done])
        nbytes = self.host_pool.backup_from(self.kv_pool, torch.from_numpy(dev), torch.from_numpy(host))
        self.size += len(dev)
        self.counters["backup_tokens"] += len(dev)
        self.counters["bytes_L1_to_L2"] += nbytes
        for nd in done:
            self.queue.offer(nd)
        if self.storage is not None:
            self.storage.write_l3(done)
        return len(done)

    def count_hit(self, node: HiNode, threshold: int) -> None:
        """One admission through ``node``'s path: ``write_through_selective`` copies a run to
        L2 once ``threshold`` admissions went through it."""
        todo = []
        while node.parent is not None:
            node.hit_count += 1
            if node.hit_count >= threshold and node.host is None and node.value is not None:
                todo.append(node)
            node = node.parent
        if todo:
            todo.reverse()
            self.backup(todo)

    def store_fetched(self, n: int, pages: list, offset: int, page_size: int) -> Optional[tuple]:
        """L2 slots for up to ``n`` tokens a prefetch brought, holding the pages' tokens from
        ``offset`` on (if L2 cannot take them all, the leading whole pages that fit):
        ``(slots, tokens stored, bytes written)``, or None when not one page fits."""
        hidx = self.alloc(n)
        if hidx is None:
            n = self.host_pool.available
            if n >= page_size:
                hidx = self.alloc(n)
        if hidx is None:
            return None
        data = pages[0].data if len(pages) == 1 else torch.cat([p.data for p in pages], dim=2)
        return hidx, n, self.host_pool.write(torch.from_numpy(hidx), data[:, :, offset : offset + n])

    # ------------------------------------------------------------------ L2 -> L1
    def queue_load(self, host: np.ndarray, dev: np.ndarray) -> None:
        """Copy L2 slots ``host`` into L1 slots ``dev`` at the next ``flush_loads``."""
        self.pending.append((host, dev))
        self.counters["loaded_tokens"] += len(dev)
        self.counters["bytes_L2_to_L1"] += len(dev) * self.host_pool.bytes_per_token

    def flush_loads(self) -> Optional[torch.Tensor]:
        """Issue the deferred L2 -> L1 copies (one gather and one scatter for all of them);
        return the L1 slots written (None when there were none)."""
        if not self.pending:
            return None
        pend = self.pending
        self.pending = []
        host, dev = _cat([h for h, _ in pend]), _cat([d for _, d in pend])
        dev_t = torch.from_numpy(dev)
        self.host_pool.load_to(self.kv_pool, torch.from_numpy(host), dev_t)
        return dev_t

    # ------------------------------------------------------------------ eviction
    def evict_host(self, num_tokens: int) -> int:
        """See :meth:`.hiradix.HiRadixCache.evict_host`."""
        num_tokens = check_num_tokens(num_tokens)
        if not num_tokens:
            return 0
        self.flush_loads()
        freed = 0
        arrays: List[np.ndarray] = []
        now = self._now()
        pop = self.queue.pop
        while freed < num_tokens:
            node = pop()
            if node is None:
                break
            freed += self._take_host(node, now, arrays)
        if freed:
            self.size -= freed
            self.free(arrays)
        return freed

    def _take_host(self, node: HiNode, now: float, arrays: List[np.ndarray]) -> int:
        """Take ``node``'s L2 copy (its slots go to ``arrays``); a node left in no tier leaves
        the tree. Returns the tokens taken."""
        L = len(node.host)
        arrays.append(node.host)
        node.host = None
        self.age_at_eviction.observe(now - node.used_time)
        self.counters["evicted_tokens_L2"] += L
        if node.value is None:
            self.counters["deleted_tokens_L2"] += L
            self._leave(node, "L2", now)
        return L

    def drop_below(self, node: HiNode, now: float) -> None:
        """Delete every node below ``node`` (all L2-only, none pinned), freeing their L2 slots:
        ``node`` leaves L1 without a copy, and L2 runs cannot hang from nothing."""
        order: List[HiNode] = []
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        arrays: List[np.ndarray] = []
        for x in reversed(order):  # children before parents
            self.size -= self._take_host(x, now, arrays)
        if arrays:
            self.free(arrays)

    # ------------------------------------------------------------------ checks
    def check(self, nodes: Sequence[HiNode]) -> None:
        """L2 invariants over the tree's ``nodes``: copies sized like their runs, the size
        counter, the host pool's slots (each in one place), the L2 queue, pending loads."""
        held = []
        for node in nodes:
            h = node.host
            if h is None:
                continue
            if h.dtype != np.int64 or h.ndim != 1 or len(h) != len(node.key) >> 2:
                raise AssertionError(f"{node!r}: host must be 1-D int64 of {len(node.key) >> 2}")
            held.append(h)
            if _l2_candidate(node) and node not in self.queue:
                raise AssertionError(f"{node!r}: L2 eviction candidate not queued")
        total = sum(map(len, held))
        if total != self.size:
            raise AssertionError(f"L2 accounting: tree holds {total}, counter says {self.size}")
        if total != self.host_pool.used:
            raise AssertionError(f"L2 slots: tree holds {total}, host pool has {self.host_pool.used} in use")
        allv = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
        if len(np.unique(allv)) != len(allv):
            raise AssertionError("an L2 slot is held by two tree positions")
        if self.host_pool.allocator.free_slot_set() & set(allv.tolist()):
            raise AssertionError("an L2 slot is both in the tree and free")
        self.queue.check()
        for h, _ in self.pending:
            if len(h) and not np.isin(h, allv).all():
                raise AssertionError("a pending load reads an L2 slot the tree no longer holds")
