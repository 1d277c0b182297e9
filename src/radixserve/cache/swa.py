"""The radix cache of a hybrid model: one tree, full-attention KV on every node, sliding-window
(SWA) KV only where a window can still read it.

Every node holds the full slots of its run (``value``), as in :class:`.radix.RadixCache`; the
SWA slot of a full slot is ``allocator.swa_map[slot]`` (:class:`radixserve.memory.swa_pool.
HybridAllocator`). A node whose SWA KV was freed keeps its full KV and becomes a tombstone
for that kind (``swa`` False). The rules, after SGLang's SWA radix cache and the unified
radix cache it grew into:

* **Match**: a prefix ending at ``b`` can be resumed only if the next token's window is
  there: full KV all the way (every node has it) and SWA KV for ``b - W + 1 .. b - 1``, so a
  match ends at the deepest node boundary with no tombstone in the ``W - 1`` tokens before it.
* **Insert** takes the request's slots as the plain cache does; a run of the request whose SWA
  slots it no longer holds (out of its window) enters as a tombstone, and a tombstone on the
  path is revived where the request holds SWA KV for those tokens (it recomputed them).
* **Budgets**: full KV is evicted leaf-first LRU (``evict``); SWA KV has its own LRU over all
  nodes, interior ones included (``evict_swa``): tombstoning the middle of a path keeps its
  full KV servable to longer matches. Its recency (``swa_access``) is the window's: a node is
  stamped when it holds part of the window before a served match's or an insert's end, never
  for being walked through, so a conversation's earlier turns (walked by every later turn,
  but no match ends there) lose their windows before an older conversation's last one.
* **Locks**: ``lock`` protects the full KV of the root path (as the plain cache) and the SWA KV
  of the last ``W - 1`` tokens before the node only (``swa_lock_ref``): a request needs no
  more window than that. The span is split at its page-aligned start, so the nodes locked
  are exactly those unlocked later.
* **Events**: a run losing or regaining its SWA KV is a ``tombstoned`` / ``revived`` event
  (:mod:`.events`), so a router's mirror applies :func:`served_nodes` to the same tombstones.
"""

from __future__ import annotations

import operator
from typing import Hashable, List, Optional, Sequence

import numpy as np
import torch

from radixserve.memory.swa_pool import HybridAllocator

from .base import MatchResult, TokenIds, check_num_tokens, match_of_runs
from .events import REVIVED, STORED, TOMBSTONED, CacheEvent
from .lru import LruQueue
from .radix import RadixCache
from .tree import Node

__all__ = ["SWARadixCache", "SWANode", "served_nodes"]

_swa_access = operator.attrgetter("swa_access")


def _swa_candidate(node: "SWANode") -> bool:
    """The SWA queue evicts a live run no window lock holds, interior ones included."""
    return node.key is not None and node.swa and not node.swa_lock_ref


class SWANode(Node):
    __slots__ = (
        "swa",  # the run still has its SWA KV (False: a tombstone for that kind)
        "swa_lock_ref",  # requests whose window covers this run
        "swa_access",  # stamp of the last match or insert whose window this run is part of
    )

    def __init__(self, key: bytes, parent: Optional["SWANode"], stamp: int, nid: int) -> None:
        Node.__init__(self, key, parent, stamp, nid)
        self.swa = True
        self.swa_lock_ref = 0
        self.swa_access = stamp


def served_nodes(path: Sequence[Node], window: int) -> int:
    """Leading nodes of ``path`` (a matched path, root side first; nodes with ``key`` and
    ``swa``) a match may end after: the deepest boundary with no tombstone among the
    ``window - 1`` tokens before it. Shared with the router's mirror, whose nodes split
    elsewhere: the answer is always the end of a live run, a boundary in both."""
    need = window - 1
    end = tomb = k = 0
    for i, nd in enumerate(path):
        end += len(nd.key) >> 2
        if not nd.swa:
            tomb = end
        elif tomb == 0 or end - tomb >= need:
            k = i + 1
    return k


