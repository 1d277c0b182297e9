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


class _TrieNode:
    __slots__ = ("children", "reqs", "weight")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.reqs: list = []
        self.weight = 0


def order_dfs_weight(reqs: Sequence[Orderable]) -> list:
    """DFS over a token trie of the requests; children with more requests go first.

    A plain per-token trie keeps this short and obviously right; it is built only over the
    waiting queue and costs O(total tokens), small next to a forward pass over them.
    """
    root = _TrieNode()
    for r in sorted(reqs, key=lambda r: r.seq_no):
        node = root
        node.weight += 1
        for t in r.fill_ids:
            nxt = node.children.get(t)
            if nxt is None:
                nxt = node.children[t] = _TrieNode()
            node = nxt
            node.weight += 1
        node.reqs.append(r)
    out: list = []
    stack = [root]
    while stack:
        node = stack.pop()
        out.extend(node.reqs)
        # Push lightest first so the heaviest child is popped (visited) first.
        for child in sorted(node.children.values(), key=lambda c: c.weight):
            stack.append(child)
    return out


POLICY_FUNCS: dict[str, Callable[..., list]] = {
    "lpm": order_lpm,
    "fcfs": order_fcfs,
    "dfs-weight": order_dfs_weight,
}


def order_waiting(policy: str, reqs: Sequence[Orderable], rng: random.Random) -> list:
    if policy == "random":
        return order_random(reqs, rng)
    try:
        fn = POLICY_FUNCS[policy]
    except KeyError:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}") from None
    return fn(reqs)
