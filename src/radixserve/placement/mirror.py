"""Per-worker mirrors of the workers' radix trees, rebuilt from their own cache events.

:class:`TokenTree` is the cache's own radix tree (:class:`radixserve.cache.tree.RadixTree`:
same packed keys, same page-aligned children, one root per salt) without KV: a node carries
only its token run and, in ``lock_ref``, how many inserted paths pass through it. It answers
``match`` (longest held page-aligned prefix) in one walk, fast enough to run per request for
every worker. Its updates are not a cache's: a mirror removes exactly the leaf run the
worker evicted (the worker decided; the mirror runs no LRU of its own), and the router's
in-flight overlay inserts and discards reference-counted paths.

A hybrid model's worker (sliding-window layers) serves a prefix only where the window before
its end still has its KV. Its events say which runs are tombstones for that KV; a mirror node
keeps the flag (``swa``) and :meth:`TokenTree.match` applies the worker's own rule
(:func:`radixserve.cache.swa.served_nodes`) with the window the worker sends, so the
prediction stays exact when the worker tombstones. :meth:`TokenTree.held_prefix` ignores
tombstones (what the worker holds full KV for).

A hybrid Mamba model's worker serves a prefix only up to the deepest state snapshot on it
(:mod:`radixserve.cache.mamba`): its ``state_stored`` / ``state_dropped`` events mark node
ends (``state``; the mirror splits an edge where a snapshot ends inside it, as the worker
did), and for such a worker (``states``, sent beside the events) :meth:`TokenTree.match`
stops at the deepest marked node, so a router does not send a conversation's next turn to a
core that holds its KV but not its state.

:class:`WorkerMirror` holds one tree per storage tier (``L1`` device KV, ``L2`` host, ``L3``
storage) and the sequencing state of the event stream: a snapshot makes it *synced*; a batch
whose sequence number or epoch does not follow makes it *stale* (the caller asks the worker
for a new snapshot and routes by load meanwhile); so does an event that does not fit what
the mirror holds.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, NamedTuple, Optional, Set, Tuple, Union

from radixserve.cache.events import CLEARED, REMOVED, REVIVED, STATE_DROPPED, STATE_STORED, STORED, TOMBSTONED
from radixserve.cache.swa import served_nodes
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


class MirrorNode(Node):
    # swa: False when the worker tombstoned this run's sliding-window KV; state: True when
    # the worker keeps a Mamba state snapshot at this run's end (a split's new upper part,
    # which ends earlier, starts without one).
    __slots__ = ("state", "swa")

    def __init__(self, key: bytes, parent: Optional["MirrorNode"], stamp: int, nid: int) -> None:
        Node.__init__(self, key, parent, stamp, nid)
        self.swa = True
        self.state = False


class _WindowFlag:
    """The tombstone flag as a component: a split divides it as the worker's tree does."""

    @staticmethod
    def split(upper: MirrorNode, lower: MirrorNode, m: int) -> None:
        upper.swa = lower.swa


class _Run(NamedTuple):
    """The part of an edge a query ends inside (what the worker's split would make a node)."""

    key: bytes
    swa: bool


