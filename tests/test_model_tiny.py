"""The tiny random Llama against transformers, and paged-KV consistency properties.

All float32 comparisons use 1e-4 absolute tolerance on logits of magnitude ~5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpu_paths import require_isa, require_kernels
from helpers_model import (
    build_hf_model,
    greedy_generate,
    pool_logits_decode,
    pool_logits_prefill,
    reference_logits_hf,
    shuffled_allocator,
)
from radixserve.kernels.isa import ISAS
from radixserve.engine.runner import ModelRunner
from radixserve.memory.allocator import SlotAllocator
from radixserve.model.arch.attention import make_attention_backend
from radixserve.model.arch.attention_kernel import TorchAttentionBackend
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.kernels.library import Kernels
from radixserve.kernels.operands import LayerBuffers, LayerGeometry, PoolPlaces
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict

TOL = 1e-4
LENGTHS = (1, 7, 33, 100)


def _prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [_prompt(n, seed=n) for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_refs(tiny_config, tiny_state_dict, prompts) -> list[torch.Tensor]:
    hf = build_hf_model(tiny_config, tiny_state_dict)
    return [reference_logits_hf(tiny_config, tiny_state_dict, p, model=hf) for p in prompts]


def _runner(config, sd, capacity=1024, dtype=torch.float32) -> ModelRunner:
    return ModelRunner.from_config(config, sd, kv_capacity=capacity, dtype=dtype)


def test_ragged_prefill_matches_transformers(tiny_config, tiny_state_dict, prompts, hf_refs):
    runner = _runner(tiny_config, tiny_state_dict)
    ours = pool_logits_prefill(runner, prompts, shuffled_allocator(1024, seed=1))
    for p, a, b in zip(prompts, ours, hf_refs):
        assert a.shape == (len(p), tiny_config.vocab_size)
        assert a.dtype == torch.float32
        assert (a - b).abs().max().item() <= TOL, len(p)


def test_batched_decode_matches_transformers(tiny_config, tiny_state_dict, prompts, hf_refs):
    runner = _runner(tiny_config, tiny_state_dict)
    ours = pool_logits_decode(runner, prompts, shuffled_allocator(1024, seed=2))
    for p, a, b in zip(prompts, ours, hf_refs):
        assert (a - b).abs().max().item() <= TOL, len(p)


def test_two_part_prefill_equals_one_prefill(tiny_config, tiny_state_dict):
    prompt = _prompt(80, seed=5)
    runner = _runner(tiny_config, tiny_state_dict)
    whole = pool_logits_prefill(runner, [prompt])[0]

    alloc = shuffled_allocator(1024, seed=3)
    slots = alloc.alloc(len(prompt))
    assert not torch.equal(slots, slots.sort().values)  # really non-contiguous
    split = 37
    head = ForwardBatch.build([prompt[:split]], [0], [slots[:split]], return_all_logits=[True])
    out_head = runner.forward(head)
    tail = ForwardBatch.build([prompt[split:]], [split], [slots], return_all_logits=[True])
    out_tail = runner.forward(tail)
    two = torch.cat([out_head.all_logits[0], out_tail.all_logits[0]])
    assert (two - whole).abs().max().item() <= TOL
    assert (out_tail.next_token_logits[0] - whole[-1]).abs().max().item() <= TOL

    gen_one = greedy_generate(runner, prompt, 12, allocator=shuffled_allocator(1024, seed=4))
    gen_two = greedy_generate(
        runner, prompt, 12, allocator=shuffled_allocator(1024, seed=5), prefix_split=split
    )
    assert gen_one == gen_two


def test_mixed_batch_prefill_tail_and_decode(tiny_config, tiny_state_dict):
    """One batch holding a fresh prefill, a prefill tail over a prefix, and a decode step."""
    runner = _runner(tiny_config, tiny_state_dict)
    a, b, c = _prompt(20, 11), _prompt(30, 12), _prompt(15, 13)
    refs = pool_logits_prefill(runner, [a, b, c])
    alloc = shuffled_allocator(1024, seed=6)
    sb, sc = alloc.alloc(len(b)), alloc.alloc(len(c))
    runner.forward(ForwardBatch.build([b[:10], c[:14]], [0, 0], [sb[:10], sc[:14]]))
    sa = alloc.alloc(len(a))
    batch = ForwardBatch.build(
        [a, b[10:], c[14:]], [0, 10, 14], [sa, sb, sc], return_all_logits=[False, True, False]
    )
    out = runner.forward(batch)
    assert out.all_logits[0] is None and out.all_logits[2] is None
    assert (out.all_logits[1] - refs[1][10:]).abs().max().item() <= TOL
    for i, ref in enumerate(refs):
        assert (out.next_token_logits[i] - ref[-1]).abs().max().item() <= TOL


def test_decode_very_different_lengths_equals_separate(tiny_config, tiny_state_dict):
    runner = _runner(tiny_config, tiny_state_dict)
    short, long = _prompt(1, 21), _prompt(200, 22)
    together = pool_logits_decode(runner, [short, long], shuffled_allocator(1024, seed=7))
    alone_short = pool_logits_decode(runner, [short])[0]
    alone_long = pool_logits_decode(runner, [long])[0]
    assert (together[0] - alone_short).abs().max().item() <= TOL
    assert (together[1] - alone_long).abs().max().item() <= TOL
    # And a decode step of both, after each has its own history, against separate steps.
    alloc = SlotAllocator(1024)
    s1, s2 = alloc.alloc(2), alloc.alloc(201)
    nxt = [7, 9]
    runner.forward(ForwardBatch.build([short], [0], [s1[:1]]))
    runner.forward(ForwardBatch.build([long], [0], [s2[:200]]))
    both = runner.forward(
        ForwardBatch.build([[nxt[0]], [nxt[1]]], [1, 200], [s1, s2])
    ).next_token_logits
    one = runner.forward(ForwardBatch.build([[nxt[0]]], [1], [s1])).next_token_logits
    two = runner.forward(ForwardBatch.build([[nxt[1]]], [200], [s2])).next_token_logits
    assert (both[0] - one[0]).abs().max().item() <= TOL
    assert (both[1] - two[0]).abs().max().item() <= TOL


def test_bfloat16_close_to_float32(tiny_config, tiny_state_dict, prompts):
    f32 = pool_logits_prefill(_runner(tiny_config, tiny_state_dict), prompts)
    bf = _runner(tiny_config, tiny_state_dict, dtype=torch.bfloat16)
    assert bf.kv_pool.dtype == torch.bfloat16
    b16 = pool_logits_prefill(bf, prompts)
    b16_dec = pool_logits_decode(bf, prompts, shuffled_allocator(1024, seed=8))
    a, b, c = torch.cat(f32), torch.cat(b16), torch.cat(b16_dec)
    assert b.dtype == torch.float32 and torch.isfinite(b).all() and torch.isfinite(c).all()
    # Random std-0.2 weights amplify rounding more than a trained model does, hence the
    # loose bounds: mean error a few % of the logit spread, top-1 agreement on most rows.
    spread = a.std().item()
    for other in (b, c):
        assert (a - other).abs().mean().item() <= 0.05 * spread
        assert (a - other).abs().max().item() <= 0.5 * spread
        assert (a.argmax(-1) == other.argmax(-1)).float().mean().item() >= 0.85


def test_qwen2_bias_matches_transformers(prompts):
    cfg = tiny_random_config(arch="qwen2")
    sd = tiny_random_state_dict(seed=1, config=cfg)
    hf = build_hf_model(cfg, sd)
    runner = _runner(cfg, sd)
    ours = pool_logits_prefill(runner, prompts)
    dec = pool_logits_decode(runner, prompts[:3])
    for i, p in enumerate(prompts):
        ref = reference_logits_hf(cfg, sd, p, model=hf)
        assert (ours[i] - ref).abs().max().item() <= TOL
        if i < 3:
            assert (dec[i] - ref).abs().max().item() <= TOL


def test_untied_and_llama3_rope_scaling_match_transformers():
    cfg = tiny_random_config(
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )
    sd = tiny_random_state_dict(seed=2, config=cfg)
    runner = _runner(cfg, sd)
    prompt = _prompt(90, 31)
    ref = reference_logits_hf(cfg, sd, prompt)
    assert (pool_logits_prefill(runner, [prompt])[0] - ref).abs().max().item() <= TOL


def test_loading_errors_name_the_key(tiny_config, tiny_state_dict):
    sd = dict(tiny_state_dict)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LlamaForCausalLM.from_state_dict(tiny_config, sd)
    sd = dict(tiny_state_dict)
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="k_proj"):
        LlamaForCausalLM.from_state_dict(tiny_config, sd)
    sd = dict(tiny_state_dict, **{"model.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected"):
        LlamaForCausalLM.from_state_dict(tiny_config, sd)
    with pytest.raises(ValueError, match="dtype"):
        LlamaForCausalLM(tiny_config, dtype=torch.int8)


def test_backend_registry_and_runner_stats(tiny_config, tiny_state_dict):
    assert isinstance(make_attention_backend("torch", "cpu"), TorchAttentionBackend)
    with pytest.raises(ValueError, match="nope"):
        make_attention_backend("nope", "cpu")
    runner = _runner(tiny_config, tiny_state_dict)
    greedy_generate(runner, _prompt(10, 41), 5)
    assert runner.prefill_tokens == 10 and runner.decode_tokens == 4
    assert runner.forward_calls == 5 and runner.forward_seconds > 0


def test_tiny_weights_are_deterministic():
    a, b = tiny_random_state_dict(seed=0), tiny_random_state_dict(seed=0)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = tiny_random_state_dict(seed=1)
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])


def _packed_runner(config, sd, dtype, backend):
    """A runner whose linears run on ``backend``, or a skip naming why it cannot here."""
    try:
        return ModelRunner.from_config(config, sd, kv_capacity=1024, dtype=dtype, linear_backend=backend)
    except ValueError as e:
        pytest.skip(f"linear backend {backend}: {e}")


@pytest.mark.parametrize("backend", ["radixserve", "radixserve-f32", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_equal_dense_linears(tiny_config, tiny_state_dict, prompts, dtype, backend):
    """Packed weights (our GEMM, or oneDNN's) give F.linear's results to rounding, in
    prefill (many rows) and decode (one row per sequence)."""
    sd = {k: v.to(dtype) for k, v in tiny_state_dict.items()}
    packed = _packed_runner(tiny_config, sd, dtype, backend)
    dense = ModelRunner.from_config(tiny_config, sd, kv_capacity=1024, dtype=dtype, pack_weights=False)
    assert packed.model.packed and packed.model.linears.backend == backend and not dense.model.packed
    if dtype == torch.float32:
        for a, b in zip(pool_logits_prefill(packed, prompts), pool_logits_prefill(dense, prompts)):
            assert (a - b).abs().max().item() <= 1e-4
        for a, b in zip(pool_logits_decode(packed, prompts), pool_logits_decode(dense, prompts)):
            assert (a - b).abs().max().item() <= 1e-4
        return
    # bf16: F.linear rounds every output to bf16 and takes bf16 activations; our GEMMs keep
    # float32 sums and a float32 residual stream (radixserve rounds a linear's input rows to
    # bf16 inside its dot products, radixserve-f32 not even that). Both are checked against
    # the float32 model: ours must be no further from it than the dense bf16 path.
    ref = ModelRunner.from_config(tiny_config, tiny_state_dict, kv_capacity=1024, pack_weights=False)
    for fn in (pool_logits_prefill, pool_logits_decode):
        r = torch.cat(fn(ref, prompts))
        a, b = torch.cat(fn(packed, prompts)), torch.cat(fn(dense, prompts))
        assert (a - b).abs().max().item() <= 0.5  # two bf16 roundings of logits of magnitude ~5
        if backend.startswith("radixserve"):
            assert (a - r).abs().mean().item() <= 1.1 * (b - r).abs().mean().item()


def test_packing_rules(tiny_config, tiny_state_dict):
    model = LlamaForCausalLM.from_state_dict(tiny_config, tiny_state_dict)
    if model.packed:
        assert model.pack_linear_weights()  # idempotent
        with pytest.raises(RuntimeError, match="pack"):
            model.load_hf_state_dict(tiny_state_dict)
    sd16 = {k: v.half() for k, v in tiny_state_dict.items()}
    with pytest.raises(ValueError, match="pack_weights"):
        LlamaForCausalLM.from_state_dict(tiny_config, sd16, dtype=torch.float16, pack_weights=True)
    assert not LlamaForCausalLM.from_state_dict(tiny_config, sd16, dtype=torch.float16).packed
    with pytest.raises(ValueError, match="linear_backend"):
        LlamaForCausalLM.from_state_dict(tiny_config, sd16, dtype=torch.float16, linear_backend="radixserve")
    with pytest.raises(ValueError, match="linear_backend"):
        LlamaForCausalLM.from_state_dict(tiny_config, tiny_state_dict, linear_backend="mkl")


@pytest.mark.parametrize("backend", ["torch", "torch-eager"])
def test_need_logits_skips_sequences(tiny_config, tiny_state_dict, backend):
    """An intermediate prefill chunk (need_logits False) gets no lm_head row; the others get
    exactly the logits they would get alone, in batch order, with their batch indices."""
    runner = ModelRunner.from_config(tiny_config, tiny_state_dict, kv_capacity=1024, backend=backend)
    a, b, c = _prompt(20, 51), _prompt(30, 52), _prompt(12, 53)
    refs = pool_logits_prefill(runner, [a, b, c])
    alloc = shuffled_allocator(1024, seed=10)
    sa, sb, sc = alloc.alloc(20), alloc.alloc(30), alloc.alloc(12)
    batch = ForwardBatch.build([a, b[:16], c], [0, 0, 0], [sa, sb[:16], sc],
                               return_all_logits=[False, False, True],
                               need_logits=[True, False, True])
    out = runner.forward(batch)
    assert out.logits_seqs == [0, 2] and out.next_token_logits.shape == (2, tiny_config.vocab_size)
    assert out.all_logits[0] is None and out.all_logits[1] is None
    assert (out.next_token_logits[0] - refs[0][-1]).abs().max().item() <= TOL
    assert (out.next_token_logits[1] - refs[2][-1]).abs().max().item() <= TOL
    assert (out.all_logits[2] - refs[2]).abs().max().item() <= TOL
    # the chunk's K/V are in the pool: its tail completes the prompt exactly
    tail = runner.forward(ForwardBatch.build([b[16:]], [16], [sb]))
    assert tail.logits_seqs == [0]
    assert (tail.next_token_logits[0] - refs[1][-1]).abs().max().item() <= TOL
    none = runner.forward(ForwardBatch.build([[1, 2]], [0], [alloc.alloc(2)], need_logits=[False]))
    assert none.next_token_logits.shape == (0, tiny_config.vocab_size) and none.logits_seqs == []
    with pytest.raises(ValueError, match="need_logits"):
        runner.forward(ForwardBatch.build([[1, 2]], [0], [alloc.alloc(2)], return_all_logits=[True],
                                          need_logits=[False]))
    with pytest.raises(ValueError, match="need_logits"):
        ForwardBatch.build([[1]], [0], [alloc.alloc(1)], need_logits=[True, False])


@pytest.mark.parametrize("backend", ["torch", "torch-eager"])
def test_all_reduce_hook_sees_o_proj_and_down_proj(tiny_config, tiny_state_dict, backend):
    """The tensor-parallel hook: called on the o_proj and down_proj outputs of every layer;
    an identity hook leaves the logits bit for bit unchanged."""
    runner = ModelRunner.from_config(tiny_config, tiny_state_dict, kv_capacity=256, backend=backend)
    prompt = _prompt(9, 61)
    plain = pool_logits_prefill(runner, [prompt])[0]
    calls: list[tuple[int, ...]] = []

    def hook(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return t

    runner.model.all_reduce = hook
    hooked = pool_logits_prefill(runner, [prompt])[0]
    assert torch.equal(plain, hooked)
    assert calls == [(9, tiny_config.hidden_size)] * (2 * tiny_config.num_layers)


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_layers_in_one_call_equal_the_python_loop(isa, dtype, arch, kv, monkeypatch):
    """Kernels.llama_layers (every decoder layer in one C++ call) gives the Python loop's
    bits, in prefill (ragged, scattered slots) and in batched decode, at every instruction-set
    level, with and without a qkv bias, on a float and a quantized pool; and it is the path
    a kernel forward takes (checked by counting its calls)."""
    require_kernels()
    require_isa(isa)
    config = tiny_random_config(arch)
    sd = {k: v.to(dtype) for k, v in tiny_random_state_dict(config=config).items()}
    runner = ModelRunner.from_config(config, sd, kv_capacity=1024, dtype=dtype, cpu_isa=isa,
                                     linear_backend="radixserve", kv_dtype=kv)
    calls = []
    one_call = Kernels.llama_layers
    monkeypatch.setattr(Kernels, "llama_layers", lambda self, *a, **kw: calls.append(1) or one_call(self, *a, **kw))
    ps = [_prompt(n, 70 + n) for n in (1, 9, 40, 17)]
    outs = {}
    for flag in (True, False):
        monkeypatch.setattr(LlamaForCausalLM, "one_call_layers", flag)
        outs[flag] = (pool_logits_prefill(runner, ps, shuffled_allocator(1024, seed=3)),
                      pool_logits_decode(runner, ps, shuffled_allocator(1024, seed=4)))
    assert calls and len(calls) == 1 + max(len(p) for p in ps)  # one prefill, then a step per token
    for a, b in zip(outs[True][0] + outs[True][1], outs[False][0] + outs[False][1]):
        assert torch.equal(a, b)


def test_layers_in_one_call_reject_bad_input(tiny_config, tiny_state_dict):
    """The one call checks what each kernel checks (a slot outside the pool is an error, not a
    write out of bounds) and that its per-layer lists match."""
    require_kernels()
    runner = ModelRunner.from_config(tiny_config, tiny_state_dict, kv_capacity=64, linear_backend="radixserve")
    with pytest.raises((RuntimeError, ValueError), match="slot"):
        runner.forward(ForwardBatch.build([[1, 2]], [0], [torch.tensor([3, 1000])]))
    model, kern = runner.model, runner.attn_backend.kernels
    w = model.kernel_layers().one_call
    caches = runner.attn_backend.layer_caches(runner.kv_pool, runner.attn_backend.prepare(
        ForwardBatch.build([[1]], [0], [torch.tensor([0])]), runner.kv_pool))
    cfg = tiny_config
    qs, kvs = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    bufs = LayerBuffers.empty(1, cfg.hidden_size, qs + 2 * kvs, qs, cfg.intermediate_size)
    one = torch.zeros(1, dtype=torch.int64)
    places = PoolPlaces(caches[0], caches[1], one, one, torch.tensor([[0, 1, 0, 1]]), model.rotary.cos,
                        model.rotary.sin, 0, None)
    geometry = LayerGeometry(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 1e-5, 0.25)
    short = dataclasses.replace(w, o=w.o[:-1])
    with pytest.raises(RuntimeError, match="one entry per layer"):
        kern.llama_layers(torch.zeros(1, cfg.hidden_size), bufs, short, places, torch.zeros(1, dtype=torch.int64),
                          geometry)
