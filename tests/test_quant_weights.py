"""Quantized weights in the model and the engine: what the rule picks and why, what a quantized
model holds, where it falls back to dense weights, and where it refuses.

The kernels' exactness is tests/test_gemm_quant.py's; the engine's (a quantized model gives
the dense bfloat16 model's tokens and logprobs, alone, busy and cached) is
tests/test_batch_invariance.py's.
"""

from __future__ import annotations

import logging

import pytest
import torch

from cpu_paths import require_kernels
from gguf_writer import TINY_QUANT, write_gguf, write_tiny_quant_gguf
from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.kernels.isa import effective_isa, native_bf16
from radixserve.kernels.operands import PackedWeight
from radixserve.kernels.quant_weights import QuantTensor
from radixserve.kernels.weight_choice import AUTO_CODES_FORMATS, choose_weights
from radixserve.model.registry import load_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
PROMPT = [5, 17, 99, 3, 250, 7, 41]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tq") / "tiny-quant.gguf"
    write_tiny_quant_gguf(path)
    return str(path)


def answer(engine: Engine) -> tuple[list[int], list[float]]:
    out = engine.generate([PROMPT], GREEDY)[0]
    return list(out.token_ids), list(out.logprobs)


def test_the_rule_keeps_a_ggufs_blocks_for_a_bfloat16_model_on_the_kernels():
    """By the file, the dtype and the CPU level: never a timing. Explicit requests the
    quantized path cannot serve are refused, naming why."""
    bf16 = torch.bfloat16
    if native_bf16("auto"):
        auto = choose_weights("auto", gguf_source=True, dtype=bf16)
        assert auto.format == "gguf-codes" and auto.codes_formats == AUTO_CODES_FORMATS == {"Q4_0", "Q8_0"}
        assert "blocks" in auto.reason and "by CPU features" in auto.reason and "Q4_0+Q8_0" in auto.reason
    for kw, why in ((dict(dtype=torch.float32), "bfloat16 model"), (dict(cpu_isa="generic"), "no vector kernels"),
                    # (a process capped to the portable level is generic whatever is asked)
                    (dict(cpu_isa="avx2"), "emulates the bfloat16 dot products at level avx2"
                     if effective_isa("avx2") == "avx2" else "no vector kernels"),
                    (dict(tp_size=2), "tensor-parallel"), (dict(linear_backend="onednn"), "radixserve linear"),
                    (dict(kernels_available=False), "CPU kernels")):
        c = choose_weights("auto", **{"gguf_source": True, "dtype": bf16, **kw})
        assert c.format == "dense" and why in c.reason, (kw, c)
    assert choose_weights("auto", gguf_source=False, dtype=bf16).format == "dense"
    assert choose_weights("dense", gguf_source=True, dtype=bf16).format == "dense"
    assert choose_weights("int8", gguf_source=False, dtype=bf16).format == "int8"
    with pytest.raises(ValueError, match="needs a GGUF"):
        choose_weights("gguf", gguf_source=False, dtype=bf16)
    with pytest.raises(ValueError, match="needs a GGUF"):
        choose_weights("gguf-q8", gguf_source=False, dtype=bf16)
    assert choose_weights("gguf-q8", gguf_source=True, dtype=bf16, cpu_isa="avx2").format == "gguf-q8"
    with pytest.raises(ValueError, match="tensor-parallel"):
        choose_weights("gguf", gguf_source=True, dtype=bf16, tp_size=2)
    with pytest.raises(ValueError, match="bfloat16 model"):
        choose_weights("int8", gguf_source=False, dtype=torch.float32)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("own", ["gguf-q8", "gguf-codes"])
