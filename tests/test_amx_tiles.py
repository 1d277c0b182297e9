"""The AMX tile kernels (csrc/gemm_dot.cpp, "tile calls"; the unit in csrc/tiles.h).

A call of 16 rows or more at the ``amx`` level runs on the AMX-BF16 tiles, and must give the
bits of the vdpbf16ps chain that every other path gives (decode rows, which stay on the native
tiles, included). The tile kernels are templates over the tile unit, so on any CPU with
AVX512-BF16 the same kernel code runs against the software model of the unit (the SDM's
definition of ``tdpbf16ps``) and is checked here bit for bit: padding, pair order, blocking,
epilogue. Only the instructions themselves need an AMX CPU: the tests marked so are skipped
elsewhere, and the startup probe (``Kernels.amx_status``) keeps the tiles out of a process
where they disagree with the model.

The tile paths are also among ``cpu_paths.dot_paths``, so the GEMM, gated and quantized-weight
tests (test_gemm_dot, test_gated_linear, test_gemm_quant) run them too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cpu_paths import require_isa, require_kernels
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.kernels.isa import cpu_flags
from test_gemm_dot import _values

pytestmark = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    kern = require_kernels()
    if not kern.native_dot:
        pytest.skip("the tile kernels need the native bf16 dot products (AVX512-BF16); this build has none")
    return kern


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                       b.view(torch.int32 if b.dtype == torch.float32 else torch.int16))


def _units(k: kernels.Kernels) -> dict[str, kernels.Kernels]:
    """The tile units this machine runs: the model always, the hardware where it was admitted."""
    out = {"model": k.with_tile_model().capped("avx512")}
    if "amx" in k.available_isas():
        out["hardware"] = k.capped("amx")
    return out


@st.composite
def problems(draw):
    m = draw(st.integers(16, 100))  # tile calls: 16 rows or more; one, two, odd row tiles
    kk = draw(st.sampled_from([1, 2, 31, 32, 33, 64, 70, 130]))  # zero pairs in front: 0 to 15
    n = draw(st.integers(1, 100))  # part panels, odd panel counts
    kind = draw(st.sampled_from(["normal", "wide", "tiny", "cancel"]))
    x = _values(draw, m * kk, kind).view(m, kk)
    w = _values(draw, n * kk, kind).view(n, kk)
    bias = _values(draw, n, kind) if draw(st.booleans()) else None
    out_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return x, w, bias, out_dtype


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problems())
# products that underflow to -0: the chain ends at -0, which zero pairs after it would make +0
@example(problem=(torch.full((16, 2), 1e-30), torch.full((1, 2), -1e-30), None, torch.float32))
def test_tile_calls_give_the_native_bits(k, problem):
    """Every element of a tile call equals the native tiles' chain, bit for bit: values that
    lose bits at every step (wide), meet the denormal range (tiny), or cancel to zero."""
    x, w, bias, out_dtype = problem
    pw = k.pack_linear(w, torch.bfloat16, dot=True)
    want = k.capped("avx512").packed_linear(x, pw, bias, out_dtype)
    for name, kern in _units(k).items():
        assert _same(kern.packed_linear(x, pw, bias, out_dtype), want), name


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(16, 700), st.sampled_from([(576, 192), (1536, 96), (640, 1024), (2048, 64)]),
       st.integers(0, 2**31 - 1))
@example(rows=600, shape=(576, 192), seed=1)  # several row blocks and panel groups
def test_a_row_alone_equals_the_row_inside_a_tile_call(k, rows, shape, seed):
    """A decode row (native tiles) gets the bits it gets inside a prefill (tile calls), at the
    models' widths: the invariance the tiles must keep."""
    kk, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, kk, generator=gen)
    pw = k.pack_linear(torch.randn(n, kk, generator=gen) * 0.05, torch.bfloat16, dot=True)
    for name, kern in _units(k).items():
        full = kern.packed_linear(x, pw)
        for r in {0, rows // 2, rows - 1}:
            assert _same(kern.packed_linear(x[r:r + 1], pw), full[r:r + 1]), (name, r)
        assert _same(kern.packed_linear(x[:15], pw), full[:15]), name  # the most rows without tiles


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(16, 120), st.sampled_from([1, 33, 576]), st.integers(1, 6), st.sampled_from(["silu", "gelu_tanh"]),
       st.integers(0, 2**31 - 1))
