"""Scheduling policies: pure functions that order the waiting queue.

Each takes the waiting requests (with ``match_len`` already computed against the prefix
cache) and returns them in admission order. They never touch the cache or memory, so they
can be tested and compared on their own.

- ``lpm``: longest matched prefix first (the paper's cache-aware policy). Requests that hit
  the same cached prefix run together while it is hot; ties keep arrival order.
- ``dfs-weight``: depth-first order over the prefix tree of the waiting requests' own
  tokens, heavier subtrees first. For an offline batch this visits each shared prefix once
  in a row, which is the paper's optimal order (Theorem 3.1).
- ``fcfs``: arrival order. ``random``: a seeded shuffle (ablation baselines).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from radixserve.cache.packed import pack
from radixserve.cache.tree import RadixTree
from radixserve.config import POLICIES


class Orderable(Protocol):
    seq_no: int
    match_len: int

    @property
    def fill_ids(self) -> list[int]: ...


def order_fcfs(reqs: Sequence[Orderable]) -> list:
    return sorted(reqs, key=lambda r: r.seq_no)


def order_lpm(reqs: Sequence[Orderable]) -> list:
    return sorted(reqs, key=lambda r: (-r.match_len, r.seq_no))


def order_random(reqs: Sequence[Orderable], rng: random.Random) -> list:
    out = list(reqs)
    rng.shuffle(out)
    return out


def order_dfs_weight(reqs: Sequence[Orderable]) -> list:
    """DFS over the radix tree of the requests' tokens; heavier subtrees (more requests
    through them) go first, and a request comes out at the node its tokens end at.

    The tree is the cache's own (:class:`~radixserve.cache.tree.RadixTree`, counting paths
    instead of holding KV), built over the waiting queue only."""
    tree = RadixTree(1)
    ends: dict = {}
    for r in sorted(reqs, key=lambda r: r.seq_no):
        ids, q = pack(r.fill_ids)
        node = tree.add_path(ids, q, len(ids))[0] if ids else tree.root
        ends.setdefault(node, []).append(r)
    out: list = list(ends.get(tree.root, ()))
    # Push lightest first so the heaviest child is popped (visited) first.
    stack = sorted(tree.root.children.values(), key=lambda c: c.lock_ref)
    while stack:
        node = stack.pop()
        out.extend(ends.get(node, ()))
        stack.extend(sorted(node.children.values(), key=lambda c: c.lock_ref))
    return out


#: A request that waited this many times ``lpm_max_wait_s`` goes first, in arrival order.
OVERDUE_FACTOR = 4


def promote_urgent(ordered: list, now: float, max_wait_s: float, max_passes: int) -> list:
    """LPM's bounded wait: requests that waited longer than ``max_wait_s`` or were passed
    over ``max_passes`` times go first (LPM alone can starve a request whose prefix is never
    hot). Among those urgent requests LPM still decides (a burst where everyone has waited
    long must not turn into FCFS and lose the hits); one that has waited ``OVERDUE_FACTOR``
    times the bound goes before all of them, oldest first, so no request waits unboundedly
    behind urgent ones with longer matches."""
    urgent = [r for r in ordered if r.passed_over >= max_passes or now - r.arrival >= max_wait_s]
    if not urgent:
        return ordered
    late = OVERDUE_FACTOR * max_wait_s
    overdue = sorted((r for r in urgent if now - r.arrival >= late), key=lambda r: (r.arrival, r.seq_no))
    first = overdue + [r for r in urgent if now - r.arrival < late]
    ids = {id(r) for r in first}
    return first + [r for r in ordered if id(r) not in ids]


POLICY_FUNCS: dict[str, Callable[..., list]] = {"lpm": order_lpm, "fcfs": order_fcfs, "dfs-weight": order_dfs_weight}


def order_waiting(policy: str, reqs: Sequence[Orderable], rng: random.Random) -> list:
    if policy == "random":
        return order_random(reqs, rng)
    if policy not in POLICY_FUNCS:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    return POLICY_FUNCS[policy](reqs)
