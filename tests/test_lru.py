"""The eviction queue (cache/lru.py) against a sorted-list reference: whatever the touches
(stamps raised without a call), demotions (stamps lowered, announced), deferred pushes,
locks (nodes that stop and start being candidates, offered again) and orphans, ``pop``
returns the queued candidate with the least ``(stamp, id)``."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixserve.cache.lru import LruQueue


class _Node:
    def __init__(self, nid: int) -> None:
        self.id = nid
        self.stamp = 0
        self.locked = False

    def __repr__(self) -> str:
        return f"_Node({self.id}, stamp={self.stamp}, locked={self.locked})"


NODES = 6
node_ids = st.integers(0, NODES - 1)


class LruMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.nodes = [_Node(i) for i in range(NODES)]
        self.clock = 1
        self.q: LruQueue[_Node] = LruQueue(lambda n: n.stamp, lambda n: not n.locked)
        self.queued: set = set()  # reference: the nodes queued, by id

    def _ref_pop(self):
        """Sorted list of the queued nodes by their current (stamp, id); the first candidate
        is taken, the non-candidates before it are forgotten (they are offered again when
        they become candidates)."""
        for nd in sorted((self.nodes[i] for i in self.queued), key=lambda n: (n.stamp, n.id)):
            self.queued.discard(nd.id)
            if not nd.locked:
                return nd
        return None

    @rule(i=node_ids)
    def push(self, i):
        self.q.push(self.nodes[i])
        self.queued.add(i)

    @rule(i=node_ids)
    def push_later(self, i):
        self.q.push_later(self.nodes[i])
        self.queued.add(i)

    @rule(i=node_ids)
    def touch(self, i):
        """A match through the node: its stamp rises, nobody tells the queue."""
        self.clock += 1
        self.nodes[i].stamp = self.clock

    @rule(i=node_ids, by=st.integers(1, 1000))
    def demote(self, i, by):
        nd = self.nodes[i]
        nd.stamp -= by
        self.q.lowered(nd)  # (re)queued at the lower stamp
        self.queued.add(i)

    @rule(i=node_ids)
    def lock(self, i):
        self.nodes[i].locked = True

    @rule(i=node_ids)
    def unlock(self, i):
        nd = self.nodes[i]
        if nd.locked:
            nd.locked = False
            self.q.offer(nd)
            self.queued.add(i)

    @rule(i=node_ids)
    def offer(self, i):
        nd = self.nodes[i]
        self.q.offer(nd)
        if not nd.locked:
            self.queued.add(i)

    @rule(i=node_ids)
    def discard(self, i):
        self.q.discard(self.nodes[i])
        self.queued.discard(i)

    @rule()
    def pop(self):
        got = self.q.pop()
        want = self._ref_pop()
        assert got is want, (got, want)

    @rule()
    def pop_and_keep(self):
        """An evictor that pops a node and decides to keep it pushes it back."""
        got = self.q.pop()
        assert got is self._ref_pop()
        if got is not None:
            self.q.push(got)
            self.queued.add(got.id)

    @invariant()
    def consistent(self):
        if hasattr(self, "q"):
            self.q.check()
            # Every queued candidate is known to the queue (non-candidates may be forgotten).
            for i in self.queued:
                if not self.nodes[i].locked:
                    assert self.nodes[i] in self.q


LruMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestLruQueue = LruMachine.TestCase


def test_pop_drains_in_lru_order_with_stale_entries():
    nodes = [_Node(i) for i in range(5)]
    for k, nd in enumerate(nodes):
        nd.stamp = 10 + k
    q: LruQueue[_Node] = LruQueue(lambda n: n.stamp, lambda n: True)
    for nd in nodes:
        q.push(nd)
    nodes[0].stamp = 100  # touched: its entry at 10 is stale
    nodes[3].stamp = 1  # demoted
    q.lowered(nodes[3])
    assert [q.pop().id for _ in range(5)] == [3, 1, 2, 4, 0]
    assert q.pop() is None and len(q) == 0
