"""The L3 interface: a key-value store of KV pages shared by servers and restarts.

A backend only moves bytes: batched existence checks, gets and puts of opaque objects under
32-byte keys (:mod:`.keys`). It may raise anything (an OSError, a redis ConnectionError, a
timeout): :class:`~radixserve.storage.client.StorageClient` turns every failure into a miss or a
skipped write and counts it, so no storage error ever reaches a request. Backends must be safe
to call from the storage client's background threads (one reader, one writer) concurrently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Tuple

__all__ = ["StorageBackend"]


class StorageBackend(ABC):
    """Opaque objects under fixed-size binary keys."""

    #: The URL the backend was opened from (for logs and stats; no credentials are added).
    url: str = ""

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        """For each key, whether an object is stored under it (one round trip where possible)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        """The object under each key, or None where there is none."""

    @abstractmethod
    def put(self, items: Sequence[Tuple[bytes, bytes]]) -> None:
        """Store each ``(key, object)``, replacing an existing one. A reader must never see half
        an object under a key: backends write atomically (rename into place, single SET)."""

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing
        """Release connections/handles (idempotent)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
