"""RadixAttention's prefix cache: the radix tree (:mod:`.tree`) with KV slots on every node.

* ``node.value`` holds the KV slots of the edge's tokens (an int64 numpy array, never
  changed in place); a match's ``indices`` concatenate them and convert once with
  ``torch.from_numpy`` when first read (torch ops on tiny tensors cost more than the walk).
* Eviction is leaf-first LRU over an :class:`.lru.LruQueue` (a lazily invalidated heap).
  Recency is a monotonic operation counter (deterministic in tests). Since
  ``parent.last_access >= child.last_access`` always holds, a parent that becomes a leaf is
  never "older" than the leaf just evicted below it: the order stays exact LRU among leaves.
  Leaves made by ``insert`` are queued with ``push_later`` (heap entries built at ``evict``).
* Tokens move between ``evictable_size`` and ``protected_size`` exactly on lock-count 0->1
  and 1->0 transitions. Salts: one root per salt, so namespaces never share a node.
* Priorities. A request may say its tokens from some position on (``low_priority_from``)
  are not worth keeping: a router that saw the prompt fork there from its siblings knows the
  rest is this request's own. They are stamped :data:`LOW_PRIORITY` below the clock, so such
  leaves go before all others, LRU among them. Otherwise a unique question cached below a
  shared system prompt carries the prompt's stamp: once it is evicted the prompt is the
  oldest leaf and goes next, so under memory pressure every miss evicts a prefix about to be
  hit. A request never lowers a stamp (a token another request keeps at normal priority
  stays there); a later request whose normal part reaches a low token raises it back.
  Between the two, probation (``probation_from``, with ``low_priority_from``): the part of a
  family's shared prefix the request did not find and computed again is stamped
  :data:`PROBATION` below the clock (after every low token, before every normal one) until
  a later request finds it and raises it to normal. Prefixes that keep being found then
  stay while those that keep missing take turns in the rest (a segmented LRU), instead of
  each miss evicting the LRU prefix, which is the one wanted soonest when families take turns.
"""

from __future__ import annotations

import operator
from typing import Hashable, List, Optional, Sequence

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
    match_of_runs,
)
from .events import CLEARED, REMOVED, STORED, CacheEvent, CacheListener
from .lru import LruQueue
from .packed import pack as _pack
from .tree import Node, RadixTree

__all__ = ["RadixCache", "LOW_PRIORITY", "PROBATION"]

#: How far below the clock low-priority tokens are stamped: further than any stamp a live
#: node can have, so they sort before every normal one and keep their own LRU order.
LOW_PRIORITY = 1 << 62
#: The same for tokens on probation: between the low class and the normal one.
PROBATION = 1 << 61


_from_numpy = torch.from_numpy
_concat = np.concatenate
_Tensor = torch.Tensor
_NP_I64 = np.dtype(np.int64)
_new_node = object.__new__
_value = operator.attrgetter("value")
_last_access = operator.attrgetter("last_access")


def _index_array(indices: SlotIndices, n: int) -> np.ndarray:
    """``indices`` as an int64 numpy array of ``n`` slots. Fast path for what the engine
    passes, a 1-D int64 CPU tensor: numpy attribute reads are cheaper than torch's, so the
    checks run on the numpy view; anything unusual (CUDA, requires_grad, other dtypes or
    shapes) takes the validating path."""
    if type(indices) is _Tensor:
        try:
            arr = indices.numpy()
        except (RuntimeError, TypeError):
            pass
        else:
            if arr.dtype is _NP_I64 and len(arr.shape) == 1 and arr.shape[0] == n:
                return arr
    return as_index_array(indices, n)


