"""L3: KV pages in storage shared by servers and restarts (a local directory or Redis).

``open_storage("file:///path" | "redis://host:port/db")`` builds a backend;
:class:`StorageClient` wraps it (object checks, failures as counted misses), and the
:class:`Prefetcher` / :class:`Writer` threads move pages in the background. The tree that
decides what to fetch and write is :mod:`radixserve.cache.hicache`.
"""

from __future__ import annotations

from urllib.parse import unquote, urlparse

from radixserve.config import check_storage_url

from .base import StorageBackend
from .client import Counters, StorageClient
from .file import FileStorage
from .keys import KEY_BYTES, ModelFingerprint, encode_salt, page_keys
from .objects import HEADER_SIZE, DecodedPage, ObjectError, decode_page, encode_page
from .prefetcher import PrefetchJob, Prefetcher
from .writer import WriteItem, Writer

__all__ = [
    "Counters",
    "DecodedPage",
    "FileStorage",
    "HEADER_SIZE",
    "KEY_BYTES",
    "ModelFingerprint",
    "ObjectError",
    "PrefetchJob",
    "Prefetcher",
    "StorageBackend",
    "StorageClient",
    "WriteItem",
    "Writer",
    "check_storage_url",
    "decode_page",
    "encode_page",
    "encode_salt",
    "open_storage",
    "page_keys",
]

def open_storage(url: str, timeout_s: float = 1.0) -> StorageBackend:
    """The backend for ``url``: ``file:///path`` (a directory, created if missing) or
    ``redis://host:port/db`` (any Redis or Valkey server)."""
    check_storage_url(url)
    u = urlparse(url)
    if u.scheme == "file":
        return FileStorage(unquote(u.path))
    from .redis_store import RedisStorage

    return RedisStorage(url, timeout_s=timeout_s)