def test_the_rule_takes_the_codes_only_where_the_dot_products_are_native(isa, own):
    """auto never picks gguf-q8 (8-bit activations change answers), and gguf-codes only with
    native bfloat16 dot products (AVX512-BF16 under the cap); each is served at any level when
    asked for by name (gguf-codes then for every format), and needs a GGUF."""
    c = choose_weights("auto", gguf_source=True, dtype=torch.bfloat16, cpu_isa=isa)
    assert c.format != "gguf-q8" and (c.format == "gguf-codes") == native_bf16(isa), c
    assert choose_weights(own, gguf_source=True, dtype=torch.bfloat16, cpu_isa=isa).codes_formats is None
    assert choose_weights(own, gguf_source=True, dtype=torch.bfloat16, cpu_isa=isa).format == own
    with pytest.raises(ValueError, match="needs a GGUF"):
        choose_weights(own, gguf_source=False, dtype=torch.bfloat16, cpu_isa=isa)


def test_an_integer_dot_engine_says_what_it_holds(tiny_gguf, caplog):
    """--weight-dtype gguf-q8: Q4_0/Q4_1/Q8_0 tensors (and the tied Q8_0 embedding / lm_head,
    one blob serving both) on integer dot products, the Q5_0/Q5_1 gate/up expanded, a log
    line naming those; the tied embedding rows are still the dense model's."""
    require_kernels()
    caplog.set_level(logging.INFO, logger="radixserve.model.registry")
    eng = Engine(model=tiny_gguf, cache="radix", dtype="bfloat16", kv_cache_tokens=512, weight_dtype="gguf-q8")
    assert "Q5_0 tensor(s) keep the bfloat16 expansion" in caplog.text
    info = eng.core.stats()
    assert info["weight_dtype"] == "gguf-q8" and "integer dot products" in info["weights"]
    m = eng.core.runner.model
    assert set(m.weight_formats()) == {"Q4_0/q8", "Q8_0/q8", "Q4_1/q8", "Q5_0", "Q5_1"}
    assert m._embed_packed is m._lm_head[1]
    ids = torch.tensor([1, 7, 300])
    dense = load_model(tiny_gguf, torch.bfloat16)
    want = dense.state_dict["model.embed_tokens.weight"][ids]
    assert torch.equal(m.linears.kernels.quant_rows(m._embed_packed, ids).view(torch.int16), want.view(torch.int16))
    toks, lps = answer(eng)
    assert len(toks) == 8 and all(lp <= 0 for lp in lps)


def test_a_block_codes_engine_says_what_it_holds(tiny_gguf, caplog):
    """--weight-dtype gguf-codes: Q4_0/Q4_1/Q8_0 tensors (and the tied Q8_0 embedding / lm_head,
    one blob serving both) on their block codes, the Q5_0/Q5_1 gate/up expanded, a log line
    naming those; the tied embedding rows are still the dense model's."""
    require_kernels()
    caplog.set_level(logging.INFO, logger="radixserve.model.registry")
    eng = Engine(model=tiny_gguf, cache="radix", dtype="bfloat16", kv_cache_tokens=512, weight_dtype="gguf-codes")
    assert "gguf-codes:" in caplog.text and "Q5_0 tensor(s) keep the bfloat16 expansion" in caplog.text
    info = eng.core.stats()
    assert info["weight_dtype"] == "gguf-codes" and "block codes" in info["weights"]
    m = eng.core.runner.model
    assert set(m.weight_formats()) == {"Q4_0/codes", "Q8_0/codes", "Q4_1/codes", "Q5_0", "Q5_1"}
    assert m._embed_packed is m._lm_head[1]
    ids = torch.tensor([1, 7, 300])
    dense = load_model(tiny_gguf, torch.bfloat16)
    want = dense.state_dict["model.embed_tokens.weight"][ids]
    assert torch.equal(m.linears.kernels.quant_rows(m._embed_packed, ids).view(torch.int16), want.view(torch.int16))
    toks, lps = answer(eng)
    assert len(toks) == 8 and all(lp <= 0 for lp in lps)


