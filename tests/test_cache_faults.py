"""Misuse and corruption of the KV caches on the one tree, run against each kind: the plain
cache, the tiered one (HiRadixCache) and the hybrid model's (SWARadixCache). They share
insert, lock/unlock, eviction and reset, so they must refuse and detect the same things."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.cache import HiCacheConfig, HiRadixCache, RadixCache
from radixserve.cache.swa import SWARadixCache
from radixserve.memory.allocator import SlotAllocator
from radixserve.memory.host_pool import HostKVPool
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.swa_pool import HybridAllocator

CAP = 32


def _plain():
    return RadixCache()


def _tiered():
    alloc = SlotAllocator(CAP, 1)
    assert alloc.alloc(CAP) is not None  # the tests hand out slots themselves
    kv = KVPool(1, CAP, 1, 2)
    return HiRadixCache(alloc, kv, HostKVPool.like(kv, CAP, 1), HiCacheConfig(l2_tokens=CAP), on_free=lambda t: None)


def _swa():
    alloc = HybridAllocator(CAP, CAP, 1)
    assert alloc.alloc(CAP) is not None
    cache = SWARadixCache(alloc, window=2)
    cache.on_free = lambda t: None
    return cache


KINDS = {"plain": _plain, "tiered": _tiered, "swa": _swa}


@pytest.fixture(params=sorted(KINDS))
def cache(request):
    return KINDS[request.param]()


def test_unbalanced_unlock_raises_and_changes_nothing(cache):
    cache.insert([1, 2, 3], torch.tensor([1, 2, 3]))
    r = cache.match_prefix([1, 2, 3])
    with pytest.raises(RuntimeError, match="without a matching lock"):
        cache.unlock(r.node)
    assert cache.evictable_size == 3 and cache.protected_size == 0
    cache.check_integrity()


def test_handles_of_evicted_or_reset_nodes_are_rejected(cache):
    cache.insert([1, 2], torch.tensor([1, 2]))
    r = cache.match_prefix([1, 2])
    assert cache.evict(2) == 2
    if cache.tiered:  # the tiered tree may have demoted it to L2: drop that too
        cache.evict_host(2)
    with pytest.raises(ValueError):
        cache.lock(r.node)
    with pytest.raises(ValueError):
        cache.lock("not a node")
    cache.insert([4, 5], torch.tensor([4, 5]))
    r = cache.match_prefix([4, 5])
    cache.reset()
    with pytest.raises(ValueError):
        cache.unlock(r.node)
    cache.check_integrity()


def test_reset_refuses_while_locked_and_keeps_everything(cache):
    cache.insert([1, 2, 3], torch.tensor([1, 2, 3]))
    r = cache.match_prefix([1, 2])
    cache.lock(r.node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert cache.total_size == 3 and cache.protected_size == 2
    cache.check_integrity()
    cache.unlock(r.node)
    cache.reset()
    assert cache.total_size == 0 and cache.num_nodes == 0
    cache.check_integrity()


def test_locked_paths_survive_eviction(cache):
    cache.insert([1, 2, 3, 4], torch.tensor([1, 2, 3, 4]))
    cache.insert([1, 2, 7, 8], torch.tensor([11, 12, 17, 18]))
    r = cache.match_prefix([1, 2, 3, 4])
    cache.lock(r.node)
    assert cache.evict(CAP) == 2  # only the unlocked run [7, 8]
    assert cache.match_prefix([1, 2, 3, 4]).length == 4
    cache.unlock(r.node)
    cache.check_integrity()


def test_bad_arguments_raise_value_error(cache):
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix([1, -1])
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)
    assert cache.total_size == 0
    cache.check_integrity()


def test_check_integrity_detects_a_slot_held_twice(cache):
    cache.insert([1, 2, 3], torch.tensor([1, 2, 3]))
    cache.insert([1, 2, 4], torch.tensor([1, 2, 4]))
    cache.check_integrity()
    node = cache.match_prefix([1, 2, 4]).node
    node.value = np.array([1], dtype=np.int64)
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_check_integrity_detects_a_lost_eviction_candidate(cache):
    cache.insert([1, 2, 3], torch.tensor([1, 2, 3]))
    node = cache.match_prefix([1, 2, 3]).node
    cache._lru.discard(node)
    with pytest.raises(AssertionError, match="queue"):
        cache.check_integrity()
