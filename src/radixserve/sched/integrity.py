"""The scheduler's invariants, checked on demand (tests, ``/debug/integrity``): O(pool size).

* every KV slot is in exactly one place: the free list, the prefix cache, or one running
  request's private slots (``free + tree + private == capacity``, no slot twice);
* every slot the cache holds, and every slot a request counts as written, holds K/V that a
  successful forward pass (or a load from a lower tier) wrote: a step that failed can never
  be served to a later request;
* every Mamba state slot (hybrid Mamba models) is free, one active request's or one snapshot's;
* waiting requests hold nothing; an idle engine protects nothing but what retained sessions
  lock (``sched/sessions.py``): for a tree, every lock it counts is one a running request or
  a session holds, so none leaks.
"""

from __future__ import annotations

from typing import Sequence

import torch

from radixserve.cache import PrefixCache
from radixserve.cache.tree import RadixTree
from radixserve.request import Req
from radixserve.memory import SlotAllocator
from radixserve.sched.mamba import RecurrentStates
from radixserve.sched.sessions import SessionTable


class Auditor:
    """Checks the invariants over the pieces that hold slots and locks; it changes nothing."""

    def __init__(self, allocator: SlotAllocator, cache: PrefixCache, sessions: SessionTable,
                 mamba: RecurrentStates) -> None:
        self.allocator = allocator
        self.cache = cache
        self.sessions = sessions
        self.mamba = mamba

    def check(self, active: Sequence[Req], waiting: Sequence[Req]) -> None:
        """``active``: the requests holding slots (running, and the chunked one); raise
        AssertionError if an invariant does not hold."""
        self.cache.check_integrity()
        private = self._check_requests(active, waiting)
        self._check_slots(private)
        self._check_locks(active)
        self.mamba.check(active, waiting)

    def _check_requests(self, active: Sequence[Req], waiting: Sequence[Req]) -> list[torch.Tensor]:
        """Each request's counts are ordered and its written slots written; returns the
        active requests' private slots."""
        private: list[torch.Tensor] = []
        for r in active:
            private += [r.kv_slots[r.prefix_len :], r.spare_slots]
            if not 0 <= r.prefix_len <= r.kv_written <= r.computed_len:
                raise AssertionError(f"request {r.rid}: prefix {r.prefix_len} <= written {r.kv_written} "
                                     f"<= slots {r.computed_len} does not hold")
            if not self.allocator.all_written(r.kv_slots[: r.kv_written]):
                raise AssertionError(f"request {r.rid} counts unwritten slots as written")
        for r in waiting:
            if r.computed_len or r.spare_slots.numel() or r.last_node is not None:
                raise AssertionError(f"waiting request {r.rid} holds KV slots")
        return private

    def _check_slots(self, private: list[torch.Tensor]) -> None:
        """Every slot is in exactly one place; the tree's slots are written."""
        a, cache = self.allocator, self.cache
        n_private = sum(int(p.numel()) for p in private)
        if a.available + cache.total_size + n_private != a.capacity:
            raise AssertionError(f"slot leak: free {a.available} + tree {cache.total_size} + "
                                 f"private {n_private} != capacity {a.capacity}")
        tree_slots = cache.held_slots()
        if tree_slots is not None and not a.all_written(tree_slots):
            raise AssertionError("the prefix cache holds slots whose K/V were never written")
        if private:
            allp = torch.cat(private)
            if allp.unique().numel() != allp.numel():
                raise AssertionError("a private slot is held twice")
            if a.free_slot_set() & set(allp.tolist()):
                raise AssertionError("a private slot is also on the free list")

    def _check_locks(self, active: Sequence[Req]) -> None:
        """Locks are held by running requests and retained sessions only, and are all counted."""
        cache = self.cache
        held = list(self.sessions.handles())
        if not held and not active and cache.protected_size != 0:
            raise AssertionError(f"idle but {cache.protected_size} tokens still protected")
        if not isinstance(cache, RadixTree):
            return
        for nd in held:
            if nd.key is None or nd.lock_ref <= 0:
                raise AssertionError(f"a session holds {nd!r}, which is not locked in the tree")
        # A lock adds one to every node of its root path: the top nodes count each lock once.
        counted = sum(c.lock_ref for root in cache._roots.values() for c in root.children.values())
        owned = len(held) + sum(1 for r in active if r.last_node is not None and r.last_node.parent is not None)
        if counted != owned:
            raise AssertionError(f"lock leak: the tree counts {counted} locks; running requests and "
                                 f"sessions hold {owned}")
        if not active:  # then exactly the sessions' root paths are protected
            tokens = _path_tokens(held)
            if tokens != cache.protected_size:
                raise AssertionError(f"idle: {cache.protected_size} tokens protected, the sessions' "
                                     f"paths hold {tokens}")


def _path_tokens(nodes: Sequence) -> int:
    """Tokens on the union of the root paths of ``nodes``."""
    seen: set[int] = set()
    tokens = 0
    for nd in nodes:
        while nd.parent is not None and id(nd) not in seen:
            seen.add(id(nd))
            tokens += len(nd.key) >> 2
            nd = nd.parent
    return tokens
