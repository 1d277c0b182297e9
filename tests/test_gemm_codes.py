"""Block-codes linears (csrc/gemm_codes.cpp, ``--weight-dtype gguf-codes``) against their definition.

The reference is a numpy transcription of the definition in gemm_codes.cpp's header, every
value under FLT_MIN flushed to a zero of its sign (inputs and results):

1. the row rounded to bfloat16; the weight's signed codes c (Q8_0: int8; Q4_0: q - 8; Q4_1: q,
   with the offset m) and fp16 scale d;
2. per block: B = 0; for each pair j in order: B = fma(x[2j+1], c[2j+1], B), then
   B = fma(x[2j], c[2j], B);
3. Q4_1, per row and block: S = 0; S = S + x[2j+1]; S = S + x[2j] for each pair in order;
4. acc = 0; over the blocks in order: acc = acc + d * B (Q4_1: then acc = acc + m * S);
5. + bias, stored float32 (or rounded to bfloat16).

Checked bit for bit: the linear on every path this machine has (each instruction-set level,
the native vdpbf16ps and its emulation) and at the row counts of decode and prefill; a row
alone equals the row inside any batch; blocks from gguf-py's own quantizer; the embedding rows
of a block-codes weight are still the dense model's. The reference is sensitive to the
chain's order (the mutation check): reversing the blocks gives other bits on the same inputs.
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
from radixserve.kernels.quant_weights import CODES_FORMATS, QuantTensor, pack_quant_tensor
from test_gemm_q8dot import fma32, weight_codes
from test_gemm_quant import bits, random_blocks

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")

FORMATS = list(CODES_FORMATS)
_TINY = np.float32(np.finfo(np.float32).tiny)


# ---------------------------------------------------------------- the definition, in numpy
def flush(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return np.where(np.abs(v) < _TINY, np.copysign(np.float32(0), v), v).astype(np.float32)


def bf16_rows(x: torch.Tensor) -> np.ndarray:
    """Step 1: the rows rounded to bfloat16 (to nearest even), as float32."""
    return x.to(torch.bfloat16).to(torch.float32).numpy()


def reference(x: torch.Tensor, qtype: str, raw: np.ndarray, k: int, bias: torch.Tensor | None = None,
              order: str = "forward") -> torch.Tensor:
    """Steps 1-5 (``order="reversed"``: the chain over the blocks backwards, a mutation)."""
    xb = flush(bf16_rows(x))
    c, d, mn = weight_codes(qtype, raw, k)
    cf = c.astype(np.float32)
    m, n, g = x.shape[0], raw.shape[0], k // 32
    acc = np.zeros((m, n), np.float32)
    for blk in (range(g) if order == "forward" else reversed(range(g))):
        b = np.zeros((m, n), np.float32)
        s = np.zeros(m, np.float32)
        for j in range(16):
            for kk in (blk * 32 + 2 * j + 1, blk * 32 + 2 * j):
                xa = np.broadcast_to(xb[:, kk, None], (m, n))
                b = flush(fma32(xa, np.broadcast_to(cf[None, :, kk], (m, n)), b))
                s = flush(s + xb[:, kk])
        acc = flush(acc + flush(d[None, :, blk] * b))
        if mn is not None:
            acc = flush(acc + flush(mn[None, :, blk] * s[:, None]))
    if bias is not None:
        acc = flush(acc + flush(bias.numpy()[None, :]))
    return torch.from_numpy(acc)


# ---------------------------------------------------------------- helpers
def paths(k: kernels.Kernels) -> dict[str, kernels.Kernels]:
    """Every level this machine has; at avx512 also without the native instruction."""
    out = {isa: k.capped(isa) for isa in ISAS[: ISAS.index(host_isa()) + 1]}
    if "avx512" in out:
        out["avx512-emulated"] = out["avx512"].without_native_dot()
    return out


def codes(qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantTensor:
    return QuantTensor.from_gguf(qtype, raw, shape).for_block_codes()


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    return require_kernels()


@st.composite
def rows_of(draw, k: int, m: int):
    """Activation rows: normal, wide magnitudes (denormal products and blocks included), zeros."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "wide", "sparse"]))
    x = rng.standard_normal((m, k)).astype(np.float32)
    if kind == "wide":
        x *= np.exp2(rng.integers(-135, 20, (m, k))).astype(np.float32)
    elif kind == "sparse":
        x[:, rng.integers(0, k, k // 2)] = 0.0
        x[:, : min(k, 32)] *= np.float32(2.0 ** -120)  # a block of denormal products
    return torch.from_numpy(x)


@st.composite
def cases(draw, max_rows: int = 24):
    qtype = draw(st.sampled_from(FORMATS))
    n = draw(st.integers(1, 70))
    kk = 32 * draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = random_blocks(rng, qtype, n, kk, draw(st.sampled_from(["normal", "wide", "zeros"])))
    x = draw(rows_of(kk, draw(st.integers(1, max_rows))))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if draw(st.booleans()) else None
    return qtype, raw, x, bias


# ---------------------------------------------------------------- tests
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_every_path_gives_the_definitions_bits(k, case):
    qtype, raw, x, bias = case
    n, kk = raw.shape[0], x.shape[1]
    want = reference(x, qtype, raw, kk, bias)
    pw = pack_quant_tensor(k, codes(qtype, raw, (n, kk)), dot=True)
    for name, kern in paths(k).items():
        got = kern.packed_linear(x, pw, bias)
        assert torch.equal(bits(got), bits(want)), (name, qtype, x.shape, n)
        got16 = kern.packed_linear(x, pw, bias, out_dtype=torch.bfloat16)
        assert torch.equal(bits(got16), bits(want.to(torch.bfloat16))), (name, "bf16 out")


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 64, 513])
def test_decode_and_prefill_row_counts_give_the_definitions_bits(k, qtype, rows):
    """Row tiles of 8, 4 and 1, 1-4 panels a tile, chunks of panels shared by the row tiles:
    every row count gives the definition's bits on every path."""
    n, kk = 150, 256  # 10 panels: the 8-panel decode tile and the tails
    rng = np.random.default_rng(rows)
    raw = random_blocks(rng, qtype, n, kk, "normal")
    x = torch.from_numpy(rng.standard_normal((rows, kk)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    want = bits(reference(x, qtype, raw, kk, bias))
    pw = pack_quant_tensor(k, codes(qtype, raw, (n, kk)), dot=True)
    for name, kern in paths(k).items():
        assert torch.equal(bits(kern.packed_linear(x, pw, bias)), want), (name, rows)


@pytest.mark.parametrize("rows", [9, 13])
def test_many_rows_over_several_chunks_of_expanded_codes(k, rows):
    """A Q8_0 call of many rows expands its panels into scratch a chunk at a time (natively);
    a long K makes a chunk hold few panels, so the 10 panels run as several chunks and tails."""
    n, kk = 150, 4096
    rng = np.random.default_rng(rows)
    raw = random_blocks(rng, "Q8_0", n, kk, "normal")
    x = torch.from_numpy(rng.standard_normal((rows, kk)).astype(np.float32))
    want = bits(reference(x, "Q8_0", raw, kk, None))
    pw = pack_quant_tensor(k, codes("Q8_0", raw, (n, kk)), dot=True)
    for name, kern in paths(k).items():
        if name == "generic":
            continue  # the portable loop has no chunks; the row-count test covers it
        assert torch.equal(bits(kern.packed_linear(x, pw)), want), (name, rows)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FORMATS), st.integers(1, 300), st.sampled_from([(96, 512), (200, 1024)]),
       st.integers(0, 2**31 - 1))
