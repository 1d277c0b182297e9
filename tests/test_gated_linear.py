"""The gate_up projection and its gate in one pass (csrc/gemm_dot.cpp, "gated calls").

``Kernels.gated_linear`` must give, bit for bit, what the two passes it replaces give: the
packed GEMM into ``[M, 2 I]`` rows, then ``silu_mul`` / ``gelu_tanh_mul`` over them. That holds
on every path the machine has (each level, the native instruction and its emulation), for any
row count (decode tiles, prefill tiles, several row blocks, the threads' split of the panels),
and for values whose products and gates meet the denormal range: the GEMM runs with denormals
flushed, the gate must not (the two-pass gate runs under the caller's MXCSR).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cpu_paths import require_isa, require_kernels
from radixserve.engine.runner import ModelRunner
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.kernels.isa import ISAS
from radixserve.kernels.library import Kernels
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
from test_gemm_dot import _values, paths
from test_last_layer_rows import assert_switch_keeps_the_bits

pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    return require_kernels()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _two_pass(kern: kernels.Kernels, x: torch.Tensor, pw, gate: str) -> torch.Tensor:
    gu = kern.packed_linear(x, pw)
    return kern.silu_mul(gu) if gate == "silu" else kern.gelu_tanh_mul(gu)


@st.composite
def problems(draw):
    m = draw(st.integers(1, 90))
    kk = draw(st.sampled_from([1, 7, 32, 33, 64, 130]))
    inter = 16 * draw(st.integers(1, 12))  # up to 12 gate panels: groups and the threads' split
    kind = draw(st.sampled_from(["normal", "wide", "tiny", "cancel"]))
    x = _values(draw, m * kk, kind).view(m, kk)
    w = _values(draw, 2 * inter * kk, kind).view(2 * inter, kk)
    return x, w, draw(st.sampled_from(["silu", "gelu_tanh"]))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problems())
def test_one_pass_gives_the_two_passes_bits_on_every_path(k, problem):
    x, w, gate = problem
    pw = k.pack_linear(w, torch.bfloat16, dot=True)
    for name, kern in paths(k).items():
        want = _two_pass(kern, x, pw, gate)
        got = kern.gated_linear(x, pw, gate)
        assert _same(got, want), (name, gate)
        assert _same(kern.gated_linear(x, pw, gate, fuse=False), want), name


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 400), st.sampled_from([(576, 1536), (1536, 96), (640, 2048)]), st.integers(0, 2**31 - 1),
       st.sampled_from(["silu", "gelu_tanh"]))
@example(rows=300, shape=(1536, 96), seed=0, gate="silu")  # K 1536: blocks of 42 rows, seven of them
def test_model_shapes_alone_and_in_any_batch(k, rows, shape, seed, gate):
    """SmolLM2's and Gemma 3's shapes: the one pass equals the two, and a row gets the same bits
    alone as inside the call."""
    kk, inter = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, kk, generator=gen)
    pw = k.pack_linear(torch.randn(2 * inter, kk, generator=gen) * 0.05, torch.bfloat16, dot=True)
    for name, kern in paths(k).items():
        if name.startswith("generic") and rows * inter > 40 * 96:
            continue  # the portable loop is slow; small problems above hold its bits
        full = kern.gated_linear(x, pw, gate)
        assert _same(full, _two_pass(kern, x, pw, gate)), name
        i = int(torch.randint(rows, (1,), generator=gen))
        assert _same(kern.gated_linear(x[i:i + 1].contiguous(), pw, gate), full[i:i + 1]), (name, i)


def test_denormal_gates_are_not_flushed(k):
    """Gate and up values near 1e-20: silu(g) * u is a float32 denormal, which the two passes
    keep. The one pass computes g and u with denormals flushed; its gate must run without."""
    x = torch.full((3, 4), 2.0 ** -35)
    w = torch.full((32, 4), 2.0 ** -33)  # g = u = 4 * 2^-68 = 2^-66
    w[16:] *= torch.linspace(0.5, 1.5, 16).view(16, 1)
    pw = k.pack_linear(w, torch.bfloat16, dot=True)
    for name, kern in paths(k).items():
        want = _two_pass(kern, x, pw, "silu")
        assert bool(((want != 0) & (want.abs() < torch.finfo(torch.float32).tiny)).all()), "denormals expected"
        assert _same(kern.gated_linear(x, pw, "silu"), want), name


def test_fallbacks_and_arguments(k):
    """An intermediate size that is not whole panels, float32 chains and a quantized-style
    weight run the two passes (the same bits); bad arguments are refused by name."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 40, generator=gen)
    odd = k.pack_linear(torch.randn(2 * 20, 40, generator=gen), torch.bfloat16, dot=True)  # I = 20
    assert _same(k.gated_linear(x, odd, "silu"), _two_pass(k, x, odd, "silu"))
    chains = k.pack_linear(torch.randn(64, 40, generator=gen), torch.bfloat16)  # float32 chains
    assert _same(k.gated_linear(x, chains, "gelu_tanh"), _two_pass(k, x, chains, "gelu_tanh"))
    pw = k.pack_linear(torch.randn(64, 40, generator=gen), torch.bfloat16, dot=True)
    with pytest.raises(KeyError):
        k.gated_linear(x, pw, "relu")
    with pytest.raises(RuntimeError, match="gu must be"):
        k.gated_linear(x, pw, "silu", out=torch.empty(9, 31))
    with pytest.raises(RuntimeError, match="kind"):
        torch.ops.radixserve.gated_linear(x, pw.data, 7, torch.empty(9, 64), torch.empty(9, 32), 0, 1)
    with pytest.raises(RuntimeError, match="packed"):
        k.gated_linear(torch.randn(9, 38), pw, "silu")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("isa", ISAS)
