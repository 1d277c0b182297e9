"""The scheduler's invariants, checked on demand (tests, ``/debug/integrity``): O(pool size).

* every KV slot is in exactly one place: the free list, the prefix cache, or one running
  request's private slots (``free + tree + private == capacity``, no slot twice);
* every slot the cache holds, and every slot a request counts as written, holds K/V that a
  successful forward pass (or a load from a lower tier) wrote: a step that failed can never
  be served to a later request;
* waiting requests hold nothing; an idle engine protects nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
    if not active and s.cache.protected_size != 0:
        raise AssertionError(f"idle but {s.cache.protected_size} tokens still protected")