class TokenTree(RadixTree):
    """Radix tree of token runs per salt, at page granularity, holding no KV.

    Two uses with two sets of operations (do not mix them on one tree):

    * a mirror: :meth:`insert` a path, :meth:`remove_tail` the run a worker evicted,
      :meth:`set_window_kv` on the runs a hybrid worker tombstones or revives (``window``:
      the worker's sliding window, 0 for a worker without one), :meth:`set_state` where a
      Mamba worker takes or drops a state snapshot (``states``: the worker's matches end at
      one);
    * a multiset of in-flight prompts: :meth:`insert` (counts +1 along the path) and
      :meth:`discard` (counts -1; nodes no path passes through any more are dropped).
    """

    node_type = MirrorNode
    components = (_WindowFlag(),)

    def __init__(self, page_size: int = 1, window: int = 0, states: bool = False) -> None:
        super().__init__(page_size)
        self.num_tokens = 0
        self.tombstoned = 0  # tokens whose sliding-window KV the worker no longer holds
        self.window = window
        self.states = states

    def clear(self) -> None:
        self._init_tree()
        self.num_tokens = 0
        self.tombstoned = 0

    @property
    def roots(self) -> Dict[Hashable, Node]:
        """The namespaces that hold something."""
        return {s: r for s, r in self._roots.items() if r.children}

    def _aligned(self, q: bytes) -> Tuple[array, int]:
        n = len(q) >> 2
        return array("I", q[: n << 2]), n - n % self.page_size

    # ------------------------------------------------------------------ queries
    def match(self, q: bytes, salt: Hashable = None) -> int:
        """Tokens of the longest page-aligned prefix of ``q`` (packed) under ``salt`` the
        worker can serve: held, with the window before its end where it has one, and ending
        at a state snapshot for a Mamba worker."""
        if not self.tombstoned and not self.states:
            return self.held_prefix(q, salt)
        root = self._roots.get(salt)
        if root is None:
            return 0
        ids, n = self._aligned(q)
        path = self._walk(root, ids, q, n)
        k = served_nodes(path, self.window) if self.tombstoned else len(path)
        if self.states:
            k = max((i + 1 for i, nd in enumerate(path[:k]) if getattr(nd, "state", False)), default=0)
        return sum(len(r.key) >> 2 for r in path[:k])

    def held_prefix(self, q: bytes, salt: Hashable = None) -> int:
        """Tokens of the longest held page-aligned prefix of ``q``, tombstones or not."""
        root = self._roots.get(salt)
        if root is None or not root.children:
            return 0
        ids, n = self._aligned(q)
        return self._peek(root, ids, q, n)[1]

    def _walk(self, root: Node, ids: array, q: bytes, n: int) -> List:
        """The nodes the first ``n`` tokens of ``q`` pass, the last cut where the query leaves it (as the
        worker's match splits it), without touching the tree."""
        node, pos, path = self._descend(root, ids, q, n, None, False, False)
        full = sum(len(nd.key) for nd in path) >> 2
        if pos > full:  # the query leaves an edge midway: its shared part, as a run
            child = node.children[self._child_key(q[full << 2 : (full + self.page_size) << 2])]
            path.append(_Run(child.key[: (pos - full) << 2], child.swa))
        return path

    # ------------------------------------------------------------------ updates
    def insert(self, q: bytes, salt: Hashable = None) -> int:
        """Hold ``q`` (whole pages), one more reference on each node of its path; returns the tokens held before."""
        ids, n = self._aligned(q)
        if n == 0:
            return 0
        pos = self.add_path(ids, q, n, salt)[1]
        self.num_tokens += n - pos
        return pos

    def remove_tail(self, q: bytes, length: int, salt: Hashable = None) -> bool:
        """Stop holding the last ``length`` tokens of ``q``, which must end at a leaf. Returns
        False (changing nothing) if the tree does not hold ``q`` or holds something below it:
        the mirror disagrees with the worker and must be rebuilt."""
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
        remaining, cur = length, node
        while remaining > cur.num_tokens:
            remaining -= cur.num_tokens
            cur = cur.parent
            if cur.parent is None or len(cur.children) != 1:
                return False
        remaining, cur = length, node
        while remaining:
            k = cur.num_tokens
            if k > remaining:
                cur.key = cur.key[: (k - remaining) << 2]
                cur.state = False  # its end moved up: a snapshot there left with the run
                if not cur.swa:
                    self.tombstoned -= remaining
                break
            remaining -= k
            if not cur.swa:
                self.tombstoned -= k
            cur = self._unlink(cur)
        self.num_tokens -= length
        return True

    def set_window_kv(self, q: bytes, length: int, salt: Hashable, live: bool) -> bool:
        """The last ``length`` tokens of ``q`` (held) lost (``live`` False) or regained their
        sliding-window KV. Returns False, changing nothing, if the tree does not hold ``q``
        or some of the run is already in that state: the mirror must be rebuilt."""
        root = self._roots.get(salt)
        ps = self.page_size
        if (root is None or self.window < 2 or length <= 0 or len(q) % (4 * ps) or length % ps
                or 4 * length > len(q)):
            return False
        ids, n = self._aligned(q)
        if self._peek(root, ids, q, n)[1] != n:
            return False
        start, end = n - length, n
        for nd in reversed(self._walk(root, ids, q, n)):
            if nd.swa == live:
                return False
            end -= len(nd.key) >> 2
            if end <= start:
                break
        path = self._descend(root, ids, q, n)[2]  # splits the edge at n
        end = n
        for nd in reversed(path):
            L = nd.num_tokens
            if end - L < start:  # the run starts inside nd: split there (nd keeps the lower part)
                self._split(nd, start - (end - L))
                L = end - start
            nd.swa = live
            self.tombstoned += -L if live else L
            end -= L
            if end <= start:
                break
        return True

    def set_state(self, q: bytes, salt: Hashable, held: bool) -> bool:
        """The worker took (``held``) or dropped the state snapshot after exactly ``q``
        (held tokens). Returns False, changing nothing, if the tree does not hold ``q`` or
        already says so: the mirror must be rebuilt."""
        root = self._roots.get(salt)
        if root is None or not self.states or not q or len(q) % (4 * self.page_size):
            return False
        ids, n = self._aligned(q)
        if self._peek(root, ids, q, n)[1] != n:
            return False
        path = self._walk(root, ids, q, n)
        if isinstance(path[-1], MirrorNode):
            node = path[-1]
        elif held:
            node = self._descend(root, ids, q, n)[2][-1]  # splits the edge at n
        else:
            return False  # no node ends there: no snapshot to drop
        if node.state == held:
            return False
        node.state = held
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
                if not sub.swa:
                    self.tombstoned -= sub.num_tokens
                self._unlink(sub)

    def _subtree(self, node: Node):
        """``node`` and everything below it, children before parents."""
        order = [node]
        for nd in order:  # the list grows as it is walked: breadth first
            order.extend(nd.children.values())
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
        if ev.kind != STORED:
            continue
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
    """What one worker holds, per tier, plus the state of its event stream (module doc)."""

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.window = 0  # the worker's sliding window (from its snapshot; 0: none)
        self.states = False  # the worker's matches end at Mamba state snapshots (from its snapshot)
        self.trees: Dict[str, TokenTree] = {}
        self.status = MirrorStatus()
        self.load = None  # the worker's last Load record

    @property
    def synced(self) -> bool:
        return self.status.synced

    def tree(self, tier: str = "L1") -> TokenTree:
        t = self.trees.get(tier)
        if t is None:
            t = self.trees[tier] = TokenTree(self.page_size, self.window, self.states)
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
        if ev.kind in (TOMBSTONED, REVIVED):
            return tree.set_window_kv(ev.tokens, ev.length, ev.salt, ev.kind == REVIVED)
        if ev.kind in (STATE_STORED, STATE_DROPPED):
            return tree.set_state(ev.tokens, ev.salt, ev.kind == STATE_STORED)
        return False

    def apply_message(self, msg, now: float = 0.0) -> bool:
        """Apply a decoded :class:`~radixserve.kv_events.Batch` or
        :class:`~radixserve.kv_events.Snapshot`; True if a (new) snapshot is needed (the
        mirror is stale until one is applied)."""
        st = self.status
        st.last_message = now
        if type(msg).__name__ == "Snapshot":
            shape = (msg.page_size, msg.window, getattr(msg, "states", False))
            if shape != (self.page_size, self.window, self.states):
                self.page_size, self.window, self.states = shape
                self.trees = {}
            else:
                for t in self.trees.values():
                    t.clear()
            if st.epoch is not None:
                st.resyncs += 1
            st.epoch = msg.epoch
            st.seq = msg.seq
            ok = all([self.apply_event(ev) for ev in msg.events])  # each one, even after a misfit
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
        if (msg.epoch != st.epoch or msg.seq != st.seq + 1 or msg.page_size != self.page_size
                or msg.window != self.window or getattr(msg, "states", False) != self.states):
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
        """Servable prefix length of ``q`` per tier (tiers holding nothing are left out)."""
        return {tier: t.match(q, salt) for tier, t in self.trees.items() if t.roots}

    def held_tokens(self, tier: str = "L1") -> int:
        t = self.trees.get(tier)
        return t.num_tokens if t is not None else 0
