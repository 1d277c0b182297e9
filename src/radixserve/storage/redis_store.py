"""L3 in Redis or Valkey (``redis://host:port/db``), through redis-py.

One string value per page under ``<prefix><hex key>``. Batches are pipelined (one round trip
for the existence checks or gets of a prefetch, one per batch of writes); a single SET is
atomic, so a reader never sees half a page. Timeouts are short and redis-py's retries off: a
down or slow server must cost a request one bounded wait, after which the storage client
stops asking for a while (:mod:`.client`). Bounding the store's size is the server's job
(``maxmemory`` with an ``allkeys-lru`` policy fits a cache); an entry that disappears is a
miss. Any number of servers may share one database: keys name the model and tenant
(:mod:`.keys`).
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

from .base import StorageBackend

__all__ = ["RedisStorage"]


class RedisStorage(StorageBackend):
    def __init__(self, url: str, timeout_s: float = 1.0, prefix: str = "rxkv:", ttl_s: Optional[int] = None) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:  # pragma: no cover - redis is installed wherever this is tested
            raise ValueError("storage URL redis://... needs the redis package (pip install redis)") from e
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must be redis://host:port/db, got {url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1 or None, got {ttl_s}")
        self.url = url
        self.prefix = prefix.encode()
        self.ttl_s = ttl_s
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )

    def _k(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    def exists(self, keys: Sequence[bytes]) -> List[bool]:
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._k(k))
        return [bool(x) for x in pipe.execute()]

    def get(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        if not keys:
            return []
        return list(self._client.mget([self._k(k) for k in keys]))

    def put(self, items: Sequence[Tuple[bytes, bytes]]) -> None:
        if not items:
            return
        pipe = self._client.pipeline(transaction=False)
        for key, blob in items:
            pipe.set(self._k(key), blob, ex=self.ttl_s)
        pipe.execute()

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a dead connection may raise; nothing to do
            self._client.close()
