"""RadixAttention's prefix cache: the radix tree (:mod:`.tree`) with KV slots on every node.

* ``node.value`` holds the KV slots of the edge's tokens (an int64 numpy array);
  ``match_prefix`` concatenates once and converts once with ``torch.from_numpy`` (torch ops
  on tiny tensors cost more than the walk).
* Eviction is leaf-first LRU. Recency is a monotonic operation counter (deterministic in
  tests). Candidates live in a heap with lazy invalidation: a node has at most one heap
  entry (``in_heap``); a popped entry whose node is locked or has children is dropped, one
  whose stamp is stale is re-pushed with the current stamp. Since ``parent.last_access >=
  child.last_access`` always holds, a parent that becomes a leaf is never "older" than the
  leaf just evicted below it, so the order stays exact LRU among leaves. Leaves made by
  ``insert`` are first appended to a plain list (``_fresh``) and pushed into the heap by the
  next ``evict``: a heap entry is a GC-tracked tuple, and one per insert makes the cyclic GC
  run more often; ``in_heap`` means "has a candidate entry" in either place.
* Tokens move between ``evictable_size`` and ``protected_size`` exactly on lock-count 0->1
  and 1->0 transitions. Salts: one root per salt, so namespaces never share a node.
* Two priorities. A request may say that its tokens from some position on
  (``low_priority_from``) are not worth keeping: a router that has seen the prompt fork
  there from its siblings knows that the rest is this request's own and will not come again.
  Those tokens are stamped :data:`LOW_PRIORITY` below the clock, so every such leaf is
  evicted before any other, least recently used first among them. Without that, a unique
  question cached below a shared system prompt carries the prompt's own stamp: once it is
  evicted, the prompt is the oldest leaf and goes next, which under memory pressure turns
  every miss into the eviction of a prefix that was about to be hit. A request never lowers
  a stamp (a token another request keeps at normal priority stays there), and any later
  request whose normal part reaches a low token raises it back: it was reused.
  Between the two, probation (``probation_from``, with ``low_priority_from``): the part of
  a family's shared prefix that the request did not find and computed again is stamped
  :data:`PROBATION` below the clock, after every low token and before every normal one,
  until a later request finds it and raises it to normal. Prefixes that keep being found
  then stay while those that keep missing take turns in what is left (as a segmented LRU
  does), instead of each miss evicting the least recently used prefix: when families take
  turns, that is the one wanted soonest.
"""

from __future__ import annotations

import heapq
import operator
from typing import Hashable, List, Optional

import numpy as np
import torch

from . import radix_introspect
from .base import (
    FreeCallback,
    MatchResult,
    PrefixCache,
    SlotIndices,
    TokenIds,
    as_index_array,
    check_num_tokens,
    empty_indices,
)
from .events import CLEARED, REMOVED, STORED, CacheEvent, CacheListener
from .packed import common_prefix_at
from .packed import pack as _pack
from .tree import Node, RadixTree

__all__ = ["RadixCache", "LOW_PRIORITY", "PROBATION"]

#: How far below the clock low-priority tokens are stamped: further than any stamp a live
#: node can have, so they sort before every normal one and keep their own LRU order.
LOW_PRIORITY = 1 << 62
#: The same for tokens on probation: between the low class and the normal one.
PROBATION = 1 << 61


_heappush = heapq.heappush
_heappop = heapq.heappop
_from_numpy = torch.from_numpy
_concat = np.concatenate
_new_match = tuple.__new__  # MatchResult(...) without the namedtuple's Python-level __new__
_Tensor = torch.Tensor
_new_node = object.__new__
_NP_I64 = np.dtype(np.int64)
_value = operator.attrgetter("value")