def test_gated_tile_calls_give_the_two_passes_bits(k, rows, kk, panels, gate, seed):
    """gate_up and its gate in one pass on the tiles: the native two passes' bits."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, kk, generator=gen)
    pw = k.pack_linear(torch.randn(2 * 16 * panels, kk, generator=gen) * 0.1, torch.bfloat16, dot=True)
    native = k.capped("avx512")
    gu = native.packed_linear(x, pw)
    want = native.silu_mul(gu) if gate == "silu" else native.gelu_tanh_mul(gu)
    for name, kern in _units(k).items():
        assert _same(kern.gated_linear(x, pw, gate), want), name


def test_status_says_why_the_tiles_do_or_do_not_run(k):
    """The probe's verdict matches the CPU, and only an admitted unit is a level of its own."""
    flags = cpu_flags()
    assert k.amx_status in kernels.AMX_STATUS
    if not {"amx_tile", "amx_bf16"} <= flags:
        assert k.amx_status == 2, kernels.AMX_STATUS[k.amx_status]
    else:
        assert k.amx_status in (0, 3, 4, 5)
    assert ("amx" in k.available_isas()) == (k.amx_status == 0)
    assert k.capped("avx512").isa == "avx512"


def test_startup_log_says_why_an_amx_cpu_does_not_use_the_tiles(k):
    """The linear backend's reason (logged at startup, in /server_info) names the probe's or
    Linux's refusal on an AMX CPU, and says nothing of tiles on a CPU without them."""
    import copy

    from radixserve.kernels.linear import choose_backend

    for status, says in [(kernels.AMX_NO_CPU, None), (kernels.AMX_NO_OS, "arch_prctl"),
                         (kernels.AMX_PROBE_DIFFERS, "startup probe"), (kernels.AMX_PROBE_FAILED, "died")]:
        view = copy.copy(k.capped("avx512"))
        view.amx_status = status
        _, why = choose_backend("auto", torch.device("cpu"), torch.bfloat16, "auto", view)
        assert "native (AVX512-BF16" in why
        assert (says in why) if says else ("AMX" not in why), why


def test_the_built_tile_instructions_name_the_operands_the_model_takes(k):
    """Where the tiles cannot run, the one layer the model does not stand in for is the
    assembly of HardwareTiles: read it back from the built library. tdpbf16ps (AT&T order:
    B, A, C) must multiply a row tile (4, 5) by a panel tile (6, 7) into a C tile (0-3), as
    ModelTiles::dot<C, A, B> does; the SDM's A operand is the one whose rows are C's rows."""
    import re
    import shutil
    import subprocess

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump (binutils) to read the library back")
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(k.path)], capture_output=True, text=True,
                          check=True).stdout
    dots = set(re.findall(r"tdpbf16ps\s+%tmm(\d),%tmm(\d),%tmm(\d)", text))
    as_cab = {(int(c), int(a), int(b)) for b, a, c in dots}
    # the GEMM's 2 x 2 C tiles; attention uses (0, 4, 6) and (1, 4, 7)
    assert as_cab == {(0, 4, 6), (1, 4, 7), (2, 5, 6), (3, 5, 7)}, as_cab
    assert re.search(r"ldtilecfg\s", text) and re.search(r"tilerelease", text)


def test_hardware_tiles_give_the_models_bits(k):
    """On an AMX CPU: the tiles admitted, and a long call's every bit the model's."""
    require_isa("amx")
    assert k.amx_status == 0, kernels.AMX_STATUS[k.amx_status]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=gen) * torch.exp2(torch.randint(-20, 20, (300, 576), generator=gen).float())
    pw = k.pack_linear(torch.randn(1536, 576, generator=gen), torch.bfloat16, dot=True)
    assert _same(k.capped("amx").packed_linear(x, pw), k.with_tile_model().capped("avx512").packed_linear(x, pw))


# tiny Llama's head_dim 16 is no whole tile row of q.k: its attention stays on kBf16
@pytest.mark.parametrize("name,attention", [("tiny-random", kernels.IMPL_BF16),
                                            ("tiny-random-gemma3", kernels.IMPL_AMX_MODEL)])
def test_tiny_models_on_the_tile_model_alone_busy_cached(name, attention, monkeypatch):
    """The batch-invariance check of test_batch_invariance with prefill rows and prefill
    attention on the tile model: a prompt's rows go through tile calls alone and native tiles
    in a decode batch (or the other way round), and alone / busy / cached keep the same
    tokens and logprobs."""
    from test_batch_invariance import check

    kern = require_kernels()
    if not kern.native_dot:
        pytest.skip("the tile kernels need the native bf16 dot products (AVX512-BF16)")
    calls = []
    arith = kernels.Kernels.arith
    monkeypatch.setattr(kern, "tile_model", True)  # views the engines make inherit it
    monkeypatch.setattr(kernels.Kernels, "arith", lambda self, w: calls.append(a := arith(self, w)) or a)
    picked = []
    pick = kernels.Kernels.pick_attention_impl
    monkeypatch.setattr(kernels.Kernels, "pick_attention_impl",
                        lambda self, *a, **kw: picked.append(i := pick(self, *a, **kw)) or i)
    check(name, torch.bfloat16, "avx512", families=3, prefix_len=60)
    assert kernels.ARITH_DOT_TILE_MODEL in calls
    assert picked and set(picked) == {attention}