def test_the_default_engine_computes_q4_0_and_q8_0_on_codes_and_expands_the_rest(tiny_gguf, caplog):
    """--weight-dtype auto with native bfloat16 dot products: the Q4_0 and Q8_0 tensors on their
    codes (each exactly as --weight-dtype gguf-codes computes it), Q4_1 and the others expanded
    to the dense model's weights (as --weight-dtype gguf does), the reason in the stats."""
    require_kernels()
    if not native_bf16("auto"):
        pytest.skip("auto takes the codes only with native bfloat16 dot products (not on this CPU)")
    caplog.set_level(logging.INFO, logger="radixserve.model.registry")
    eng = Engine(model=tiny_gguf, cache="radix", dtype="bfloat16", kv_cache_tokens=512)
    assert "Q4_1 tensor(s) keep the bfloat16 expansion (block codes only for Q4_0+Q8_0)" in caplog.text
    info = eng.core.stats()
    assert info["weight_dtype"] == "gguf-codes" and "Q4_0+Q8_0 on their integer codes" in info["weight_dtype_reason"]
    m = eng.core.runner.model
    assert set(m.weight_formats()) == {"Q4_0/codes", "Q8_0/codes", "Q4_1", "Q5_0", "Q5_1"}
    codes = load_model(tiny_gguf, torch.bfloat16, weights="gguf-codes")
    expanded = load_model(tiny_gguf, torch.bfloat16, weights="gguf")
    auto = load_model(tiny_gguf, torch.bfloat16, weights="gguf-codes", codes_formats=AUTO_CODES_FORMATS)
    for name, v in auto.state_dict.items():
        if isinstance(v, QuantTensor):
            want = codes if set(v.formats) <= AUTO_CODES_FORMATS else expanded
            assert v.compute == want.state_dict[name].compute, name
    toks, lps = answer(eng)
    assert len(toks) == 8 and all(lp <= 0 for lp in lps)


@pytest.mark.parametrize("weights", ["dense", "gguf"])
def test_a_core_keeps_one_copy_of_the_weights(tiny_gguf, weights):
    """A core that loaded its model drops the loader's state dict once the runner holds the
    weights: packed panels beside a dense copy doubled a served model's resident memory. A
    model the caller passed in is left whole (it may serve other cores), and both answer alike."""
    require_kernels()
    opts = dict(cache="radix", dtype="bfloat16", kv_cache_tokens=512, weight_dtype=weights)
    own = Engine(model=tiny_gguf, **opts)
    assert own.core.loaded.state_dict == {} and own.core.runner.model.packed
    loaded = load_model(tiny_gguf, torch.bfloat16, weights=weights)
    keys = set(loaded.state_dict)
    given = Engine(loaded, **opts)
    assert given.core.loaded is loaded and set(loaded.state_dict) == keys
    assert answer(own) == answer(given)


def test_a_quantized_engine_says_what_it_holds(tiny_gguf):
    """/server_info-style stats: the weight format and why, the formats computed, resident
    memory after load; the layers and the tied embedding / lm_head hold their blocks (no
    dense copy of the table), fewer bytes than the dense model's."""
    require_kernels()
    eng = Engine(model=tiny_gguf, cache="radix", dtype="bfloat16", kv_cache_tokens=512, weight_dtype="gguf")
    info = eng.core.stats()
    assert info["weight_dtype"] == "gguf" and info["weight_dtype_reason"] == "--weight-dtype gguf"
    assert info["rss_after_load_bytes"] > 0
    assert "Q4_0" in info["weights"] and "Q8_0" in info["weights"] and "same bits" in info["weights"]
    m = eng.core.runner.model
    assert set(m.weight_formats()) == set(TINY_QUANT.values())
    assert isinstance(m.layers[0].qkv_weight, PackedWeight) and m.layers[0].qkv_weight.quantized
    assert m.embed_weight.numel() == 0 and m._lm_head[1].quantized
    dense = Engine(model=tiny_gguf, cache="radix", dtype="bfloat16", kv_cache_tokens=512, weight_dtype="dense")
    md = dense.core.runner.model
    assert dense.core.stats()["weight_dtype"] == "dense" and not md.weight_formats()
    q_bytes = sum(getattr(l, n).data.nbytes for l in m.layers for n in ("qkv_weight", "gate_up_weight", "down_weight"))
    d_bytes = sum(getattr(l, n).data.nbytes for l in md.layers for n in ("qkv_weight", "gate_up_weight", "down_weight"))
    assert q_bytes < 0.6 * d_bytes
    assert answer(eng) == answer(dense)


