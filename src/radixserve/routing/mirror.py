"""Per-worker mirrors of the workers' radix trees, rebuilt from their own cache events.

:class:`TokenTree` is the cache's own radix tree (:class:`radixserve.cache.tree.RadixTree`:
same packed keys, same page-aligned children, one root per salt) without KV: a node carries
only its token run and, in ``lock_ref``, how many inserted paths pass through it. It answers
``match`` (longest held page-aligned prefix) in one walk, fast enough to run per request for
every worker. Its updates are not a cache's: a mirror removes exactly the leaf run the
worker evicted (the worker decided; the mirror runs no LRU of its own), and the router's
in-flight overlay inserts and discards reference-counted paths.

:class:`WorkerMirror` holds one tree per storage tier (``L1`` device KV, ``L2`` host, ``L3``
storage) and the sequencing state of the event stream: a snapshot makes it *synced*; a batch
whose sequence number or epoch does not follow makes it *stale* (the caller asks the worker
for a new snapshot and routes by load meanwhile); so does an event that does not fit what
the mirror holds.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, Optional, Set, Tuple, Union

from radixserve.cache.events import CLEARED, REMOVED, STORED
from radixserve.cache.tree import Node, RadixTree

__all__ = ["TokenTree", "WorkerMirror", "TIERS", "pack", "MirrorStatus"]

#: Storage tiers, fastest first: a hit in a later tier costs a load, not a recompute.
TIERS = ("L1", "L2", "L3")


def pack(tokens: Union[Iterable[int], bytes]) -> bytes:
    """Token ids packed as native ``uint32`` (what the worker's tree and events use)."""
    if isinstance(tokens, bytes):
        return tokens
    a = array("I")
    a.fromlist(list(tokens))
    return a.tobytes()


class TokenTree(RadixTree):
    """Radix tree of token runs per salt, at page granularity, holding no KV.

    Two uses with two sets of operations (do not mix them on one tree):

    * a mirror: :meth:`insert` a path, :meth:`remove_tail` the run a worker evicted;
    * a multiset of in-flight prompts: :meth:`insert` (counts +1 along the path) and
      :meth:`discard` (counts -1; nodes no path passes through any more are dropped).
    """

    def __init__(self, page_size: int = 1) -> None:
        super().__init__(page_size)
        self.num_tokens = 0

    def clear(self) -> None:
        self._init_tree()
        self.num_tokens = 0

    @property
    def roots(self) -> Dict[Hashable, Node]:
        """The namespaces that hold something."""
        return {s: r for s, r in self._roots.items() if r.children}

    def _aligned(self, q: bytes) -> Tuple[array, int]:
        n = len(q) >> 2
        return array("I", q[: n << 2]), n - n % self.page_size

    # ------------------------------------------------------------------ queries
    def match(self, q: bytes, salt: Hashable = None) -> int:
        """Tokens of the longest held page-aligned prefix of ``q`` (packed) under ``salt``."""
        root = self._roots.get(salt)
        if root is None or not root.children:
            return 0
        ids, n = self._aligned(q)
        return self._peek(root, ids, q, n)[1]

    # ------------------------------------------------------------------ updates
    def insert(self, q: bytes, salt: Hashable = None) -> int:
        """Hold ``q`` (whole pages); returns the tokens that were held before the call.
        Every node on the path gets one more reference."""
        ids, n = self._aligned(q)
        if n == 0:
            return 0
        pos = self.add_path(ids, q, n, salt)[1]
        self.num_tokens += n - pos
        return pos

    def remove_tail(self, q: bytes, length: int, salt: Hashable = None) -> bool:
        """Stop holding the last ``length`` tokens of ``q``, which must end at a leaf.

        Returns False (changing nothing) if the tree does not hold ``q`` or holds something
        below it: the mirror disagrees with the worker and must be rebuilt."""
        root = self._roots.get(salt)
        ps = self.page_size
        if root is None or length <= 0 or len(q) % (4 * ps) or length % ps or 4 * length > len(q):
            return False
        ids, n = self._aligned(q)
        node, pos = self._peek(root, ids, q, n)
        if pos != n or node is root or node.children:
            return False
        # Dry run: the run may span several edges (the worker split where the mirror did
        # not); above the leaf, each of them must have only the child we came from.
        remaining = length
        cur = node
        while remaining > cur.num_tokens:
            remaining -= cur.num_tokens
            cur = cur.parent
            if cur.parent is None or len(cur.children) != 1:
                return False
        remaining = length
        cur = node
        while remaining:
            k = cur.num_tokens
            if k > remaining:
                cur.key = cur.key[: (k - remaining) << 2]
                break
            remaining -= k
            cur = self._unlink(cur)
        self.num_tokens -= length
        return True

    def discard(self, q: bytes, salt: Hashable = None) -> None:
        """Undo one :meth:`insert` of ``q`` (reference-counted use)."""
        root = self._roots.get(salt)
        if root is None:
            return
        ids, n = self._aligned(q)
        node, pos = self._peek(root, ids, q, n)
        if pos != n or node is root:
            return  # never inserted (or already discarded): nothing to undo
        dropped = []
        self._unlock_path(node, dropped)
        for x in dropped:  # deepest first: each is a leaf once the ones below are gone
            for sub in list(self._subtree(x)):
                self.num_tokens -= sub.num_tokens
                self._unlink(sub)

    def _subtree(self, node: Node):
        """``node`` and everything below it, children before parents."""
        order = [node]
        i = 0
        while i < len(order):
            order.extend(order[i].children.values())
            i += 1
        return reversed(order)

    # ------------------------------------------------------------------ introspection
    def leaf_paths(self) -> Set[Tuple[Hashable, bytes]]:
        """``(salt, packed path)`` of every leaf: the set of held sequences is exactly the
        page-aligned prefixes of these, so two trees hold the same iff these sets agree."""
        return {(salt, path) for salt, path, nd in self.iter_paths() if not nd.children}


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
