"""Quantized weights (csrc/gemm_quant.cpp, kernels/quant_weights.py) against what they are exact to.

The reference: the dense bfloat16 model of the same GGUF, whose weights are gguf-py's numpy
dequantization rounded to bfloat16 (torch's ``.to(bfloat16)``). So, for every GGUF block
format the kernels keep, on blocks of every kind (random codes and scales: fp16 scales of any
sign and size, subnormal and zero included; and blocks from gguf-py's own quantizers):

* the expanded rows (the embedding lookup) are those bfloat16 weights, bit for bit;
* a linear on the blocks gives the bits of the bfloat16 dot-product definition (numpy, from
  test_gemm_dot) on those weights, and of the dense packed GEMM, on every path this machine
  has (each instruction-set level, native and emulated dot products), for any row count:
  decode's few rows (expanded in registers) and prefill's many (expanded into scratch);
* the lm_head's float32 chains on the blocks give the dense float32-chain GEMM's bits;
* a row's result is the same alone and inside any batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_paths import dot_paths, require_kernels
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.kernels.isa import ISAS, host_isa
from radixserve.kernels.quant_weights import GGUF_FORMATS, QuantSegment, QuantTensor, pack_quant_tensor
from test_gemm_dot import reference

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")

FORMATS = sorted(GGUF_FORMATS)
# Byte offsets of the fp16 scale words in a block of each format.
_F16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def block_size(qtype: str) -> tuple[int, int]:
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int, scales: str) -> np.ndarray:
    """Raw blocks ``[n, bytes per row]``: random codes, finite fp16 scales of ``scales`` kind."""
    bk, bb = block_size(qtype)
    raw = rng.integers(0, 256, size=(n, k // bk, bb), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        shape = (n, k // bk)
        if scales == "normal":
            d = rng.standard_normal(shape) * 0.05
        elif scales == "wide":  # fp16's whole range: subnormals to ~1e4
            d = np.clip(rng.standard_normal(shape) * np.exp2(rng.integers(-24, 14, shape)), -6e4, 6e4)
        else:  # "zeros": zero and negative-zero scales among tiny ones
            d = rng.choice([0.0, -0.0, 6e-8, -1.2e-7, 3e-5], size=shape)
        raw[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(n, k // bk, 2)
    return raw.reshape(n, -1)


def paths(k: kernels.Kernels) -> dict[str, kernels.Kernels]:
    return dot_paths(k)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    return require_kernels()


@st.composite
def weights(draw, max_rows: int = 40):
    qtype = draw(st.sampled_from(FORMATS))
    bk, _ = block_size(qtype)
    n = draw(st.integers(1, 70))
    kk = bk * draw(st.integers(1, 2 if bk == 256 else 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = random_blocks(rng, qtype, n, kk, draw(st.sampled_from(["normal", "wide", "zeros"])))
    m = draw(st.integers(1, max_rows))
    x = torch.from_numpy(rng.standard_normal((m, kk)).astype(np.float32))
    return QuantTensor.from_gguf(qtype, raw, (n, kk)), x


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weights())
def test_blocks_expand_to_the_dense_models_weights(k, case):
    qt, _ = case
    want = qt.dequantize().to(torch.bfloat16)
    got = k.quant_rows(pack_quant_tensor(k, qt, dot=True), torch.arange(qt.shape[0]))
    assert torch.equal(bits(got), bits(want)), qt


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weights())
def test_every_path_gives_the_dense_models_bits(k, case):
    """The dot products against their numpy definition on the dense bfloat16 weights, and the
    lm_head's float32 chains against the dense float32-chain GEMM, on every path."""
    qt, x = case
    dense = qt.dequantize().to(torch.bfloat16)
    want_dot = reference(x, dense.float(), None)
    dot, chain = pack_quant_tensor(k, qt, dot=True), pack_quant_tensor(k, qt, dot=False)
    dense_chain = k.pack_linear(dense, torch.bfloat16)
    for name, kern in paths(k).items():
        assert torch.equal(bits(kern.packed_linear(x, dot)), bits(want_dot)), (name, qt, x.shape)
        assert torch.equal(bits(kern.packed_linear(x, chain)), bits(kern.packed_linear(x, dense_chain))), name


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(FORMATS), st.integers(1, 300), st.sampled_from([(96, 512), (256, 1024)]),
       st.integers(0, 2**31 - 1))
