"""SGLang's RadixCache as a side-by-side contender for ``benchmarks/bench_cache.py --sglang``.

Needs an importable ``sglang`` (0.5.23 was used): its radix_cache module pulls in much of
the package, so the simplest setup is a separate venv; see benchmarks/README.md.  The
keys SGLang wants (``RadixKey`` over ``array('q')``) are built *outside* the timed loops,
which favours SGLang: our cache converts the plain token lists inside its own calls.
"""

from __future__ import annotations

from array import array

import torch


class _NullAllocator:
    """What the simulated cache needs from a KV allocator: a device and ``free``."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free(self, indices: torch.Tensor) -> None:
        self.freed += len(indices)

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += len(indices)


class SGLangContender:
    """Same operations as the bench drives on ours: insert, match, evict everything."""

    def __init__(self, page_size: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: F401
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self._P = (InsertParams, MatchPrefixParams, EvictParams)
        self.alloc = _NullAllocator()
        self.cache = RadixCache.create_simulated(mock_allocator=self.alloc, page_size=page_size)
        self.RadixKey = RadixKey

    def keys(self, seqs: list) -> list:
        return [self.RadixKey(array("q", s)) for s in seqs]

    def insert_all(self, keys: list, slots: list) -> None:
        insert, P = self.cache.insert, self._P[0]
        for k, v in zip(keys, slots):
            insert(P(key=k, value=v))

    def match_all(self, keys: list) -> list:
        match, P = self.cache.match_prefix, self._P[1]
        return [match(P(key=k)).device_prefix_len for k in keys]

    def match_indices_all(self, keys: list) -> list:
        """Matches and the KV indices of each matched path (SGLang builds them outside
        ``match_prefix``, at admission: ``path_device_indices``)."""
        match, P, path = self.cache.match_prefix, self._P[1], self.cache.path_device_indices
        return [path(match(P(key=k)).last_device_node) for k in keys]

    def total_size(self) -> int:
        return self.cache.total_size()

    def evict_all(self) -> int:
        return self.cache.evict(self._P[2](num_tokens=self.total_size())).num_tokens_evicted


def version() -> str:
    try:
        from importlib.metadata import version as v

        return v("sglang")
    except Exception:  # noqa: BLE001 - importable from a source tree without metadata
        import sglang

        return getattr(sglang, "__version__", "unknown")
