"""Per-worker mirrors of the workers' radix trees, rebuilt from their own cache events.

:class:`TokenTree` is a radix tree over packed ``uint32`` token runs (the worker's own key
format), one root per salt, children keyed by their first page: two page-aligned runs may
share their first tokens and still be siblings, so a token-level trie would merge what the
worker keeps apart. It answers ``match`` (longest held page-aligned prefix) in one walk of
``bytes.startswith`` comparisons, fast enough to run per request for every worker.

It does not reuse :class:`radixserve.cache.RadixCache`: a mirror needs "remove exactly this
leaf run" (the worker decided what to evict; the mirror must not run its own LRU) and
reference counts (for the router's in-flight overlay), neither of which a cache has.

:class:`WorkerMirror` holds one tree per storage tier (``L1`` device KV now; ``L2`` host and
``L3`` storage from the hierarchical cache later) and the sequencing state of the event
stream: a snapshot makes it *synced*; a batch whose sequence number or epoch does not follow
makes it *stale* (the caller asks the worker for a new snapshot and routes by load
meanwhile); so does an event that does not fit what the mirror holds.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Set, Tuple, Union

from radixserve.cache.events import CLEARED, REMOVED, STORED

__all__ = ["TokenTree", "WorkerMirror", "TIERS", "pack", "MirrorStatus"]

#: Storage tiers, fastest first: a hit in a later tier costs a load, not a recompute.
TIERS = ("L1", "L2", "L3")

_from_bytes = int.from_bytes


def pack(tokens: Union[Iterable[int], bytes]) -> bytes:
    """Token ids packed as native ``uint32`` (what the worker's tree and events use)."""
    if isinstance(tokens, bytes):
        return tokens
    a = array("I")
    a.fromlist(list(tokens))
    return a.tobytes()


def _common_tokens(a: bytes, b: bytes, off: int, lim: int) -> int:
    """Whole tokens that ``a[:lim]`` and ``b[off:off + lim]`` share (``lim`` in bytes):
    the lowest set bit of the XOR of the two runs read as integers marks the first
    difference (C speed, no per-token loop)."""
    x = _from_bytes(a[:lim], "little") ^ _from_bytes(b[off : off + lim], "little")
    if not x:
        return lim >> 2
    return ((x & -x).bit_length() - 1) >> 5


class _Node:
    __slots__ = ("key", "children", "parent", "count")

    def __init__(self, key: bytes, parent: Optional["_Node"]) -> None:
        self.key = key  # packed tokens of the edge into this node (b"" for a root)
        self.children: Dict[bytes, _Node] = {}  # first page (packed) -> child
        self.parent = parent
        self.count = 0  # inserted paths through this node (reference-counted use only)


class TokenTree:
    """Radix tree of token runs per salt, at page granularity.

    Two uses with two sets of operations (do not mix them on one tree):

    * a mirror: :meth:`insert` a path, :meth:`remove_tail` the run a worker evicted;
    * a multiset of in-flight prompts: :meth:`insert` (counts +1 along the path) and
      :meth:`discard` (counts -1; nodes no path passes through any more are dropped).
    """

    def __init__(self, page_size: int = 1) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.page_size = page_size
        self._pb = 4 * page_size  # bytes per page
        self.roots: Dict[Hashable, _Node] = {}
        self.num_tokens = 0
        self.num_nodes = 0

    def clear(self) -> None:
        self.roots.clear()
        self.num_tokens = 0
        self.num_nodes = 0

    # ------------------------------------------------------------------ walk
    def _walk(self, root: _Node, q: bytes, n: int, split: bool) -> Tuple[_Node, int, List[_Node]]:
        """Follow ``q[:n]`` (bytes, page-aligned) from ``root``. Returns ``(node, matched
        bytes, nodes passed)``. A match ending inside an edge splits it when ``split``
        (so the returned node ends exactly there) and otherwise returns the partially
        matched child with the matched length counting only its common part."""
        pb = self._pb
        node = root
        pos = 0
        path: List[_Node] = []
        while pos < n:
            child = node.children.get(q[pos : pos + pb])
            if child is None:
                break
            ck = child.key
            end = pos + len(ck)
            if end <= n and q.startswith(ck, pos):
                node = child
                path.append(child)
                pos = end
                continue
            m = _common_tokens(ck, q, pos, min(len(ck), n - pos)) * 4
            m -= m % pb  # >= one page: the child was found by its first page
            if split:
                node = self._split(child, m)
                path.append(node)
            else:
                path.append(child)
            pos += m
            break
        return node, pos, path

    def _split(self, child: _Node, m: int) -> _Node:
        """``parent -> child[0:N]`` becomes ``parent -> new[0:m] -> child[m:N]`` (bytes)."""
        parent = child.parent
        new = _Node(child.key[:m], parent)
        new.count = child.count
        rest = child.key[m:]
        parent.children[child.key[: self._pb]] = new
        child.key = rest
        child.parent = new
        new.children[rest[: self._pb]] = child
        self.num_nodes += 1
        return new

    # ------------------------------------------------------------------ queries
    def match(self, q: bytes, salt: Hashable = None) -> int:
        """Tokens of the longest held page-aligned prefix of ``q`` (packed) under ``salt``."""
        root = self.roots.get(salt)
        if root is None:
            return 0
        n = len(q)
        n -= n % self._pb
        return self._walk(root, q, n, False)[1] >> 2

    # ------------------------------------------------------------------ updates
    def insert(self, q: bytes, salt: Hashable = None) -> int:
        """Hold ``q`` (whole pages); returns the tokens that were held before the call.
        Every node on the path gets one more reference."""
        n = len(q)
        n -= n % self._pb
        if n == 0:
            return 0
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = _Node(b"", None)
        node, pos, path = self._walk(root, q, n, True)
        for p in path:
            p.count += 1
        if pos < n:
            leaf = _Node(q[pos:n], node)
            leaf.count = 1
            node.children[q[pos : pos + self._pb]] = leaf
            self.num_tokens += (n - pos) >> 2
            self.num_nodes += 1
        return pos >> 2

    def remove_tail(self, q: bytes, length: int, salt: Hashable = None) -> bool:
        """Stop holding the last ``length`` tokens of ``q``, which must end at a leaf.

        Returns False (changing nothing) if the tree does not hold ``q`` or holds something
        below it: the mirror disagrees with the worker and must be rebuilt."""
        root = self.roots.get(salt)
        pb = self._pb
        if root is None or length <= 0 or len(q) % pb or (4 * length) % pb or 4 * length > len(q):
            return False
        node, pos, path = self._walk(root, q, len(q), False)
        if pos != len(q) or not path or node.children:
            return False
        # Dry run: the run may span several edges (the worker split where the mirror did
        # not); above the leaf, each of them must have only the child we came from.
        remaining = 4 * length
        cur = path[-1]
        while remaining > len(cur.key):
            remaining -= len(cur.key)
            cur = cur.parent
            if cur is None or cur.parent is None or len(cur.children) != 1:
                return False
        remaining = 4 * length
        cur = path[-1]
        while remaining:
            k = len(cur.key)
            if k > remaining:
                cur.key = cur.key[: k - remaining]
                remaining = 0
                break
            parent = cur.parent
            del parent.children[cur.key[:pb]]
            cur.parent = None
            self.num_nodes -= 1
            remaining -= k
            cur = parent
        self.num_tokens -= length
        if not root.children:
            del self.roots[salt]
        return True

    def discard(self, q: bytes, salt: Hashable = None) -> None:
        """Undo one :meth:`insert` of ``q`` (reference-counted use)."""
        root = self.roots.get(salt)
        if root is None:
            return
        n = len(q)
        n -= n % self._pb
        _, pos, path = self._walk(root, q, n, False)
        if pos != n:
            return  # never inserted (or already discarded): nothing to undo
        for p in path:
            p.count -= 1
        for p in reversed(path):
            if p.count > 0:
                break
            parent = p.parent
            del parent.children[p.key[: self._pb]]
            p.parent = None
            self.num_tokens -= len(p.key) >> 2
            self.num_nodes -= 1
            self._drop_subtree(p)
        if not root.children:
            del self.roots[salt]

    def _drop_subtree(self, node: _Node) -> None:
        stack = list(node.children.values())
        while stack:
            c = stack.pop()
            self.num_tokens -= len(c.key) >> 2
            self.num_nodes -= 1
            stack.extend(c.children.values())
        node.children = {}

    # ------------------------------------------------------------------ introspection
    def leaf_paths(self) -> Set[Tuple[Hashable, bytes]]:
        """``(salt, packed path)`` of every leaf: the set of held sequences is exactly the
        page-aligned prefixes of these, so two trees hold the same iff these sets agree."""
        out: Set[Tuple[Hashable, bytes]] = set()
        for salt, root in self.roots.items():
            stack = [(c, c.key) for c in root.children.values()]
            while stack:
                node, path = stack.pop()
                if not node.children:
                    out.add((salt, path))
                stack.extend((c, path + c.key) for c in node.children.values())
        return out


def leaf_paths_of_events(events: Iterable) -> Dict[str, Set[Tuple[Hashable, bytes]]]:
    """Leaf paths per tier of a snapshot's ``stored`` events, computed without a tree (an
    independent check of a mirror). A snapshot has one event per node, so a node's path is
    a leaf iff it is nobody's parent path (``tokens[:-length]``)."""
    paths: Dict[str, Set[Tuple[Hashable, bytes]]] = {}
    parents: Dict[str, Set[Tuple[Hashable, bytes]]] = {}
    for ev in events:
        tok = bytes(ev.tokens)
        paths.setdefault(ev.tier, set()).add((ev.salt, tok))
        parents.setdefault(ev.tier, set()).add((ev.salt, tok[: len(tok) - 4 * ev.length]))
    return {tier: p - parents[tier] for tier, p in paths.items()}


@dataclass
class MirrorStatus:
    synced: bool = False
    epoch: Optional[int] = None
    seq: int = 0
    resyncs: int = 0  # snapshots applied after the first
    gaps: int = 0  # sequence or epoch breaks seen
    mismatches: int = 0  # events that did not fit the mirror
    events: int = 0
    last_message: float = 0.0


class WorkerMirror:
    """What one worker holds, per tier, plus the state of its event stream.

    ``apply_message(msg)`` takes a decoded :class:`~radixserve.kv_events.Batch` or
    :class:`~radixserve.kv_events.Snapshot` and returns True when the mirror needs a new
    snapshot (it is then stale until one is applied).
    """

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.trees: Dict[str, TokenTree] = {}
        self.status = MirrorStatus()
        self.load = None  # the worker's last Load record

    @property
    def synced(self) -> bool:
        return self.status.synced

    def tree(self, tier: str = "L1") -> TokenTree:
        t = self.trees.get(tier)
        if t is None:
            t = self.trees[tier] = TokenTree(self.page_size)
        return t

    def invalidate(self) -> None:
        """Forget everything (worker down or restarted): stale until the next snapshot."""
        self.status.synced = False
        for t in self.trees.values():
            t.clear()

    # ------------------------------------------------------------------ events
    def apply_event(self, ev) -> bool:
        """Apply one event; False if it does not fit what the mirror holds."""
        tree = self.tree(ev.tier)
        if ev.kind == STORED:
            before = tree.insert(ev.tokens, ev.salt)
            n = len(ev.tokens) >> 2
            n -= n % self.page_size
            return before == n - ev.length
        if ev.kind == REMOVED:
            return tree.remove_tail(ev.tokens, ev.length, ev.salt)
        if ev.kind == CLEARED:
            tree.clear()
            return True
        return False

    def apply_message(self, msg, now: float = 0.0) -> bool:
        """Apply a Batch or Snapshot; True if a (new) snapshot is needed."""
        st = self.status
        st.last_message = now
        if type(msg).__name__ == "Snapshot":
            if msg.page_size != self.page_size:
                self.page_size = msg.page_size
                self.trees = {}
            else:
                for t in self.trees.values():
                    t.clear()
            if st.epoch is not None:
                st.resyncs += 1
            st.epoch = msg.epoch
            st.seq = msg.seq
            ok = True
            for ev in msg.events:
                ok = self.apply_event(ev) and ok
            st.events += len(msg.events)
            self.load = msg.load
            if not ok:
                st.mismatches += 1
                st.synced = False
                return True
            st.synced = True
            return False
        # A batch.
        if not st.synced:
            return False  # waiting for the snapshot already asked for: ignore the stream
        if msg.epoch != st.epoch or msg.seq != st.seq + 1 or msg.page_size != self.page_size:
            st.gaps += 1
            st.synced = False
            return True
        st.seq = msg.seq
        if msg.load is not None:
            self.load = msg.load
        for ev in msg.events:
            if not self.apply_event(ev):
                st.mismatches += 1
                st.synced = False
                return True
        st.events += len(msg.events)
        return False

    # ------------------------------------------------------------------ queries
    def match(self, q: bytes, salt: Hashable = None) -> Dict[str, int]:
        """Held prefix length of ``q`` per tier (tiers holding nothing are left out)."""
        return {tier: t.match(q, salt) for tier, t in self.trees.items() if t.roots}

    def held_tokens(self, tier: str = "L1") -> int:
        t = self.trees.get(tier)
        return t.num_tokens if t is not None else 0
