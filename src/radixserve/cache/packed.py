"""Token ids packed as native uint32 ``bytes``: the key format of the radix trees (why:
:mod:`.tree`)."""

from __future__ import annotations

from array import array

from .base import TokenIds, as_token_bytes, as_token_list, common_prefix_at

__all__ = ["common_prefix_at", "pack", "unpack"]

_array = array


def pack(token_ids: TokenIds) -> tuple:
    """``(ids, packed)``: the ids as an indexable sequence of ints and as uint32 bytes.

    Lists are read in place by ``array.fromlist`` (cheaper than ``array("I", ids)``, which
    goes through the generic sequence protocol for every item); an ``array("I")`` is already
    packed and costs one copy. Anything else is validated and converted by
    :func:`.base.as_token_bytes`, whose ValueError names ``token_ids``."""
    t = type(token_ids)
    if t is list:
        q = _array("I")
        try:
            q.fromlist(token_ids)
        except (TypeError, OverflowError):
            as_token_bytes(token_ids)  # raises the ValueError
            raise
        return token_ids, q.tobytes()
    if t is _array and token_ids.typecode == "I":
        return token_ids, token_ids.tobytes()
    ids = token_ids if t is tuple else as_token_list(token_ids)
    return ids, as_token_bytes(ids)


def unpack(key: bytes) -> list:
    """Token ids of a packed key (for introspection, never on the hot path)."""
    return _array("I", key).tolist()
