"""The bfloat16 dot-product GEMM (csrc/gemm_dot.cpp) against its definition, on every path.

The definition, written out in numpy below: the rows rounded to bfloat16 (to nearest even),
and per output element one float32 chain over the k pairs in order, ``acc += x[2j+1] w[2j+1]``
then ``acc += x[2j] w[2j]``, each a single rounding of an exact product, with denormal inputs
read as zero and denormal results flushed to zero (vdpbf16ps's definition). Every path — the
CPU's own instruction, its AVX-512 and AVX2 emulations, the portable loop — must give those
bits, for any row count: a row alone, in a decode batch or inside a long prefill.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_paths import dot_paths, require_isa, require_kernels
from radixserve.kernels.isa import ISAS, host_isa
from radixserve.kernels import builder
from radixserve.kernels import library as kernels

pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")

_TINY = np.float32(1.17549435e-38)


def _flush(a: np.ndarray) -> np.ndarray:
    return np.where(np.abs(a) < _TINY, np.copysign(np.float32(0), a), a).astype(np.float32)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The definition, one k step at a time over every element at once (float64 holds each
    product and sum exactly before the one float32 rounding)."""
    xb = _flush(x.to(torch.bfloat16).float().numpy())
    wb = _flush(w.to(torch.bfloat16).float().numpy())
    if xb.shape[1] % 2:
        xb = np.pad(xb, ((0, 0), (0, 1)))
        wb = np.pad(wb, ((0, 0), (0, 1)))
    acc = np.zeros((xb.shape[0], wb.shape[0]), np.float32)
    for j in range(xb.shape[1] // 2):
        for k in (2 * j + 1, 2 * j):
            acc = _flush((acc.astype(np.float64) + np.outer(xb[:, k].astype(np.float64), wb[:, k])).astype(np.float32))
    if bias is not None:
        acc = _flush(acc + _flush(bias.numpy()))
    return torch.from_numpy(acc)


def paths(k: kernels.Kernels) -> dict[str, kernels.Kernels]:
    """Every way this machine can run the dot products (cpu_paths.dot_paths)."""
    return dot_paths(k)


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    return require_kernels()


def _values(draw, n: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    v = torch.randn(n, generator=gen)
    if kind == "wide":
        v = v * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).float())
    elif kind == "tiny":  # products and sums near the denormal range: the flushes matter
        v = v * torch.exp2(torch.randint(-70, -55, (n,), generator=gen).float())
        v[torch.rand(n, generator=gen) < 0.1] = 1e-39  # float32 denormals
    elif kind == "cancel":  # exact cancellations: the sign of zero matters
        v = torch.round(v * 4) / 4
    return v


@st.composite
def problems(draw):
    m = draw(st.integers(1, 40))
    kk = draw(st.integers(1, 70))
    n = draw(st.integers(1, 150))  # up to 10 panels: a few-row tile takes up to 8
    kind = draw(st.sampled_from(["normal", "wide", "tiny", "cancel"]))
    x = _values(draw, m * kk, kind).view(m, kk)
    w = _values(draw, n * kk, kind).view(n, kk)
    bias = _values(draw, n, kind) if draw(st.booleans()) else None
    return x, w, bias


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problems())
def test_every_path_gives_the_definitions_bits(k, problem):
    x, w, bias = problem
    pw = k.pack_linear(w, torch.bfloat16, dot=True)
    want = reference(x, w, bias)
    for name, kern in paths(k).items():
        got = kern.packed_linear(x, pw, bias)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), name


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 600), st.sampled_from([(576, 960), (1536, 576), (33, 250)]), st.integers(0, 2**31 - 1))
def test_a_row_is_the_same_bits_alone_and_in_any_batch(k, rows, shape, seed):
    """Decode tiles (few rows, several panels a tile), prefill tiles (row tiles against panel
    groups held in L2, the rows in blocks that L2 holds too: past a few hundred rows at these
    widths a call has several) and the threads' split of the panels all give a row the same
    bits."""
    kk, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, kk, generator=gen)
    pw = k.pack_linear(torch.randn(n, kk, generator=gen) * 0.05, torch.bfloat16, dot=True)
    for name, kern in paths(k).items():
        if name.startswith("generic") and rows > 40:
            continue  # the portable loop is slow; its bits are held to the definition above
        full = kern.packed_linear(x, pw)
        picks = sorted({0, rows - 1, rows // 2, int(torch.randint(rows, (1,), generator=gen))})
        for i in picks:
            assert torch.equal(kern.packed_linear(x[i:i + 1].contiguous(), pw), full[i:i + 1]), (name, i)
        head = min(rows, 5)
        assert torch.equal(kern.packed_linear(x[:head].contiguous(), pw), full[:head]), name


def test_packing_and_arguments(k):
    """bf16 weights given as float32 or bfloat16 pack alike; the dot layout needs bfloat16
    storage; a packed weight of another K, or of the other layout, is refused."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(20, 9, generator=gen)
    a = k.pack_linear(w, torch.bfloat16, dot=True)
    assert torch.equal(a.data, k.pack_linear(w.to(torch.bfloat16), torch.bfloat16, dot=True).data)
    assert a.data.numel() == k.packed_numel(20, 9, dot=True) == 32 * 10
    with pytest.raises(ValueError, match="bfloat16"):
        k.pack_linear(w, torch.float32, dot=True)
    with pytest.raises(RuntimeError, match="packed"):
        k.packed_linear(torch.zeros(2, 11), a)
    f32_chain = k.pack_linear(w, torch.bfloat16)  # odd K: the two layouts differ in size
    with pytest.raises(RuntimeError, match="pack_linear_dot"):
        k.packed_linear(torch.zeros(2, 9), f32_chain._replace(dot=True))


def test_the_native_instruction_is_what_the_definition_says(k):
    """The emulation stands on the CPU's instruction meaning exactly this chain; where the CPU
    has it, its results on values chosen to tell orders apart are the reference's."""
    require_isa("avx512")
    if not k.native_dot:
        pytest.skip("this CPU has no AVX512-BF16: the native path is not built here")
    gen = torch.Generator().manual_seed(3)
    # Products of magnitudes up to 2^24 apart: summed in the other pair order, a good share of
    # the elements round differently, so agreement here tells the orders apart.
    x = torch.randn(64, 8, generator=gen) * torch.exp2(torch.randint(0, 12, (64, 8), generator=gen).float())
    w = torch.randn(16, 8, generator=gen) * torch.exp2(torch.randint(0, 12, (16, 8), generator=gen).float())
    got = k.capped("avx512").packed_linear(x, k.pack_linear(w, torch.bfloat16, dot=True))
    assert torch.equal(got, reference(x, w, None))
    swapped = reference(x[:, [1, 0, 3, 2, 5, 4, 7, 6]], w[:, [1, 0, 3, 2, 5, 4, 7, 6]], None)
    assert (got != swapped).float().mean() > 0.05
