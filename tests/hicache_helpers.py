"""Building tiered caches for tests, and a stand-in for the scheduler's use of one.

``Driver.serve`` does what the scheduler integration documented in
``radixserve.cache.hicache`` does for one request (prefetch, match, load_back,
flush_loads, lock, allocate and "compute" the tail, insert, free duplicates, unlock), with
the "model" replaced by a deterministic function of the token prefix: the KV of token ``i``
of ``seq`` under ``salt`` is ``token_kv(salt, seq[:i+1])``. So any slot the cache hands out
can be checked bit for bit against what the prefix must hold, whichever tiers it went through.
"""

from __future__ import annotations

import hashlib
from typing import Hashable, Optional, Sequence

import torch

from radixserve.cache.hicache import HiCacheConfig, HiRadixCache
from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.kv_pool import KVPool

LAYERS, HEADS, DIM = 2, 2, 4


def token_kv(salt: Hashable, prefix: Sequence[int], layers: int = LAYERS, heads: int = HEADS,
             dim: int = DIM, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[layers, 2, heads, dim]``: the KV a token has after ``prefix`` (its last token)."""
    d = hashlib.blake2b(repr((salt, tuple(prefix))).encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(d, "little") & ((1 << 63) - 1))
    return torch.randn(layers, 2, heads, dim, generator=g).to(dtype)


def expected_kv(salt: Hashable, seq: Sequence[int], n: int, **kw) -> torch.Tensor:
    """``[layers, 2, n, heads, dim]`` for the first ``n`` tokens of ``seq``."""
    if n == 0:
        return torch.empty(LAYERS, 2, 0, HEADS, DIM)
    return torch.stack([token_kv(salt, seq[: i + 1], **kw) for i in range(n)], dim=2)


def make_cache(l1: int = 32, l2: int = 64, page: int = 1, storage: Optional[str] = None,
               model: str = "test-model", dtype: torch.dtype = torch.float32, **cfg) -> HiRadixCache:
    cfg.setdefault("storage_page_tokens", 4 * page)
    cfg.setdefault("prefetch_policy", "wait_complete")
    config = HiCacheConfig(l2_tokens=l2, storage=storage, model_name=model, **cfg)
    alloc = SlotAllocator(l1, page)
    kv = KVPool(LAYERS, l1, HEADS, DIM, dtype=dtype)
    return HiRadixCache.from_config(config, alloc, kv)


class Driver:
    """Serves requests against ``cache`` the way the scheduler will."""

    def __init__(self, cache: HiRadixCache, check: bool = True) -> None:
        self.cache = cache
        self.check = check
        self.reports: list = []

    def slots_kv(self, idx: torch.Tensor) -> torch.Tensor:
        return self.cache.kv_pool.kv[:, :, idx]

    def serve(self, seq: Sequence[int], salt: Hashable = None, prefetch_wait: float = 10.0):
        """One request; returns (HiMatchResult after load_back, admission report)."""
        c = self.cache
        seq = list(seq)
        h = c.prefetch(seq, salt)
        if h is not None:
            h.job.wait(prefetch_wait)
        while not c.prefetch_ready(h):
            h.job.wait(0.01)
        m = c.match_prefix(seq, salt)
        m = c.load_back(m)
        c.flush_loads()
        c.lock(m.node)
        if self.check:
            got = self.slots_kv(m.indices)
            want = expected_kv(salt, seq, m.length, dtype=c.kv_pool.dtype)
            assert torch.equal(got, want), f"KV of a cached prefix differs (len {m.length})"
        report = c.record_admission(seq, m, salt, h)
        self.reports.append(report)
        alloc = c.allocator
        need = alloc.pages_for(len(seq) - m.length) * alloc.page_size
        if alloc.available < need:
            c.evict(need - alloc.available)
        fresh = alloc.alloc(len(seq) - m.length)
        assert fresh is not None, "test L1 too small for the request"
        tail = expected_kv(salt, seq, len(seq), dtype=c.kv_pool.dtype)[:, :, m.length :]
        c.kv_pool.kv[:, :, fresh[: len(seq) - m.length]] = tail
        idx = torch.cat([m.indices, fresh[: len(seq) - m.length]])
        n = c.insert(seq, idx, salt)
        A = c.cacheable_length(len(seq))
        assert n >= m.length
        dup = idx[m.length : n]
        own_tail = torch.cat([idx[A:], fresh[len(seq) - m.length :]])
        if dup.numel():
            alloc.free(dup)
        if own_tail.numel():
            alloc.free(own_tail)
        c.unlock(m.node)
        return m, report
