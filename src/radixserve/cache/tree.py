"""The one radix tree: token runs on edges, one root per salt, page-aligned keys.

Every prefix structure in radixserve is this tree: the KV cache (:class:`.radix.RadixCache`)
and its extensions (tiers, sliding-window KV, Mamba state), the router's mirror of a worker's
cache (:class:`radixserve.placement.mirror.TokenTree`) and affinity tree, and the scheduler's
DFS order over the waiting queue. What a node carries beside its run is added through
:class:`Component` (its node slots, how its data divides when an edge splits, how much of a
matched path it serves). All walk with the one loop, :meth:`RadixTree._descend`.

Why the walk looks the way it does
----------------------------------
* ``key`` is ``bytes``: the token ids packed as native uint32 (never tracked by the cyclic
  GC, 4 bytes per token). A query is packed once per call and an edge is compared in place
  with ``query.startswith(key, offset)`` (a memcmp: no slice built, no int object touched);
  the first mismatch (once per split) is found by XOR-ing the two runs read as big integers.
* Children are found by their first token (page_size 1, read straight from the query's id
  list) or by their first page's packed bytes (a slice of the packed query: one small bytes
  object hashed at C speed instead of a tuple of ``page_size`` int objects). All keys are
  page-aligned, so two siblings never share a first page.
* ``lock_ref`` of a node counts the locks held on it or on any descendant, so a lock on a
  node protects its whole root path.
* A split keeps the lower half's identity, so handles (locks, a request's last node) on the
  child stay valid and still end where they ended.
"""

from __future__ import annotations

from array import array
from typing import Any, Dict, Hashable, Iterator, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from .base import check_page_size
from .packed import common_prefix_at, pack

__all__ = ["Node", "RadixTree", "Component"]

_array = array
#: The stamp of a walk that touches nothing: below every stamp a node can have (the radix
#: cache's low-priority class included).
_NO_STAMP = -(1 << 64)


