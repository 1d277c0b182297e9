"""KVPool storage: large CPU pools live in 2 MB-aligned, madvise(MADV_HUGEPAGE) memory."""

from __future__ import annotations

import mmap

import pytest
import torch

from radixserve.memory.kv_pool import KVPool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity", [10, 50_000])
def test_pool_is_zeroed_contiguous_and_writable(dtype, capacity):
    pool = KVPool(num_layers=2, capacity=capacity, num_kv_heads=3, head_dim=64, dtype=dtype)
    assert pool.kv.shape == (2, 2, capacity + 1, 3, 64) and pool.kv.dtype == dtype
    assert pool.kv.is_contiguous() and not pool.kv.any()
    slots = torch.tensor([0, capacity - 1, capacity // 2])
    k = torch.randn(3, 3, 64)
    v = torch.randn(3, 3, 64)
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k(1)[slots], k.to(dtype)) and torch.equal(pool.v(1)[slots], v.to(dtype))
    assert pool.kv[0].count_nonzero() == 0
    big = pool.nbytes() >= 8 << 20
    if big and hasattr(mmap, "MADV_HUGEPAGE"):
        assert pool.kv.data_ptr() % (2 << 20) == 0  # aligned for 2 MB pages