class SWAKV:
    """The SWA kind of KV as a component of the tree: per-node liveness, locks and LRU."""

    def __init__(self, cache: "SWARadixCache") -> None:
        self.cache = cache
        self.queue: LruQueue[SWANode] = LruQueue(_swa_access, _swa_candidate)
        self.clear(())

    def clear(self, dead: Sequence[SWANode]) -> None:
        """Start empty (the tree was reset: the SWA slots went with the full ones)."""
        self.evictable = self.protected = 0  # live SWA tokens without / with a window lock
        self.queue.clear()
        self.tombstoned_tokens = 0  # cumulative, for stats

    def push(self, node: SWANode) -> None:
        if node.parent is not None:
            self.queue.offer(node)

    def touch(self, node: SWANode, stamp: int) -> None:
        """Stamp the runs holding the ``W - 1`` tokens before the end of ``node``: the window
        a match ending there reads (stale queue entries are re-queued when popped)."""
        need = self.cache.window - 1
        while node.parent is not None and need > 0:
            node.swa_access = stamp
            need -= len(node.key) >> 2
            node = node.parent

    # ------------------------------------------------------------------ component
    def split(self, upper: SWANode, lower: SWANode, m: int) -> None:
        upper.swa = lower.swa
        upper.swa_lock_ref = lower.swa_lock_ref
        upper.swa_access = lower.swa_access
        self.push(upper)

    def served(self, path: Sequence[SWANode]) -> int:
        return served_nodes(path, self.cache.window)

    def dropped(self, node: SWANode) -> None:
        """``node`` left the tree with its full KV (its SWA slots went with them)."""
        self.queue.discard(node)
        if node.swa:
            L = len(node.key) >> 2
            if node.swa_lock_ref:
                self.protected -= L
            else:
                self.evictable -= L

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` SWA slots if possible; return how many were freed. Two
        passes in LRU order: first every run longer than a window gives up all but its last
        window (split off and tombstoned), since a match resumes at a run's end far more often
        than in its middle and the end needs only that window; then whole runs go."""
        num_tokens = check_num_tokens(num_tokens)
        c = self.cache
        ps = c.page_size
        keep = c.window - 1 + (-(c.window - 1)) % ps  # the window before a run's end, in pages
        freed = 0
        dead: List[np.ndarray] = []
        queue = self.queue
        tails: List[SWANode] = []  # runs already down to their window, for the second pass
        while freed < num_tokens:
            node = queue.pop()
            if node is None:
                break
            L = len(node.value)
            if L > keep:
                head = c._split(node, L - keep)  # node keeps its identity as the tail
                head.swa = False  # (its queue entry from the split is dropped when popped)
                c._emit_node(TOMBSTONED, head, L - keep)
                dead.append(head.value)
                freed += L - keep
            tails.append(node)
        for node in tails:  # in LRU order already
            if freed >= num_tokens:
                queue.push(node)
                continue
            node.swa = False
            c._emit_node(TOMBSTONED, node, len(node.value))
            dead.append(node.value)
            freed += len(node.value)
        if freed:
            self.evictable -= freed
            self.tombstoned_tokens += freed
            c.allocator.free_swa(torch.from_numpy(np.concatenate(dead)))
        return freed

    # ------------------------------------------------------------------ locks
    def lock_span(self, node: SWANode, delta: int) -> None:
        """Add ``delta`` window locks on the nodes holding the ``W - 1`` tokens before the end
        of ``node`` (splitting the first at the page-aligned start of the span)."""
        c = self.cache
        depth = 0
        x = node
        while x.parent is not None:
            depth += len(x.key) >> 2
            x = x.parent
        start = max(0, depth - (c.window - 1))
        start -= start % c.page_size
        x = node
        end = depth
        while x.parent is not None and end > start:
            L = len(x.key) >> 2
            if end - L < start:  # the span starts inside x: make it a node boundary (x keeps
                c._split(x, start - (end - L))  # its identity as the lower half)
                L = end - start
            if x.swa and ((delta > 0 and x.swa_lock_ref == 0) or (delta < 0 and x.swa_lock_ref == 1)):
                self.evictable -= delta * L  # the run's first lock taken, or its last released
                self.protected += delta * L
            x.swa_lock_ref += delta
            if x.swa_lock_ref < 0:
                raise RuntimeError(f"window unlock of {x!r} without a matching lock")
            if x.swa_lock_ref == 0:
                self.push(x)
            end -= L
            x = x.parent


class SWARadixCache(RadixCache):
    """Radix cache over a :class:`HybridAllocator`: full KV per node, SWA KV per the rules above."""

    node_type = SWANode
    priorities = False

    def __init__(self, allocator: HybridAllocator, window: int) -> None:
        if not isinstance(allocator, HybridAllocator):
            raise ValueError(f"allocator must be a HybridAllocator, got {type(allocator).__name__}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an int >= 2, got {window!r}")
        self.allocator = allocator
        self.window = window
        self.swa_kv = SWAKV(self)
        self.components = (self.swa_kv,)
        super().__init__(allocator.page_size, allocator.free)

    # ------------------------------------------------------------------ sizes
    @property
    def swa_evictable_size(self) -> int:
        return self.swa_kv.evictable

    @property
    def swa_size(self) -> int:
        """Tokens of the tree that still have their SWA KV."""
        return self.swa_kv.evictable + self.swa_kv.protected

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> MatchResult:
        """Longest cached prefix whose window is there too (see the module docstring)."""
        runs, length, end, _, _ = self._match_served(token_ids, salt, True, self.swa_kv)
        if length:
            self.swa_kv.touch(end, self._clock)
        return match_of_runs(runs, length, end)

    def _inserted(self, salt: Hashable, q: bytes, n: int, arr: np.ndarray, path: List[SWANode],
                  pos: int, leaf: Optional[SWANode], stamp: int) -> int:
        """As the plain cache's; runs whose SWA slots the request no longer holds enter as
        tombstones, tombstones it holds SWA KV for are revived with it."""
        live = self.allocator.has_swa(torch.from_numpy(arr[:n])).numpy()
        off = 0
        for nd in path:
            L = len(nd.key) >> 2
            if not nd.swa:
                self._revive(nd, arr, live, off, L)
            off += L
        end = path[-1] if path else None
        if leaf is not None:
            w0 = self._first_live(live, pos, n)
            if w0 > pos:  # the request's SWA KV of [pos, w0) is gone: a tombstone for it
                leaf.swa = False
                if w0 < n:
                    self._split(leaf, w0 - pos)
                    leaf.swa = True
            if leaf.swa:
                self.swa_kv.evictable += n - w0
                self.swa_kv.push(leaf)
            if self.listener is not None:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - pos))
                if w0 > pos:
                    self.listener(CacheEvent(TOMBSTONED, salt, q[: w0 << 2], w0 - pos))
            end = leaf
        if end is not None:
            self.swa_kv.touch(end, stamp)
        return pos

    def _first_live(self, live: np.ndarray, a: int, b: int) -> int:
        """First page-aligned position in ``[a, b)`` from which the request holds SWA KV to
        ``b`` (a request frees its window's tail from the front, so that part is a suffix)."""
        dead = np.flatnonzero(~live[a:b])
        if not len(dead):
            return a
        w = a + int(dead[-1]) + 1
        return min(b, w + (-w) % self.page_size)

    def _revive(self, nd: SWANode, arr: np.ndarray, live: np.ndarray, off: int, L: int) -> None:
        w0 = self._first_live(live, off, off + L)
        if w0 >= off + L:
            return
        if w0 > off:  # only the lower part: split there, the upper stays a tombstone
            self._split(nd, w0 - off)
        src = torch.from_numpy(arr[w0 : off + L])
        self.allocator.move_swa(torch.from_numpy(nd.value), src)
        nd.swa = True
        self._emit_node(REVIVED, nd, len(nd.value))
        if nd.swa_lock_ref:
            self.swa_kv.protected += len(nd.value)
        else:
            self.swa_kv.evictable += len(nd.value)
            self.swa_kv.push(nd)

    def snapshot_events(self) -> List[CacheEvent]:
        """The plain cache's snapshot, each tombstone's event right after its node's."""
        return [CacheEvent(kind, salt, path, len(nd.value)) for salt, path, nd in self.iter_paths()
                for kind in ((STORED,) if nd.swa else (STORED, TOMBSTONED))]

    # ------------------------------------------------------------------ locks / eviction
    def lock(self, node: SWANode) -> None:
        super().lock(node)
        self.swa_kv.lock_span(node, 1)

    def unlock(self, node: SWANode) -> None:
        self._check_handle(node)
        if node.parent is not None and node.lock_ref <= 0:  # before the window locks move
            raise RuntimeError(f"unlock of {node!r} without a matching lock")
        self.swa_kv.lock_span(node, -1)
        super().unlock(node)

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` SWA slots if possible by tombstoning LRU runs."""
        return self.swa_kv.evict(num_tokens)

    def stats(self) -> dict:
        return {**super().stats(), "swa_size": self.swa_size, "swa_evictable_size": self.swa_evictable_size,
                "swa_tombstoned_tokens": self.swa_kv.tombstoned_tokens, "window": self.window}

    def check_integrity(self) -> None:
        """The plain cache's invariants, plus: SWA sizes, window locks within full locks, and
        the SWA slots the tree's live runs hold are exactly the ones mapped."""
        super().check_integrity()
        ev = pr = 0
        for nd in self.iter_nodes():
            L = len(nd.value)
            if nd.swa_lock_ref > nd.lock_ref:
                raise AssertionError(f"{nd!r}: window locks without full locks")
            has = self.allocator.has_swa(torch.from_numpy(nd.value))
            if nd.swa:
                if not bool(has.all()):
                    raise AssertionError(f"{nd!r}: live for SWA but its SWA slots are gone")
                if nd.swa_lock_ref:
                    pr += L
                else:
                    ev += L
                    if nd not in self.swa_kv.queue:
                        raise AssertionError(f"{nd!r}: SWA eviction candidate not queued")
            elif bool(has.any()):
                raise AssertionError(f"{nd!r}: a tombstone still maps SWA slots")
        if (ev, pr) != (self.swa_kv.evictable, self.swa_kv.protected):
            raise AssertionError(f"SWA accounting: tree has {ev}/{pr}, counters say "
                                 f"{self.swa_kv.evictable}/{self.swa_kv.protected}")