# ---------------------------------------------------------------- attention
@st.composite
def attention_problems(draw):
    d = draw(st.sampled_from([32, 64, 128, 256]))
    kv, group = draw(st.sampled_from([(1, 4), (3, 3), (2, 1), (8, 1)]))
    seqs = draw(st.lists(st.tuples(st.integers(0, 80), st.integers(1, 120)), min_size=1, max_size=3))
    window = draw(st.sampled_from([0, 0, 17, 40]))
    q_dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    out_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    scale = draw(st.sampled_from([1.0, 8.0]))  # 8: scores far apart, p underflows to 0
    return d, kv, group, seqs, window, q_dtype, out_dtype, scale, draw(st.integers(0, 2**31 - 1))


def _attention(kern: kernels.Kernels, impl: int, problem) -> torch.Tensor:
    d, kv, group, seqs, window, q_dtype, out_dtype, scale, seed = problem
    gen = torch.Generator().manual_seed(seed)
    t = sum(n for _, n in seqs)
    slots_n = sum(p + n for p, n in seqs) + 7
    q = torch.randn(t, kv * group, d, generator=gen).to(q_dtype)
    k_cache = torch.randn(slots_n, kv, d, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(slots_n, kv, d, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(slots_n, generator=gen)
    info, slots, row, at = [], [], 0, 0
    for prefix, new in seqs:
        info.append([row, new, at, prefix + new])
        slots.append(perm[at:at + prefix + new])
        row, at = row + new, at + prefix + new
    out = torch.empty(t, kv * group * d, dtype=out_dtype)
    return kern.attention(q, k_cache, v_cache, torch.cat(slots), torch.tensor(info), out, scale * d ** -0.5, impl,
                          window)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(attention_problems())
def test_attention_on_the_tiles_gives_the_bf16_paths_bits(k, problem):
    """Prefill items (more than 8 rows) run their blocks' q.k and p.v on the tile unit: the
    AVX-512 bf16 path's bits, with prefixes, part blocks, windows, grouped heads."""
    want = _attention(k, kernels.IMPL_BF16, problem)
    assert _same(_attention(k, kernels.IMPL_AMX_MODEL, problem), want)
    if k.impl_available(kernels.IMPL_AMX, torch.bfloat16, problem[0]):
        assert _same(_attention(k, kernels.IMPL_AMX, problem), want)


def test_attention_impls_on_the_tiles_are_offered_where_they_run(k):
    """The model serves bf16 pools of whole-tile head sizes; it is picked only by a tile-model
    view, the hardware only where the tiles were admitted (and never under an avx512 cap)."""
    assert k.impl_available(kernels.IMPL_AMX_MODEL, torch.bfloat16, 64)
    assert not k.impl_available(kernels.IMPL_AMX_MODEL, torch.bfloat16, 16)
    assert not k.impl_available(kernels.IMPL_AMX_MODEL, torch.float32, 64)
    assert k.impl_available(kernels.IMPL_AMX, torch.bfloat16, 64) == (k.amx_status == 0)
    assert k.with_tile_model().capped("avx512").pick_attention_impl(torch.bfloat16, 64) == kernels.IMPL_AMX_MODEL
    assert k.capped("avx512").pick_attention_impl(torch.bfloat16, 64) == kernels.IMPL_BF16
    assert k.with_tile_model().pick_attention_impl(torch.bfloat16, 16) == kernels.IMPL_BF16


def test_the_probe_runs_apart_and_survives_a_trap(k):
    """The startup probe runs in a child process: its own layout of the operands agrees on
    the model (0), and where the CPU has no AMX the hardware probe's child dies of the trap
    (or Linux refuses the tile state) while this process goes on."""
    probe = torch.ops.radixserve.tile_probe
    assert probe(False, False) == kernels.AMX_READY
    if {"amx_tile", "amx_bf16"} <= cpu_flags():
        assert probe(True, True) == k.amx_status
    else:
        assert probe(True, False) == kernels.AMX_PROBE_FAILED  # ldtilecfg traps: SIGILL in the child
        assert probe(True, True) == kernels.AMX_NO_OS  # arch_prctl refuses
    assert probe(False, False) == kernels.AMX_READY  # and this process still computes
