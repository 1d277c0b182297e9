"""The prefix-cache interface shared by the radix tree, the flat-table ablation and NoCache.

The scheduler, the only caller, drives every cache through the same handful of methods, so
the paper's ablations (no cache / table instead of tree) are a configuration switch.

Ownership of KV slots (the rule every implementation follows)
-------------------------------------------------------------
A KV slot is in exactly one place: the allocator's free list, the cache, or privately held
by a running request.  The cache never allocates; it only *takes* slots in ``insert`` and
*gives them back* through the ``on_free`` callback (in ``evict`` and ``reset``).

For one request with ``L`` tokens ``ids`` and slots ``idx`` (``len(idx) == L``), where the
request started from ``r = cache.match_prefix(ids[:...])`` of length ``m = r.length``,
kept ``r.node`` locked while it ran, and built ``idx = cat(r.indices, fresh slots)``::

    n = cache.insert(ids, idx)           # tokens that were already cached before this call
    A = cache.cacheable_length(L)        # page-aligned length the cache will hold
    # idx[:m]  -> the cache's own slots (came from match_prefix): do nothing
    # idx[m:n] -> duplicates of slots the cache already holds: the caller frees them
    # idx[n:A] -> now owned by the cache: the caller must NOT free them
    # idx[A:]  -> unaligned tail the cache does not store: the caller frees them
    cache.unlock(r.node)

``m <= n`` holds as long as ``r.node`` stays locked until after ``insert`` (a locked path
cannot be evicted).  ``NoCache.cacheable_length`` is 0, so with it the caller frees
everything it allocated, which is exactly the "no cache" baseline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from typing import Any, Callable, Hashable, Optional, Protocol, Sequence, Union

import numpy as np
import torch

__all__ = [
    "MatchResult",
    "check_low_priority_from",
    "common_prefix_tokens",
    "PrefixCache",
    "TieredCache",
    "FreeCallback",
    "TokenIds",
    "SlotIndices",
]

#: Called with a 1-D ``torch.int64`` CPU tensor of slots the cache no longer holds.
FreeCallback = Callable[[torch.Tensor], None]
#: ``array('I')`` is the packed form the radix tree reads without converting (the engine
#: passes it, see ``Req.cache_key``); lists are packed inside each call.
TokenIds = Union[Sequence[int], "array[int]", np.ndarray, torch.Tensor]
SlotIndices = Union[Sequence[int], np.ndarray, torch.Tensor]


class CacheHandle(Protocol):
    """Where a match ends, as a cache hands it out (a tree's node, a table's entry, the empty
    cache's root): opaque to everyone else, who only passes it back (lock, unlock, a session's
    hold, a Mamba snapshot's fork)."""


class PrefetchTicket(Protocol):
    """A tiered cache's fetch from storage for one waiting request (:meth:`TieredCache.prefetch`):
    opaque to the scheduler, which passes it back until the request is admitted or leaves."""


class MatchResult:
    """Result of :meth:`PrefixCache.match_prefix`: what the scheduler needs, per tier.

    ``indices``: the ``length`` L1 (KV pool) slots of the matched prefix in token order, a
    fresh 1-D int64 tensor (never aliasing the cache's storage) built on first access from the
    runs the match captured (a cache never changes a run in place), so a match read only for
    its length and node (the waiting queue's order, a session's lock) builds no tensor.
    ``node``: an opaque handle for ``lock``/``unlock`` (on a miss a root: no-ops). A tiered
    cache holds ``host_length`` more tokens in a lower tier, ending at ``host_node``
    (``load_back`` moves them into L1; ``loaded``: how many of ``length`` it brought in)."""

    __slots__ = ("_indices", "_runs", "length", "node", "host_length", "host_node", "loaded")

    def __init__(self, indices: torch.Tensor, length: int, node: CacheHandle, host_length: int = 0,
                 host_node: Optional[CacheHandle] = None, loaded: int = 0) -> None:
        self._indices: Optional[torch.Tensor] = indices
        self._runs: Sequence[np.ndarray] = ()
        self.length = length
        self.node = node
        self.host_length = host_length
        self.host_node = host_node
        self.loaded = loaded

    @property
    def indices(self) -> torch.Tensor:
        idx = self._indices
        if idx is None:
            runs = self._runs
            if runs:
                idx = torch.from_numpy(runs[0].copy() if len(runs) == 1 else np.concatenate(runs))
            else:
                idx = empty_indices()
            self._indices = idx
            self._runs = ()
        return idx

    @property
    def total_length(self) -> int:
        """Tokens the cache can serve without recomputing them, in any tier."""
        return self.length + self.host_length

    def __repr__(self) -> str:
        return (f"MatchResult(length={self.length}, node={self.node!r}, host_length={self.host_length}, "
                f"loaded={self.loaded})")


_new_object = object.__new__


def match_of_runs(runs: Sequence[np.ndarray], length: int, node: CacheHandle, host_length: int = 0,
                  host_node: Optional[CacheHandle] = None) -> MatchResult:
    """A :class:`MatchResult` whose ``indices`` are the concatenation of ``runs`` (int64
    arrays the cache will not change in place), built when first read."""
    m = _new_object(MatchResult)
    m._indices = None
    m._runs = runs
    m.length = length
    m.node = node
    m.host_length = host_length
    m.host_node = host_node
    m.loaded = 0
    return m


def _noop_free(indices: torch.Tensor) -> None:
    """Default ``on_free``: used only by tests/benchmarks that do not track slots."""


class PrefixCache(ABC):
    """Maps token prefixes to the KV slots that hold their keys/values. Subclasses keep
    ``evictable_size + protected_size == total_size`` (tokens held) and move tokens between
    the two buckets exactly when a lock count goes 0->1 or 1->0."""

    page_size: int
    #: Whether a request may hit a *part* of another request's prompt (a tree can, a table of
    #: whole sequences cannot): only then does the scheduler's in-batch sharing (a request
    #: waits one step for another computing their common uncached prefix) pay off.
    can_share_partial_prefix: bool = False

    def __init__(self, page_size: int = 1, on_free: Optional[FreeCallback] = None) -> None:
        page_size = check_page_size(page_size)
        if on_free is not None and not callable(on_free):
            raise ValueError(f"on_free must be callable or None, got {on_free!r}")
        self.page_size = int(page_size)
        self.on_free: FreeCallback = on_free if on_free is not None else _noop_free
        #: Cumulative number of tokens handed back through ``evict`` (not ``reset``).
        self.evicted_tokens = 0

    # ------------------------------------------------------------------ core API
    @abstractmethod
    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> MatchResult:
        """Longest cached (page-aligned) prefix of ``token_ids`` in namespace ``salt``.
        ``low_priority_from``, ``probation_from``: what this request's tokens are worth
        keeping (see :meth:`insert`); the match does not raise those past either."""

    def match_inserted(self, token_ids: TokenIds, salt: Hashable = None,
                       low_priority_from: int | None = None,
                       probation_from: int | None = None) -> MatchResult:
        """The cached path of tokens the caller just inserted, for it to lock while it goes on
        computing after them: :meth:`match_prefix` here; a cache whose matches may stop short
        of the KV it holds (Mamba snapshots, ``.mamba``) returns the whole KV path instead."""
        return self.match_prefix(token_ids, salt, low_priority_from, probation_from)

    @abstractmethod
    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None,
               low_priority_from: Optional[int] = None,
               probation_from: Optional[int] = None) -> int:
        """Store ``token_ids`` -> ``indices``; return how many leading tokens were already
        cached before the call (the module docstring says who frees what).
        ``low_priority_from``: tokens from there on are evicted before all others;
        ``probation_from`` (the prefix the request did not find cached): tokens from there up
        to ``low_priority_from`` go before normal ones but after low ones, and are raised to
        normal by the next request that finds them (:class:`~.radix.RadixCache`; the other
        caches have one priority and ignore both)."""

    @abstractmethod
    def lock(self, node: CacheHandle) -> None:
        """Protect the tokens of ``node`` (and, for a tree, its whole root path)."""

    @abstractmethod
    def unlock(self, node: CacheHandle) -> None:
        """Release one ``lock``; raises RuntimeError on unbalanced unlock."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked tokens if possible (through ``on_free``);
        return how many were freed (may exceed the request: whole nodes go)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything, handing every held slot back through ``on_free``. Raises
        RuntimeError (and changes nothing) while anything is locked: a running request still
        reads those slots."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError/RuntimeError if an internal invariant is violated."""

    #: Token counters behind the two sizes; implementations move tokens between them.
    _evictable = 0
    _protected = 0

    @property
    def evictable_size(self) -> int:
        """Tokens held that no lock protects (what ``evict`` could free)."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens held under at least one lock."""
        return self._protected

    @property
    @abstractmethod
    def num_nodes(self) -> int:
        """Number of nodes/entries (roots excluded)."""

    @abstractmethod
    def dump(self) -> str:
        """Human-readable picture of the cache contents, for debugging."""

    def held_slots(self) -> Optional[torch.Tensor]:
        """Every slot the cache holds (for integrity checks; O(size)), or None if unknown."""
        return None

    # ------------------------------------------------------------------ lifecycle
    #: Whether this cache has tiers below the KV pool: then it also implements
    #: :class:`TieredCache`, and the scheduler drives those calls (prefetch, load_back, ...).
    tiered: bool = False

    def poll(self) -> None:
        """Finish background work (prefetches, writes) on the scheduler's thread."""

    def wait_background(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for background work a waiting request needs (a prefetch):
        called when a step ran nothing although requests wait, since a spinning loop would
        hold the GIL the background reader needs."""

    def close(self) -> None:
        """Stop background threads (at shutdown)."""

    # ------------------------------------------------------------------ shared helpers
    @property
    def total_size(self) -> int:
        """Tokens (= KV slots) the cache holds."""
        return self.evictable_size + self.protected_size

    @property
    def pretty(self) -> str:
        """Same as :meth:`dump`; handy in a debugger."""
        return self.dump()

    def cacheable_length(self, num_tokens: int) -> int:
        """How many of ``num_tokens`` tokens an ``insert`` would keep (whole pages only): the
        caller frees ``indices[cacheable_length(len(indices)):]`` after ``insert``."""
        return num_tokens - num_tokens % self.page_size

    def stats(self) -> dict:
        """Sizes and counters, for metrics and logs."""
        return {
            "kind": type(self).__name__,
            "page_size": self.page_size,
            "total_size": self.total_size,
            "evictable_size": self.evictable_size,
            "protected_size": self.protected_size,
            "num_nodes": self.num_nodes,
            "evicted_tokens": self.evicted_tokens,
        }

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(page_size={self.page_size}, total={self.total_size}, "
                f"evictable={self.evictable_size}, protected={self.protected_size}, nodes={self.num_nodes})")


class TieredCache(Protocol):
    """What a cache with tiers below the KV pool adds (:class:`~.hicache.HiRadixCache`, whose
    package gives the order of calls); ``PrefixCache.tiered`` says whether a cache has it."""

    def prefetch(self, token_ids: TokenIds, salt: Hashable = None) -> Optional[PrefetchTicket]:
        """Start fetching what lower tiers hold beyond the local match (on arrival)."""

    def prefetch_ready(self, handle: PrefetchTicket) -> bool:
        """Whether a request whose prefetch is ``handle`` may be admitted now."""

    def cancel_prefetch(self, handle: PrefetchTicket) -> None:
        """A request left the queue before its prefetch finished."""

    def load_back(self, m: MatchResult) -> MatchResult:
        """Bring the part of a match held in a lower tier into the KV pool."""

    def flush_loads(self) -> int:
        """Issue the copies of this step's ``load_back`` s (before the forward)."""

    def record_admission(self, token_ids: TokenIds, m: MatchResult, salt: Hashable = None,
                         prefetch: Optional[PrefetchTicket] = None) -> Optional[dict]:
        """Per-request report of where the cached tokens came from (tiers)."""


# ---------------------------------------------------------------------- input coercion
_EMPTY_I64 = np.empty(0, dtype=np.int64)
_from_bytes = int.from_bytes


def as_token_list(token_ids: TokenIds) -> list:
    """Token ids as a Python list of ints; lists are used as-is (never mutated, never
    stored): list slicing/equality runs at C speed, which makes key comparison cheap."""
    t = type(token_ids)
    if t is list:
        return token_ids  # type: ignore[return-value]
    if t is tuple:
        return list(token_ids)  # type: ignore[arg-type]
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        if token_ids.is_floating_point() or token_ids.is_complex():
            raise ValueError(f"token_ids must hold integers, got dtype {token_ids.dtype}")
        return token_ids.tolist()
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {token_ids.shape}")
        if token_ids.dtype.kind not in "iu":
            raise ValueError(f"token_ids must hold integers, got dtype {token_ids.dtype}")
        return token_ids.tolist()
    if isinstance(token_ids, (str, bytes)):
        raise ValueError("token_ids must be a sequence of ints, got a string")
    try:
        return list(token_ids)  # any other sequence / iterable of ints
    except TypeError:
        raise ValueError(f"token_ids must be a sequence of ints, got {t.__name__}") from None


def as_token_tuple(token_ids: TokenIds) -> tuple:
    """Token ids as a tuple of ints (tuples as-is), the table cache's keys: CPython's cyclic
    GC untracks a tuple of ints after one look, while a list of ints is re-traversed by every
    collection of its generation."""
    if type(token_ids) is tuple:
        return token_ids  # type: ignore[return-value]
    if type(token_ids) is list:
        return tuple(token_ids)
    return tuple(as_token_list(token_ids))


def as_token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids packed as native uint32 (``array('I', ids).tobytes()``), the radix tree's
    key format (:mod:`.tree` says why); ValueError naming ``token_ids`` for anything that is
    not a 1-D sequence of ints in ``[0, 2**32)``."""
    ids = token_ids if type(token_ids) in (list, tuple) else as_token_list(token_ids)
    try:
        return array("I", ids).tobytes()
    except OverflowError:
        raise ValueError("token_ids must be ints in [0, 2**32)") from None
    except TypeError:
        bad = next((x for x in ids if not isinstance(x, (int, np.integer))), None)
        raise ValueError(f"token_ids must be a sequence of ints, got an item {bad!r}") from None


def as_index_array(indices: SlotIndices, expected_len: int) -> np.ndarray:
    """Slot indices as a 1-D int64 numpy array (a view when possible: the caller slices
    and copies only the part the cache keeps)."""
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ValueError(f"indices must hold integers, got dtype {indices.dtype}")
        if indices.device.type != "cpu":
            indices = indices.cpu()
        arr = indices.numpy()
    elif isinstance(indices, np.ndarray):
        if indices.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {indices.shape}")
        if indices.dtype.kind not in "iu":
            raise ValueError(f"indices must hold integers, got dtype {indices.dtype}")
        arr = indices
    else:
        try:
            arr = np.asarray(indices, dtype=np.int64)
        except (TypeError, ValueError):
            raise ValueError("indices must be a 1-D sequence of ints") from None
        if arr.ndim != 1:
            if arr.size == 0:
                arr = _EMPTY_I64
            else:
                raise ValueError(f"indices must be 1-D, got shape {arr.shape}")
    if arr.dtype != np.int64:
        arr = arr.astype(np.int64)
    if arr.shape[0] != expected_len:
        raise ValueError(
            f"indices has {arr.shape[0]} entries but token_ids has {expected_len}; "
            "they must be the same length"
        )
    return arr


def common_prefix_at(key: bytes, query: bytes, off: int, lim: int) -> int:
    """Tokens that ``key[:lim]`` and ``query[off:off + lim]`` (``lim`` in bytes) share.

    Both runs are read as little-endian integers and XOR-ed: the lowest set bit of the
    result sits in the first differing token (4 bytes = 32 bits per token). O(length) at C
    speed, no per-token Python loop."""
    x = _from_bytes(key[:lim], "little") ^ _from_bytes(query[off : off + lim], "little")
    if not x:
        return lim >> 2
    return ((x & -x).bit_length() - 1) >> 5


def common_prefix_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two packed uint32 keys share."""
    return common_prefix_at(a, b, 0, min(len(a), len(b)))


def check_page_size(page_size: Any) -> int:
    """Validate a ``page_size`` argument (an int >= 1)."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)):
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    return int(page_size)


def check_low_priority_from(value: Any, field: str = "low_priority_from") -> Optional[int]:
    """``value`` if it is None or a token position (an int in [0, 2**63)), else ValueError
    naming ``field``: a request's position from which what it caches is evicted first. (A
    position past the prompt lowers nothing; the bound keeps it a 64-bit int on the wire.)"""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
            or not 0 <= value < 1 << 63):
        raise ValueError(f"{field} must be an integer >= 0 and < 2**63, got {value!r}")
    return int(value)


def check_num_tokens(num_tokens: int) -> int:
    """Validate the argument of ``evict``."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
        raise ValueError(f"num_tokens must be an int, got {num_tokens!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return int(num_tokens)


def empty_indices() -> torch.Tensor:
    """A fresh empty int64 tensor (fresh so nobody can resize a shared one)."""
    return torch.empty(0, dtype=torch.int64)
