"""Integer-dot linears (csrc/gemm_q8dot.cpp, ``--weight-dtype gguf-q8``) against their definition.

The reference is a numpy transcription of the definition in gemm_q8dot.cpp's header:

1. each row quantized per 32-block: amax = max |x|; below 2^-60 the block is zeros (dx = 0);
   else dx = amax / 127, inv = 127 / amax, xq = clamp(rint(x * inv), -127, 127) (half to
   even), sx = sum xq;
2. the weight's signed codes c (Q8_0: int8; Q4_0: q - 8; Q4_1: q, with the offset m) and fp16 d;
3. I = sum c * xq, exact;
4. acc = fma(d * dx, I, acc) over the blocks in order (Q4_1: then fma(m * dx, sx, acc));
5. + bias, stored float32 (or bfloat16).

Checked bit for bit: the row quantization; the linear on every path this machine has (each
instruction-set level) and for any row count (decode's few rows and prefill's many, a
thread's chunk of panels); a row alone equals the row inside any batch; blocks from gguf-py's
own quantizer; the embedding rows of an integer-dot weight are still the dense model's. The
reference is sensitive to the chain's order (the mutation check): reversing the blocks
gives other bits on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_paths import require_kernels
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.kernels.isa import ISAS, host_isa
from radixserve.kernels.quant_weights import INT_DOT_FORMATS, QuantTensor, pack_quant_tensor
from test_gemm_quant import bits, random_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")

FORMATS = list(INT_DOT_FORMATS)
_TINY_AMAX = np.float32(2.0 ** -60)


# ---------------------------------------------------------------- the definition, in numpy
def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Step 1: (codes int8 [M, K], dx float32 [M, G], sx int32 [M, G])."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // 32, 32)
    amax = np.abs(xb).max(axis=2)
    live = amax >= _TINY_AMAX
    safe = np.where(live, amax, np.float32(1))
    dx = np.where(live, safe / np.float32(127), np.float32(0)).astype(np.float32)
    inv = (np.float32(127) / safe).astype(np.float32)
    q = np.clip(np.rint(xb * inv[:, :, None]), -127, 127)
    q = np.where(live[:, :, None], q, 0).astype(np.int8)
    return q.reshape(m, k), dx, q.astype(np.int32).sum(axis=2).astype(np.int32)


def weight_codes(qtype: str, raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Step 2 from GGUF blocks: (signed codes int32 [N, K], d float32 [N, G], m float32 [N, G] or None)."""
    n = raw.shape[0]
    g = k // 32
    b = raw.reshape(n, g, -1)
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if qtype == "Q8_0":
        return b[:, :, 2:34].copy().view(np.int8).astype(np.int32).reshape(n, k), d, None
    at = 2 if qtype == "Q4_0" else 4
    nib = b[:, :, at:at + 16].astype(np.int32)
    codes = np.concatenate([nib & 15, nib >> 4], axis=2).reshape(n, k)
    if qtype == "Q4_0":
        return codes - 8, d, None
    return codes, d, b[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c), correctly rounded, for |a| of 24 bits and integer |b| < 2^24 (the
    product is exact in float64); the float64 sum's error (TwoSum) settles a float32 tie."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    r = s.astype(np.float32)
    toward = np.where(s > r.astype(np.float64), np.inf, -np.inf).astype(np.float32)
    other = np.nextafter(r, toward)
    tie = (r.astype(np.float64) + other.astype(np.float64)) / 2 == s
    up = err > 0
    pick_other = tie & (err != 0) & ((other.astype(np.float64) > r.astype(np.float64)) == up)
    return np.where(pick_other, other, r).astype(np.float32)


def reference(x: torch.Tensor, qtype: str, raw: np.ndarray, k: int, bias: torch.Tensor | None = None,
              order: str = "forward") -> torch.Tensor:
    """Steps 1-5 (``order="reversed"``: the chain over the blocks backwards, a mutation)."""
    xq, dx, sx = quantize_rows(x.numpy())
    c, d, mn = weight_codes(qtype, raw, k)
    m, n, g = x.shape[0], raw.shape[0], k // 32
    integer = np.einsum("mgk,ngk->mng", xq.reshape(m, g, 32).astype(np.int64),
                        c.reshape(n, g, 32).astype(np.int64)).astype(np.float32)
    acc = np.zeros((m, n), np.float32)
    for blk in (range(g) if order == "forward" else reversed(range(g))):
        scale = (d[None, :, blk] * dx[:, blk, None]).astype(np.float32)
        acc = fma32(scale, integer[:, :, blk], acc)
        if mn is not None:
            acc = fma32((mn[None, :, blk] * dx[:, blk, None]).astype(np.float32),
                        np.broadcast_to(sx[:, blk, None].astype(np.float32), (m, n)), acc)
    if bias is not None:
        acc = (acc + bias.numpy()[None, :]).astype(np.float32)
    return torch.from_numpy(acc)