def test_where_no_kernel_computes_the_blocks_they_are_dequantized(tiny_gguf):
    """A float32 model, the torch linear backend, unpacked weights: the blocks become the dense
    weights they stand for (the dense model's tokens and logprobs)."""
    require_kernels()
    quant = load_model(tiny_gguf, torch.float32, weights="gguf")
    assert isinstance(quant.state_dict["model.layers.0.self_attn.q_proj.weight"], QuantTensor)
    dense = load_model(tiny_gguf, torch.float32)
    for kw in (dict(dtype="float32"), dict(dtype="float32", linear_backend="torch")):
        a = Engine(quant, cache="none", kv_cache_tokens=512, **kw)
        assert not a.core.runner.model.weight_formats()
        assert answer(a) == answer(Engine(dense, cache="none", kv_cache_tokens=512, **kw)), kw
    from radixserve.model.arch.factory import create_model

    m = create_model(quant.config, quant.state_dict, dtype=torch.bfloat16, pack_weights=False)
    assert not m.weight_formats() and m.embed_weight.shape == (quant.config.vocab_size, quant.config.hidden_size)


def test_the_loader_names_what_it_dequantizes(tmp_path, caplog):
    """Types the kernels do not keep (here F16 for q_proj) are dequantized at load, and a log
    line names them; a fused weight with one dense part is dense (the dense model's values)."""
    from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
    from radixserve.model.testing.tiny_tokenizer import byte_level_spec

    cfg = tiny_random_config()
    path = tmp_path / "mixed.gguf"
    quant = {k: v for k, v in TINY_QUANT.items() if k != "q_proj"}
    write_gguf(path, cfg, tiny_random_state_dict(0, cfg), byte_level_spec(cfg.vocab_size), dtype="f16", quant=quant)
    caplog.set_level(logging.INFO, logger="radixserve.model.loaders.gguf_loader")
    loaded = load_model(str(path), torch.bfloat16, weights="gguf")
    assert "dequantized at load: F16 (2 tensors)" in caplog.text and "kept in blocks" in caplog.text
    sd = loaded.state_dict
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert isinstance(sd["model.layers.0.self_attn.k_proj.weight"], QuantTensor)
    require_kernels()
    eng = Engine(loaded, cache="none", dtype="bfloat16", kv_cache_tokens=512)
    m = eng.core.runner.model
    assert not m.layers[0].qkv_weight.quantized and m.layers[0].o_weight.quantized
    ref = Engine(load_model(str(path), torch.bfloat16), cache="none", dtype="bfloat16", kv_cache_tokens=512)
    assert answer(eng) == answer(ref)


def test_tensor_parallelism_refuses_quantized_weights(tiny_gguf):
    from radixserve.parallel.shard_model import build_shard_model
    from radixserve.parallel.sharding import plan_shards

    loaded = load_model(tiny_gguf, torch.bfloat16, weights="gguf")
    plan = plan_shards(loaded.config, 2)
    with pytest.raises(ValueError, match="does not shard quantized weights.*--weight-dtype dense"):
        build_shard_model(loaded.config, loaded.state_dict, plan[0], comm=None, dtype=torch.bfloat16)


def test_shared_storage_keys_carry_the_weight_format(tiny_gguf, tmp_path):
    """HiCache's L3 fingerprint: a quantized model's pages never meet a dense model's."""
    require_kernels()
    common = dict(model=tiny_gguf, cache="radix", dtype="bfloat16", kv_cache_tokens=512, hicache_l2_tokens=256,
                  hicache_storage=f"file://{tmp_path}", hicache_storage_page_tokens=16)
    fps = {}
    for weights in ("gguf", "gguf-q8", "dense"):
        eng = Engine(weight_dtype=weights, **common)
        fps[weights] = eng.core.cache.storage.fingerprint
        eng.close()
    assert "weights=" in fps["gguf"].model and "weights=" not in fps["dense"].model
    assert fps["gguf"].digest != fps["dense"].digest
    assert len({fps[w].digest for w in fps}) == 3, "integer-dot KV must not meet the expanded blocks' KV"