def test_a_row_is_the_same_bits_alone_and_in_any_batch(k, qtype, rows, shape, seed):
    """Larger weights (several chunks of panels, the threads' split of them): a row's bits do
    not depend on the batch it runs in."""
    n, kk = shape
    rng = np.random.default_rng(seed)
    pw = pack_quant_tensor(k, codes(qtype, random_blocks(rng, qtype, n, kk, "normal"), (n, kk)), dot=True)
    x = torch.from_numpy(rng.standard_normal((rows, kk)).astype(np.float32))
    for name, kern in paths(k).items():
        if name == "generic" and rows > 40:
            continue  # the portable loop is slow; its bits are held to the definition above
        full = kern.packed_linear(x, pw)
        for i in sorted({0, rows - 1, rows // 2, int(rng.integers(rows))}):
            assert torch.equal(bits(kern.packed_linear(x[i:i + 1].contiguous(), pw)), bits(full[i:i + 1])), (name, i)
        for head in (2, 3, 7, 8, 9):
            if head <= rows:
                assert torch.equal(bits(kern.packed_linear(x[:head].contiguous(), pw)), bits(full[:head])), \
                    (name, head)


@pytest.mark.parametrize("qtype", FORMATS)
def test_gguf_quantized_blocks_and_the_dense_model(k, qtype):
    """Blocks from gguf-py's own quantizer: the definition's bits on every path, and within a
    bfloat16 model's error of the dense bfloat16 model on the same weights (the scale applied
    per block, not rounded into each weight)."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((48, 512)) * 0.05).astype(np.float32)
    raw = np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]), dtype=np.uint8)
    x = torch.from_numpy(rng.standard_normal((5, 512)).astype(np.float32))
    want = reference(x, qtype, raw, 512)
    qt = codes(qtype, raw, w.shape)
    pw = pack_quant_tensor(k, qt, dot=True)
    for name, kern in paths(k).items():
        assert torch.equal(bits(kern.packed_linear(x, pw)), bits(want)), name
    dense = x.to(torch.bfloat16).double() @ qt.dequantize().to(torch.bfloat16).double().T
    assert torch.allclose(want.double(), dense, rtol=2e-2, atol=2e-2 * float(dense.abs().max()))


def test_the_reference_sees_the_chains_order(k):
    """Mutation check: the blocks' chain reversed gives other bits (so the exactness above is
    not a property any order would have)."""
    rng = np.random.default_rng(3)
    raw = random_blocks(rng, "Q4_1", 32, 1024, "normal")
    x = torch.from_numpy(rng.standard_normal((4, 1024)).astype(np.float32))
    fwd, rev = reference(x, "Q4_1", raw, 1024), reference(x, "Q4_1", raw, 1024, order="reversed")
    assert not torch.equal(bits(fwd), bits(rev))
    got = k.packed_linear(x, pack_quant_tensor(k, codes("Q4_1", raw, (32, 1024)), dot=True))
    assert torch.equal(bits(got), bits(fwd))


def test_embedding_rows_are_the_dense_models(k):
    """The embedding lookup of a block-codes table (the tied lm_head's blob) expands to the
    dense bfloat16 model's rows, as the expansion layout's does."""
    rng = np.random.default_rng(5)
    raw = random_blocks(rng, "Q8_0", 40, 256, "normal")
    qt = QuantTensor.from_gguf("Q8_0", raw, (40, 256))
    ids = torch.tensor([0, 17, 39, 17])
    want = qt.dequantize().to(torch.bfloat16)[ids]
    got = k.quant_rows(pack_quant_tensor(k, qt.for_block_codes(), dot=True), ids)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_codes_are_marked_and_refused_for_other_formats():
    """A fused weight keeps block codes only where every part has them; the labels tell the
    computation apart (cache fingerprints); other formats are refused with a clear error."""
    rng = np.random.default_rng(2)
    raw5 = random_blocks(rng, "Q5_0", 16, 64, "normal")
    with pytest.raises(ValueError, match="block codes compute"):
        QuantTensor.from_gguf("Q5_0", raw5, (16, 64)).for_block_codes()
    q4 = codes("Q4_0", random_blocks(rng, "Q4_0", 16, 64, "normal"), (16, 64))
    q8 = codes("Q8_0", random_blocks(rng, "Q8_0", 16, 64, "normal"), (16, 64))
    fused = QuantTensor.cat([q4, q8])
    assert fused.compute == "codes" and fused.labels == ("Q4_0/codes", "Q8_0/codes")
    assert QuantTensor.cat([q4, QuantTensor.from_gguf("Q5_0", raw5, (16, 64))]).compute == "expand"


def test_a_fused_weight_of_several_formats(k):
    """One blob of Q4_0 and Q8_0 segments (a fused projection): each segment's columns are its
    own definition's bits."""
    rng = np.random.default_rng(11)
    parts = [("Q4_0", 24), ("Q8_0", 40)]
    raws = [random_blocks(rng, q, n, 128, "normal") for q, n in parts]
    fused = QuantTensor.cat([codes(q, r, (n, 128)) for (q, n), r in zip(parts, raws)])
    x = torch.from_numpy(rng.standard_normal((6, 128)).astype(np.float32))
    want = torch.cat([reference(x, q, r, 128) for (q, _), r in zip(parts, raws)], dim=1)
    pw = pack_quant_tensor(k, fused, dot=True)
    for name, kern in paths(k).items():
        assert torch.equal(bits(kern.packed_linear(x, pw)), bits(want)), name
