"""Every CPU path, end to end, on whatever machine runs the suite.

For each instruction-set level this CPU has (capped by ``RADIXSERVE_CPU_ISA``; the others are
skipped, see ``cpu_paths``) and each serving dtype, the real SmolLM2 answers the
capital-of-France question with Paris, and greedy output with the radix cache on equals the
output with it off. Plus the pieces that choose between paths: the instruction-set cap, the
``--dtype auto`` rule, and the bfloat16 logits regression (logits rounded to bfloat16 tie and
flip greedy answers; see ``LlamaForCausalLM._lm_head``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_paths import require_isa, require_kernels
from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.kernels.isa import (ISAS, LIBRARY_CAPS, effective_isa, host_isa, isa_allows, isa_cap, native_bf16,
                            silicon_isa)
from radixserve.kernels.dtype_choice import choose_dtype
from radixserve.engine.engine import Engine
from radixserve.engine.runner import ModelRunner
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.model.arch.forward_batch import ForwardBatch

QUESTION = "What is the capital of France?"
SHARED = ("You answer in one short sentence. Known facts: Paris is the capital of France, "
          "Rome of Italy, Madrid of Spain, Berlin of Germany. ")
FOLLOW_UPS = ["Which city is the capital of Italy?", "Name the capital of Spain.",
              "What is the capital of Germany?"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", ISAS)
def test_smollm2_answers_paris_and_cache_equals_no_cache_on_every_path(smollm2_loaded, isa, dtype):
    require_isa(isa)
    require_kernels()
    opts = dict(dtype=dtype, cpu_isa=isa, kv_cache_tokens=4096)
    eng = Engine(smollm2_loaded, **opts)
    assert eng.stats()["cpu_isa"] == isa and eng.stats()["dtype"] == dtype
    tok = eng.tokenizer
    answer = eng.generate(tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                  add_generation_prompt=True),
                          SamplingParams(max_tokens=12, temperature=0))[0].text
    assert "Paris" in answer, (isa, dtype, answer)

    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": SHARED},
                                                   {"role": "user", "content": q}],
                                                  add_generation_prompt=True)) for q in FOLLOW_UPS]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cached = [eng.generate([p], sp)[0] for p in prompts]  # one by one: later ones hit the tree
    assert all(o.cached_tokens > 20 for o in cached[1:])
    off = Engine(smollm2_loaded, cache="none", **opts).generate(prompts, sp)
    assert [o.token_ids for o in cached] == [o.token_ids for o in off], (isa, dtype)
    eng.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "torch-eager"])
def test_bfloat16_logits_are_not_rounded_to_bfloat16(tiny_config, tiny_state_dict, backend):
    """Regression: a bfloat16 model's logits used to come out of a bfloat16 lm_head, so they
    were multiples of 2^-7 of their magnitude and near-equal candidates tied. They are float32
    dot products now, on every path, and close to the float32 model's."""
    if backend == "torch":
        require_kernels()
    sd16 = {k: v.to(torch.bfloat16) for k, v in tiny_state_dict.items()}
    runner = ModelRunner.from_config(tiny_config, sd16, kv_capacity=256, dtype=torch.bfloat16, backend=backend)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = ForwardBatch.build([ids], [0], [torch.arange(40)], return_all_logits=[True])
    logits = runner.forward(batch).all_logits[0]
    assert logits.dtype == torch.float32
    on_grid = logits == logits.to(torch.bfloat16).float()
    assert on_grid.float().mean().item() < 0.2  # float32 values: few happen to be bf16-exact
    # The logits are the float32 product of the final hidden rows and the bf16 weights.
    ref = ModelRunner.from_config(tiny_config, tiny_state_dict, kv_capacity=256, backend=backend)
    ref_logits = ref.forward(ForwardBatch.build([ids], [0], [torch.arange(40)],
                                                return_all_logits=[True])).all_logits[0]
    assert (logits - ref_logits).abs().max().item() < 0.5