class RadixCache(RadixTree, PrefixCache):
    """Radix-tree prefix cache with leaf-first LRU eviction, ref-counted locks and salts.

    ``on_free(indices)`` receives a 1-D ``torch.int64`` tensor of slots that left the tree
    (one call per ``evict``/``reset`` that freed something). See :mod:`.base` for the
    ownership rules of ``insert``.
    """

    can_share_partial_prefix = True

    def __init__(self, page_size: int = 1, on_free: Optional[FreeCallback] = None) -> None:
        PrefixCache.__init__(self, page_size, on_free)
        #: Called with a :class:`CacheEvent` for every run of tokens that enters or leaves
        #: the tree (see :mod:`.events`); None costs one attribute test per insert/evict.
        self.listener: Optional[CacheListener] = None
        RadixTree.__init__(self, page_size)

    def _init_tree(self) -> None:
        RadixTree._init_tree(self)
        self._evictable = 0
        self._protected = 0
        self._heap: List[tuple] = []
        self._fresh: List[Node] = []

    def _make_root(self, salt: Hashable) -> Node:
        root = RadixTree._make_root(self, salt)
        root.value = np.empty(0, dtype=np.int64)
        return root

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` under ``salt``.

        Refreshes the LRU stamp and bumps the hit count of every node on the matched path
        (past ``probation_from`` and ``low_priority_from`` tokens the stamp is refreshed
        within the probation or low class only: see the module docstring). If the match ends inside an edge, that edge is split so
        that ``r.node`` covers exactly the matched tokens (locking it then protects exactly
        ``r.indices``). ``r.indices`` is a fresh 1-D int64 tensor (never aliases the tree's
        storage)."""
        ids, q = _pack(token_ids)
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            return _new_match(MatchResult, (empty_indices(), 0, self._default_root, 0, None, 0))
        n = len(ids)
        n -= n % self.page_size
        self._clock = stamp = self._clock + 1
        r0, r = self._bounds(n, low_priority_from, probation_from)
        if r0 >= n:
            node, pos, path = self._descend(root, ids, q, n, stamp, True)
        else:
            node, pos, path = self._descend_prioritised(root, ids, q, n, stamp, True, r0, r)
        k = len(path)
        if k == 2:  # the common full hit: a shared prefix and a request's own run
            idx = _from_numpy(_concat((path[0].value, path[1].value)))
        elif k == 1:
            idx = _from_numpy(path[0].value.copy())
        elif k:
            idx = _from_numpy(_concat(list(map(_value, path))))
        else:
            idx = empty_indices()
        return _new_match(MatchResult, (idx, pos, node, 0, None, 0))

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None,
               low_priority_from: Optional[int] = None,
               probation_from: Optional[int] = None) -> int:
        """Cache ``token_ids`` (whole pages only) with slots ``indices``.

        Returns ``n``, the number of leading tokens that were already cached before the call.
        The tree keeps its own slots for those and takes (a copy of) ``indices[n:A]`` with
        ``A = cacheable_length(len(token_ids))``; the caller still owns ``indices[:n]``
        (minus the slots it got from ``match_prefix``, which are the tree's) and
        ``indices[A:]`` and must free them. Refreshes LRU stamps along the path; tokens
        from ``probation_from`` up to ``low_priority_from`` enter (or are refreshed) on
        probation, those from ``low_priority_from`` on at low priority."""
        ids, q = _pack(token_ids)
        n = len(ids)
        # Fast path for what the engine passes: a 1-D int64 CPU tensor. numpy attribute
        # reads are cheaper than torch's, so the checks run on the numpy view; anything
        # unusual (CUDA, requires_grad, other dtypes/shapes) takes the validating slow path.
        arr = None
        if type(indices) is _Tensor:
            try:
                arr = indices.numpy()
            except (RuntimeError, TypeError):
                pass
            else:
                if arr.dtype is not _NP_I64 or len(arr.shape) != 1 or arr.shape[0] != n:
                    arr = None
        if arr is None:
            arr = as_index_array(indices, n)
        ps = self.page_size
        n -= n % ps
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            root = self._root_for_insert(salt)
        self._clock = stamp = self._clock + 1
        if low_priority_from is not None or probation_from is not None:
            r0, r = self._bounds(n, low_priority_from, probation_from)
            if r0 < n:
                return self._insert_prioritised(root, ids, q, n, arr, stamp, salt, r0, r)
        node, pos, _ = self._descend(root, ids, q, n, stamp, False)
        if pos < n:
            self._next_id = nid = self._next_id + 1
            # Inline construction (no __init__ call): this runs once per request.
            leaf = _new_node(Node)
            leaf.key = q[pos << 2 : n << 2]
            leaf.value = arr[pos:n].copy()
            leaf.children = {}
            leaf.parent = node
            leaf.lock_ref = 0
            leaf.last_access = stamp
            leaf.hit_count = 0
            leaf.id = nid
            leaf.salt = None
            node.children[ids[pos] if ps == 1 else q[pos << 2 : (pos + ps) << 2]] = leaf
            self._evictable += n - pos
            self._num_nodes += 1
            leaf.in_heap = True
            self._fresh.append(leaf)
            if self.listener is not None:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - pos))
        return pos

    def _bounds(self, n: int, low_from: Optional[int], probation_from: Optional[int]) -> tuple:
        """``(r0, r)``, page-aligned and at most ``n``: a walk over ``ids[:n]`` is normal
        before ``r0``, probation from ``r0`` to ``r`` and low from ``r``."""
        ps = self.page_size
        r = n if low_from is None else min(n, low_from - low_from % ps)
        r0 = r if probation_from is None else min(r, probation_from - probation_from % ps)
        return r0, r

    def _descend_prioritised(self, root: Node, ids, q: bytes, n: int, stamp: int, hits: bool,
                             r0: int, r: int) -> tuple:
        """:meth:`_descend` with the tokens from ``r0`` to ``r`` stamped in the probation class
        and those from ``r`` on in the low class (``r0 <= r <= n``, page-aligned, ``r0 < n``):
        within a class never below what a node has, never below that class's clock. Edges that
        run across ``r0`` or ``r`` are split there, so each node is in one class."""
        node, pos, path = self._descend(root, ids, q, r0, stamp, hits) if r0 else (root, 0, [])
        if pos < r0:
            return node, pos, path  # the match ends in the normal part
        ps = self.page_size
        for seg_end, cls in ((r, stamp - PROBATION), (n, stamp - LOW_PRIORITY)):
            while pos < seg_end:
                child = node.children.get(ids[pos] if ps == 1 else q[pos << 2 : (pos + ps) << 2])
                if child is None:
                    return node, pos, path
                ck = child.key
                end = pos + (len(ck) >> 2)
                if end <= seg_end and q.startswith(ck, pos << 2):
                    nxt = child
                    pos = end
                    cut = False
                else:  # the query leaves the edge, or the class changes inside it
                    m = common_prefix_at(ck, q, pos << 2, len(ck) if end <= seg_end else (seg_end - pos) << 2)
                    m -= m % ps  # >= one page: the child was found by its first page
                    nxt = self._split(child, m)
                    pos += m
                    cut = True
                if nxt.last_access < cls:
                    nxt.last_access = cls
                if hits:
                    nxt.hit_count += 1
                path.append(nxt)
                node = nxt
                if cut and pos < seg_end:
                    return node, pos, path
        return node, pos, path

    def _insert_prioritised(self, root: Node, ids, q: bytes, n: int, arr: np.ndarray, stamp: int,
                            salt: Hashable, r0: int, r: int) -> int:
        """:meth:`insert` for a request with a probation or low part (the rare path: a router
        asked for it); new tokens form one leaf per class (normal, probation, low)."""
        node, pos, _ = self._descend_prioritised(root, ids, q, n, stamp, False, r0, r)
        if pos < n:
            start = pos
            for seg_end, cls in ((r0, stamp), (r, stamp - PROBATION), (n, stamp - LOW_PRIORITY)):
                if start < seg_end:
                    node = self._attach(node, ids, q, start, seg_end, cls)
                    node.value = arr[start:seg_end].copy()
                    start = seg_end
            self._evictable += n - pos
            node.in_heap = True
            self._fresh.append(node)
            if self.listener is not None:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - pos))
        return pos

    # ------------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        """Protect ``node`` and all its ancestors from eviction (ref-counted)."""
        self._check_handle(node)
        delta = self._lock_path(node)
        self._evictable -= delta
        self._protected += delta

    def unlock(self, node: Node) -> None:
        """Release one lock taken with :meth:`lock` on the same node."""
        self._check_handle(node)
        released: List[Node] = []
        delta = self._unlock_path(node, released)
        heap = self._heap
        for nd in released:
            if not nd.children and not nd.in_heap:
                nd.in_heap = True
                _heappush(heap, (nd.last_access, nd.id, nd))
        self._evictable += delta
        self._protected -= delta

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free whole unlocked leaves, least recently used first, until ``num_tokens``
        tokens are freed or nothing evictable is left. A parent that loses its last
        child becomes a candidate. Freed slots go to ``on_free`` in one call."""
        num_tokens = check_num_tokens(num_tokens)
        heap = self._heap
        fresh = self._fresh
        if fresh and num_tokens:
            for node in fresh:
                if node.key is not None:
                    _heappush(heap, (node.last_access, node.id, node))
            fresh.clear()
        freed = 0
        arrays = []
        comps = self.components
        while freed < num_tokens and heap:
            stamp, _, node = _heappop(heap)
            node.in_heap = False
            if node.lock_ref or node.children:
                continue  # not a candidate any more; re-pushed when it becomes one again
            if stamp != node.last_access:
                node.in_heap = True
                _heappush(heap, (node.last_access, node.id, node))
                continue
            if self.listener is not None:
                self.listener(CacheEvent(REMOVED, self.salt_of(node), self.path_bytes(node),
                                         len(node.value)))
            for c in comps:
                c.dropped(node)
            arrays.append(node.value)
            freed += len(node.value)
            parent = self._unlink(node)
            if (parent.parent is not None and not parent.children and parent.lock_ref == 0
                    and not parent.in_heap):
                parent.in_heap = True
                _heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self._evictable -= freed
            self.evicted_tokens += freed
            self.on_free(_from_numpy(arrays[0] if len(arrays) == 1 else _concat(arrays)))
        return freed

    def reset(self) -> None:
        """Drop the whole tree, handing every slot back through ``on_free`` (one call).

        Raises RuntimeError and changes nothing if any node is locked. Outstanding
        handles to non-root nodes become invalid (lock/unlock on them raise ValueError);
        root handles (misses) stay harmless no-ops."""
        if self._protected:
            raise RuntimeError(
                f"reset() while {self._protected} tokens are locked by running requests"
            )
        arrays = [nd.value for nd in self._detach_all()]
        if self.listener is not None:
            self.listener(CacheEvent(CLEARED, None, b"", 0))
        if arrays:
            self.on_free(_from_numpy(_concat(arrays)))

    # ------------------------------------------------------------------ introspection
    def snapshot_events(self) -> List[CacheEvent]:
        """``stored`` events that rebuild the current contents from empty (parents first):
        what a mirror that (re)connects replays before the live stream."""
        return [CacheEvent(STORED, salt, path, len(nd.value)) for salt, path, nd in self.iter_paths()]

    def held_slots(self) -> torch.Tensor:
        values = [n.value for n in self.iter_nodes()]
        return torch.from_numpy(np.concatenate(values)) if values else empty_indices()

    def as_dict(self, salt: Hashable = None) -> dict:
        """The tree of one namespace as nested ``{tuple(edge tokens): {...children}}``."""
        return radix_introspect.as_dict(self, salt)

    def dump(self, max_tokens: int = 8) -> str:
        """One line per node: id, edge tokens (abbreviated), slots, lock, hits, stamp."""
        return radix_introspect.dump(self, max_tokens)

    def check_integrity(self) -> None:
        """Verify structure, sizes, lock counts, slot uniqueness and the eviction heap."""
        radix_introspect.check_integrity(self)
