"""Eviction candidates in least-recently-used order: the one queue every eviction of the
tree runs on (L1 leaves, L2 copies, sliding-window KV, Mamba state snapshots). A node's
recency (its *stamp*) changes on every match through it, far more often than anything is
evicted, so the queue is a binary heap of ``(stamp, id, node)`` entries corrected lazily
instead of on every touch. The rule, kept here and nowhere else:

* A node has at most one **live** entry; the queue remembers which (``_entry``). Any other
  entry of the node is an **orphan** and is dropped when popped.
* A stamp that **rises** (a touch) needs no call: when the node's entry pops, it is pushed
  again with the current stamp.
* A stamp that is **lowered** (a demotion) must be announced with :meth:`lowered`: a new
  live entry goes in at the lower stamp, and the old one becomes an orphan.
* A popped node that is no **candidate** any more (locked, has children, lost what this
  queue evicts) is dropped; whoever makes it a candidate again offers it (:meth:`offer`).

So :meth:`pop` returns the queued candidate with the least ``(stamp, id)``
(``tests/test_lru.py`` holds it to a sorted-list reference).

``push_later`` defers a node's heap entry (and ``_entry``) until the queue is next read: an
insert creates one candidate per request, and a heap entry is a GC-tracked tuple, so building
them in one go at eviction time keeps the cyclic GC off the insert path. Every other method
flushes the deferred nodes first (a node pushed meanwhile keeps its entry), so they behave
as if pushed at once.
"""

from __future__ import annotations

import heapq
from typing import Callable, Dict, Generic, Iterator, List, Optional, TypeVar

__all__ = ["LruQueue"]

N = TypeVar("N")

_heappush = heapq.heappush
_heappop = heapq.heappop


class LruQueue(Generic[N]):
    """Lazily invalidated LRU heap over nodes that have an ``id`` (the tie-breaker).
    ``stamp(node)`` reads a node's recency; ``candidate(node)`` says whether this queue may
    evict it now."""

    __slots__ = ("_heap", "_entry", "_later", "_stamp", "_candidate")

    def __init__(self, stamp: Callable[[N], int], candidate: Callable[[N], bool]) -> None:
        self._stamp = stamp
        self._candidate = candidate
        self._heap: List[tuple] = []
        self._entry: Dict[N, tuple] = {}  # node -> its live heap entry
        self._later: List[N] = []

    def __len__(self) -> int:
        """Nodes with a live entry."""
        if self._later:
            self._flush_later()
        return len(self._entry)

    def __contains__(self, node: N) -> bool:
        if self._later:
            self._flush_later()
        return node in self._entry

    def __iter__(self) -> Iterator[N]:
        """The queued nodes, in no particular order."""
        if self._later:
            self._flush_later()
        return iter(list(self._entry))

    def clear(self) -> None:
        self._heap.clear()
        self._entry.clear()
        self._later.clear()

    # ------------------------------------------------------------------ queueing
    def push(self, node: N) -> None:
        """Queue ``node`` at its current stamp unless it is queued already."""
        if self._later:
            self._flush_later()
        entry = self._entry
        if node not in entry:
            entry[node] = item = (self._stamp(node), node.id, node)  # type: ignore[attr-defined]
            _heappush(self._heap, item)

    def offer(self, node: N) -> None:
        """:meth:`push` ``node`` if it is a candidate (it may just have become one)."""
        if self._later:
            self._flush_later()
        if node not in self._entry and self._candidate(node):
            self._entry[node] = item = (self._stamp(node), node.id, node)  # type: ignore[attr-defined]
            _heappush(self._heap, item)

    def push_later(self, node: N) -> None:
        """:meth:`push`, with the heap entry built when the queue is next read."""
        self._later.append(node)

    def lowered(self, node: N) -> None:
        """``node``'s stamp went down: queue it at the new stamp (any older entry of it is
        orphaned). Whether it is a candidate is checked when it pops."""
        if self._later:
            self._flush_later()
        s = self._stamp(node)
        old = self._entry.get(node)
        if old is not None and old[0] == s:
            return
        self._entry[node] = item = (s, node.id, node)  # type: ignore[attr-defined]
        _heappush(self._heap, item)

    def discard(self, node: N) -> None:
        """Forget ``node`` (it left the tree): its entries become orphans."""
        if self._later:
            self._flush_later()
        self._entry.pop(node, None)

    # ------------------------------------------------------------------ eviction
    def pop(self) -> Optional[N]:
        """Take the least recently used candidate out of the queue; None when there is none.
        The caller evicts it, or :meth:`push` es it back if it keeps it."""
        if self._later:
            self._flush_later()
        heap = self._heap
        entry = self._entry
        stamp = self._stamp
        candidate = self._candidate
        while heap:
            item = _heappop(heap)
            node = item[2]
            if entry.get(node) is not item:
                continue  # an orphan
            del entry[node]
            if not candidate(node):
                continue
            now = stamp(node)
            if now != item[0]:  # touched since it was queued: back in at its stamp
                entry[node] = item = (now, item[1], node)
                _heappush(heap, item)
                continue
            return node
        return None

    def _flush_later(self) -> None:
        heap = self._heap
        entry = self._entry
        stamp = self._stamp
        for node in self._later:
            if node not in entry:
                entry[node] = item = (stamp(node), node.id, node)  # type: ignore[attr-defined]
                _heappush(heap, item)
        self._later.clear()

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Every queued node has its one live entry in the heap, never above its stamp."""
        if self._later:
            self._flush_later()
        in_heap = set(map(id, self._heap))
        for node, item in self._entry.items():
            if id(item) not in in_heap or item[2] is not node:
                raise AssertionError(f"{node!r}: queued without its heap entry")
            if item[0] > self._stamp(node):
                raise AssertionError(f"{node!r}: queued above its stamp (a lowering not announced)")
