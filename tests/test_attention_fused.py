"""The paged attention kernel ("torch" backend) against the eager reference ("torch-eager").

Random tensors straight into the attention backends, and the tiny model through both
backends: random slot orders, padding (very different lengths in one batch), GQA and MHA,
head sizes on the vectorised and the portable path, decode, prefill and prefill over a
cached prefix in one batch, float32 and bfloat16 pools, every kernel implementation this CPU
has (the others are skipped, see ``cpu_paths``).
Tolerances: float32 paths agree to float32 rounding (1e-5 on unit-scale outputs); the
bfloat16 implementation rounds q and the softmax weights to bfloat16 before its dot
products, so it agrees to bfloat16 rounding (3e-2 on unit-scale outputs).
"""

from __future__ import annotations

import pytest
import torch

from cpu_paths import ALL_IMPLS, FLOAT32_MODE_IMPLS, impl_id, require_impl
from helpers_model import pool_logits_decode, pool_logits_prefill, shuffled_allocator
from radixserve.engine.runner import ModelRunner
from radixserve.memory.kv_pool import KVPool
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.model.arch.attention import make_attention_backend
from radixserve.model.arch.attention_eager import EagerTorchAttentionBackend
from radixserve.model.arch.attention_kernel import KernelAttentionMetadata, TorchAttentionBackend
from radixserve.model.arch.forward_batch import ForwardBatch

needs_kernels = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")