class RadixCache(RadixTree, PrefixCache):
    """Radix-tree prefix cache with leaf-first LRU eviction, ref-counted locks and salts.
    ``on_free(indices)`` receives a 1-D ``torch.int64`` tensor of slots that left the tree
    (one call per ``evict``/``reset`` that freed something); :mod:`.base` has the ownership
    rules of ``insert``.

    Extensions (:mod:`.swa`, :mod:`.mamba`, :mod:`.hicache`) add components to the nodes and
    refine what happens through these protected hooks: :meth:`_l1_candidate` (which nodes the
    L1 queue may evict), :meth:`_inserted` (after ``insert`` walked and attached: events, the
    path's other kinds of KV), :meth:`_evict_node` (what evicting one L1 candidate does).
    """

    can_share_partial_prefix = True
    #: Whether ``insert`` and ``match_prefix`` apply ``low_priority_from``/``probation_from``.
    priorities = True

    #: Whether this class keeps the plain :meth:`_inserted` (``insert`` then inlines it).
    _inserted_is_plain = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._inserted_is_plain = cls._inserted is RadixCache._inserted

    def __init__(self, page_size: int = 1, on_free: Optional[FreeCallback] = None) -> None:
        PrefixCache.__init__(self, page_size, on_free)
        #: Called with a :class:`CacheEvent` for every run of tokens that enters or leaves
        #: the tree (see :mod:`.events`); None costs one attribute test per insert/evict.
        self.listener: Optional[CacheListener] = None
        self._lru: LruQueue[Node] = LruQueue(_last_access, self._l1_candidate)
        RadixTree.__init__(self, page_size)

    def _init_tree(self) -> None:
        RadixTree._init_tree(self)
        self._evictable = 0
        self._protected = 0
        self._lru.clear()

    def _make_root(self, salt: Hashable) -> Node:
        root = RadixTree._make_root(self, salt)
        root.value = np.empty(0, dtype=np.int64)
        return root

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` under ``salt``. Refreshes the
        stamp and bumps the hit count of every node on the matched path (past
        ``probation_from``/``low_priority_from`` only within that class: see the module
        docstring). A match ending inside an edge splits it, so that ``r.node`` covers exactly
        the matched tokens (locking it protects exactly ``r.indices``)."""
        ids, q = _pack(token_ids)
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            return match_of_runs((), 0, self._default_root)
        n = len(ids)
        n -= n % self.page_size
        self._clock = stamp = self._clock + 1
        if low_priority_from is None and probation_from is None:
            node, pos, path = self._descend(root, ids, q, n, stamp, True)
        else:
            node, pos, path = self._descend_prioritised(root, ids, q, n, stamp, True,
                                                        *self._bounds(n, low_priority_from, probation_from))
        return match_of_runs(list(map(_value, path)), pos, node)

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None,
               low_priority_from: Optional[int] = None,
               probation_from: Optional[int] = None) -> int:
        """Cache ``token_ids`` (whole pages only) with slots ``indices``; return ``n``, the
        leading tokens already cached. The tree keeps its own slots for those and takes (a
        copy of) ``indices[n:A]``, ``A = cacheable_length(len(token_ids))``; the caller still
        owns and frees ``indices[:n]`` (minus its matched slots, the tree's) and
        ``indices[A:]``. Refreshes stamps along the path, in the priority classes of
        :meth:`.base.PrefixCache.insert`."""
        ids, q = _pack(token_ids)
        n = len(ids)
        arr = _index_array(indices, n)
        n -= n % self.page_size
        root = self._default_root if salt is None else self._root_for_insert(salt)
        self._clock = stamp = self._clock + 1
        if (low_priority_from is None and probation_from is None) or not self.priorities:
            r0 = r = n
            node, pos, path = self._descend(root, ids, q, n, stamp)
        else:
            r0, r = self._bounds(n, low_priority_from, probation_from)
            node, pos, path = self._descend_prioritised(root, ids, q, n, stamp, False, r0, r)
        leaf = None
        if pos < n:
            if r0 < n:
                leaf = self._attach_classes(node, ids, q, pos, n, arr, stamp, r0, r)
            elif self.node_type is Node:
                leaf = self._attach_plain(node, ids, q, pos, n, arr, stamp)
            else:
                leaf = self._attach(node, ids, q, pos, n, stamp)
                leaf.value = arr[pos:n].copy()
            self._evictable += n - pos
            self._lru.push_later(leaf)
        if self._inserted_is_plain:  # the plain cache's hook, inlined: this runs per request
            if leaf is not None and self.listener is not None:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - pos))
            return pos
        return self._inserted(salt, q, n, arr, path, pos, leaf, stamp)

    def _attach_plain(self, node: Node, ids, q: bytes, pos: int, n: int, arr: np.ndarray,
                      stamp: int) -> Node:
        """A plain leaf holding ``ids[pos:n]`` under ``node``, built inline (no ``__init__``
        call): the common insert, once per request."""
        self._next_id = nid = self._next_id + 1
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
        node.children[ids[pos] if self.page_size == 1 else q[pos << 2 : (pos + self.page_size) << 2]] = leaf
        self._num_nodes += 1
        return leaf

    def _attach_classes(self, node: Node, ids, q: bytes, pos: int, n: int, arr: np.ndarray,
                        stamp: int, r0: int, r: int) -> Node:
        """New tokens ``ids[pos:n]`` as one leaf per eviction class they fall in (normal
        before ``r0``, probation before ``r``, low after); returns the deepest."""
        for seg_end, cls in ((r0, stamp), (r, stamp - PROBATION), (n, stamp - LOW_PRIORITY)):
            if pos < seg_end:
                node = self._attach(node, ids, q, pos, seg_end, cls)
                node.value = arr[pos:seg_end].copy()
                pos = seg_end
        return node

    def _inserted(self, salt: Hashable, q: bytes, n: int, arr: np.ndarray, path: List[Node],
                  pos: int, leaf: Optional[Node], stamp: int) -> int:
        """Hook: ``insert`` walked ``path`` (the nodes holding ``q[:pos]``, stamped) and, when
        ``pos < n``, attached ``leaf`` holding ``arr[pos:n]``; emit what entered, return
        ``insert``'s result."""
        if leaf is not None and self.listener is not None:
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
        and those from ``r`` on in the low class (``r0 <= r <= n``, page-aligned): within a
        class never below what a node has, never below that class's clock. Edges that run
        across ``r0`` or ``r`` are split there, so each node is in one class."""
        node, pos, path = self._descend(root, ids, q, r0, stamp, hits)
        if pos < r0:
            return node, pos, path  # the match ends in the normal part
        for seg_end, cls in ((r, stamp - PROBATION), (n, stamp - LOW_PRIORITY)):
            if pos < seg_end:
                node, pos, more = self._descend(node, ids, q, seg_end, cls, hits, True, pos)
                path += more
                if pos < seg_end:
                    break
        return node, pos, path

    def _emit(self, ev: CacheEvent) -> None:
        if self.listener is not None:
            self.listener(ev)

    def _emit_node(self, kind: str, node: Node, length: int, tier: str = "L1") -> None:
        """An event for the run of ``node`` (the path from the root through it)."""
        if self.listener is not None:
            self.listener(CacheEvent(kind, self.salt_of(node), self.path_bytes(node), length, tier))

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
        offer = self._lru.offer
        for nd in released:
            offer(nd)
        self._evictable += delta
        self._protected -= delta

    # ------------------------------------------------------------------ eviction
    def _l1_candidate(self, node: Node) -> bool:
        """Hook: whether the L1 queue may evict ``node`` now (an unlocked leaf)."""
        return not node.lock_ref and not node.children

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, LRU first (a parent losing its last child becomes a candidate),
        until ``num_tokens`` are freed or none is left; the slots go to ``on_free`` in one call."""
        num_tokens = check_num_tokens(num_tokens)
        freed = 0
        arrays: List[np.ndarray] = []
        kept: List[Node] = []
        pop = self._lru.pop
        evict_node = self._evict_node
        while freed < num_tokens:
            node = pop()
            if node is None:
                break
            k = evict_node(node, arrays)
            if k:
                freed += k
            else:
                kept.append(node)
        for nd in kept:
            self._lru.push(nd)
        if freed:
            self._evictable -= freed
            self.evicted_tokens += freed
            self.on_free(_from_numpy(arrays[0] if len(arrays) == 1 else _concat(arrays)))
        return freed

    def _evict_node(self, node: Node, freed: List[np.ndarray]) -> int:
        """Hook: evict the L1 candidate ``node``: append the slots it frees to ``freed`` and
        return their number (0: it stays, and is queued again after this ``evict``)."""
        v = node.value
        self._emit_node(REMOVED, node, len(v))
        for c in self.components:
            c.dropped(node)
        freed.append(v)
        parent = self._unlink(node)
        if parent.parent is not None:
            self._lru.offer(parent)
        return len(v)

    def reset(self) -> None:
        """Drop the whole tree, handing every slot back through ``on_free`` (one call);
        RuntimeError (no change) if any node is locked. Handles to non-root nodes go dead
        (lock/unlock on them raise ValueError); root handles (misses) stay harmless no-ops."""
        if self._protected:
            raise RuntimeError(f"reset() while {self._protected} tokens are locked by running requests")
        dead = self._detach_all()
        arrays = [nd.value for nd in dead if nd.value is not None]
        for nd in dead:
            nd.value = None
        self._emit(CacheEvent(CLEARED, None, b"", 0))
        for c in self.components:
            c.clear(dead)
        if arrays:
            self.on_free(_from_numpy(_concat(arrays)))

    # ------------------------------------------------------------------ introspection
    def snapshot_events(self) -> List[CacheEvent]:
        """``stored`` events that rebuild the current contents from empty (parents first):
        what a mirror that (re)connects replays before the live stream."""
        return [CacheEvent(STORED, salt, path, len(nd.value)) for salt, path, nd in self.iter_paths()]

    def held_slots(self) -> torch.Tensor:
        """Every L1 slot the tree holds (for the scheduler's integrity check)."""
        values = [n.value for n in self.iter_nodes() if n.value is not None]
        return _from_numpy(_concat(values)) if values else empty_indices()

    def as_dict(self, salt: Hashable = None) -> dict:
        """The tree of one namespace as nested ``{tuple(edge tokens): {...children}}``."""
        return radix_introspect.as_dict(self, salt)

    def dump(self, max_tokens: int = 8) -> str:
        """One line per node: id, edge tokens (abbreviated), slots, lock, hits, stamp."""
        return radix_introspect.dump(self, max_tokens)

    def check_integrity(self) -> None:
        """Structure (:meth:`check_structure`), L1 sizes and lock counts, slot uniqueness,
        and the L1 queue: every candidate queued, the queue's own rule kept."""
        nodes = self.check_structure()
        self._check_l1(nodes, nodes)

    def _check_l1(self, nodes: Sequence[Node], in_l1: Sequence[Node]) -> None:
        """L1 checks over ``in_l1`` (the nodes holding L1 slots, among ``nodes``)."""
        ps = self.page_size
        evictable = protected = 0
        for node in in_l1:
            v = node.value
            if v is None or len(node.key) != 4 * len(v):
                raise AssertionError(f"{node!r}: key/value length mismatch")
            if len(v) % ps:
                raise AssertionError(f"{node!r}: length not a multiple of page_size")
            if v.dtype != np.int64 or v.ndim != 1:
                raise AssertionError(f"{node!r}: value must be 1-D int64")
            if node.lock_ref:
                protected += len(v)
            else:
                evictable += len(v)
                if self._l1_candidate(node) and node not in self._lru:
                    raise AssertionError(f"{node!r}: evictable leaf missing from the L1 queue")
        if evictable != self._evictable or protected != self._protected:
            raise AssertionError(f"size accounting: tree has evictable={evictable} protected={protected}, "
                                 f"counters say {self._evictable}/{self._protected}")
        if in_l1:
            allv = np.concatenate([nd.value for nd in in_l1])
            if len(np.unique(allv)) != len(allv):
                raise AssertionError("a KV slot is held by two tree positions")
        self._lru.check()
        live = set(map(id, nodes))
        for nd in self._lru:
            if nd.key is not None and id(nd) not in live:
                raise AssertionError(f"{nd!r}: queued for L1 but not in the tree")
