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

from typing import TYPE_CHECKING

import torch

from radixserve.cache.tree import RadixTree

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def check_scheduler(s: "Scheduler") -> None:
    """Every slot is in exactly one place (free list, tree, or one request's private set),
    and every slot the tree holds holds written K/V."""
    s.cache.check_integrity()
    private: list[torch.Tensor] = []
    active = s.running + ([s.chunked] if s.chunked else [])
    for r in active:
        private += [r.kv_slots[r.prefix_len :], r.spare_slots]
        if not 0 <= r.prefix_len <= r.kv_written <= r.computed_len:
            raise AssertionError(
                f"request {r.rid}: prefix {r.prefix_len} <= written {r.kv_written} "
                f"<= slots {r.computed_len} does not hold")
        if not s.allocator.all_written(r.kv_slots[: r.kv_written]):
            raise AssertionError(f"request {r.rid} counts unwritten slots as written")
    for r in s.waiting:
        if r.computed_len or r.spare_slots.numel() or r.last_node is not None:
            raise AssertionError(f"waiting request {r.rid} holds KV slots")
    n_private = sum(int(p.numel()) for p in private)
    total = s.allocator.available + s.cache.total_size + n_private
    if total != s.allocator.capacity:
        raise AssertionError(
            f"slot leak: free {s.allocator.available} + tree {s.cache.total_size} + "
            f"private {n_private} != capacity {s.allocator.capacity}"
        )
    tree_slots = s.cache.held_slots()
    if tree_slots is not None and not s.allocator.all_written(tree_slots):
        raise AssertionError("the prefix cache holds slots whose K/V were never written")
    if private:
        allp = torch.cat(private)
        if allp.unique().numel() != allp.numel():
            raise AssertionError("a private slot is held twice")
        free = s.allocator.free_slot_set()
        if free & set(allp.tolist()):
            raise AssertionError("a private slot is also on the free list")
    _check_locks(s, active)
    s.mamba.check(active, s.waiting)


def _check_locks(s: "Scheduler", active: list) -> None:
    """Locks are held by running requests and retained sessions only, and are all counted."""
    cache = s.cache
    held = list(s.sessions.handles())
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
        seen: set[int] = set()
        tokens = 0
        for nd in held:
            while nd.parent is not None and id(nd) not in seen:
                seen.add(id(nd))
                tokens += len(nd.key) >> 2
                nd = nd.parent
        if tokens != cache.protected_size:
            raise AssertionError(f"idle: {cache.protected_size} tokens protected, the sessions' "
                                 f"paths hold {tokens}")