# ---------------------------------------------------------------- helpers
def paths(k: kernels.Kernels) -> dict[str, kernels.Kernels]:
    return {isa: k.capped(isa) for isa in ISAS[: ISAS.index(host_isa()) + 1]}


def int_dot(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantTensor:
    return QuantTensor.from_gguf(qtype, raw, shape).for_integer_dot()


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    return require_kernels()


@st.composite
def rows_of(draw, k: int, m: int):
    """Activation rows of several kinds: normal, wide magnitudes, zero and tiny blocks, ties."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "wide", "sparse", "ties"]))
    x = rng.standard_normal((m, k)).astype(np.float32)
    if kind == "wide":
        x *= np.exp2(rng.integers(-70, 20, (m, k))).astype(np.float32)
    elif kind == "sparse":
        x[:, rng.integers(0, k, k // 2)] = 0.0
        x[:, : min(k, 32)] *= np.float32(2.0 ** -64)  # a block under the threshold
    elif kind == "ties":  # x * inv lands on halves: amax 127 makes inv 1
        x = (rng.integers(-254, 255, (m, k)) / 2).astype(np.float32)
        x[:, ::32] = 127.0
    return torch.from_numpy(x)


@st.composite
def cases(draw, max_rows: int = 24):
    qtype = draw(st.sampled_from(FORMATS))
    n = draw(st.integers(1, 70))
    kk = 32 * draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = random_blocks(rng, qtype, n, kk, draw(st.sampled_from(["normal", "wide", "zeros"])))
    x = draw(rows_of(kk, draw(st.integers(1, max_rows))))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if draw(st.booleans()) else None
    return qtype, raw, x, bias


# ---------------------------------------------------------------- tests
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 8).flatmap(lambda g: rows_of(32 * g, 5)))
def test_rows_quantize_as_defined(k, x):
    q, d, s = k.q8dot_quantize(x)
    want_q, want_d, want_s = quantize_rows(x.numpy())
    assert np.array_equal(q.numpy(), want_q)
    assert np.array_equal(d.numpy().view(np.int32), want_d.view(np.int32))
    assert np.array_equal(s.numpy(), want_s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_every_path_gives_the_definitions_bits(k, case):
    qtype, raw, x, bias = case
    n, kk = raw.shape[0], x.shape[1]
    want = reference(x, qtype, raw, kk, bias)
    pw = pack_quant_tensor(k, int_dot(qtype, raw, (n, kk)), dot=True)
    for name, kern in paths(k).items():
        got = kern.packed_linear(x, pw, bias)
        assert torch.equal(bits(got), bits(want)), (name, qtype, x.shape, n)
        got16 = kern.packed_linear(x, pw, bias, out_dtype=torch.bfloat16)
        assert torch.equal(bits(got16), bits(want.to(torch.bfloat16))), (name, "bf16 out")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FORMATS), st.integers(1, 300), st.sampled_from([(96, 512), (200, 1024)]),
       st.integers(0, 2**31 - 1))
def test_a_row_is_the_same_bits_alone_and_in_any_batch(k, qtype, rows, shape, seed):
    """Row tiles of 4 and 1, 1-4 panels a tile, chunks of panels and the threads' split of
    them: a row's bits do not depend on the batch it runs in."""
    n, kk = shape
    rng = np.random.default_rng(seed)
    pw = pack_quant_tensor(k, int_dot(qtype, random_blocks(rng, qtype, n, kk, "normal"), (n, kk)), dot=True)
    x = torch.from_numpy(rng.standard_normal((rows, kk)).astype(np.float32))
    for name, kern in paths(k).items():
        if name == "generic" and rows > 40:
            continue  # the portable loop is slow; its bits are held to the definition above
        full = kern.packed_linear(x, pw)
        for i in sorted({0, rows - 1, rows // 2, int(rng.integers(rows))}):
            assert torch.equal(bits(kern.packed_linear(x[i:i + 1].contiguous(), pw)), bits(full[i:i + 1])), (name, i)
        for head in (3, 5, 8, 9):
            if head <= rows:
                assert torch.equal(bits(kern.packed_linear(x[:head].contiguous(), pw)), bits(full[:head])), \
                    (name, head)


@pytest.mark.parametrize("qtype", FORMATS)
def test_blocks_from_ggufs_own_quantizer(k, qtype):
    """Blocks as a converter writes them, a realistic shape with a partial last panel: the
    linear is the definition's bits on every path, and the embedding rows of the same blob
    are the dense bfloat16 model's."""
    gen = np.random.default_rng(7)
    w = (gen.standard_normal((200, 576)) * 0.02).astype(np.float32)
    w[3, :64] = 0.0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    qt = int_dot(qtype, raw, w.shape)
    pw = pack_quant_tensor(k, qt, dot=False)
    dense = qt.dequantize().to(torch.bfloat16)
    assert torch.equal(bits(k.quant_rows(pw, torch.arange(200))), bits(dense))
    x = torch.from_numpy(gen.standard_normal((13, 576)).astype(np.float32))
    bias = torch.from_numpy(gen.standard_normal(200).astype(np.float32))
    want = reference(x, qtype, raw, 576, bias)
    for name, kern in paths(k).items():
        for m in (1, 5, 13):
            assert torch.equal(bits(kern.packed_linear(x[:m], pw, bias)), bits(want[:m])), (name, m)
    # and close to the float32 product on the dense weights (8-bit activations: ~1% error)
    exact = x @ qt.dequantize().T + bias
    assert (want - exact).abs().max() < 0.05 * exact.abs().max()


def test_the_chain_order_is_what_the_tests_hold(k):
    """Mutation check of the reference: the chain run over the blocks backwards gives other
    bits on these inputs, so a kernel that reordered its chain would fail the tests above."""
    gen = np.random.default_rng(11)
    raw = random_blocks(gen, "Q4_1", 48, 1024, "normal")
    x = torch.from_numpy(gen.standard_normal((6, 1024)).astype(np.float32))
    pw = pack_quant_tensor(k, int_dot("Q4_1", raw, (48, 1024)), dot=True)
    got = k.packed_linear(x, pw)
    assert torch.equal(bits(got), bits(reference(x, "Q4_1", raw, 1024)))
    assert not torch.equal(bits(got), bits(reference(x, "Q4_1", raw, 1024, order="reversed")))


def test_a_fused_weight_of_several_formats(k):
    """q/k in Q4_0 beside v in Q8_0, one weight of two segments, q's rows reordered."""
    gen = np.random.default_rng(3)
    raws = {}
    parts = []
    for i, (qtype, n) in enumerate((("Q4_0", 48), ("Q4_0", 16), ("Q8_0", 24))):
        raws[i] = (qtype, random_blocks(gen, qtype, n, 128, "normal"))
        parts.append(int_dot(qtype, raws[i][1], (n, 128)))
    perm = gen.permutation(48)
    parts[0] = parts[0].permute_rows(perm)
    fused = QuantTensor.cat(parts)
    assert fused.int_dot and fused.labels == ("Q4_0/q8", "Q8_0/q8")
    pw = pack_quant_tensor(k, fused, dot=True)
    x = torch.from_numpy(gen.standard_normal((7, 128)).astype(np.float32))
    want = torch.cat([reference(x, "Q4_0", raws[0][1][perm], 128), reference(x, "Q4_0", raws[1][1], 128),
                      reference(x, "Q8_0", raws[2][1], 128)], dim=1)
    for name, kern in paths(k).items():
        assert torch.equal(bits(kern.packed_linear(x, pw)), bits(want)), name


def test_refusals():
    """Formats without an integer-dot kernel cannot be marked for one; a mixed fused weight
    stays on the expansion."""
    raw = random_blocks(np.random.default_rng(1), "Q5_0", 16, 64, "normal")
    with pytest.raises(ValueError, match="integer dot"):
        QuantTensor.from_gguf("Q5_0", raw, (16, 64)).for_integer_dot()
    q4 = int_dot("Q4_0", random_blocks(np.random.default_rng(2), "Q4_0", 16, 64, "normal"), (16, 64))
    assert not QuantTensor.cat([q4, QuantTensor.from_gguf("Q5_0", raw, (16, 64))]).int_dot
