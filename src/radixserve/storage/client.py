"""Pages in and out of a storage backend, with every failure turned into a counted miss.

:class:`StorageClient` is what the cache (through the prefetcher and the writer threads) uses
instead of a backend directly. It encodes and checks objects (:mod:`.objects`), so a corrupt,
truncated or foreign object is a miss and never data; and it catches every exception a backend
raises (connection refused, timeout, disk error), counts it and stops calling the backend for
``retry_after_s``, so that a dead server costs one timeout, not one per request. Nothing
here raises to the caller.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from .base import StorageBackend
from .keys import ModelFingerprint
from .objects import DecodedPage, ObjectError, decode_page, encode_page

__all__ = ["StorageClient", "Counters"]

T = TypeVar("T")
#: What ``_call`` returns when the backend failed or was not called (None is a valid result).
_FAILED: object = object()


class Counters:
    """Integer counters that several threads add to."""

    def __init__(self, names: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._c: Dict[str, int] = {n: 0 for n in names}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def get(self, name: str) -> int:
        with self._lock:
            return self._c.get(name, 0)

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._c)


_COUNTERS = (
    "errors",  # backend calls that raised (each one also starts a back-off)
    "skipped_calls",  # calls not made because the backend failed within retry_after_s
    "pages_present",  # pages an existence check found
    "pages_read",  # valid pages read
    "bytes_read",
    "pages_written",
    "bytes_written",
    "pages_already_present",  # writes skipped: another writer (or an earlier run) stored them
    "corrupt",  # objects that failed a checksum or had a malformed header
    "truncated",
    "foreign",  # another model/format, or stored under a key that is not its own
    "vanished",  # said to exist, gone when read (evicted by the store in between)
)


class StorageClient:
    def __init__(self, backend: StorageBackend, fingerprint: ModelFingerprint, retry_after_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(backend, StorageBackend):
            raise ValueError(f"backend must be a StorageBackend, got {type(backend).__name__}")
        if not isinstance(fingerprint, ModelFingerprint):
            raise ValueError(f"fingerprint must be a ModelFingerprint, got {type(fingerprint).__name__}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.backend = backend
        self.fingerprint = fingerprint
        self.page_tokens = fingerprint.page_tokens
        self.retry_after_s = retry_after_s
        self.counters = Counters(_COUNTERS)
        self.last_error: Optional[str] = None
        self._clock = clock
        self._down_until = float("-inf")

    # ------------------------------------------------------------------ failure handling
    @property
    def healthy(self) -> bool:
        """False while backing off after a failed call."""
        return self._clock() >= self._down_until

    def _call(self, fn: Callable[[], T]) -> Any:
        """``fn()``, or ``_FAILED`` if it raised or the backend is backing off."""
        if self._clock() < self._down_until:
            self.counters.add("skipped_calls")
            return _FAILED
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - any backend failure is a miss, by contract
            self.counters.add("errors")
            self.last_error = f"{type(e).__name__}: {e}"
            self._down_until = self._clock() + self.retry_after_s
            return _FAILED

    # ------------------------------------------------------------------ reads
    def count_present(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (0 on any failure)."""
        if not keys:
            return 0
        found = self._call(lambda: self.backend.exists(list(keys)))
        if found is _FAILED:
            return 0
        n = next((i for i, f in enumerate(found) if not f), len(found))
        self.counters.add("pages_present", n)
        return n

    def fetch(self, keys: Sequence[bytes]) -> List[DecodedPage]:
        """The pages under ``keys``, from the first, up to the first one that is missing or
        fails a check (the rest of a chain is useless without it)."""
        if not keys:
            return []
        blobs = self._call(lambda: self.backend.get(list(keys)))
        if blobs is _FAILED:
            return []
        out: List[DecodedPage] = []
        for key, blob in zip(keys, blobs):
            if blob is None:
                self.counters.add("vanished")
                break
            try:
                page = decode_page(blob, key, self.fingerprint)
            except ObjectError as e:
                self.counters.add(e.reason)
                break
            out.append(page)
            self.counters.add("pages_read")
            self.counters.add("bytes_read", len(blob))
        return out

    # ------------------------------------------------------------------ writes
    def store(self, pages: Sequence[Tuple[bytes, torch.Tensor]]) -> Optional[List[bool]]:
        """Write each ``(key, data)`` not already stored; per page, True if it is stored now
        (written or found), or None if the backend failed."""
        if not pages:
            return []
        keys = [k for k, _ in pages]
        present = self._call(lambda: self.backend.exists(keys))
        if present is _FAILED:
            return None
        todo = [(k, d) for (k, d), p in zip(pages, present) if not p]
        self.counters.add("pages_already_present", len(pages) - len(todo))
        if todo:
            now = time.time()
            blobs = [(k, encode_page(k, self.fingerprint, d, now)) for k, d in todo]
            if self._call(lambda: self.backend.put(blobs)) is _FAILED:
                return None
            self.counters.add("pages_written", len(blobs))
            self.counters.add("bytes_written", sum(len(b) for _, b in blobs))
        return [True] * len(pages)

    def stats(self) -> Dict[str, object]:
        return {**self.counters.snapshot(), "url": self.backend.url, "healthy": self.healthy,
                "last_error": self.last_error}

    def close(self) -> None:
        self._call(self.backend.close)
