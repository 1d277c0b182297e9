"""The fused paged decode kernel against the eager gather path (no timing assertions).

Random tensors straight into the attention backends, and the tiny model through both
backends: random slot orders, padding (very different lengths in one batch), GQA and MHA,
head sizes on the vectorised (multiple of 16) and the generic path, mixed prefill + decode
batches, float32 and bfloat16 pools, and the eager fallback when the kernel is unavailable.
"""

from __future__ import annotations

import logging

import pytest
import torch

from helpers_model import pool_logits_decode, shuffled_allocator
from radixserve.engine.runner import ModelRunner
from radixserve.memory.kv_pool import KVPool
from radixserve.model import paged_decode
from radixserve.model.attention import (
    EagerTorchAttentionBackend,
    TorchAttentionBackend,
    make_attention_backend,
)
from radixserve.model.forward_batch import ForwardBatch

TOL = 1e-4

kernel = paged_decode.load_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="fused kernel unavailable (no C compiler?)")


def test_kernel_builds_wherever_a_compiler_exists():
    """Skipping the kernel tests is only acceptable on a machine without a C compiler: a
    build that fails where a compiler exists must fail the suite, not hide behind a skip."""
    import os
    import shutil

    if os.environ.get("RADIXSERVE_FUSED_DECODE", "1") == "0":
        pytest.skip("kernel disabled by RADIXSERVE_FUSED_DECODE=0")
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    assert kernel is not None, "a C compiler exists but the fused decode kernel did not build"


