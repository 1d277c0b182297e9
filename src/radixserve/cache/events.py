"""What enters and leaves a prefix cache, as events a mirror can replay exactly.

A data-parallel router keeps, per worker, a copy of what that worker's tree holds (the
meta-tree of the RadixAttention paper). Guessing it from the text the router has sent
misses evictions and tokens the worker generated; replaying the worker's own insertions
and evictions does not. The events are at token granularity and carry the whole path from
the root, so a mirror needs no node ids (the worker's splits never change which token
sequences are held, so splits are not events).

Semantics, per namespace (``salt``) and tier:

* ``stored``: the last ``length`` tokens of ``tokens`` are now held, under the prefix
  ``tokens[:-length]`` (which was already held in that tier, or is stored by an earlier event);
* ``removed``: the last ``length`` tokens of ``tokens`` are no longer held (they were a leaf
  in that tier: nothing below them stays);
* ``cleared``: everything in every namespace of that tier is gone.

``tokens`` are packed ``uint32`` (``array('I').tobytes()``), the tree's own key format.

Tiers: a RadixCache emits ``"L1"`` events only. The tiered tree
(:mod:`radixserve.cache.hicache`) also emits ``"L2"`` events, which describe everything the
worker holds locally, in L1 *or* L2 (a prefix-closed set, so the rules above hold per tier),
and ``"L3"`` STORED events, one per storage page the worker wrote. Storage is shared by all
workers and its evictions are not observable, so L3 has no REMOVED events and an L3 event's
prefix may not have been stored yet.
"""

from __future__ import annotations

from array import array
from typing import Callable, NamedTuple, Optional

__all__ = ["CacheEvent", "CacheListener", "STORED", "REMOVED", "CLEARED"]

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


class CacheEvent(NamedTuple):
    kind: str  # STORED | REMOVED | CLEARED
    salt: Optional[str]
    tokens: bytes  # packed uint32 path from the root to the end of the affected run
    length: int  # tokens at the end of ``tokens`` stored / removed (0 for CLEARED)
    tier: str = "L1"

    def token_list(self) -> list:
        return array("I", self.tokens).tolist()


CacheListener = Callable[[CacheEvent], None]
