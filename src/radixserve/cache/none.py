"""NoCache: the "no cache" baseline behind the same interface.

``match_prefix`` always misses and ``insert`` stores nothing and returns 0. Since
``cacheable_length`` is 0, by the ownership rule of :mod:`.base` the caller still owns (and
frees) *every* index it passed to ``insert``; nothing goes through ``on_free``.
"""

from __future__ import annotations

import torch

from typing import Any, Hashable, Optional

from .base import (
    FreeCallback,
    MatchResult,
    PrefixCache,
    SlotIndices,
    TokenIds,
    as_index_array,
    as_token_list,
    check_num_tokens,
    empty_indices,
)

__all__ = ["NoCache"]


class _NoCacheRoot:
    """The handle every miss returns; locking it does nothing."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NoCacheRoot"


class NoCache(PrefixCache):
    """Never matches, never stores."""

    def __init__(self, page_size: int = 1, on_free: Optional[FreeCallback] = None) -> None:
        super().__init__(page_size, on_free)
        self._root = _NoCacheRoot()

    @property
    def root(self) -> _NoCacheRoot:
        return self._root

    def match_prefix(self, token_ids: TokenIds, salt: Hashable = None,
                     low_priority_from: Optional[int] = None,
                     probation_from: Optional[int] = None) -> MatchResult:
        as_token_list(token_ids)  # same argument validation as the real caches
        return MatchResult(empty_indices(), 0, self._root)

    def insert(self, token_ids: TokenIds, indices: SlotIndices, salt: Hashable = None,
               low_priority_from: Optional[int] = None,
               probation_from: Optional[int] = None) -> int:
        """Validates its arguments and stores nothing: the caller frees all ``indices``."""
        as_index_array(indices, len(as_token_list(token_ids)))
        return 0

    def cacheable_length(self, num_tokens: int) -> int:
        return 0

    def _check_handle(self, node: Any) -> None:
        if node is not self._root:
            raise ValueError(f"node must be a handle from this cache's match_prefix, got {node!r}")

    def lock(self, node: Any) -> None:
        self._check_handle(node)

    def unlock(self, node: Any) -> None:
        self._check_handle(node)

    def evict(self, num_tokens: int) -> int:
        check_num_tokens(num_tokens)
        return 0

    def reset(self) -> None:
        """Nothing to drop."""

    def held_slots(self) -> torch.Tensor:
        return empty_indices()

    @property
    def num_nodes(self) -> int:
        return 0

    def dump(self) -> str:
        return repr(self)

    def check_integrity(self) -> None:
        """Trivially consistent."""
