"""The radix cache of a hybrid Mamba model: one tree, attention KV on every node, a Mamba
state snapshot only at some node ends.

A Mamba layer's whole memory of a prefix is a fixed-size state (``radixserve.memory.mamba``)
that cannot be cut back to a shorter prefix. So the tree holds the attention layers' KV as
the plain cache does (``value``) and, as a component, a snapshot of the state at chosen node
ends. The rules, after SGLang's Mamba radix cache and vLLM's hybrid KV manager:

* **Match**: a prefix can be resumed only where the state after it is known, so a match ends
  at the deepest node of the walked path that holds a snapshot (the KV may reach further:
  :meth:`MambaRadixCache.kv_reach` says how far, and the request recomputes that part).
* **Fork**: an admitted request copies the snapshot into its own state slot
  (:meth:`fork_state`) and advances only that copy: two requests continuing one prefix never
  share a mutable state, and a snapshot, never written after it is taken, needs no lock.
* **Where snapshots are taken** is the scheduler's choice (``sched/mamba.py``):
  :meth:`snapshot` copies a request's state to the node ending where its tokens end.
* **Budgets**: attention KV is evicted leaf-first LRU as in the plain cache, and a snapshot
  goes with its node. Snapshots also have their own budget (``max_snapshots``) and LRU, over
  interior nodes too: evicting a snapshot keeps the node and its KV, which still serve deeper
  snapshots (like a sliding-window tombstone). A snapshot's recency is that of matches
  *ending* at it, never of walks through it. Session-aware: a snapshot taken below another
  with no branch between them (a conversation's next turn, a retracted request resuming)
  supersedes the one above, which goes before every snapshot in use: a conversation's latest
  snapshot outlives its earlier ones, and the other conversations' latest ones too.
* ``can_share_partial_prefix`` is False: a request waiting for another to compute a shared
  uncached prefix would find it without a snapshot at its end, and gain nothing.

Cache events (:mod:`.events`): beside the plain tree's, ``state_stored`` and
``state_dropped`` (by the budget), so a router's mirror predicts the hit up to the deepest
snapshot, not the KV's reach.

Page size 1 only: a snapshot is the state after an exact token count, which must be a node
boundary, and a request's end rarely falls on a page boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from radixserve.memory.mamba import MambaStatePool

from .base import FreeCallback, MatchResult, TokenIds, match_of_runs
from .events import STATE_DROPPED, STATE_STORED, CacheEvent
from .lru import LruQueue
from .packed import pack
from .radix import RadixCache
from .tree import Node

__all__ = ["MambaRadixCache", "MambaSnapshots"]

#: How far below the clock a superseded snapshot is stamped: below every stamp in use, so it
#: is evicted first, in the order of its demotion.
SUPERSEDED = 1 << 62


class MambaSnapshots:
    """Snapshots of the Mamba state as a component of the tree: which node ends hold one (the
    state-pool slot), their recency and their LRU."""

    def __init__(self, pool: MambaStatePool, max_snapshots: int) -> None:
        if isinstance(max_snapshots, bool) or not isinstance(max_snapshots, int) or max_snapshots < 0:
            raise ValueError(f"max_snapshots must be an int >= 0, got {max_snapshots!r}")
        self.pool = pool
        self.max_snapshots = max_snapshots
        self.slots: dict[Node, int] = {}
        #: Recency of each snapshot: the stamp of the last match that ended there (only
        #: :meth:`demote` lowers one). The LRU queue reads it; a node is a candidate while it
        #: holds a snapshot.
        self.access: dict[Node, int] = {}
        self.queue: LruQueue[Node] = LruQueue(self.access.__getitem__, self.slots.__contains__)
        self.taken = self.evicted = self.forked = 0  # cumulative counters, for stats
        #: Called with each node whose snapshot the budget's LRU drops (not with a node that
        #: leaves the tree with its KV): the tree turns it into a cache event.
        self.on_evict: Callable[[Node], None] | None = None

    def clear(self, dead: Sequence[Node] = ()) -> None:
        """Give every snapshot's slot back (the tree was emptied)."""
        for slot in self.slots.values():
            self.pool.free(slot)
        self.slots.clear()
        self.access.clear()
        self.queue.clear()

    def __len__(self) -> int:
        return len(self.slots)

    # ------------------------------------------------------------------ component
    def split(self, upper: Node, lower: Node, m: int) -> None:
        """A snapshot belongs to its node's end, which ``lower`` keeps: nothing moves."""

    def served(self, path: Sequence[Node]) -> int:
        slots = self.slots
        return next((i + 1 for i in range(len(path) - 1, -1, -1) if path[i] in slots), 0)

    def dropped(self, node: Node) -> None:
        """``node`` left the tree with its KV: its snapshot goes too."""
        slot = self.slots.pop(node, None)
        if slot is not None:
            del self.access[node]
            self.queue.discard(node)
            self.pool.free(slot)

    def evict(self, num_snapshots: int, keep: Node | None = None) -> int:
        """Drop up to ``num_snapshots`` snapshots (LRU), never ``keep``'s; how many went."""
        freed = 0
        queue = self.queue
        spared = None
        while freed < num_snapshots:
            node = queue.pop()
            if node is None:
                break
            if node is keep:
                spared = node
                continue
            self.pool.free(self.slots.pop(node))
            del self.access[node]
            freed += 1
            if self.on_evict is not None:
                self.on_evict(node)
        if spared is not None:
            queue.push(spared)
        self.evicted += freed
        return freed

    # ------------------------------------------------------------------ snapshots
    def touch(self, node: Node, stamp: int) -> None:
        """A match ended at ``node``'s snapshot (or one was just taken there): it is recent."""
        self.access[node] = stamp
        self.queue.push(node)

    def demote(self, node: Node, stamp: int) -> None:
        """``node``'s snapshot was superseded by one further down its only path: it goes
        before every snapshot in use (oldest demotion first), unless a match ends there again."""
        self.access[node] = stamp - SUPERSEDED
        self.queue.lowered(node)

    def put(self, node: Node, src: int, stamp: int) -> bool:
        """Snapshot state slot ``src`` at ``node`` (evicting the LRU snapshot at the budget);
        False when the budget is 0 or no slot can be had."""
        if node in self.slots:
            self.touch(node, stamp)  # the same prefix gives the same state: keep the one there
            return True
        if self.max_snapshots == 0:
            return False
        if len(self.slots) >= self.max_snapshots:
            self.evict(1)
        dst = self.pool.alloc()
        if dst is None and self.evict(1):
            dst = self.pool.alloc()
        if dst is None:
            return False
        self.pool.copy(src, dst)
        self.slots[node] = dst
        self.taken += 1
        self.touch(node, stamp)
        return True

    def fork(self, node: Node, dst: int) -> bool:
        """State slot ``dst`` becomes the state after ``node``'s prefix: a copy of its snapshot,
        or the initial (zero) state at a root. Whether it came from a snapshot."""
        src = self.slots.get(node)
        if src is None:
            if node.parent is not None:
                raise RuntimeError(f"{node!r} holds no Mamba state snapshot: a match never ends there")
            self.pool.zero(dst)
            return False
        self.pool.copy(src, dst)
        self.forked += 1
        return True


