"""An LRU of image embeddings (the vision encoder + projector output), bounded in bytes.

The prefix tree saves an image's prefill only while its KV is cached and only for the prompt
prefix it sits in; the same image in another place (after a different system prompt, in a
new conversation) still needs its features. Keyed by the image's content hash
(:func:`radixserve.model.vision.image_processor.image_content_hash`), this cache lets such a
request skip the encoder too. The key is opaque to the cache: a caller that must keep
tenants from observing each other's images (through the time a hit saves) puts the tenant's
salt into it, as it does for the tree's keys.

Entries are the feature tensors themselves (not copies): callers must not modify what
:meth:`ImageEmbeddingCache.get` returns. Thread-safe (one lock), so an API thread and the
engine loop may share it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch


class CacheStats(NamedTuple):
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ImageEmbeddingCache:
    """Least-recently-used image features by key, holding at most ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0 (0 disables the cache), got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The features stored under ``key`` (now the most recently used), or None."""
        with self._lock:
            t = self._entries.get(key)
            if t is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return t

    def put(self, key: Hashable, features: torch.Tensor) -> bool:
        """Store ``features`` under ``key`` as the most recently used entry, evicting the
        least recently used ones to make room. False (nothing stored) when the tensor alone
        exceeds the capacity."""
        if not isinstance(features, torch.Tensor):
            raise ValueError(f"features must be a torch.Tensor, got {type(features).__name__}")
        size = tensor_bytes(features)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= tensor_bytes(old)
            if size > self.capacity_bytes:
                return False
            while self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= tensor_bytes(evicted)
                self.evictions += 1
            self._entries[key] = features
            self._bytes += size
            return True

    def get_or_compute(self, keys: Sequence[Hashable],
                       compute: Callable[[list[int]], torch.Tensor]) -> list[torch.Tensor]:
        """Features for every key, in order: cached ones from the cache, the others from ONE
        call ``compute(indices)`` (indices into ``keys`` of the distinct missing keys; it
        returns their features stacked, ``[len(indices), ...]``), which are then stored. A key
        repeated within ``keys`` is computed once."""
        found: dict[Hashable, torch.Tensor] = {}
        missing: list[int] = []
        for i, k in enumerate(keys):
            if k in found or any(keys[j] == k for j in missing):
                continue
            t = self.get(k)
            if t is None:
                missing.append(i)
            else:
                found[k] = t
        if missing:
            out = compute(missing)
            if not isinstance(out, torch.Tensor) or out.shape[0] != len(missing):
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"compute returned {got}, expected {len(missing)} rows")
            for row, i in enumerate(missing):
                # A copy per row: a view would keep the whole batch alive after the others go.
                t = out[row].clone() if len(missing) > 1 else out[0]
                found[keys[i]] = t
                self.put(keys[i], t)
        return [found[k] for k in keys]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._entries), self._bytes, self.capacity_bytes,
                              self.hits, self.misses, self.evictions)