def test_a_bfloat16_models_lm_head_rounds_its_rows_like_the_layers(tiny_config, tiny_state_dict):
    """The lm_head of a bfloat16 model on the kernels' GEMM takes bfloat16 rows (the layers'
    dot products), so its logits are those of the rows rounded to bfloat16; a float32 model's
    and a ``radixserve-f32`` one's keep float32 rows."""
    require_kernels()
    from radixserve.kernels.linear import make_linears

    w = tiny_state_dict["lm_head.weight"].to(torch.bfloat16) if "lm_head.weight" in tiny_state_dict \
        else tiny_state_dict["model.embed_tokens.weight"].to(torch.bfloat16)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(3))
    lin = make_linears("auto", torch.device("cpu"), torch.bfloat16)
    head = lin.pack_lm_head(w)
    assert head[1].dot
    logits = lin.logits(x, head)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, lin.logits(x.to(torch.bfloat16).float(), head))
    f32_rows = lin.logits(x, lin.pack_lm_head(w, dot=False))
    assert not torch.equal(logits, f32_rows) and (logits - f32_rows).abs().max().item() < 0.05
    assert not make_linears("radixserve-f32", torch.device("cpu"), torch.bfloat16).pack_lm_head(w)[1].dot
    assert not make_linears("auto", torch.device("cpu"), torch.float32).pack_lm_head(w.float())[1].dot


def test_isa_cap_rules(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_CPU_ISA", raising=False)
    assert isa_cap("auto") == "amx" and effective_isa("auto") == host_isa()
    assert isa_cap("avx2") == "avx2" and isa_allows("avx2", "generic") and not isa_allows("avx2", "avx512")
    assert effective_isa("generic") == "generic"
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "AVX2")
    assert isa_cap("auto") == "avx2" and isa_cap("generic") == "generic"  # the field wins over the env
    assert not native_bf16("auto")  # bf16 arithmetic is an AVX-512-level feature
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="RADIXSERVE_CPU_ISA"):
        EngineConfig()
    monkeypatch.delenv("RADIXSERVE_CPU_ISA")
    with pytest.raises(ValueError, match="cpu_isa"):
        EngineConfig(cpu_isa="sse9")


def test_dtype_auto_is_decided_by_cpu_features(monkeypatch):
    """float32 on the portable path (nothing makes bfloat16 faster there); bfloat16 wherever the
    vector kernels run, native dot products or emulated, and the reason says which. No timing
    is involved, so the same machine decides the same on every start, busy or idle."""
    monkeypatch.delenv("RADIXSERVE_CPU_ISA", raising=False)
    choice = choose_dtype("auto", "cpu", "generic")
    assert choice.dtype == torch.float32 and "no vector kernels" in choice.reason
    for cap in ("avx2", "auto"):
        if ISAS.index(effective_isa(cap)) < ISAS.index("avx2"):
            continue
        choices = {choose_dtype("auto", "cpu", cap) for _ in range(3)}
        assert len(choices) == 1
        choice = choices.pop()
        assert choice.dtype == torch.bfloat16 and "by CPU features" in choice.reason
        assert ("native bfloat16 dot products" in choice.reason) == native_bf16(cap)
    assert choose_dtype("bfloat16").dtype == torch.bfloat16
    assert choose_dtype("float32").reason == "--dtype float32"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_instruction_set_gives_the_same_logits(tiny_config, tiny_state_dict, dtype):
    """The whole forward on our kernels (packed GEMM, row ops, attention) is the same bits at
    every instruction-set level this CPU has: the vectorised paths repeat the portable one."""
    require_kernels()
    sd = {k: v.to(dtype) for k, v in tiny_state_dict.items()}
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    outs = {}
    for isa in ISAS:
        if ISAS.index(isa) > ISAS.index(host_isa()) or not isa_allows("auto", isa):
            continue
        runner = ModelRunner.from_config(tiny_config, sd, kv_capacity=256, dtype=dtype, cpu_isa=isa,
                                         linear_backend="radixserve")
        # The float32-mode attention of this level (on an AVX-512-BF16 CPU a bfloat16 pool
        # would pick the bf16 dot products, which round differently by design; checked below).
        runner.attn_backend.attention_impl = _FLOAT32_MODE_IMPL[isa]
        outs[isa] = _logits_of(runner, ids)
    if len(outs) < 2:
        pytest.skip(f"one instruction-set level here ({list(outs)})")
    first = next(iter(outs.values()))
    for isa, logits in outs.items():
        assert torch.equal(logits, first), isa
    k = require_kernels()
    if dtype == torch.bfloat16 and isa_allows("auto", "avx512") and k.impl_available(
            kernels.IMPL_BF16, torch.bfloat16, tiny_config.head_dim):
        runner.attn_backend.attention_impl = kernels.IMPL_BF16
        bf16_mode = _logits_of(runner, ids)
        err = (bf16_mode - first).abs().max().item()
        assert err < 0.05 * first.abs().max().item(), err