class MambaRadixCache(RadixCache):
    """Radix cache over attention KV slots plus Mamba state snapshots (see the module docstring)."""

    can_share_partial_prefix = False

    def __init__(self, pool: MambaStatePool, max_snapshots: int, page_size: int = 1,
                 on_free: FreeCallback | None = None) -> None:
        if not isinstance(pool, MambaStatePool):
            raise ValueError(f"pool must be a MambaStatePool, got {type(pool).__name__}")
        if page_size != 1:
            raise ValueError(f"a Mamba state snapshot needs page_size 1 (it ends on an exact token), got "
                             f"{page_size!r}")
        self.snapshots = MambaSnapshots(pool, max_snapshots)
        self.snapshots.on_evict = lambda node: self._emit_node(STATE_DROPPED, node, 0)
        self.components = (self.snapshots,)
        super().__init__(page_size, on_free)

    # ------------------------------------------------------------------ match
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: int | None = None,
                     probation_from: int | None = None) -> MatchResult:
        """Longest cached prefix ending at a snapshot (see the module docstring); one
        priority class (``low_priority_from`` and ``probation_from`` are not applied)."""
        runs, length, end, _, _ = self._match_served(token_ids, salt, True, self.snapshots)
        if length:
            self.snapshots.touch(end, self._clock)
        return match_of_runs(runs, length, end)

    def match_inserted(self, token_ids: TokenIds, salt: Hashable = None,
                       low_priority_from: int | None = None,
                       probation_from: int | None = None) -> MatchResult:
        """The KV path of tokens just inserted, whatever snapshots it holds: the inserting
        request keeps its own state and locks its KV to where it ends."""
        return RadixCache.match_prefix(self, token_ids, salt, low_priority_from, probation_from)

    def kv_reach(self, token_ids: TokenIds, salt: Hashable = None) -> int:
        """How many leading tokens of ``token_ids`` the tree holds KV for, snapshots or not
        (no stamps, no splits): where a request computing them leaves the cached paths."""
        root = self._roots.get(salt)
        if root is None:
            return 0
        ids, q = pack(token_ids)
        return self._peek(root, ids, q, len(ids))[1]

    # ------------------------------------------------------------------ states
    def fork_state(self, node: Node, dst: int) -> bool:
        """State slot ``dst`` gets the state after the prefix ``node`` (a match's handle) ends:
        a copy of its snapshot, or the zero state for a miss. Whether a snapshot served it."""
        if node.parent is not None:
            self._check_handle(node)
        return self.snapshots.fork(node, dst)

    def snapshot(self, token_ids: TokenIds, salt: Hashable, src: int) -> bool:
        """Keep a copy of state slot ``src``, the state after exactly ``token_ids``, at the node
        ending there (splitting an edge if needed); False when the tokens are not all in the
        tree or the snapshot budget cannot hold it."""
        ids, q = pack(token_ids)
        n = len(ids)
        root = self._roots.get(salt)
        if not n or root is None:
            return False
        self._clock = stamp = self._clock + 1
        node, pos, _ = self._descend(root, ids, q, n, stamp, False)
        if pos != n:
            return False
        if node in self.snapshots.slots:
            return self.snapshots.put(node, src, stamp)
        self._supersede(node, stamp)  # first: the budget's eviction then takes it, if any
        if not self.snapshots.put(node, src, stamp):
            return False
        self._emit_node(STATE_STORED, node, 0)
        return True

    def snapshot_events(self) -> list[CacheEvent]:
        """The plain tree's ``stored`` events, then a ``state_stored`` event per snapshot
        (each after the run it ends)."""
        return super().snapshot_events() + [CacheEvent(STATE_STORED, self.salt_of(nd), self.path_bytes(nd), 0)
                                            for nd in self.snapshots.slots]

    def _supersede(self, node: Node, stamp: int) -> None:
        """Demote the nearest snapshot above ``node`` if nothing branches between them (the
        earlier turn, or where a retracted request stopped); a branch point, which other paths
        still need, keeps its place."""
        x = node.parent
        while x.parent is not None and len(x.children) == 1:
            if x in self.snapshots.slots:
                self.snapshots.demote(x, stamp)
                return
            x = x.parent

    def evict_states(self, num_snapshots: int, keep: Node | None = None) -> int:
        """Drop up to ``num_snapshots`` snapshots (LRU), never ``keep``'s (a match about to be
        forked); the nodes and their KV stay."""
        return self.snapshots.evict(num_snapshots, keep)

    def snapshot_slots(self) -> list[int]:
        """The state slots the snapshots hold (integrity checks)."""
        return list(self.snapshots.slots.values())

    def stats(self) -> dict:
        s = self.snapshots
        return {**super().stats(), "mamba_snapshots": len(s),
                "mamba_snapshot_bytes": len(s) * s.pool.bytes_per_slot, "mamba_snapshots_taken": s.taken,
                "mamba_snapshots_evicted": s.evicted, "mamba_snapshot_hits": s.forked,
                "max_mamba_snapshots": s.max_snapshots}

    def check_integrity(self) -> None:
        """The plain cache's invariants, plus: every snapshot sits on a live node of the tree,
        no slot twice, none on the free list, within the budget."""
        super().check_integrity()
        s = self.snapshots
        live = set(map(id, self.iter_nodes()))
        for nd in s.slots:
            if nd.key is None or id(nd) not in live:
                raise AssertionError(f"a Mamba snapshot sits on {nd!r}, which is not in the tree")
            if nd not in s.access or nd not in s.queue:
                raise AssertionError(f"{nd!r}: snapshot without a recency stamp or an LRU entry")
        s.queue.check()
        slots = list(s.slots.values())
        if len(set(slots)) != len(slots):
            raise AssertionError("two snapshots share a state slot")
        if set(slots) & s.pool.free_slot_set():
            raise AssertionError("a snapshot's state slot is on the free list")
        if len(slots) > s.max_snapshots:
            raise AssertionError(f"{len(slots)} snapshots over the budget of {s.max_snapshots}")
