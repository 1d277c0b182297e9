"""The tree's L2 -> L1 side: a match's L2 continuation is given L1 slots (evicting L1 if it
must) and its copies are queued on :class:`.tiers.HostTier`, to go out together at
``flush_loads``. The one place that decides how much of a continuation to load and where the
budget cuts a run; the tree mutations it needs (pins, locks, eviction, splits) stay the tree's."""

from __future__ import annotations

from typing import Dict, List, Optional, Protocol

import numpy as np
import torch

from radixserve.memory.allocator import SlotAllocator

from ..base import empty_indices
from .node import HiMatchResult, HiNode
from .tiers import HostTier

__all__ = ["LoadBack"]


class LoadingTree(Protocol):
    """What the loads ask of their tree (:class:`.hiradix.HiRadixCache`)."""

    page_size: int

    def lock(self, node: HiNode) -> None: ...
    def unlock(self, node: HiNode) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def _pin(self, node: HiNode) -> None: ...
    def _unpin(self, node: HiNode) -> None: ...
    def _split(self, child: HiNode, m: int) -> HiNode: ...
    def _loaded(self, load: List[HiNode], n: int) -> None: ...


class LoadBack:
    """Loads for one tiered tree. ``threshold`` is ``write_through_threshold`` under
    ``write_through_selective`` (every load_back counts a hit then), else None."""

    def __init__(self, tree: LoadingTree, allocator: SlotAllocator, tiers: HostTier,
                 counters: Dict[str, int], threshold: Optional[int]) -> None:
        self._tree = tree
        self._allocator = allocator
        self._tiers = tiers
        self._counters = counters
        self._threshold = threshold

    def load(self, m: HiMatchResult, max_tokens: Optional[int] = None) -> HiMatchResult:
        """See :meth:`.hiradix.HiRadixCache.load_back`."""
        if not isinstance(m, HiMatchResult):
            raise ValueError(f"m must be the HiMatchResult of match_prefix, got {type(m).__name__}")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 0):
            raise ValueError(f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        target = m.host_node if m.host_node is not None else m.node
        if m.host_length and target.key is None:
            raise ValueError("m is stale: its node was evicted since match_prefix")
        if m.host_length == 0 or target.parent is None:
            if m.node.key is not None:
                self._count_hit(m.node)
            return m
        self._counters["load_back_calls"] += 1
        chain: List[HiNode] = []
        x = target
        while x.parent is not None and x.value is None:
            chain.append(x)
            x = x.parent
        chain.reverse()
        total = sum(len(nd.key) >> 2 for nd in chain)
        page = self._tree.page_size
        want = total if max_tokens is None else min(total, max_tokens - max_tokens % page)
        load = self._make_room(target, x, chain, want) if want > 0 else []
        loaded = sum(len(nd.value) for nd in load)
        node = load[-1] if load else m.node
        if load:
            self._tree._loaded(load, loaded)
        self._count_hit(node)
        idx = _path_values(node) if load else m.indices
        return HiMatchResult(idx, m.length + loaded, node, m.host_length - loaded, target, loaded)

    def _make_room(self, target: HiNode, frontier: HiNode, chain: List[HiNode], want: int) -> List[HiNode]:
        """Evict L1 for up to ``want`` tokens of ``chain`` while the path to ``target`` is
        pinned and the L1 ``frontier`` it hangs from is locked (eviction must not take
        either), then load what fits."""
        tree = self._tree
        tree._pin(target)
        if frontier.parent is not None:
            tree.lock(frontier)
        try:
            short = want - self._allocator.available
            if short > 0:
                tree.evict(short)
            return self._take_l1(chain, min(want, self._allocator.available))
        finally:
            if frontier.parent is not None:
                tree.unlock(frontier)
            tree._unpin(target)

    def _take_l1(self, chain: List[HiNode], want: int) -> List[HiNode]:
        """Give the first ``want`` tokens of ``chain`` (L2-only runs below an L1 node, root side
        first) L1 slots, splitting the run the budget ends in; queue their copies; return them."""
        if want <= 0:
            return []
        load: List[HiNode] = []
        loaded = 0
        for nd in chain:
            L = len(nd.key) >> 2
            if loaded + L <= want:
                load.append(nd)
                loaded += L
                continue
            r = want - loaded
            if r > 0:
                load.append(self._tree._split(nd, r))
                loaded += r
            break
        slots = self._allocator.alloc(loaded)
        if slots is None:  # cannot happen: available was checked
            raise RuntimeError("L1 allocation failed after eviction")
        s = slots.numpy()
        off = 0
        hosts = []
        for nd in load:
            L = len(nd.host)
            nd.value = s[off : off + L]
            hosts.append(nd.host)
            off += L
        self._tiers.queue_load(hosts[0] if len(hosts) == 1 else np.concatenate(hosts), s)
        return load

    def _count_hit(self, node: HiNode) -> None:
        if self._threshold is not None:
            self._tiers.count_hit(node, self._threshold)


def _path_values(node: HiNode) -> torch.Tensor:
    """L1 slots of the path root..node (all of it must be in L1), as a fresh tensor."""
    vals = []
    while node.parent is not None:
        vals.append(node.value)
        node = node.parent
    return torch.from_numpy(np.concatenate(vals[::-1])) if vals else empty_indices()
