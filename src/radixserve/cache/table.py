"""TableCache: the paper's "no tree structure" ablation.

Whole inserted sequences live in a flat LRU table; a request reuses the longest stored
sequence that is a prefix of it (one level of sharing, never a partial entry, never a split),
so two requests sharing a system prompt each keep their own copy of the prompt's KV: exactly
the waste the radix tree removes.

Entry rules (chosen so that every slot has a well-defined owner set):

* Entries are immutable once stored, so a request that matched entry ``E`` (and holds its
  lock) can rely on ``E`` still being a prefix of its sequence when it inserts.
* ``insert(q)`` where a stored entry ``E`` is a proper prefix of ``q``: a new entry ``q`` is
  stored whose slots are ``E.slots + indices[len(E):A]`` — the only sharing the table does
  (one level) — and ``E`` is dropped if it is unlocked (``q`` replaces it; a locked ``E``
  stays until evicted).  Returns ``len(E)``.
* ``insert(q)`` with an identical entry: returns ``len(q)``, nothing stored.
* otherwise ``q`` becomes a new entry owning ``indices[:A]`` (return 0), even when an entry
  shares part of its prefix or has ``q`` as a prefix — no partial sharing, by design.
* Slots carry reference counts (how many entries hold them); a slot goes back through
  ``on_free`` when its last entry is evicted.  ``total_size`` counts distinct slots;
  ``protected_size`` the slots held by at least one locked entry.
* Locks and LRU eviction are per entry: an entry is evicted whole.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Dict, Hashable, List, Optional, Tuple

import numpy as np
import torch

from .base import (
    FreeCallback,
    MatchResult,
    PrefixCache,
    SlotIndices,
    TokenIds,
    as_index_array,
    as_token_tuple,
    check_num_tokens,
    empty_indices,
)

__all__ = ["TableCache", "TableEntry"]

_EMPTY_VALUE = np.empty(0, dtype=np.int64)


class TableEntry:
    """One stored sequence (or the sentinel returned on a miss, with an empty key)."""

    __slots__ = ("key", "value", "salt", "lock_ref", "last_access", "hit_count", "id", "alive")

    def __init__(self, key: tuple, value: np.ndarray, salt: Hashable, stamp: int, eid: int):
        self.key = key
        self.value = value
        self.salt = salt
        self.lock_ref = 0
        self.last_access = stamp
        self.hit_count = 0
        self.id = eid
        self.alive = True

    def __repr__(self) -> str:
        return (f"TableEntry#{self.id}(len={len(self.key)}, salt={self.salt!r}, lock={self.lock_ref}, "
                f"last={self.last_access}, hits={self.hit_count}, alive={self.alive})")


class TableCache(PrefixCache):
    """Flat table of whole sequences with per-entry locks and LRU eviction."""

    def __init__(self, page_size: int = 1, on_free: Optional[FreeCallback] = None) -> None:
        super().__init__(page_size, on_free)
        self._ids = itertools.count()
        # The miss handle: lock/unlock on it are no-ops (like a tree root).
        self._root = TableEntry((), _EMPTY_VALUE, None, 0, -1)
        self._init_state()

    def _init_state(self) -> None:
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        # (salt, first token or first page) -> entries starting with it: no whole-table scans.
        self._buckets: Dict[Tuple[Hashable, Any], List[TableEntry]] = {}
        self._lru: "OrderedDict[int, TableEntry]" = OrderedDict()  # oldest first
        # Per-slot counts (by slot id, grown on demand): entries holding it, locked ones among them.
        self._refs = np.zeros(0, dtype=np.int64)
        self._locked = np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ sizes
    @property
    def num_nodes(self) -> int:
        return len(self._lru)

    @property
    def root(self) -> TableEntry:
        return self._root

    # ------------------------------------------------------------------ lookup
    def _bucket_key(self, key: tuple, salt: Hashable):
        ps = self.page_size
        return (salt, key[0] if ps == 1 else tuple(key[:ps]))

    def _longest_prefix_entry(self, key: tuple, n: int, salt: Hashable) -> Optional[TableEntry]:
        """The longest stored entry that is a prefix of ``key[:n]`` (n page-aligned)."""
        bucket = self._buckets.get(self._bucket_key(key, salt)) if n else None
        if not bucket:
            return None
        best = None
        best_len = 0
        for e in bucket:
            L = len(e.key)
            if best_len < L <= n and key[:L] == e.key:
                best, best_len = e, L
        return best

    def _touch(self, e: TableEntry) -> None:
        self._clock += 1
        e.last_access = self._clock
        self._lru.move_to_end(e.id)

    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> MatchResult:
        """Longest stored whole sequence that is a (page-aligned) prefix of ``token_ids``."""
        key = as_token_tuple(token_ids)
        n = len(key)
        n -= n % self.page_size
        e = self._longest_prefix_entry(key, n, salt)
        if e is None:
            return MatchResult(empty_indices(), 0, self._root)
        self._touch(e)
        e.hit_count += 1
        return MatchResult(torch.from_numpy(e.value.copy()), len(e.key), e)

    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None,
               low_priority_from: Optional[int] = None,
               probation_from: Optional[int] = None) -> int:
        """Store the page-aligned part of ``token_ids``; return the length of the longest
        stored entry that was a prefix of it (the caller's duplicates are ``indices[:n]``
        minus the slots it matched).  See the module docstring for the entry rules."""
        key = as_token_tuple(token_ids)
        n = len(key)
        arr = as_index_array(indices, n)
        hash(salt)
        n -= n % self.page_size
        if n == 0:
            return 0
        e = self._longest_prefix_entry(key, n, salt)
        if e is not None and len(e.key) == n:
            self._touch(e)
            return n
        have = 0 if e is None else len(e.key)
        tail = arr[have:n]
        if len(np.unique(tail)) != len(tail):
            raise ValueError("indices must not repeat a slot")
        self._grow(int(tail.max()) + 1 if len(tail) else 0)
        if len(tail) and self._refs[tail].any():
            raise ValueError("indices[len(matched entry):] contains slots the cache already holds")
        value = tail.copy() if e is None else np.concatenate([e.value, tail])
        self._clock += 1
        new = TableEntry(key[:n], value, salt, self._clock, next(self._ids))
        self._buckets.setdefault(self._bucket_key(key, salt), []).append(new)
        self._lru[new.id] = new
        self._refs[value] += 1
        self._evictable += len(tail)
        if e is not None and not e.lock_ref:
            self._drop(e)  # replaced: its slots live on in the new entry
        return have

    def _grow(self, size: int) -> None:
        if size > len(self._refs):
            size = max(size, 2 * len(self._refs), 1024)
            for name in ("_refs", "_locked"):
                old = getattr(self, name)
                arr = np.zeros(size, dtype=np.int64)
                arr[: len(old)] = old
                setattr(self, name, arr)

    # ------------------------------------------------------------------ locks
    def _check_handle(self, e: Any) -> None:
        if type(e) is not TableEntry:
            raise ValueError(f"node must be a handle from match_prefix, got {type(e).__name__}")
        if not e.alive:
            raise ValueError("node has been evicted or reset; its handle is no longer valid")

    def lock(self, node: TableEntry) -> None:
        """Protect one entry (the whole entry: that is what was matched)."""
        self._check_handle(node)
        if node is self._root:
            return
        if node.lock_ref == 0:
            v = node.value
            newly = int(np.count_nonzero(self._locked[v] == 0))
            self._locked[v] += 1
            self._evictable -= newly
            self._protected += newly
        node.lock_ref += 1

    def unlock(self, node: TableEntry) -> None:
        self._check_handle(node)
        if node is self._root:
            return
        if node.lock_ref <= 0:
            raise RuntimeError(f"unlock of {node!r} without a matching lock")
        node.lock_ref -= 1
        if node.lock_ref == 0:
            v = node.value
            self._locked[v] -= 1
            released = int(np.count_nonzero(self._locked[v] == 0))
            self._protected -= released
            self._evictable += released

    # ------------------------------------------------------------------ eviction
    def _drop(self, e: TableEntry) -> np.ndarray:
        """Remove an unlocked entry; return the slots no other entry holds (now free)."""
        del self._lru[e.id]
        bk = self._bucket_key(e.key, e.salt)
        bucket = self._buckets[bk]
        bucket.remove(e)
        if not bucket:
            del self._buckets[bk]
        e.alive = False
        v = e.value
        self._refs[v] -= 1
        gone = v[self._refs[v] == 0]
        self._evictable -= len(gone)
        return gone

    def evict(self, num_tokens: int) -> int:
        """Evict whole unlocked entries, least recently used first, until ``num_tokens``
        slots are freed (slots shared with a surviving entry are not freed)."""
        num_tokens = check_num_tokens(num_tokens)
        freed = 0
        victims = []
        for e in self._lru.values():
            if freed >= num_tokens:
                break
            if not e.lock_ref:
                victims.append(e)
                freed += int(np.count_nonzero(self._refs[e.value] == 1))
        gone = [self._drop(e) for e in victims]  # after the scan: the LRU dict cannot change while iterated
        freed = sum(map(len, gone))
        if freed:
            self.evicted_tokens += freed
            self.on_free(torch.from_numpy(np.concatenate(gone)))
        return freed

    def reset(self) -> None:
        """Drop every entry, returning all slots through ``on_free``; RuntimeError (and no
        change) while anything is locked."""
        if self._protected:
            raise RuntimeError(f"reset() while {self._protected} tokens are locked")
        for e in self._lru.values():
            e.alive = False
        held = np.flatnonzero(self._refs)
        self._init_state()
        if len(held):
            self.on_free(torch.from_numpy(held.astype(np.int64)))

    # ------------------------------------------------------------------ introspection
    def held_slots(self) -> torch.Tensor:
        return torch.from_numpy(np.flatnonzero(self._refs).astype(np.int64))

    def entries(self, salt: Hashable = None) -> List[tuple]:
        """Stored sequences of one namespace as tuples, oldest first."""
        return [tuple(e.key) for e in self._lru.values() if e.salt == salt]

    def dump(self, max_tokens: int = 8) -> str:
        lines = [repr(self)]
        for e in self._lru.values():
            toks = ",".join(map(str, e.key[:max_tokens])) + (",..." if len(e.key) > max_tokens else "")
            lines.append(f"#{e.id} salt={e.salt!r} [{toks}] len={len(e.key)} lock={e.lock_ref} "
                         f"hits={e.hit_count} last={e.last_access}")
        return "\n".join(lines)

    def check_integrity(self) -> None:
        ps = self.page_size
        refs = np.zeros(len(self._refs), dtype=np.int64)
        locked = np.zeros(len(self._refs), dtype=np.int64)
        last = -1
        for e in self._lru.values():
            if not e.alive or not e.key:
                raise AssertionError(f"{e!r}: dead or empty entry in the table")
            if len(e.key) != len(e.value) or len(e.key) % ps:
                raise AssertionError(f"{e!r}: bad length")
            if len(np.unique(e.value)) != len(e.value):
                raise AssertionError(f"{e!r}: a slot repeats inside one entry")
            if e.lock_ref < 0:
                raise AssertionError(f"{e!r}: negative lock count")
            if e.last_access < last:
                raise AssertionError(f"{e!r}: LRU order broken")
            last = e.last_access
            if e not in self._buckets.get(self._bucket_key(e.key, e.salt), ()):
                raise AssertionError(f"{e!r}: missing from its bucket")
            refs[e.value] += 1
            if e.lock_ref:
                locked[e.value] += 1
        if sum(map(len, self._buckets.values())) != len(self._lru):
            raise AssertionError("bucket index and LRU list disagree")
        if not (np.array_equal(refs, self._refs) and np.array_equal(locked, self._locked)):
            raise AssertionError("slot reference/lock counts disagree with the entries")
        total = int(np.count_nonzero(refs))
        protected = int(np.count_nonzero(locked))
        if (total - protected, protected) != (self._evictable, self._protected):
            raise AssertionError(f"size accounting: entries say {total - protected}/{protected}, counters "
                                 f"{self._evictable}/{self._protected}")
