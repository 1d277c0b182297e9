"""RadixAttention's prefix cache: a radix tree from token ids to KV slot indices.

Why it looks the way it does
----------------------------
* Every edge holds a *run* of tokens (``key``) and the slots of those tokens (``value``, an
  int64 numpy array).  ``key`` is ``bytes``: the token ids packed as native uint32
  (``array('I', ids).tobytes()``).  A query is packed once per call (or arrives packed:
  the engine passes ``array('I')``, kept up to date per request), and an edge is then
  compared in place with ``query.startswith(key, offset)``, a ``memcmp``: no slice of the
  query is built and no int object of the stored key is touched.  The first mismatch (once
  per split) is found at C speed by XOR-ing the two runs read as big integers.
  This replaced tuple keys, which cost twice: every comparison dereferenced two int objects
  per token (32 bytes each, scattered over the heap), and the cyclic GC traversed each new
  key tuple, token by token, before untracking it.  ``bytes`` are never GC-tracked and take
  4 bytes per token (``python benchmarks/bench_cache.py`` has the resulting throughput).
* Children are found by their first token (page_size == 1) or their first page as a tuple
  (page_size > 1), read straight from the query list.  All keys are page-aligned, so two
  siblings never share a first page.
* Slot arrays stay in numpy; ``match_prefix`` concatenates once and converts once with
  ``torch.from_numpy`` (torch ops on tiny tensors cost microseconds each).
* Eviction is leaf-first LRU.  Recency is a monotonic operation counter (deterministic in
  tests).  Candidates live in a heap with lazy invalidation: a node has at most one heap
  entry (``in_heap``); a popped entry whose node is locked or has children is dropped, one
  whose stamp is stale is re-pushed with the current stamp.  Since ``parent.last_access >=
  child.last_access`` always holds, a parent that becomes a leaf is never "older" than
  the leaf that was just evicted below it, so the order stays exact LRU among leaves.
  Leaves made by ``insert`` are first appended to a plain list (``_fresh``) and pushed
  into the heap by the next ``evict``: a heap entry is a GC-tracked tuple, and one per
  insert made the cyclic GC run (and reach its expensive full collections) more often;
  ``in_heap`` means "has a candidate entry" in either place.
* ``lock_ref`` of a node counts the locks held on it or on any descendant, so a lock on a
  node protects the whole root path; tokens move between ``evictable_size`` and
  ``protected_size`` exactly on 0->1 and 1->0 transitions.
* Salts: one root per salt, so different namespaces never share a node.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any, Dict, Hashable, List, Optional

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
from .packed import common_prefix_at as _common_prefix_tokens
from .packed import pack as _pack

__all__ = ["RadixCache", "TreeNode"]

_EMPTY_VALUE = np.empty(0, dtype=np.int64)
_heappush = heapq.heappush
_heappop = heapq.heappop
_from_numpy = torch.from_numpy
_concat = np.concatenate
_new_match = tuple.__new__  # MatchResult(...) without the namedtuple's Python-level __new__
_Tensor = torch.Tensor
_new_node = object.__new__
_array = array
_NP_I64 = np.dtype(np.int64)


class TreeNode:
    """One edge of the tree (the edge *into* this node) plus bookkeeping.

    ``key`` is ``None`` once the node has been evicted or dropped by ``reset`` — a handle
    to such a node must not be locked any more.
    """

    __slots__ = (
        "key",  # bytes: tokens of this edge packed as uint32 (b"" for a root)
        "value",  # np.ndarray[int64]: KV slots of those tokens
        "children",  # dict: first token (or first page tuple) -> TreeNode
        "parent",  # TreeNode | None (None for roots and dead nodes)
        "lock_ref",  # locks held on this node or any descendant
        "last_access",  # logical clock of the last match/insert through this node
        "hit_count",  # how many match_prefix calls went through this node
        "id",  # creation order; heap tie-breaker and debug name
        "in_heap",  # True iff an entry for this node sits in the eviction heap or _fresh
        "salt",  # namespace (only meaningful on roots)
    )

    def __init__(self, key: bytes, value: np.ndarray, parent: Optional["TreeNode"], stamp: int, nid: int):
        self.key = key
        self.value = value
        self.children: Dict[Any, TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = stamp
        self.hit_count = 0
        self.id = nid
        self.in_heap = False
        self.salt = None

    def __repr__(self) -> str:
        if self.key is None:
            return f"TreeNode#{self.id}(dead)"
        return (
            f"TreeNode#{self.id}(len={len(self.value)}, lock={self.lock_ref}, "
            f"last={self.last_access}, hits={self.hit_count}, children={len(self.children)})"
        )



class RadixCache(PrefixCache):
    """Radix-tree prefix cache with leaf-first LRU eviction, ref-counted locks and salts.

    ``on_free(indices)`` receives a 1-D ``torch.int64`` tensor of slots that left the tree
    (one call per ``evict``/``reset`` that freed something).  See :mod:`.base` for the
    ownership rules of ``insert``.
    """

    can_share_partial_prefix = True

    def __init__(self, page_size: int = 1, on_free: Optional[FreeCallback] = None) -> None:
        super().__init__(page_size, on_free)
        self._next_id = 0
        #: Called with a :class:`CacheEvent` for every run of tokens that enters or leaves
        #: the tree (see :mod:`.events`); None costs one attribute test per insert/evict.
        self.listener: Optional[CacheListener] = None
        self._init_state()

    # ------------------------------------------------------------------ state
    def _init_state(self) -> None:
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._heap: List[tuple] = []
        # Leaves created by ``insert`` since the last ``evict``: they enter the heap only
        # when an eviction needs it (a list append allocates nothing the GC tracks, a heap
        # entry does, and most leaves are never evicted).  ``in_heap`` covers both.
        self._fresh: List[TreeNode] = []
        self._default_root = self._make_root(None)
        self._roots: Dict[Hashable, TreeNode] = {None: self._default_root}

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _make_root(self, salt: Hashable) -> TreeNode:
        root = TreeNode(b"", _EMPTY_VALUE, None, 0, self._new_id())
        root.salt = salt
        return root

    def _root_for_insert(self, salt: Hashable) -> TreeNode:
        root = self._roots.get(salt)
        if root is None:
            hash(salt)  # unhashable salt -> TypeError before any state changes
            root = self._roots[salt] = self._make_root(salt)
        return root

    def _child_key(self, key: bytes):
        """Dict key of an edge under its parent: its first token (page_size 1) or its first
        page as a tuple, the same keys ``match_prefix`` builds from a query list."""
        if self.page_size == 1:
            return _array("I", key[:4])[0]
        return tuple(_array("I", key[: 4 * self.page_size]))

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
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def root(self) -> TreeNode:
        """Root of the default (``salt=None``) namespace."""
        return self._default_root

    # ------------------------------------------------------------------ split
    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child``'s edge after ``m`` tokens; return the new upper node.

        ``parent -> child[0:N]`` becomes ``parent -> new[0:m] -> child[m:N]``.  The lower
        half keeps its identity, so existing handles (locks) on ``child`` stay valid and the
        new node inherits ``child.lock_ref`` (every lock on child covers new too)."""
        ck = child.key
        cv = child.value
        mb = 4 * m
        new = TreeNode(ck[:mb], cv[:m], child.parent, child.last_access, self._new_id())
        new.lock_ref = child.lock_ref
        new.hit_count = child.hit_count
        child.key = rest = ck[mb:]
        child.value = cv[m:]
        child.parent.children[self._child_key(ck)] = new
        new.children[self._child_key(rest)] = child
        child.parent = new
        self._num_nodes += 1
        return new

    # ------------------------------------------------------------------ walk
    def _descend(self, root: TreeNode, ids, q: bytes, n: int, stamp: int, hits: bool) -> tuple:
        """Walk down from ``root`` along ``ids[:n]`` (``q``: the same ids packed), stamping
        every node passed with ``stamp`` (and counting a hit on it when ``hits``); an edge the
        query leaves midway is split there.  Returns ``(last node, tokens matched, the slot
        arrays of the nodes passed)``: what match_prefix returns and where insert attaches
        its new leaf.  Hot path: kept flat, locals only."""
        ps = self.page_size
        node = root
        children = root.children
        pos = 0
        values = []
        while pos < n:
            child = children.get(ids[pos] if ps == 1 else tuple(ids[pos : pos + ps]))
            if child is None:
                break
            ck = child.key
            end = pos + (len(ck) >> 2)
            if end <= n and q.startswith(ck, pos << 2):
                child.last_access = stamp
                if hits:
                    child.hit_count += 1
                values.append(child.value)
                node = child
                children = child.children
                pos = end
                continue
            m = _common_prefix_tokens(ck, q, pos << 2, len(ck) if end <= n else (n - pos) << 2)
            m -= m % ps  # >= one page: the child was found by its first page
            node = self._split(child, m)
            node.last_access = stamp
            if hits:
                node.hit_count += 1
            values.append(node.value)
            pos += m
            break  # the next token/page differs from the only candidate, or the query ended
        return node, pos, values

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``token_ids`` under ``salt``.

        Refreshes the LRU stamp and bumps the hit count of every node on the matched path.
        If the match ends inside an edge, that edge is split so that ``r.node`` covers
        exactly the matched tokens (locking it then protects exactly ``r.indices``).
        ``r.indices`` is a fresh 1-D int64 tensor (never aliases the tree's storage)."""
        ids, q = _pack(token_ids)
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            return _new_match(MatchResult, (empty_indices(), 0, self._default_root))
        n = len(ids)
        n -= n % self.page_size
        self._clock = stamp = self._clock + 1
        node, pos, values = self._descend(root, ids, q, n, stamp, True)
        if not values:
            return _new_match(MatchResult, (empty_indices(), 0, node))
        if len(values) == 1:
            return _new_match(MatchResult, (_from_numpy(values[0].copy()), pos, node))
        return _new_match(MatchResult, (_from_numpy(_concat(values)), pos, node))

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None) -> int:
        """Cache ``token_ids`` (whole pages only) with slots ``indices``.

        Returns ``n``, the number of leading tokens that were already cached before the call.
        The tree keeps its own slots for those and takes (a copy of) ``indices[n:A]`` with
        ``A = cacheable_length(len(token_ids))``; the caller still owns ``indices[:n]``
        (minus the slots it got from ``match_prefix``, which are the tree's) and
        ``indices[A:]`` and must free them.  Refreshes LRU stamps along the path."""
        ids, q = _pack(token_ids)
        n = len(ids)
        # Fast path for what the engine passes: a 1-D int64 CPU tensor.  numpy attribute
        # reads are ~2x cheaper than torch's, so the checks run on the numpy view; anything
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
        node, pos, _ = self._descend(root, ids, q, n, stamp, False)
        if pos < n:
            self._next_id = nid = self._next_id + 1
            # Inline construction (no __init__ call): this runs once per request.
            leaf = _new_node(TreeNode)
            leaf.key = q[pos << 2 : n << 2]
            leaf.value = arr[pos:n].copy()
            leaf.children = {}
            leaf.parent = node
            leaf.lock_ref = 0
            leaf.last_access = stamp
            leaf.hit_count = 0
            leaf.id = nid
            leaf.salt = None
            node.children[ids[pos] if ps == 1 else tuple(ids[pos : pos + ps])] = leaf
            self._evictable += n - pos
            self._num_nodes += 1
            leaf.in_heap = True
            self._fresh.append(leaf)
            if self.listener is not None:
                self.listener(CacheEvent(STORED, salt, q[: n << 2], n - pos))
        return pos

    # ------------------------------------------------------------------ locks
    @staticmethod
    def _check_handle(node: Any) -> None:
        if type(node) is not TreeNode:
            raise ValueError(f"node must be a TreeNode handle from match_prefix, got {type(node).__name__}")
        if node.key is None:
            raise ValueError("node has been evicted or reset; its handle is no longer valid")

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and all its ancestors from eviction (ref-counted)."""
        self._check_handle(node)
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                delta += len(node.value)
            node.lock_ref += 1
            node = node.parent
        self._evictable -= delta
        self._protected += delta

    def unlock(self, node: TreeNode) -> None:
        """Release one lock taken with :meth:`lock` on the same node."""
        self._check_handle(node)
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r} without a matching lock")
        delta = 0
        heap = self._heap
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.value)
                if not node.children and not node.in_heap:
                    node.in_heap = True
                    _heappush(heap, (node.last_access, node.id, node))
            node = node.parent
        self._evictable += delta
        self._protected -= delta

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free whole unlocked leaves, least recently used first, until ``num_tokens``
        tokens are freed or nothing evictable is left.  A parent that loses its last
        child becomes a candidate.  Freed slots go to ``on_free`` in one call."""
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
        child_key = self._child_key
        while freed < num_tokens and heap:
            stamp, _, node = _heappop(heap)
            node.in_heap = False
            if node.lock_ref or node.children:
                continue  # not a candidate any more; re-pushed when it becomes one again
            if stamp != node.last_access:
                node.in_heap = True
                _heappush(heap, (node.last_access, node.id, node))
                continue
            parent = node.parent
            if self.listener is not None:
                self.listener(CacheEvent(REMOVED, self._salt_of(node), self._path_bytes(node),
                                         len(node.value)))
            del parent.children[child_key(node.key)]
            arrays.append(node.value)
            freed += len(node.value)
            node.key = None
            node.parent = None
            node.children = {}
            self._num_nodes -= 1
            if parent.parent is not None:
                if not parent.children and parent.lock_ref == 0 and not parent.in_heap:
                    parent.in_heap = True
                    _heappush(heap, (parent.last_access, parent.id, parent))
            elif not parent.children and parent.salt is not None:
                del self._roots[parent.salt]  # empty salted namespace: do not accumulate roots
        if freed:
            self._evictable -= freed
            self.evicted_tokens += freed
            self.on_free(_from_numpy(arrays[0] if len(arrays) == 1 else _concat(arrays)))
        return freed

    def reset(self) -> None:
        """Drop the whole tree, handing every slot back through ``on_free`` (one call).

        Raises RuntimeError and changes nothing if any node is locked.  Outstanding
        handles to non-root nodes become invalid (lock/unlock on them raise ValueError);
        root handles (misses) stay harmless no-ops."""
        if self._protected:
            raise RuntimeError(
                f"reset() while {self._protected} tokens are locked by running requests"
            )
        arrays = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                arrays.append(node.value)
                stack.extend(node.children.values())
                node.key = None
                node.parent = None
                node.children = {}
            # Roots stay valid objects (a request may still hold a no-op "lock" on one).
        self._init_state()
        if self.listener is not None:
            self.listener(CacheEvent(CLEARED, None, b"", 0))
        if arrays:
            self.on_free(_from_numpy(_concat(arrays)))

    # ------------------------------------------------------------------ introspection
    @staticmethod
    def _path_bytes(node: TreeNode) -> bytes:
        """Packed tokens from the root through ``node`` (walks up: events and snapshots only)."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return b"".join(reversed(keys))

    @staticmethod
    def _salt_of(node: TreeNode) -> Hashable:
        while node.parent is not None:
            node = node.parent
        return node.salt


    def snapshot_events(self) -> List[CacheEvent]:
        """``stored`` events that rebuild the current contents from empty (parents first):
        what a mirror that (re)connects replays before the live stream."""
        return radix_introspect.snapshot_events(self)

    def held_slots(self) -> torch.Tensor:
        return radix_introspect.held_slots(self)

    def _iter_nodes(self):  # noqa: ANN202
        return radix_introspect.iter_nodes(self)

    def as_dict(self, salt: Hashable = None) -> dict:
        """The tree of one namespace as nested ``{tuple(edge tokens): {...children}}``."""
        return radix_introspect.as_dict(self, salt)

    def dump(self, max_tokens: int = 8) -> str:
        """One line per node: id, edge tokens (abbreviated), slots, lock, hits, stamp."""
        return radix_introspect.dump(self, max_tokens)

    def check_integrity(self) -> None:
        """Verify structure, sizes, lock counts, slot uniqueness and the eviction heap."""
        radix_introspect.check_integrity(self)