@pytest.mark.parametrize("level", ["generic", "avx2"])
def test_a_capped_process_builds_and_computes_as_a_cpu_of_its_level(tmp_path, tiny_config, tiny_state_dict, level):
    """``RADIXSERVE_CPU_ISA=<level>`` at a process's start makes it an x86 CPU of that level
    for everything it computes with: our kernels are built for that level's instruction set
    (so the AVX-512 paths are absent, not merely unpicked), and ATen, oneDNN and MKL are
    capped to it. Its logits are the same bits as this process's native build at that level,
    so what the capped runs of the suite test is what such a CPU runs."""
    k = require_kernels()
    if not isa_allows("auto", level):
        pytest.skip(f"{level}: capped by RADIXSERVE_CPU_ISA={isa_cap()}")
    if ISAS.index(level) >= ISAS.index(silicon_isa()) or not sys.platform.startswith("linux"):
        pytest.skip(f"this CPU is not above {level} (it has {silicon_isa()})")
    weights, out = tmp_path / "weights.pt", tmp_path / "logits.pt"
    torch.save(tiny_state_dict, weights)
    env = {**os.environ, "RADIXSERVE_CPU_ISA": level}
    for name in LIBRARY_CAPS[level]:
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("capped_process.py")), str(weights), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["host_isa"] == level
    assert got["cflags"][1] == builder.CAPPED_MARCH[level]
    assert got["available_isas"] == list(ISAS[:ISAS.index(level) + 1])
    assert got["aten"] == ("AVX2" if level == "avx2" else "DEFAULT")
    assert got["library_env"] == LIBRARY_CAPS[level]
    theirs = torch.load(out)
    impl = _FLOAT32_MODE_IMPL[level]
    assert k.impl_available(impl, torch.float32, tiny_config.head_dim)
    for dtype in (torch.float32, torch.bfloat16):
        sd = {n: v.to(dtype) for n, v in tiny_state_dict.items()}
        runner = ModelRunner.from_config(tiny_config, sd, kv_capacity=256, dtype=dtype, cpu_isa=level,
                                         linear_backend="radixserve")
        runner.attn_backend.attention_impl = impl
        assert torch.equal(_logits_of(runner, _TINY_IDS), theirs[str(dtype)]), (level, dtype)


_TINY_IDS = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(5)).tolist()
_FLOAT32_MODE_IMPL = {"generic": kernels.IMPL_GENERIC, "avx2": kernels.IMPL_AVX2, "avx512": kernels.IMPL_F32}


def _logits_of(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    batch = ForwardBatch.build([ids[:40], ids[40:]], [0, 0], [torch.arange(40), torch.arange(40, 70)],
                               return_all_logits=[True, True])
    return torch.cat(runner.forward(batch).all_logits)
