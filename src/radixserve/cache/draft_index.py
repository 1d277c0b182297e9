"""Where each short token run ends in the radix tree: the draft source of n-gram speculation.

Speculative decoding drafted by the tree (``sched/speculation.py``) needs, at every decode
step of every request, the longest suffix of its sequence (up to ``max_ngram`` tokens) found
anywhere in its namespace's tree, and the tokens that followed it there: ``O(max_ngram)``
dictionary lookups plus the draft's length here, instead of a walk of the tree per step.

How it is kept
--------------
* One dictionary per salt (so a draft cannot cross a tenant boundary): n-gram (packed
  uint32 ``bytes``, the tree's key format) -> a handle to where its last token sits in the
  tree, the most recent insertion winning.
* It is fed by the tree's own cache events (:mod:`.events`), the stream a router's mirror
  replays, so the tree needs no hook of its own: ``stored`` indexes every n-gram ending in
  the new run (those starting in the prefix included), ``removed`` (sent before the leaf is
  unlinked) drops the entries pointing into the leaf, ``cleared`` drops all. So entries never
  outnumber ``len(sizes)`` per token held, and no node is kept alive after the tree let it go.
* A handle is ``(node, back)``: the position ``back`` tokens before the end of ``node``'s
  run. A split keeps the lower half's identity and end, so the handle stays exact; a
  position that moved into the new upper half is found by walking up (a hop per split since
  the entry was made). A handle whose node left the tree (``key is None``) is stale and
  dropped when met.

A draft is the tokens after the matched position: the rest of that run, then down the child
used most recently (a node with many children is a fork the index cannot choose from: the
draft stops there). It is a guess: verification decides what is kept, so an index that is
momentarily behind the tree costs acceptance, never correctness.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Hashable

from .events import CLEARED, REMOVED, STORED, CacheEvent
from .tree import Node, RadixTree

__all__ = ["TreeDraftIndex"]

#: A node with more children than this ends a draft: choosing among many continuations by
#: recency is a coin toss, and scanning them at every step would cost their number.
MAX_FORK = 8

Handle = tuple[Node, int]
_last_access = operator.attrgetter("last_access")


class TreeDraftIndex:
    """n-gram -> where it ends in one radix tree, per salt, kept by the tree's events. N-grams
    of ``min_ngram .. max_ngram`` tokens are indexed (a lookup tries the longest first);
    ``tier``: the event tier that describes the tree's nodes (``"L1"``)."""

    def __init__(self, tree: RadixTree, min_ngram: int, max_ngram: int, tier: str = "L1") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got "
                             f"{min_ngram} and {max_ngram}")
        self.tree = tree
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tier = tier
        self._by_salt: dict[Hashable, dict[bytes, Handle]] = {}

    # ------------------------------------------------------------------ events
    def on_event(self, ev: CacheEvent) -> None:
        """The tree's listener (chain it with any other: :func:`.events.fan_out`)."""
        if ev.tier != self.tier:
            return
        if ev.kind == STORED:
            self._stored(ev.salt, ev.tokens, ev.length)
        elif ev.kind == REMOVED:
            self._removed(ev.salt, ev.tokens, ev.length)
        elif ev.kind == CLEARED:
            self._by_salt.clear()

    def _node_ending_at(self, salt: Hashable, path: bytes) -> Node | None:
        """The node whose run ends exactly at the end of ``path`` (None if the tree does not
        hold the whole path; an event's path it always does)."""
        tree = self.tree
        root = tree.root if salt is None else tree._roots.get(salt)
        if root is None:
            return None
        n = len(path) >> 2
        node, pos = tree._peek(root, array("I", path), path, n)
        return node if pos == n and node is not root else None

    def _stored(self, salt: Hashable, path: bytes, length: int) -> None:
        node = self._node_ending_at(salt, path)
        if node is None:
            return
        idx = self._by_salt.setdefault(salt, {})
        end = len(path) >> 2
        lo_n, hi_n = self.min_ngram, self.max_ngram
        for e in range(end - length, end):
            handle = (node, end - e)  # shared by every n-gram ending at e
            stop = (e + 1) << 2
            for n in range(lo_n, min(hi_n, e + 1) + 1):
                idx[path[stop - (n << 2) : stop]] = handle

    def _removed(self, salt: Hashable, path: bytes, length: int) -> None:
        idx = self._by_salt.get(salt)
        if not idx:
            return
        leaf = self._node_ending_at(salt, path)
        end = len(path) >> 2
        lo_n, hi_n = self.min_ngram, self.max_ngram
        for e in range(end - length, end):
            back = end - e
            stop = (e + 1) << 2
            for n in range(lo_n, min(hi_n, e + 1) + 1):
                key = path[stop - (n << 2) : stop]
                h = idx.get(key)
                # Another occurrence of the same tokens (a live node elsewhere) stays.
                if h is not None and (h[0].key is None or (h[0] is leaf and h[1] == back)):
                    del idx[key]
        if not idx:
            del self._by_salt[salt]

    # ------------------------------------------------------------------ lookup
    def lookup(self, salt: Hashable, suffix: bytes, max_tokens: int, min_len: int = 0) -> tuple[int, list[int]]:
        """``(n, draft)``: the longest n-gram of at least ``max(min_len, min_ngram)`` tokens
        ending ``suffix`` (packed uint32, its last ``max_ngram`` tokens are read) that the
        tree of ``salt`` holds, and up to ``max_tokens`` tokens that follow it there;
        ``(0, [])`` when none does."""
        idx = self._by_salt.get(salt)
        if not idx or max_tokens < 1:
            return 0, []
        have = len(suffix) >> 2
        for n in range(min(self.max_ngram, have), max(min_len, self.min_ngram) - 1, -1):
            key = suffix[len(suffix) - (n << 2):]
            h = idx.get(key)
            if h is None:
                continue
            draft = self._follow(h, max_tokens)
            if draft is None:  # stale: its node left the tree
                del idx[key]
                continue
            if draft:
                return n, draft
        return 0, []

    @staticmethod
    def _follow(handle: Handle, k: int) -> list[int] | None:
        """Up to ``k`` tokens after the handle's position; None when the handle is stale."""
        node, back = handle
        key = node.key
        if key is None:
            return None
        ln = len(key) >> 2
        while back > ln:  # the position moved into an upper half by a split
            back -= ln
            node = node.parent
            if node is None or node.parent is None:
                return None
            key = node.key
            ln = len(key) >> 2
        out = array("I", key[(ln - back + 1) << 2 : (ln - back + 1 + k) << 2])
        while len(out) < k:
            children = node.children
            if not children or len(children) > MAX_FORK:
                break
            node = max(children.values(), key=_last_access) if len(children) > 1 else next(iter(children.values()))
            out.frombytes(node.key[: (k - len(out)) << 2])
        return out.tolist()

    # ------------------------------------------------------------------ introspection
    def num_entries(self) -> int:
        return sum(len(d) for d in self._by_salt.values())

    def salts(self) -> list[Hashable]:
        return list(self._by_salt)
