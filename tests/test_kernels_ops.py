"""The fused row-wise kernels (RMSNorm, residual add + RMSNorm, RoPE, SiLU·mul, GeGLU, Gemma's
per-head q/k norm + RoPE, K/V store) against the eager torch ops they replace.

RoPE and the K/V store are bitwise equal to the eager path (same roundings); the norms and
SiLU·mul sum or round in another order, so they match to a few float32 ulps, or to one
bfloat16 rounding of a float32 result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.model.arch.layers import apply_rotary, rms_norm

pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    return kernels.load_kernels()


def _bf16_close(a: torch.Tensor, b_f32: torch.Tensor) -> bool:
    """a (bfloat16) is b rounded to bfloat16, or one bfloat16 step from it."""
    ref = b_f32.to(torch.bfloat16).float()
    step = ref.abs().clamp_min(1e-30) * 2.0**-7
    return bool(((a.float() - ref).abs() <= step).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (300, 96), (5, 17)])
def test_rms_norm_and_residual_add(k, dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen) * 3
    w = torch.rand(hidden, generator=gen) + 0.5
    ref = rms_norm(x, w, 1e-5)
    out = k.rms_norm(x, w, 1e-5, dtype)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert _bf16_close(out, ref)

    delta = (torch.randn(rows, hidden, generator=gen)).to(dtype)
    h1, h2 = x.clone(), x.clone()
    out = k.add_rms_norm(h1, delta, w, 1e-5, dtype)
    h2.add_(delta)
    assert torch.equal(h1, h2)  # the residual add itself is exact float32
    ref = rms_norm(h2, w, 1e-5)
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert _bf16_close(out, ref)


def test_rms_norm_rows_are_independent(k):
    """A row's result does not depend on the other rows of the call (batch composition)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 576, generator=gen)
    w = torch.rand(576, generator=gen)
    full = k.rms_norm(x, w, 1e-6, torch.bfloat16)
    for i in (0, 17, 49):
        assert torch.equal(k.rms_norm(x[i : i + 1].contiguous(), w, 1e-6, torch.bfloat16), full[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 2, 6)])