def _random_case(prefix, extend, heads, kv_heads, head_dim, dtype, seed):
    """A pool with random K/V, scattered slots per sequence, random new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, extend)]
    capacity = 2 * sum(lens) + 16
    pool = KVPool(num_layers=2, capacity=capacity, num_kv_heads=kv_heads, head_dim=head_dim,
                  dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    perm = torch.randperm(capacity, generator=gen)
    seq_slots, start = [], 0
    for n in lens:
        seq_slots.append(perm[start : start + n].clone())
        start += n
    t = sum(extend)
    q = torch.randn(t, heads, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    batch = ForwardBatch.build([[1] * e for e in extend], list(prefix), seq_slots)
    return pool, batch, q, k, v


def _attend(backend, pool, batch, q, k, v, layer=1):
    meta = backend.prepare(batch, pool)
    return backend.forward(q.clone(), k.clone(), v.clone(), layer, pool, meta).float(), meta


def _copy_pool(pool: KVPool) -> KVPool:
    other = KVPool(pool.num_layers, pool.capacity, pool.num_kv_heads, pool.head_dim, dtype=pool.dtype)
    other.kv.copy_(pool.kv)
    return other


# decode (1 new token) of very different lengths, a prefill, a prefill over a prefix,
# and a tiny chunk: one batch
PREFIX = [0, 4, 15, 16, 32, 199, 6, 63, 0, 40]
EXTEND = [1, 1, 2, 1, 1, 1, 1, 1, 70, 33]


@pytest.mark.parametrize("impl", ALL_IMPLS, ids=impl_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 2, 16), (8, 8, 32), (6, 2, 24), (4, 1, 128), (4, 1, 256), (2, 2, 40)],
)
def test_kernel_equals_eager_mixed_batch(impl, dtype, heads, kv_heads, head_dim):
    require_impl(impl, dtype, head_dim)
    pool, batch, q, k, v = _random_case(PREFIX, EXTEND, heads, kv_heads, head_dim, dtype,
                                        seed=head_dim)
    ref_pool = _copy_pool(pool)
    ref, _ = _attend(EagerTorchAttentionBackend(), ref_pool, batch, q, k, v)
    work = _copy_pool(pool)
    out, meta = _attend(TorchAttentionBackend(kernels=True, attention_impl=impl), work,
                        batch, q, k, v)
    assert isinstance(meta, KernelAttentionMetadata) and meta.num_decode == 7
    assert out.shape == (sum(EXTEND), heads * head_dim)
    tol = 3e-2 if impl == kernels.IMPL_BF16 else 1e-5
    assert (out - ref).abs().max().item() <= tol
    assert torch.equal(work.kv, ref_pool.kv)  # both wrote the new K/V to the same slots


@pytest.mark.parametrize("impl", FLOAT32_MODE_IMPLS[1:], ids=impl_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 1, 128), (4, 1, 256), (48, 1, 16), (2, 2, 40)])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_vectorised_float32_paths_equal_the_portable_path_bitwise(impl, dtype, heads, kv_heads, head_dim,
                                                                   qdtype):
    """The AVX2 and AVX-512 float32 paths repeat the portable path's operations exactly,
    for float32 and bfloat16 pools, q and outputs, in both of their layouts (few rows:
    decode; many rows: prefill), including GQA groups wider than a vector."""
    require_impl(impl, dtype, head_dim)
    pool, batch, q, k, v = _random_case(PREFIX, EXTEND, heads, kv_heads, head_dim, dtype, seed=7)
    q, k, v = q.to(qdtype), k.to(qdtype), v.to(qdtype)
    a, _ = _attend(TorchAttentionBackend(attention_impl=kernels.IMPL_GENERIC), _copy_pool(pool), batch, q, k, v)
    b, _ = _attend(TorchAttentionBackend(attention_impl=impl), _copy_pool(pool), batch, q, k, v)
    assert torch.equal(a, b)


@needs_kernels
def test_default_impl_is_the_fastest_under_the_cap(monkeypatch):
    """The backend runs the best implementation the CPU has; RADIXSERVE_CPU_ISA (or
    cpu_isa) lowers it, and "generic" is the portable path on every machine."""
    k = kernels.load_kernels()
    monkeypatch.delenv("RADIXSERVE_CPU_ISA", raising=False)
    for dtype in (torch.float32, torch.bfloat16):
        best = k.pick_attention_impl(dtype, 64, "auto")
        assert TorchAttentionBackend(cpu_isa="auto").impl_for(dtype, 64) == best
        assert TorchAttentionBackend(cpu_isa="generic").impl_for(dtype, 64) == kernels.IMPL_GENERIC
        if "avx2" in k.available_isas():
            assert TorchAttentionBackend(cpu_isa="avx2").impl_for(dtype, 64) == kernels.IMPL_AVX2
        assert TorchAttentionBackend().impl_for(dtype, 24) in (kernels.IMPL_GENERIC, kernels.IMPL_AVX2)
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "generic")
    assert TorchAttentionBackend().impl_for(torch.float32, 64) == kernels.IMPL_GENERIC
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match="RADIXSERVE_CPU_ISA"):
        TorchAttentionBackend()


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count_does_not_change_result(threads):
    pool, batch, q, k, v = _random_case(PREFIX, EXTEND, 9, 3, 64, torch.bfloat16, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out, _ = _attend(TorchAttentionBackend(), _copy_pool(pool), batch, q, k, v)
    finally:
        torch.set_num_threads(before)
    ref, _ = _attend(TorchAttentionBackend(), _copy_pool(pool), batch, q, k, v)
    assert torch.equal(out, ref)


@needs_kernels
def test_out_of_range_slots_are_rejected():
    pool, batch, q, k, v = _random_case([4, 6], [1, 1], 4, 2, 16, torch.float32, seed=1)
    batch.seq_slots[1] = batch.seq_slots[1].clone()
    batch.seq_slots[1][2] = pool.capacity + 5  # past the pad slot
    with pytest.raises(RuntimeError, match="slot"):
        _attend(TorchAttentionBackend(kernels=True), pool, batch, q, k, v)


@needs_kernels
def test_float16_pool_uses_eager_path():
    pool, batch, q, k, v = _random_case([5, 9], [1, 1], 4, 2, 16, torch.float16, seed=2)
    backend = TorchAttentionBackend(kernels=True)
    out, meta = _attend(backend, pool, batch, q, k, v)
    assert not isinstance(meta, KernelAttentionMetadata) and torch.isfinite(out).all()
    assert backend.layer_kernels(torch.float16, torch.device("cpu")) is None


def test_backend_registry():
    assert isinstance(make_attention_backend("torch-eager", "cpu"), EagerTorchAttentionBackend)
    assert not make_attention_backend("torch-eager", "cpu").uses_kernels
    assert not TorchAttentionBackend(kernels=False).uses_kernels
    assert isinstance(make_attention_backend("torch", "cpu"), TorchAttentionBackend)


def _runners(config, sd, dtype):
    fused = ModelRunner.from_config(config, sd, kv_capacity=1024, dtype=dtype, backend="torch")
    eager = ModelRunner.from_config(config, sd, kv_capacity=1024, dtype=dtype,
                                    backend="torch-eager")
    return fused, eager


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_kernels_equal_eager(tiny_config, tiny_state_dict, dtype):
    """The whole forward (fused row-wise ops + attention kernel) against the eager model:
    prefill of several prompts in one batch, then token-by-token decode."""
    sd = {k: v.to(dtype) for k, v in tiny_state_dict.items()}
    fused, eager = _runners(tiny_config, sd, dtype)
    assert fused.attn_backend.uses_kernels and not eager.attn_backend.uses_kernels
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (1, 9, 40, 130)]
    # bf16: the eager path keeps q and p in float32 and rounds at other points; on the tiny
    # random model (std-0.2 weights, logits of magnitude ~5) that moves logits by ~0.1. The
    # quality check: both are as far from the float32 model as each other.
    tol = 1e-4 if dtype == torch.float32 else 0.25
    ref = None
    if dtype == torch.bfloat16:
        ref32 = ModelRunner.from_config(tiny_config, tiny_state_dict, kv_capacity=1024,
                                        backend="torch-eager")
        ref = torch.cat(pool_logits_prefill(ref32, prompts))
    for fn, seed in ((pool_logits_prefill, 11), (pool_logits_decode, 12)):
        a = fn(fused, prompts, shuffled_allocator(1024, seed=seed))
        b = fn(eager, prompts, shuffled_allocator(1024, seed=seed))
        for x, y in zip(a, b):
            assert (x - y).abs().max().item() <= tol
        if ref is not None:
            err_kernels = (torch.cat(a) - ref).abs().mean().item()
            err_eager = (torch.cat(b) - ref).abs().mean().item()
            assert err_kernels <= 1.1 * err_eager


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_mixed_batch_kernels_equal_eager(tiny_config, tiny_state_dict, dtype):
    """Prefill, prefill tail over a cached prefix, and decodes of different lengths at once."""
    sd = {k: v.to(dtype) for k, v in tiny_state_dict.items()}
    outs = []
    gen = torch.Generator().manual_seed(4)
    p = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (20, 30, 15, 50)]
    for runner in _runners(tiny_config, sd, dtype):
        alloc = shuffled_allocator(1024, seed=9)
        s = [alloc.alloc(len(x)) for x in p]
        # history: b's first 10, c's first 14, d's first 49 tokens
        runner.forward(ForwardBatch.build([p[1][:10], p[2][:14], p[3][:49]], [0, 0, 0],
                                          [s[1][:10], s[2][:14], s[3][:49]]))
        batch = ForwardBatch.build(
            [p[0], p[1][10:], p[2][14:], p[3][49:]], [0, 10, 14, 49], s,
            return_all_logits=[False, True, False, False],
        )
        outs.append(runner.forward(batch))
    (f, e), tol = outs, (1e-4 if dtype == torch.float32 else 0.25)
    assert (f.next_token_logits - e.next_token_logits).abs().max().item() <= tol
    assert (f.all_logits[1] - e.all_logits[1]).abs().max().item() <= tol
