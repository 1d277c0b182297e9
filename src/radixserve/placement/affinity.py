"""Where each prefix family was sent: the router's own record, beside the exact mirrors.

A worker's mirror (:mod:`.mirror`) says what the worker holds *now*. That is not where a
family of requests lives: under memory pressure a worker evicts a family's prefix between
two of its requests, and a router that knows only what is resident then sees the family as
new and may start it on another worker, so every family ends up on every worker and each
cache holds all of them, which is exactly what does not fit. The same gap exists for a
moment after each response, before the worker's cache events arrive.

:class:`AffinityTree` keeps, per prefix, when it was last routed to each worker (a logical
clock: requests recorded), in the same radix tree as the mirrors (token runs, one root per
namespace, page-aligned keys). It is approximate on purpose: it records routing decisions,
never what a worker kept, and forgets least recently routed leaves past ``max_tokens``.
:meth:`AffinityTree.match` tells, for each worker, how much of a prompt was routed there
and how many requests ago; the policy turns that into a decayed affinity
(:meth:`AffinityTree.strengths`).

The same record tells how a prompt relates to the ones before it (:meth:`AffinityTree.lookup`):
how much of it any earlier prompt shared, and whether an earlier prompt is a whole prefix of
it. A prompt that continues an earlier one (a conversation's next turn, a branch of a tree
of thought) will likely be continued in turn; one that only shares a stretch with its
siblings (a system prompt, then its own question) leaves the family there, and what follows
is its own.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Dict, Hashable, NamedTuple, Optional

from radixserve.cache.tree import Node, RadixTree

__all__ = ["AffinityTree", "Affinity", "Lookup"]


class AffinityNode(Node):
    __slots__ = (
        "seen",  # worker index -> clock of the last request routed there through this run
        "ends",  # a recorded prompt ended where this run ends
    )

    def __init__(self, key: bytes, parent: Optional["AffinityNode"], stamp: int, nid: int) -> None:
        Node.__init__(self, key, parent, stamp, nid)
        self.seen: Dict[int, int] = {}
        self.ends = False


class _Seen:
    """The per-worker stamps as a component: both halves of a split edge were routed where the whole edge was."""

    @staticmethod
    def split(upper: AffinityNode, lower: AffinityNode, m: int) -> None:
        upper.seen = dict(lower.seen)  # (``ends`` stays below: the new upper run ends no prompt)


class Affinity(NamedTuple):
    tokens: int  # leading tokens of the prompt routed to the worker before
    age: int  # requests recorded since the last of them


class Lookup(NamedTuple):
    """A prompt against everything recorded (in its namespace)."""

    affinities: Dict[int, Affinity]  # per worker, as :meth:`AffinityTree.match`
    shared: int  # leading (page-aligned) tokens some earlier prompt had too
    continued: int  # tokens of the longest earlier prompt that is a whole prefix of it (0: none)


class AffinityTree(RadixTree):
    """Per prefix and worker, the clock of the last request routed there through it.

    Invariant (checked by :meth:`check`): a node's workers are a subset of its parent's,
    each stamped no later than there, because a record stamps its whole root path."""

    node_type = AffinityNode
    components = (_Seen(),)

    def __init__(self, page_size: int = 1, max_tokens: int = 1 << 22) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        super().__init__(page_size)
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.clock = 0

    def _aligned(self, q: bytes) -> tuple:
        n = len(q) >> 2
        return array("I", q[: n << 2]), n - n % self.page_size

    # ------------------------------------------------------------------ updates
    def record(self, q: bytes, salt: Hashable, worker: int) -> None:
        """A request with packed prompt ``q`` was routed to ``worker``."""
        self.clock += 1
        ids, n = self._aligned(q)
        if n == 0:
            return
        root = self._root_for_insert(salt)
        node, pos, path = self._descend(root, ids, q, n, self.clock, False)
        if pos < n:
            path.append(self._attach(node, ids, q, pos, n, self.clock))
            self.num_tokens += n - pos
        path[-1].ends = True  # the walk split the run the prompt ends inside: it ends here
        for nd in path:
            nd.seen[worker] = self.clock
        if self.num_tokens > self.max_tokens + (self.max_tokens >> 3):
            self.trim(self.max_tokens)

    def trim(self, max_tokens: int) -> int:
        """Drop least recently routed leaves until at most ``max_tokens`` are held;
        returns the tokens dropped. (Amortised: :meth:`record` calls it only once the
        tree is an eighth over its budget.)"""
        if self.num_tokens <= max_tokens:
            return 0
        heap = [(nd.last_access, nd.id, nd) for nd in self.iter_nodes() if not nd.children]
        heapq.heapify(heap)
        dropped = 0
        while heap and self.num_tokens > max_tokens:
            _, _, nd = heapq.heappop(heap)
            k = nd.num_tokens
            parent = self._unlink(nd)
            self.num_tokens -= k
            dropped += k
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return dropped

    # ------------------------------------------------------------------ queries
    def match(self, q: bytes, salt: Hashable = None) -> Dict[int, Affinity]:
        """Per worker: how many leading (page-aligned) tokens of ``q`` were routed there
        before, and how many requests ago the last of them was."""
        return self.lookup(q, salt).affinities

    def lookup(self, q: bytes, salt: Hashable = None) -> Lookup:
        """:meth:`match`, plus how much of ``q`` earlier prompts shared and the longest of
        them that ``q`` continues, in one walk."""
        root = self._roots.get(salt)
        out: Dict[int, Affinity] = {}
        if root is None or not root.children:
            return Lookup(out, 0, 0)
        ids, n = self._aligned(q)
        node, pos, path = self._descend(root, ids, q, n, None, False, False)
        clock = self.clock
        continued = full = 0
        for child in path:
            full += len(child.key) >> 2
            if child.ends:
                continued = full
            for w, t in child.seen.items():
                out[w] = Affinity(full, clock - t)
        if pos > full:  # the query leaves this edge midway: its workers had that much of it
            child = node.children[self._child_key(q[full << 2 : (full + self.page_size) << 2])]
            for w, t in child.seen.items():
                out[w] = Affinity(pos, clock - t)
        return Lookup(out, pos, continued)

    def strengths(self, q: bytes, salt: Hashable, half_life: float) -> Dict[int, float]:
        """Per worker, the tokens of ``q`` routed there before, halved for every
        ``half_life`` requests recorded since (a family not seen for long stops pulling)."""
        return self.decayed(self.match(q, salt), half_life)

    @staticmethod
    def decayed(affinities: Dict[int, Affinity], half_life: float) -> Dict[int, float]:
        """:meth:`strengths` of a :meth:`lookup`'s affinities."""
        return {w: a.tokens * 0.5 ** (a.age / half_life) for w, a in affinities.items()}

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """The tree's structure plus the affinity invariant and the token count."""
        nodes = self.check_structure()
        total = 0
        for nd in nodes:
            total += nd.num_tokens
            if not nd.seen:
                raise AssertionError(f"{nd!r}: routed to no worker")
            parent = nd.parent
            if parent.parent is not None:
                for w, t in nd.seen.items():
                    if parent.seen.get(w, -1) < t:
                        raise AssertionError(f"{nd!r}: worker {w} stamped later than on its parent")
            if nd.last_access != max(nd.seen.values()):
                raise AssertionError(f"{nd!r}: last_access is not its latest stamp")
        if total != self.num_tokens:
            raise AssertionError(f"num_tokens {self.num_tokens} != {total}")