def test_a_row_is_the_same_bits_alone_and_in_any_batch(k, qtype, rows, shape, seed):
    """Decode tiles (rows expanded in registers, several panels a tile), prefill (panels
    expanded into scratch, the dense tiles over it) and the threads' split of the panels all
    give a row the same bits."""
    n, kk = shape
    rng = np.random.default_rng(seed)
    qt = QuantTensor.from_gguf(qtype, random_blocks(rng, qtype, n, kk, "normal"), (n, kk))
    x = torch.from_numpy(rng.standard_normal((rows, kk)).astype(np.float32))
    for dot in (True, False):
        pw = pack_quant_tensor(k, qt, dot=dot)
        for name, kern in paths(k).items():
            if name.startswith("generic") and rows > 40:
                continue  # the portable loop is slow; its bits are held to the definition above
            full = kern.packed_linear(x, pw)
            picks = sorted({0, rows - 1, rows // 2, int(rng.integers(rows))})
            for i in picks:
                assert torch.equal(bits(kern.packed_linear(x[i:i + 1].contiguous(), pw)), bits(full[i:i + 1])), \
                    (name, dot, i)
            for head in (3, 8, 9):
                if head <= rows:
                    assert torch.equal(bits(kern.packed_linear(x[:head].contiguous(), pw)), bits(full[:head])), \
                        (name, dot, head)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_blocks_from_ggufs_own_quantizer(k, qtype):
    """Blocks as a converter writes them (negative scales, exact zeros), on a weight of a
    realistic shape with a partial last panel."""
    gen = np.random.default_rng(7)
    w = (gen.standard_normal((200, 576)) * 0.02).astype(np.float32)
    w[3, :64] = 0.0
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    qt = QuantTensor.from_gguf(qtype, raw, w.shape)
    dense = qt.dequantize().to(torch.bfloat16)
    assert torch.equal(bits(k.quant_rows(pack_quant_tensor(k, qt, dot=True), torch.arange(200))), bits(dense))
    ref = k.pack_linear(dense, torch.bfloat16, dot=True)
    x = torch.from_numpy(gen.standard_normal((13, 576)).astype(np.float32))
    bias = torch.from_numpy(gen.standard_normal(200).astype(np.float32))
    pw = pack_quant_tensor(k, qt, dot=True)
    for name, kern in paths(k).items():
        for m in (1, 5, 13):
            assert torch.equal(bits(kern.packed_linear(x[:m], pw, bias)), bits(kern.packed_linear(x[:m], ref, bias))), \
                (name, m)


def test_a_fused_weight_of_several_formats(k):
    """Gemma 3's fused q/k/v: q and k in Q5_0, v in Q8_0, one weight of two segments; also
    rows reordered at load (llama's q/k permutation) before packing."""
    gen = np.random.default_rng(3)
    parts = []
    for qtype, n in (("Q5_0", 48), ("Q5_0", 16), ("Q8_0", 24)):
        parts.append(QuantTensor.from_gguf(qtype, random_blocks(gen, qtype, n, 128, "normal"), (n, 128)))
    parts[0] = parts[0].permute_rows(gen.permutation(48))
    fused = QuantTensor.cat(parts)
    assert fused.shape == (88, 128) and fused.formats == ("Q5_0", "Q8_0")
    dense = fused.dequantize().to(torch.bfloat16)
    assert torch.equal(dense.float(), torch.cat([p.dequantize() for p in parts]).to(torch.bfloat16).float())
    pw = pack_quant_tensor(k, fused, dot=True)
    assert torch.equal(bits(k.quant_rows(pw, torch.tensor([0, 47, 48, 63, 64, 87]))), bits(dense[[0, 47, 48, 63, 64, 87]]))
    ref = k.pack_linear(dense, torch.bfloat16, dot=True)
    x = torch.from_numpy(gen.standard_normal((20, 128)).astype(np.float32))
    for name, kern in paths(k).items():
        for m in (1, 4, 20):
            assert torch.equal(bits(kern.packed_linear(x[:m], pw)), bits(kern.packed_linear(x[:m], ref))), (name, m)


def test_int8_channels(k):
    """Per-output-channel int8: q = round(w / s), s = max |w[n]| / 127; exact to the dense
    bfloat16 model of q * s, for a K that is not whole 32-k groups (odd, even)."""
    gen = torch.Generator().manual_seed(5)
    for kk in (70, 33):
        w = torch.randn(37, kk, generator=gen)
        w[4] = 0.0
        qt = QuantTensor.int8_channels(w)
        seg = qt.segments[0]
        assert seg.rows.dtype == np.int8 and np.abs(seg.rows).max() <= 127 and seg.scales[4] == 1.0
        assert (qt.dequantize() - w).abs().max() <= torch.from_numpy(seg.scales).max() / 2 + 1e-6
        dense = qt.dequantize().to(torch.bfloat16)
        pw, chain = pack_quant_tensor(k, qt, dot=True), pack_quant_tensor(k, qt, dot=False)
        assert torch.equal(bits(k.quant_rows(pw, torch.arange(37))), bits(dense))
        ref, ref_chain = k.pack_linear(dense, torch.bfloat16, dot=True), k.pack_linear(dense, torch.bfloat16)
        x = torch.randn(11, kk, generator=gen)
        for name, kern in paths(k).items():
            for m in (1, 6, 11):
                assert torch.equal(bits(kern.packed_linear(x[:m], pw)), bits(kern.packed_linear(x[:m], ref))), (name, m)
                assert torch.equal(bits(kern.packed_linear(x[:m], chain)),
                                   bits(kern.packed_linear(x[:m], ref_chain))), (name, m)


def test_refusals(k):
    """A weight with a non-finite scale, a blob of another shape, or a corrupted header is
    refused, never computed."""
    raw = random_blocks(np.random.default_rng(1), "Q4_0", 16, 64, "normal")
    raw[2, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(RuntimeError, match="non-finite"):
        pack_quant_tensor(k, QuantTensor.from_gguf("Q4_0", raw, (16, 64)), dot=True)
    good = QuantTensor.from_gguf("Q4_0", random_blocks(np.random.default_rng(1), "Q4_0", 16, 64, "normal"), (16, 64))
    pw = pack_quant_tensor(k, good, dot=True)
    with pytest.raises(RuntimeError, match="quantized weight is"):
        k.packed_linear(torch.zeros(1, 96), pw._replace(k=96))
    broken = pw.data.clone()
    broken[0] ^= 1
    with pytest.raises(RuntimeError, match="bad header"):
        k.packed_linear(torch.zeros(1, 64), pw._replace(data=broken))
    with pytest.raises(RuntimeError, match="blocks of"):
        k.pack_quant_panels(torch.zeros((16, 17), dtype=torch.uint8), GGUF_FORMATS["Q4_0"], 64,
                     torch.zeros(k.quant_panel_bytes(GGUF_FORMATS["Q4_0"], 64), dtype=torch.uint8))
    with pytest.raises(ValueError, match="not computed quantized"):
        QuantTensor([QuantSegment("Q2_K", np.zeros((1, 84), np.uint8))], 256)