class Node:
    """One edge of the tree (the edge *into* this node) plus what every use needs; ``key`` is
    ``None`` once the node has left the tree: a handle to it is dead."""

    __slots__ = (
        "key",  # bytes: tokens of this edge packed as uint32 (b"" for a root); None once dead
        "value",  # np.ndarray[int64] of KV slots, or None (no KV: a mirror, or not in L1)
        "children",  # dict: first token (or first page tuple) -> Node
        "parent",  # Node | None (None for roots and dead nodes)
        "lock_ref",  # locks held on this node or any descendant (a mirror: paths through it)
        "last_access",  # logical clock of the last match/insert through this node
        "hit_count",  # matches (or admissions) through this node
        "id",  # creation order; eviction-queue tie-breaker and debug name
        "salt",  # namespace (only meaningful on roots)
    )

    def __init__(self, key: bytes, parent: Optional["Node"], stamp: int, nid: int) -> None:
        self.key = key
        self.value: Optional[np.ndarray] = None
        self.children: Dict[Any, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = stamp
        self.hit_count = 0
        self.id = nid
        self.salt: Hashable = None

    @property
    def num_tokens(self) -> int:
        return len(self.key) >> 2 if self.key else 0

    def __repr__(self) -> str:
        if self.key is None:
            return f"{type(self).__name__}#{self.id}(dead)"
        return (f"{type(self).__name__}#{self.id}(len={self.num_tokens}, lock={self.lock_ref}, "
                f"last={self.last_access}, hits={self.hit_count}, children={len(self.children)})")


class Component(Protocol):
    """A kind of value carried by the tree's nodes beside the token run and the L1 slots (a
    lower tier's slots, a KV kind with its own lifetime, a state snapshot), with its own
    budget and eviction queue (:class:`.lru.LruQueue`). The tree calls ``split`` whenever an
    edge divides; a cache calls ``served`` to cut a matched path to what this component can
    serve, ``dropped`` when a node is evicted from the tree, ``clear`` when all is dropped."""

    def split(self, upper: Node, lower: Node, m: int) -> None:
        """``lower``'s first ``m`` tokens moved into the new node ``upper``: divide this
        component's data the same way (and queue ``upper`` where it now belongs)."""

    def served(self, path: Sequence[Node]) -> int:
        """How many nodes of ``path`` (a matched path, root side first) this component
        holds without a gap from the root."""

    def dropped(self, node: Node) -> None:
        """``node`` left the tree (full eviction): forget what it carried."""

    def clear(self, dead: Sequence[Node]) -> None:
        """The tree was emptied (``reset``); ``dead`` are the nodes it held: give back what
        they carried and start empty."""


class RadixTree:
    """Structure only: roots per salt, child lookup, split, walk, locks, unlink, scans.
    Subclasses own the values and decide eviction; ``components`` get every split."""

    node_type: type = Node
    components: Tuple[Component, ...] = ()

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = check_page_size(page_size)
        self._next_id = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self._clock = 0
        self._num_nodes = 0
        self._default_root = self._make_root(None)
        self._roots: Dict[Hashable, Node] = {None: self._default_root}

    def _make_root(self, salt: Hashable) -> Node:
        self._next_id += 1
        root = self.node_type(b"", None, 0, self._next_id)
        root.salt = salt
        return root

    def _root_for_insert(self, salt: Hashable) -> Node:
        root = self._roots.get(salt)
        if root is None:
            hash(salt)  # unhashable salt -> TypeError before any state changes
            root = self._roots[salt] = self._make_root(salt)
        return root

    def _child_key(self, key: bytes) -> Any:
        """Dict key of an edge under its parent: its first token (page_size 1) or its first
        page packed, the same keys a walk builds from a query."""
        if self.page_size == 1:
            return _array("I", key[:4])[0]
        return key[: 4 * self.page_size]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def root(self) -> Node:
        """Root of the default (``salt=None``) namespace."""
        return self._default_root

    def namespaces(self) -> Iterator[Tuple[Hashable, Node]]:
        """``(salt, root)`` of every namespace the tree has a root for."""
        return iter(list(self._roots.items()))

    # ------------------------------------------------------------------ split / walk
    def _split(self, child: Node, m: int) -> Node:
        """``parent -> child[0:N]`` becomes ``parent -> new[0:m] -> child[m:N]``; return new,
        which inherits the child's lock count and stamp (every lock on child covers it)."""
        ck = child.key
        mb = 4 * m
        self._next_id += 1
        new = self.node_type(ck[:mb], child.parent, child.last_access, self._next_id)
        v = child.value
        if v is not None:
            new.value = v[:m]
            child.value = v[m:]
        new.lock_ref = child.lock_ref
        new.hit_count = child.hit_count
        child.key = rest = ck[mb:]
        child.parent.children[self._child_key(ck)] = new
        new.children[self._child_key(rest)] = child
        child.parent = new
        self._num_nodes += 1
        for c in self.components:
            c.split(new, child, m)
        return new

    def _descend(self, root: Node, ids: Any, q: bytes, n: int, stamp: Optional[int] = None,
                 hits: bool = False, cut: bool = True, pos: int = 0) -> tuple:
        """The tree's one walk: down from ``root`` (which holds ``ids[:pos]``) along
        ``ids[pos:n]`` (``q``: the same ids packed); returns ``(last node, tokens matched,
        nodes passed)``. ``stamp``: raise every node passed to at least this stamp (and count
        a hit when ``hits``); None touches nothing. ``cut``: an edge the query leaves midway is
        split there and its upper part ends the path; without ``cut`` the tokens shared with
        that edge count as matched, but the node returned is the last one passed whole. Hot
        path: kept flat, locals only."""
        ps = self.page_size
        if stamp is None:
            stamp = _NO_STAMP
        node = root
        children = root.children
        path: List[Node] = []
        while pos < n:
            child = children.get(ids[pos] if ps == 1 else q[pos << 2 : (pos + ps) << 2])
            if child is None:
                break
            ck = child.key
            end = pos + (len(ck) >> 2)
            if end <= n and q.startswith(ck, pos << 2):
                pos = end
            else:
                m = common_prefix_at(ck, q, pos << 2, len(ck) if end <= n else (n - pos) << 2)
                m -= m % ps  # >= one page: the child was found by its first page
                if not cut:
                    return node, pos + m, path
                child = self._split(child, m)
                pos += m
                n = pos  # the next token/page differs from the only candidate, or the query ended
            if child.last_access < stamp:
                child.last_access = stamp
            if hits:
                child.hit_count += 1
            path.append(child)
            node = child
            children = child.children
        return node, pos, path

    def _match_served(self, token_ids: Any, salt: Hashable, hits: bool, comp: Component) -> tuple:
        """Walk a query as a match does (stamps, a split where it ends inside an edge) and cut
        the path to what ``comp`` serves. Returns ``(the served part's runs of slots, its
        tokens, the node it ends at, tokens walked, the deepest node walked)``."""
        ids, q = pack(token_ids)
        root = self._default_root if salt is None else self._roots.get(salt)
        if root is None:
            return (), 0, self._default_root, 0, self._default_root
        n = len(ids)
        n -= n % self.page_size
        self._clock = stamp = self._clock + 1
        node, pos, path = self._descend(root, ids, q, n, stamp, hits)
        k = comp.served(path)
        if not k:
            return (), 0, root, pos, node
        vals = [nd.value for nd in path[:k]]
        return vals, sum(map(len, vals)), path[k - 1], pos, node

    def reach_elsewhere(self, q: bytes, salt: Hashable, pos: int, end: int, most: int = 16) -> int:
        """How far ``q[:end]`` (packed) is held under a namespace other than ``salt`` (at least
        ``pos``), looking at ``most`` namespaces at most: bounded work per call."""
        ids = array("I", q[: end << 2])
        best = pos
        for i, (s, root) in enumerate(self._roots.items()):
            if i >= most:
                break
            if s != salt and root.children:
                best = max(best, self._peek(root, ids, q, end)[1])
        return best

    def _peek(self, root: Node, ids: Any, q: bytes, n: int) -> Tuple[Node, int]:
        """Deepest node whose path is a prefix of ``ids[:n]`` and the tokens of ``ids[:n]``
        held under ``root``, without touching the tree (no stamps, no splits)."""
        node, pos, _ = self._descend(root, ids, q, n, None, False, False)
        return node, pos

    def _attach(self, node: Node, ids: Any, q: bytes, pos: int, n: int, stamp: int) -> Node:
        """A new leaf under ``node`` holding ``ids[pos:n]`` (no value yet)."""
        self._next_id = nid = self._next_id + 1
        leaf = self.node_type(q[pos << 2 : n << 2], node, stamp, nid)
        node.children[ids[pos] if self.page_size == 1 else q[pos << 2 : (pos + self.page_size) << 2]] = leaf
        self._num_nodes += 1
        return leaf

    def add_path(self, ids: Any, q: bytes, n: int, salt: Hashable = None) -> Tuple[Node, int]:
        """Hold ``ids[:n]`` (``q`` packed; ``n`` whole pages) with one more reference on every
        node of its path, for trees that count paths instead of holding KV (the router's
        mirror, the scheduler's DFS order); return the node ending at ``n``, the tokens held before."""
        root = self._root_for_insert(salt)
        node, pos, _ = self._descend(root, ids, q, n)
        if pos < n:
            node = self._attach(node, ids, q, pos, n, 0)
        self._lock_path(node)
        return node, pos

    def _unlink(self, node: Node) -> Node:
        """Take a childless node out of the tree (its data already handed back); return its
        parent. An emptied salted root goes too, unless something is pinned on it."""
        parent = node.parent
        del parent.children[self._child_key(node.key)]
        node.key = node.parent = node.value = None
        node.children = {}
        self._num_nodes -= 1
        if parent.parent is None and not parent.children:
            self._drop_root(parent)
        return parent

    def _drop_root(self, root: Node) -> None:
        """Forget an emptied salted namespace (roots must not accumulate), unless a subclass
        says something is about to hang from it (:meth:`_root_in_use`)."""
        if root.salt is not None and not self._root_in_use(root) and self._roots.get(root.salt) is root:
            del self._roots[root.salt]

    def _root_in_use(self, root: Node) -> bool:
        """Hook: whether an empty ``root`` must stay (the tiered tree pins it in a transfer)."""
        return False

    # ------------------------------------------------------------------ locks
    def _check_handle(self, node: Any) -> None:
        if type(node) is not self.node_type:
            raise ValueError(f"node must be a {self.node_type.__name__} handle from match_prefix, "
                             f"got {type(node).__name__}")
        if node.key is None:
            raise ValueError("node has been evicted or reset; its handle is no longer valid")

    @staticmethod
    def _lock_path(node: Node) -> int:
        """One more lock on ``node``'s root path; returns the tokens that became locked."""
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                delta += len(node.key) >> 2
            node.lock_ref += 1
            node = node.parent
        return delta

    @staticmethod
    def _unlock_path(node: Node, released: List[Node]) -> int:
        """One lock less on ``node``'s root path; the nodes it freed go to ``released``, their
        tokens are returned."""
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r} without a matching lock")
        delta = 0
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.key) >> 2
                released.append(node)
            node = node.parent
        return delta

    # ------------------------------------------------------------------ scans
    @staticmethod
    def path_bytes(node: Node) -> bytes:
        """Packed tokens from the root through ``node`` (walks up: events and scans only)."""
        keys = []
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return b"".join(reversed(keys))

    @staticmethod
    def salt_of(node: Node) -> Hashable:
        while node.parent is not None:
            node = node.parent
        return node.salt

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    def iter_paths(self) -> Iterator[Tuple[Hashable, bytes, Node]]:
        """``(salt, packed path through the node, node)`` for every non-root node, parents
        first: what a snapshot of the tree as events is made of."""
        for salt, root in self._roots.items():
            stack = [(c, b"") for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                path = prefix + node.key
                yield salt, path, node
                stack.extend((c, path) for c in node.children.values())

    def _detach_all(self) -> List[Node]:
        """Kill every non-root node (handles to them go dead) and start empty; return them."""
        dead = list(self.iter_nodes())
        for node in dead:
            node.key = node.parent = None
            node.children = {}
        self._init_tree()
        return dead

    def check_structure(self) -> List[Node]:
        """Structural invariants shared by every use (parent links, child keys, whole-page
        keys, stamps and lock counts monotone towards the root); returns the non-root
        nodes for the caller's own checks."""
        ps = self.page_size
        if self._roots.get(None) is not self._default_root:
            raise AssertionError("default root missing")
        nodes: List[Node] = []
        for salt, root in self._roots.items():
            if root.parent is not None or root.key != b"" or root.salt != salt:
                raise AssertionError(f"bad root for salt {salt!r}")
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for ck, child in node.children.items():
                    if child.parent is not node:
                        raise AssertionError(f"{child!r}: parent pointer broken")
                    if not child.key:
                        raise AssertionError(f"{child!r}: empty/dead key in the tree")
                    if type(child.key) is not bytes or len(child.key) % (4 * ps):
                        raise AssertionError(f"{child!r}: key not whole pages")
                    if ck != self._child_key(child.key):
                        raise AssertionError(f"{child!r}: stored under the wrong child key {ck!r}")
                    if node.parent is not None and child.last_access > node.last_access:
                        raise AssertionError(f"{child!r}: newer than its parent {node!r}")
                    child_locks += child.lock_ref
                    stack.append(child)
                if node.parent is not None:
                    if node.lock_ref < child_locks:
                        raise AssertionError(f"{node!r}: lock_ref below the sum of its children's")
                    nodes.append(node)
        if len(nodes) != self._num_nodes:
            raise AssertionError(f"num_nodes {self._num_nodes} != {len(nodes)}")
        return nodes