def test_rope_is_the_eager_rotation(k, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    t = 37
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(t, width, generator=gen).to(dtype)
    positions = torch.randint(0, 200, (t,), generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(256).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    rot = heads + kv_heads
    ref = apply_rotary(qkv[:, : rot * head_dim].float().view(t, rot, head_dim),
                       cos[positions], sin[positions]).reshape(t, -1).to(dtype)
    got = qkv.clone()
    k.rope_(got, positions, cos, sin, rot, head_dim)
    assert torch.equal(got[:, : rot * head_dim], ref)
    assert torch.equal(got[:, rot * head_dim :], qkv[:, rot * head_dim :])  # v untouched
    with pytest.raises(RuntimeError, match="position"):
        k.rope_(got, positions + 1000, cos, sin, rot, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(k, dtype):
    gen = torch.Generator().manual_seed(1)
    gu = (torch.randn(23, 2 * 200, generator=gen) * 4).to(dtype)
    g, u = gu[:, :200].float(), gu[:, 200:].float()
    ref = F.silu(g) * u
    out = k.silu_mul(gu)
    assert out.shape == (23, 200) and out.dtype == dtype
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert _bf16_close(out, ref)
    big = torch.tensor([[-200.0, 200.0, 1.0, 1.0]])  # exp far out of range on both sides
    assert torch.allclose(k.silu_mul(big), torch.tensor([[0.0, 200.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul(k, dtype):
    gen = torch.Generator().manual_seed(4)
    gu = (torch.randn(19, 2 * 203, generator=gen) * 4).to(dtype)
    g, u = gu[:, :203].float(), gu[:, 203:].float()
    ref = F.gelu(g, approximate="tanh") * u
    out = k.gelu_tanh_mul(gu)
    assert out.shape == (19, 203) and out.dtype == dtype
    # torch's tanh reaches -1 (a product of exactly 0) where ours leaves the true tiny value
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    else:
        assert bool(((out.float() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-6).all())
    big = k.gelu_tanh_mul(torch.tensor([[-200.0, 200.0, 0.0, 1.0, 1.0, 1.0]]))  # saturated both sides
    assert big[0, 0].abs() < 1e-30 and big[0, 1] == 200.0 and big[0, 2] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (9, 3, 64), (2, 2, 6)])
def test_qk_norm_rope_is_the_eager_norm_and_rotation(k, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim + 1)
    t = 29
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    n = heads + kv_heads
    weight = torch.rand(n, head_dim, generator=gen) + 0.5
    positions = torch.randint(0, 300, (t,), generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(512).float()[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    qk = rms_norm(qkv[:, : n * head_dim].float().view(t, n, head_dim), weight, 1e-6)
    ref_qk = apply_rotary(qk, cos[positions], sin[positions]).reshape(t, -1)
    got = k.qk_norm_rope(qkv, weight, 1e-6, positions, cos, sin, n, head_dim)
    assert got.dtype == torch.float32 and got.shape == qkv.shape
    assert torch.allclose(got[:, : n * head_dim], ref_qk, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, n * head_dim :], qkv[:, n * head_dim :].float())  # v widened, unchanged
    one = k.qk_norm_rope(qkv[3:4].contiguous(), weight, 1e-6, positions[3:4].contiguous(), cos, sin, n, head_dim)
    assert torch.equal(one, got[3:4])  # a row does not depend on the batch
    with pytest.raises(RuntimeError, match="weight"):
        k.qk_norm_rope(qkv, weight[1:], 1e-6, positions, cos, sin, n, head_dim)
    with pytest.raises(RuntimeError, match="position"):
        k.qk_norm_rope(qkv, weight, 1e-6, positions + 1000, cos, sin, n, head_dim)


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                     (torch.bfloat16, torch.bfloat16)])
def test_store_kv_equals_index_copy(k, src, dst):
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(9, (4 + 2 * 2) * 16, generator=gen).to(src)
    kk = qkv[:, 64:96].view(9, 2, 16)
    vv = qkv[:, 96:].view(9, 2, 16)
    cache = torch.zeros(2, 40, 2, 16, dtype=dst)
    ref = cache.clone()
    slots = torch.randperm(40, generator=gen)[:9]
    k.store_kv(kk, vv, cache[0], cache[1], slots)
    ref[0].index_copy_(0, slots, kk.to(dst))
    ref[1].index_copy_(0, slots, vv.to(dst))
    assert torch.equal(cache, ref)
    with pytest.raises(RuntimeError, match="slot"):
        k.store_kv(kk, vv, cache[0], cache[1], slots + 40)


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inner,cols", [(1, 576, 960), (5, 64, 7), (12, 40, 16), (13, 33, 130), (25, 100, 50), (100, 1536, 40),
                                             (6, 8, 17), (1, 33, 17), (1, 24, 250), (2, 40, 130), (3, 33, 100),
                                             (4, 64, 250)])
def test_packed_linear_is_an_in_order_float32_product(k, wdt, rows, inner, cols):
    """The packed GEMM: float32 accumulation and output (within float32 rounding of the
    float64 product), bias added after, a row equals the same row computed alone, the bf16
    output is the float32 one rounded, and every instruction set gives the portable bits."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inner, generator=gen)
    w = torch.randn(cols, inner, generator=gen).to(wdt)
    b = torch.randn(cols, generator=gen)
    pw = k.pack_linear(w, wdt)
    out = k.packed_linear(x, pw, b)
    assert out.dtype == torch.float32 and out.shape == (rows, cols)
    ref = x.double() @ w.double().t() + b.double()
    assert (out.double() - ref).abs().max().item() <= 1e-5 * inner ** 0.5 * ref.abs().max().item()
    for i in (0, rows - 1):
        assert torch.equal(k.packed_linear(x[i : i + 1].contiguous(), pw, b), out[i : i + 1])
    assert torch.equal(k.packed_linear(x, pw, b, out_dtype=torch.bfloat16), out.to(torch.bfloat16))
    for isa in k.available_isas():
        assert torch.equal(k.capped(isa).packed_linear(x, pw, b), out), isa
    assert torch.equal(k.pack_linear(w.float(), torch.bfloat16).data, k.pack_linear(w.to(torch.bfloat16), torch.bfloat16).data) \
        if wdt == torch.bfloat16 else True
    with pytest.raises(RuntimeError, match="packed"):
        k.packed_linear(torch.zeros(rows, inner + 1), pw)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_ops_are_the_same_bits_on_every_instruction_set(k, isa, dtype):
    """The vectorised silu_mul and gelu_tanh_mul (the row ops with an explicit SIMD version)
    give the portable loop's bits, tails and extreme values included."""
    from cpu_paths import require_isa

    require_isa(isa)
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(9, 203, generator=gen) * 30
    g[0, :6] = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e-30, float("inf")])
    gu = torch.cat([g, torch.randn(9, 203, generator=gen)], dim=1).to(dtype)
    assert k.capped(isa).isa == isa and k.capped("generic").isa == "generic"
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for op in ("silu_mul", "gelu_tanh_mul"):
        portable = getattr(k.capped("generic"), op)(gu)
        fast = getattr(k.capped(isa), op)(gu)
        assert torch.equal(portable.view(bits), fast.view(bits)), op


def test_pack_linear_into_a_buffer_and_the_model_arena(k):
    """Packing into a given buffer (how a model puts all its weights on huge pages) gives the
    same panels as a fresh allocation; a buffer of the wrong size or dtype is a ValueError."""
    from radixserve.kernels.linear import make_linears

    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(n, kk, generator=gen) for n, kk in ((40, 24), (7, 24), (33, 8))]
    lin = make_linears("radixserve", torch.device("cpu"), torch.bfloat16)
    many = lin.pack_many(ws)
    for w, p in zip(ws, many):
        alone = k.pack_linear(w, torch.bfloat16, dot=lin.dot)
        assert torch.equal(p.data, alone.data) and (p.n, p.k, p.dot) == (alone.n, alone.k, alone.dot)
        x = torch.randn(3, w.shape[1], generator=gen)
        assert torch.equal(k.packed_linear(x, p), k.packed_linear(x, alone))
    # one buffer behind all of them, in order
    assert many[1].data.data_ptr() == many[0].data.data_ptr() + many[0].data.numel() * 2
    with pytest.raises(ValueError, match="out must be"):
        k.pack_linear(ws[0], torch.bfloat16, out=torch.empty(k.packed_numel(40, 24) - 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        k.pack_linear(ws[0], torch.bfloat16, out=torch.empty(k.packed_numel(40, 24), dtype=torch.float32))
