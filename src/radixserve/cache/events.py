"""What enters and leaves a prefix cache, as events a mirror can replay exactly.

A data-parallel router keeps, per worker, a copy of what that worker's tree holds (the
meta-tree of the RadixAttention paper). Guessing it from the text sent misses evictions and
tokens the worker generated; replaying the worker's own insertions and evictions does not.
Events are at token granularity and carry the whole path from the root, so a mirror needs
no node ids (splits never change which token sequences are held, so they are not events).

Semantics, per namespace (``salt``) and tier:

* ``stored``: the last ``length`` tokens of ``tokens`` are now held, under the prefix
  ``tokens[:-length]`` (which was already held in that tier, or is stored by an earlier event);
* ``removed``: the last ``length`` tokens of ``tokens`` are no longer held (they were a leaf
  in that tier: nothing below them stays);
* ``cleared``: everything in every namespace of that tier is gone;
* ``tombstoned`` (a hybrid model's tree, L1 only): the last ``length`` tokens of ``tokens``
  (held) lost their sliding-window KV but keep their full KV;
* ``revived``: they have it again (a request recomputed them);
* ``state_stored`` (a hybrid Mamba model's tree, L1 only): the worker keeps a snapshot of the
  recurrent state after exactly ``tokens`` (held; ``length`` 0);
* ``state_dropped``: it no longer does (the snapshot was evicted; the tokens stay held).

Why a mirror needs tombstones: a hybrid tree serves a prefix only if the window before its
end is there (:mod:`.swa`), and it tombstones window KV far more often than it evicts, so a
mirror blind to them predicts hits the worker cannot serve. With them and the window (sent
beside the events) it applies the tree's own rule (:func:`.swa.served_nodes`) exactly. A run
enters live; a ``stored`` run entering partly as a tombstone is followed by ``tombstoned``.

Why the state events: a Mamba worker resumes only where a state snapshot ends
(:mod:`.mamba`), usually well short of the KV it holds. A snapshot leaving with its tokens (a
``removed`` run) has no event of its own; a ``stored`` run enters without a snapshot, and
``state_stored`` follows.

``tokens`` are packed ``uint32`` (``array('I').tobytes()``), the tree's own key format.

Tiers: a RadixCache emits ``"L1"`` events only. The tiered tree (:mod:`.hicache`) also
emits ``"L2"`` events, describing everything held locally, in L1 *or* L2 (prefix-closed, so
the rules above hold per tier), and ``"L3"`` STORED events, one per storage page the worker
wrote. Storage is shared and its evictions are not observable, so L3 has no REMOVED events
and an L3 event's prefix may not have been stored yet.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

__all__ = ["CacheEvent", "CacheListener", "STORED", "REMOVED", "CLEARED", "TOMBSTONED", "REVIVED", "STATE_STORED",
           "STATE_DROPPED", "fan_out"]

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"
TOMBSTONED = "tombstoned"
REVIVED = "revived"
STATE_STORED = "state_stored"
STATE_DROPPED = "state_dropped"


class CacheEvent(NamedTuple):
    kind: str  # STORED | REMOVED | CLEARED | TOMBSTONED | REVIVED | STATE_STORED | STATE_DROPPED
    salt: Optional[str]
    tokens: bytes  # packed uint32 path from the root to the end of the affected run
    length: int  # tokens at the end of ``tokens`` stored / removed (0 for CLEARED)
    tier: str = "L1"


CacheListener = Callable[[CacheEvent], None]


def fan_out(first: CacheListener | None, second: CacheListener) -> CacheListener:
    """One listener calling ``first`` (if any) then ``second``: a tree has one listener slot,
    and its events may feed several readers (a router's publisher, the draft index)."""
    if first is None:
        return second

    def both(ev: CacheEvent) -> None:
        first(ev)
        second(ev)

    return both