def test_models_give_the_same_bits_with_one_pass_and_two(isa, arch, monkeypatch):
    """A bfloat16 model on the kernels' GEMM, in one C++ call and from Python, with the gate in
    the GEMM and as its own pass: the same logits, the same next decode step. From Python the
    one pass is what runs (its calls are counted)."""
    require_kernels()
    require_isa(isa)
    config = tiny_random_config(arch)
    sd = {n: v.to(torch.bfloat16) for n, v in tiny_random_state_dict(seed=0, config=config).items()}
    runner = ModelRunner.from_config(config, sd, kv_capacity=512, dtype=torch.bfloat16, cpu_isa=isa,
                                     linear_backend="radixserve")
    calls: list[bool] = []
    gated = Kernels.gated_linear
    monkeypatch.setattr(Kernels, "gated_linear", lambda self, *a, **kw: calls.append(kw["fuse"]) or gated(self, *a, **kw))
    assert_switch_keeps_the_bits(runner, "fused_gate_up", monkeypatch)
    layers = config.num_layers
    assert calls.count(True) == 2 * layers and calls.count(False) == 2 * layers  # prefill + decode, from Python


@pytest.mark.parametrize("formats", [("Q4_1", "Q4_1"), ("Q4_K", "Q6_K"), ("Q8_0", "Q5_0")])
def test_quantized_blocks_that_expand_give_the_two_passes_bits(k, formats):
    """A GGUF gate_up (gate and up tensors of their own formats, one weight of two segments)
    whose blocks expand into scratch: the one pass, a chunk of gate panels and their up panels
    at a time, gives the two passes' bits on every path, for decode batches (the two passes in
    registers) and prefills of several chunks."""
    gguf = pytest.importorskip("gguf")
    from radixserve.kernels.quant_weights import QuantTensor, pack_quant_tensor
    from test_gemm_quant import random_blocks

    rng = np.random.default_rng(11)
    inter, kk = 16 * 13, 256
    parts = [QuantTensor.from_gguf(f, random_blocks(rng, f, inter, kk, "normal"), (inter, kk)) for f in formats]
    pw = pack_quant_tensor(k, QuantTensor.cat(parts), dot=True)
    assert pw.quantized and gguf is not None
    x = torch.from_numpy(rng.standard_normal((70, kk)).astype(np.float32))
    for name, kern in paths(k).items():
        for m in (1, 8, 9, 70):
            if name.startswith("generic") and m > 9:
                continue
            for gate in ("silu", "gelu_tanh"):
                want = _two_pass(kern, x[:m], pw, gate)
                assert _same(kern.gated_linear(x[:m], pw, gate), want), (name, m, gate)


def test_quantized_segments_off_the_panels_run_two_passes(k):
    """Segments whose rows do not start on a panel (a gate of 24 rows then 8) cannot expand a
    panel from one segment: the two passes run, the same bits."""
    pytest.importorskip("gguf")
    from radixserve.kernels.quant_weights import QuantTensor, pack_quant_tensor
    from test_gemm_quant import random_blocks

    rng = np.random.default_rng(12)
    sizes = (("Q8_0", 24), ("Q4_1", 8), ("Q8_0", 32))
    parts = [QuantTensor.from_gguf(f, random_blocks(rng, f, n, 64, "normal"), (n, 64)) for f, n in sizes]
    pw = pack_quant_tensor(k, QuantTensor.cat(parts), dot=True)
    x = torch.from_numpy(rng.standard_normal((20, 64)).astype(np.float32))
    assert _same(k.gated_linear(x, pw, "silu"), _two_pass(k, x, pw, "silu"))