def _random_case(lens, heads, kv_heads, head_dim, dtype, seed, capacity=None):
    """A pool with random K/V, random (scattered) slots per sequence, random new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    capacity = capacity or 2 * sum(lens) + 16
    pool = KVPool(num_layers=2, capacity=capacity, num_kv_heads=kv_heads, head_dim=head_dim,
                  dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    perm = torch.randperm(capacity, generator=gen)
    seq_slots, start = [], 0
    for n in lens:
        seq_slots.append(perm[start : start + n].clone())
        start += n
    t = len(lens)
    q = torch.randn(t, heads, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    batch = ForwardBatch.build([[1]] * t, [n - 1 for n in lens], seq_slots)
    return pool, batch, q, k, v


def _attend(backend, pool, batch, q, k, v, layer=1):
    meta = backend.prepare(batch, pool)
    return backend.forward(q.clone(), k.clone(), v.clone(), layer, pool, meta), meta


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 2, 16), (8, 8, 32), (6, 2, 24), (4, 1, 128)],
)
def test_fused_decode_equals_eager_random(dtype, heads, kv_heads, head_dim):
    lens = [1, 5, 16, 17, 33, 200, 7, 64]  # padding to 200, partial 16-key blocks
    fused_b = TorchAttentionBackend(fused_decode=True)
    eager_b = EagerTorchAttentionBackend()
    pool, batch, q, k, v = _random_case(lens, heads, kv_heads, head_dim, dtype, seed=head_dim)
    pool2 = KVPool(2, pool.capacity, kv_heads, head_dim, dtype=dtype)
    pool2.kv.copy_(pool.kv)
    out_f, meta_f = _attend(fused_b, pool, batch, q, k, v)
    out_e, meta_e = _attend(eager_b, pool2, batch, q, k, v)
    assert meta_f.fused and not meta_e.fused
    assert out_f.shape == out_e.shape == (len(lens), heads * head_dim)
    assert out_f.dtype == torch.float32
    assert (out_f - out_e).abs().max().item() <= 1e-5
    assert torch.equal(pool.kv, pool2.kv)  # both wrote the new K/V to the same slots


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decode_thread_count_does_not_change_result(threads):
    pool, batch, q, k, v = _random_case([40, 3, 90], 9, 3, 64, torch.float32, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, _ = _attend(TorchAttentionBackend(), pool, batch, q, k, v)
    finally:
        torch.set_num_threads(before)
    ref, _ = _attend(EagerTorchAttentionBackend(), pool, batch, q, k, v)
    assert (out - ref).abs().max().item() <= 1e-5


@needs_kernel
def test_fused_decode_rejects_out_of_range_slots():
    pool, batch, q, k, v = _random_case([4, 6], 4, 2, 16, torch.float32, seed=1)
    batch.seq_slots[1] = batch.seq_slots[1].clone()
    batch.seq_slots[1][2] = pool.capacity + 1  # past the pad slot
    with pytest.raises(IndexError):
        TorchAttentionBackend().prepare(batch, pool)


def _runners(config, sd, dtype):
    fused = ModelRunner.from_config(config, sd, kv_capacity=1024, dtype=dtype, backend="torch")
    eager = ModelRunner.from_config(config, sd, kv_capacity=1024, dtype=dtype,
                                    backend="torch-eager")
    return fused, eager


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_decode_fused_equals_eager(tiny_config, tiny_state_dict, dtype):
    fused, eager = _runners(tiny_config, tiny_state_dict, dtype)
    assert fused.attn_backend.fused_decode and not eager.attn_backend.fused_decode
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 9, 40, 130)]
    a = pool_logits_decode(fused, prompts, shuffled_allocator(1024, seed=11))
    b = pool_logits_decode(eager, prompts, shuffled_allocator(1024, seed=12))
    tol = TOL if dtype == torch.float32 else 1e-2  # bf16 weights: matmul rounding in between
    for x, y in zip(a, b):
        assert (x - y).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_mixed_batch_fused_equals_eager(tiny_config, tiny_state_dict, dtype):
    """Prefill, prefill tail over a cached prefix, and decodes of different lengths at once."""
    outs = []
    gen = torch.Generator().manual_seed(4)
    p = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (20, 30, 15, 50)]
    for runner in _runners(tiny_config, tiny_state_dict, dtype):
        alloc = shuffled_allocator(1024, seed=9)
        s = [alloc.alloc(len(x)) for x in p]
        # history: b's first 10, c's first 14, d's first 49 tokens
        runner.forward(ForwardBatch.build([p[1][:10], p[2][:14], p[3][:49]], [0, 0, 0],
                                          [s[1][:10], s[2][:14], s[3][:49]]))
        batch = ForwardBatch.build(
            [p[0], p[1][10:], p[2][14:], p[3][49:]], [0, 10, 14, 49], s,
            return_all_logits=[False, True, False, False],
        )
        meta = runner.attn_backend.prepare(batch, runner.kv_pool)
        assert meta.num_decode == 2
        outs.append(runner.forward(batch))
    (f, e), tol = outs, (TOL if dtype == torch.float32 else 1e-2)
    assert (f.next_token_logits - e.next_token_logits).abs().max().item() <= tol
    assert (f.all_logits[1] - e.all_logits[1]).abs().max().item() <= tol


def test_fallback_when_kernel_unavailable(monkeypatch, caplog, tiny_config, tiny_state_dict):
    """A failed build logs one warning and the backend decodes on the eager path."""
    monkeypatch.setattr(paged_decode, "_kernel", None)
    monkeypatch.setattr(paged_decode, "_tried", False)

    def boom():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(paged_decode, "_build", boom)
    with caplog.at_level(logging.WARNING, logger="radixserve.model.paged_decode"):
        b1 = make_attention_backend("torch", "cpu")
        b2 = make_attention_backend("torch", "cpu")
    assert not b1.fused_decode and not b2.fused_decode
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1
    runner = ModelRunner(
        ModelRunner.from_config(tiny_config, tiny_state_dict, kv_capacity=256).model,
        KVPool(tiny_config.num_layers, 256, tiny_config.num_kv_heads, tiny_config.head_dim),
        b1,
    )
    out = pool_logits_decode(runner, [[1, 2, 3], [4, 5]])
    assert all(torch.isfinite(o).all() for o in out)


def test_env_switch_disables_kernel(monkeypatch):
    monkeypatch.setattr(paged_decode, "_kernel", None)
    monkeypatch.setattr(paged_decode, "_tried", False)
    monkeypatch.setenv("RADIXSERVE_FUSED_DECODE", "0")
    assert paged_decode.load_kernel() is None
    assert not TorchAttentionBackend().fused_decode


def test_eager_backend_registered():
    assert isinstance(make_attention_backend("torch-eager", "cpu"), EagerTorchAttentionBackend)
    assert not make_attention_backend("torch-eager", "cpu").fused_decode


@needs_kernel
def test_float16_pool_uses_eager_path():
    pool, batch, q, k, v = _random_case([5, 9], 4, 2, 16, torch.float16, seed=2)
    out, meta = _attend(TorchAttentionBackend(), pool, batch, q, k, v)
    assert not meta.fused and torch.isfinite(out).all()
