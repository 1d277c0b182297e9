"""HiRadixCache without storage: tiers, write policies, locks, load_back, telemetry, events."""

from __future__ import annotations

import pytest
import torch

from hicache_helpers import DIM, HEADS, LAYERS, Driver, expected_kv, make_cache
from radixserve.cache.hicache import HiCacheConfig, HiMatchResult, HiRadixCache
from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from test_cache_events import Mirror


def _random_request(cache: HiRadixCache, seq, gen: torch.Generator, salt=None) -> torch.Tensor:
    """Insert ``seq`` with random KV in fresh L1 slots; return the KV written."""
    alloc = cache.allocator
    m = cache.match_prefix(seq, salt)
    assert m.length == 0 and m.host_length == 0
    idx = alloc.alloc(len(seq))
    data = torch.randn(LAYERS, 2, len(seq), HEADS, DIM, generator=gen).to(cache.kv_pool.dtype)
    cache.kv_pool.kv[:, :, idx] = data
    assert cache.insert(seq, idx, salt) == 0
    return data


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize("field,value", [
    ("l2_tokens", -1), ("l2_tokens", 1.5), ("write_policy", "write_around"),
    ("write_through_threshold", 0), ("prefetch_policy", "eager"), ("prefetch_timeout_s", -1.0),
    ("storage_page_tokens", 0), ("write_queue_pages", 0), ("storage_timeout_s", 0),
    ("storage_retry_s", -1), ("model_name", ""), ("ghost_entries", -5),
    ("storage", "s3://bucket/x"), ("storage", "file://host/x"), ("storage", "redis://"),
    ("prefetch_min_tokens", 0),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
    kw = {"l2_tokens": 64, field: value}
    with pytest.raises(ValueError, match=field):
        HiCacheConfig(**kw)


def test_config_storage_needs_l2_and_defaults_are_off():
    assert not HiCacheConfig().enabled
    with pytest.raises(ValueError, match="storage"):
        HiCacheConfig(l2_tokens=0, storage="file:///tmp/x")
    assert HiCacheConfig(l2_tokens=8, storage="redis://localhost:6379/0").enabled


def test_constructor_checks_pools_match():
    alloc = SlotAllocator(16, 2)
    kv = KVPool(LAYERS, 16, HEADS, DIM)
    with pytest.raises(ValueError, match="page_size"):
        HiRadixCache(alloc, kv, HostKVPool.like(kv, 32, page_size=1))
    with pytest.raises(ValueError, match="host_pool"):
        HiRadixCache(alloc, kv, HostKVPool(LAYERS + 1, 32, HEADS, DIM, page_size=2))
    with pytest.raises(ValueError, match="storage_page_tokens"):
        HiRadixCache.from_config(HiCacheConfig(l2_tokens=32, storage="file:///tmp/rx-never",
                                               storage_page_tokens=3), alloc, kv)


# ---------------------------------------------------------------------- exactness
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [1, 4])
def test_demote_evict_load_back_is_bit_identical(dtype, page):
    cache = make_cache(l1=32, l2=64, page=page, dtype=dtype, write_policy="write_back")
    gen = torch.Generator().manual_seed(1)
    seqs = [list(range(100, 116)), list(range(100, 108)) + list(range(300, 308))]
    data = [_random_request(cache, seqs[0], gen)]
    m = cache.match_prefix(seqs[1])
    assert m.length == 8
    idx = torch.cat([m.indices, cache.allocator.alloc(8)])
    d1 = torch.randn(LAYERS, 2, 8, HEADS, DIM, generator=gen).to(dtype)
    cache.kv_pool.kv[:, :, idx[8:]] = d1
    cache.insert(seqs[1], idx)
    data.append(torch.cat([data[0][:, :, :8], d1], dim=2))
    cache.check_integrity()
    # Everything leaves L1 (copied down on the way: write_back), and L1 is scribbled over.
    assert cache.evict(32) == 24
    assert cache.total_size == 0 and cache.host_size == 24
    cache.kv_pool.kv.fill_(float("nan"))
    cache.check_integrity()
    for seq, want, in_l1 in zip(seqs, data, (0, 8)):  # the second shares 8 with the first
        m = cache.match_prefix(seq)
        assert (m.length, m.host_length) == (in_l1, 16 - in_l1)
        m = cache.load_back(m)
        assert (m.length, m.loaded, m.host_length) == (16, 16 - in_l1, 0)
        cache.flush_loads()
        got = cache.kv_pool.kv[:, :, m.indices]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit
        cache.check_integrity()
    st = cache.stats()
    assert st["tokens_moved"]["demoted"] == 24 and st["tokens_moved"]["load_back"] == 24
    assert st["bytes_moved"]["L2->L1"] == 24 * cache.host_pool.bytes_per_token


def test_loads_of_a_step_go_out_together_and_evict_flushes_first():
    cache = make_cache(l1=24, l2=64, write_policy="write_through")
    d = Driver(cache)
    for s in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
        d.serve(s)
    cache.evict(24)
    assert cache.total_size == 0
    ms = [cache.load_back(cache.match_prefix(s)) for s in ([1, 2, 3, 4], [5, 6, 7, 8])]
    assert len(cache._pending) == 2
    assert cache.flush_loads() == 8 and not cache._pending
    for s, m in zip(([1, 2, 3, 4], [5, 6, 7, 8]), ms):
        assert torch.equal(cache.kv_pool.kv[:, :, m.indices], expected_kv(None, s, 4))
    # A pending load whose slots an eviction would hand out is issued first.
    m = cache.load_back(cache.match_prefix([9, 10, 11, 12]))
    assert cache._pending
    cache.evict(cache.evictable_size)
    assert not cache._pending
    cache.check_integrity()


# ---------------------------------------------------------------------- write policies
def test_write_through_copies_on_insert():
    cache = make_cache(write_policy="write_through")
    Driver(cache).serve([1, 2, 3, 4, 5])
    assert cache.host_size == 5 and cache.stats()["tokens_moved"]["backup"] == 5
    assert cache.evict(5) == 5
    assert cache.stats()["tokens_moved"]["demoted"] == 5


def test_write_back_copies_only_on_eviction():
    cache = make_cache(write_policy="write_back")
    Driver(cache).serve([1, 2, 3, 4, 5])
    assert cache.host_size == 0
    cache.evict(5)
    assert cache.host_size == 5 and cache.total_size == 0
    assert cache.stats()["tokens_moved"]["backup"] == 5


def test_write_through_selective_after_threshold_hits():
    cache = make_cache(write_policy="write_through_selective", write_through_threshold=2)
    d = Driver(cache)
    d.serve([1, 2, 3, 4, 5, 6])
    d.serve([1, 2, 3, 4, 9])  # first reuse of [1..4]: hit 1
    assert cache.host_size == 0
    d.serve([1, 2, 3, 4, 7])  # second reuse: [1..4] reaches the threshold
    assert cache.host_size == 4
    # Evicting everything: [1..4] is demoted, the never-reused runs are dropped.
    cache.evict(cache.evictable_size)
    assert cache.host_size == 4 and cache.total_size == 0
    st = cache.stats()["tokens_moved"]
    assert st["demoted"] == 4 and st["dropped_L1"] == 4
    m, rep = d.serve([1, 2, 3, 4, 5, 6])
    assert rep["cached"] == {"L1": 0, "L2": 4, "L3": 0}
    assert rep["uncached"] == {"evicted_L1": 2}  # [5, 6] was dropped from L1 (no L2 copy)
    cache.check_integrity()


def test_l1_drop_keeps_l2_children_reachable():
    """A run without an L2 copy whose children live in L2 only is copied down, not dropped
    (dropping it would orphan them), even under a policy that would drop it."""
    cache = make_cache(l1=16, l2=64, write_policy="write_through_selective", write_through_threshold=1)
    d = Driver(cache)
    d.serve([1, 2, 3, 4])
    cache.evict(4)  # [1..4] dropped: no hits yet
    d.serve([1, 2, 3, 4, 5, 6])
    d.serve([1, 2, 3, 4, 5, 6])  # one reuse: the whole path gets an L2 copy
    d.serve([1, 2, 9, 9])  # splits [1..6] at 2
    cache.evict(cache.evictable_size)
    cache.check_integrity()
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.total_length == 6


# ---------------------------------------------------------------------- L2 capacity / LRU
def test_l2_lru_and_capacity():
    cache = make_cache(l1=32, l2=12, write_policy="write_through")
    d = Driver(cache)
    for base in (10, 20, 30, 40):
        d.serve([base, base + 1, base + 2, base + 3])
    assert cache.host_size == 12  # the oldest L2 copy was evicted to make room
    assert cache.host_pool.available == 0
    cache.evict(cache.evictable_size)  # all L1 -> those with copies demote, [10..13] drops
    tiers = {b: cache.match_prefix([b, b + 1, b + 2, b + 3]) for b in (10, 20, 30, 40)}
    assert tiers[10].total_length == 0
    assert all(tiers[b].host_length == 4 for b in (20, 30, 40))
    # L2-only leaves go before anything touched more recently.
    d.serve([20, 21, 22, 23])  # loads [20..23] back; now the most recent
    freed = cache.evict_host(4)
    assert freed == 4
    assert cache.match_prefix([30, 31, 32, 33]).total_length == 0
    assert cache.match_prefix([20, 21, 22, 23]).length == 4
    cache.check_integrity()


def test_evict_host_frees_copies_of_l1_runs_without_leaving_the_tree():
    cache = make_cache(l1=32, l2=32, write_policy="write_through")
    Driver(cache).serve([1, 2, 3, 4])
    assert cache.evict_host(4) == 4
    assert cache.host_size == 0 and cache.total_size == 4
    assert cache.match_prefix([1, 2, 3, 4]).length == 4
    cache.check_integrity()


# ---------------------------------------------------------------------- locks / load_back
def test_locked_runs_never_leave_l1_and_lock_needs_l1():
    cache = make_cache(l1=16, l2=32, write_policy="write_through")
    d = Driver(cache)
    d.serve([1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    assert cache.evict(16) == 0
    cache.unlock(m.node)
    assert cache.evict(16) == 4
    m = cache.match_prefix([1, 2, 3, 4])
    with pytest.raises(ValueError, match="not in L1"):
        cache.lock(m.host_node)
    with pytest.raises(RuntimeError):
        cache.unlock(cache.load_back(m).node)


def test_load_back_capped_and_limited_by_l1():
    cache = make_cache(l1=12, l2=32, write_policy="write_through")
    d = Driver(cache)
    d.serve(list(range(1, 9)))
    cache.evict(8)
    m = cache.match_prefix(list(range(1, 9)))
    m2 = cache.load_back(m, max_tokens=3)
    assert (m2.length, m2.loaded, m2.host_length) == (3, 3, 5)
    cache.flush_loads()
    assert torch.equal(cache.kv_pool.kv[:, :, m2.indices], expected_kv(None, list(range(1, 9)), 3))
    cache.check_integrity()
    rep = cache.record_admission(list(range(1, 9)), m2)
    assert rep["cached"]["L2"] == 3 and rep["uncached"] == {"l1_full": 5}
    # L1 full of locked runs: load what fits.
    cache.lock(m2.node)
    other = cache.allocator.alloc(cache.allocator.available - 2)  # a "running request"
    m3 = cache.load_back(cache.match_prefix(list(range(1, 9))))
    assert m3.loaded == 2 and m3.length == 5
    cache.flush_loads()
    assert torch.equal(cache.kv_pool.kv[:, :, m3.indices], expected_kv(None, list(range(1, 9)), 5))
    cache.unlock(m2.node)
    cache.allocator.free(other)
    cache.check_integrity()


def test_insert_takes_fresh_slots_for_runs_held_in_l2_only():
    cache = make_cache(l1=16, l2=32, write_policy="write_through")
    d = Driver(cache)
    d.serve([1, 2, 3, 4])
    cache.evict(4)
    # A request that did not load back [1..4] computed it again, plus a tail.
    idx = cache.allocator.alloc(6)
    seq = [1, 2, 3, 4, 5, 6]
    cache.kv_pool.kv[:, :, idx] = expected_kv(None, seq, 6)
    assert cache.insert(seq, idx) == 0  # nothing was in L1: the cache owns all 6 slots now
    m = cache.match_prefix(seq)
    assert m.length == 6 and torch.equal(m.indices, idx)
    assert cache.host_size == 6  # the old L2 copy stays; the tail was written through
    cache.check_integrity()
    assert cache.allocator.available + cache.total_size == cache.allocator.capacity


def test_load_back_of_stale_match_is_refused_and_other_types_rejected():
    cache = make_cache(write_policy="write_through")
    Driver(cache).serve([1, 2, 3, 4])
    cache.evict(4)
    m = cache.match_prefix([1, 2, 3, 4])
    cache.evict_host(4)
    with pytest.raises(ValueError, match="stale"):
        cache.load_back(m)
    with pytest.raises(ValueError, match="HiMatchResult"):
        cache.load_back((m.indices, m.length, m.node))
    with pytest.raises(ValueError, match="max_tokens"):
        cache.load_back(cache.match_prefix([1]), max_tokens=-1)


# ---------------------------------------------------------------------- reset / events
def test_reset_frees_both_tiers_and_refuses_while_locked():
    cache = make_cache(l1=16, l2=32, write_policy="write_through")
    d = Driver(cache)
    d.serve([1, 2, 3, 4])
    d.serve([5, 6, 7, 8])
    cache.evict(4)
    m = cache.match_prefix([5, 6, 7, 8])
    cache.lock(m.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert cache.total_size == cache.host_size == cache.num_nodes == 0
    assert cache.allocator.available == cache.allocator.capacity
    assert cache.host_pool.available == cache.host_pool.capacity
    cache.check_integrity()


def test_events_per_tier_replay_to_the_tree():
    cache = make_cache(l1=12, l2=20, write_policy="write_back")
    mirrors = {"L1": Mirror(1), "L2": Mirror(1)}
    cache.listener = lambda ev: mirrors[ev.tier].apply(ev)
    d = Driver(cache)
    for s in ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 9], [1, 2, 3, 4, 10], [7, 8, 9, 11, 12]):
        d.serve(s)
        for salt in (None,):
            tc = cache.tier_contents(salt)
            assert tc["L1"] == mirrors["L1"].held.get(salt, set())
            assert tc["L2"] == mirrors["L2"].held.get(salt, set())
    fresh = {"L1": Mirror(1), "L2": Mirror(1)}
    for ev in cache.snapshot_events():
        fresh[ev.tier].apply(ev)
    assert fresh["L1"].held == {k: v for k, v in mirrors["L1"].held.items() if v}
    assert fresh["L2"].held == {k: v for k, v in mirrors["L2"].held.items() if v}
    cache.reset()
    assert not any(mirrors["L1"].held.values()) and not any(mirrors["L2"].held.values())


# ---------------------------------------------------------------------- telemetry
def test_miss_reasons():
    cache = make_cache(l1=16, l2=16, page=2, write_policy="write_through", ghost_entries=1000)
    d = Driver(cache)
    _, rep = d.serve([1, 2, 3, 4, 5])
    assert rep["cached"] == {"L1": 0, "L2": 0, "L3": 0}
    assert rep["uncached"] == {"never_seen": 4, "page_boundary": 1}
    _, rep = d.serve([1, 2, 3, 4, 6, 7], salt="tenant")
    assert rep["uncached"] == {"salt": 4, "never_seen": 2}
    _, rep = d.serve([1, 2, 3, 4, 8, 9])
    assert rep["cached"]["L1"] == 4 and rep["uncached"] == {"never_seen": 2}
    # Out of L1 (demoted: write_through made copies), then out of L2.
    cache.evict(cache.evictable_size)
    assert cache.total_size == 0 and cache.match_prefix([1, 2, 3, 4, 8, 9]).host_length == 6
    cache.evict_host(cache.host_size)
    _, rep = d.serve([1, 2, 3, 4, 8, 9])
    assert rep["uncached"] == {"evicted_L2": 6}
    # Runs without an L2 copy are dropped from L1: "evicted_L1".
    cache.evict_host(cache.host_size)
    cache.evict(cache.evictable_size)
    _, rep = d.serve([1, 2, 3, 4, 8, 9, 10, 11])
    assert rep["uncached"] == {"evicted_L1": 8}
    st = cache.stats()
    assert st["miss_tokens"]["evicted_L2"] == 6 and st["miss_tokens"]["salt"] == 4
    assert st["hit_tokens"]["L1"] == 4 and st["requests"] == 5
    assert st["age_at_eviction_s"]["L2"]["count"] > 0 and st["age_at_hit_s"]["L1"]["count"] == 1
    cache.check_integrity()


def test_ages_use_the_injected_clock():
    now = [100.0]
    alloc = SlotAllocator(16, 1)
    kv = KVPool(LAYERS, 16, HEADS, DIM)
    cache = HiRadixCache(alloc, kv, HostKVPool.like(kv, 32), HiCacheConfig(l2_tokens=32),
                         clock=lambda: now[0])
    d = Driver(cache)
    d.serve([1, 2, 3, 4])
    now[0] = 105.0
    cache.evict(4)
    now[0] = 165.0
    d.serve([1, 2, 3, 4, 5])
    h = cache.stats()
    assert h["age_at_eviction_s"]["L1"]["sum"] == 5.0
    assert h["age_at_hit_s"]["L2"]["sum"] == 65.0
    assert h["age_at_hit_s"]["L2"]["buckets"][3] == (60.0, 0)
    assert h["age_at_hit_s"]["L2"]["buckets"][4] == (300.0, 1)


def test_stats_shape_and_zero_cost_config():
    cache = make_cache()
    st = cache.stats()
    for k in ("l1", "l2", "hit_tokens", "miss_tokens", "bytes_moved", "prefetch", "l3_writes",
              "age_at_hit_s", "age_at_eviction_s", "total_size", "evictable_size"):
        assert k in st
    assert st["storage"] is None
    assert isinstance(cache.match_prefix([1, 2]), HiMatchResult)
