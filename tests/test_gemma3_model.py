"""Gemma 3 (text) against transformers' Gemma3ForCausalLM, and sliding-window attention.

The tiny random Gemma 3 (``tiny_random_config("gemma3")``: 6 layers, two sliding-window
layers of window 12 per full layer, MQA, head_dim 32, query_pre_attn_scalar 24) is saved
as a Hugging Face folder by transformers, read back by our loader, and run through the
paged KV pool: prefill of prompts longer than the window, decode steps, and a cached
prefix plus the rest — each within 1e-4 of transformers' logits (float32) on both attention
backends. The windowed attention itself is checked at the backend: kernels (every CPU path
this machine has) against the eager reference, bitwise split invariance, and that no slot
before the window is ever read.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cpu_paths import ALL_IMPLS, FLOAT32_MODE_IMPLS, impl_id, require_impl, require_isa, require_kernels
from helpers_model import greedy_generate, pool_logits_decode, pool_logits_prefill, shuffled_allocator
from radixserve.kernels.isa import ISAS
from radixserve.engine.runner import ModelRunner
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.swa_pool import HybridKVPool
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.model import create_model
from radixserve.model.arch.attention_eager import EagerTorchAttentionBackend
from radixserve.model.arch.attention_kernel import TorchAttentionBackend
from radixserve.model.model_config import ModelConfig
from radixserve.model.load_error import ModelLoadError
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.arch.gemma3 import Gemma3ForCausalLM
from radixserve.kernels.library import Kernels
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.model.loaders.hf_loader import load_hf_dir
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict
from radixserve.parallel.sharding import plan_shards

TOL = 1e-4
WINDOW = 12
LENGTHS = (1, 7, 13, 40, 100)  # one inside the window, the others cross it (100: 32-key blocks too)
BACKENDS = ("torch", "torch-eager")
needs_kernels = pytest.mark.skipif(not builder.kernels_expected(), reason="no C++ compiler")


def _prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_gemma3_config(cfg: ModelConfig):
    """transformers' Gemma3TextConfig equivalent to our ModelConfig (the bench's converter)."""
    from radixserve.bench.offline import _to_hf_config

    return _to_hf_config(cfg)


def save_hf_folder(cfg: ModelConfig, sd: dict[str, torch.Tensor], path) -> None:
    """transformers builds Gemma3ForCausalLM with our weights and saves it to ``path``."""
    from transformers import Gemma3ForCausalLM as HFGemma3

    model = HFGemma3(hf_gemma3_config(cfg))
    missing, unexpected = model.load_state_dict(dict(sd), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(path)


def hf_logits(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All-position float32 logits of each prompt from the saved folder (eager attention)."""
    from transformers import Gemma3ForCausalLM as HFGemma3

    model = HFGemma3.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([p])).logits[0].float() for p in prompts]


@pytest.fixture(scope="module")
def g3_config() -> ModelConfig:
    return tiny_random_config("gemma3")


@pytest.fixture(scope="module")
def g3_state_dict(g3_config) -> dict[str, torch.Tensor]:
    return tiny_random_state_dict(seed=0, config=g3_config)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, g3_config, g3_state_dict):
    path = tmp_path_factory.mktemp("gemma3-tiny")
    save_hf_folder(g3_config, g3_state_dict, path)
    return path


@pytest.fixture(scope="module")
def loaded(hf_folder):
    return load_hf_dir(hf_folder, with_tokenizer=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [_prompt(n, seed=n) for n in LENGTHS]


@pytest.fixture(scope="module")
def refs(hf_folder, prompts) -> list[torch.Tensor]:
    return hf_logits(hf_folder, prompts)


def _runner(loaded, backend: str, capacity: int = 1024, dtype=torch.float32) -> ModelRunner:
    return ModelRunner.from_config(loaded.config, loaded.state_dict, kv_capacity=capacity,
                                   dtype=dtype, backend=backend)


def _max_err(ours: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(ours, refs))


# --------------------------------------------------------------------------- loading
def test_hf_folder_reads_back_as_the_config(loaded, g3_config, g3_state_dict):
    assert loaded.config == g3_config
    assert loaded.config.layer_types == ("sliding", "sliding", "full") * 2
    assert [loaded.config.layer_window(i) for i in range(6)] == [WINDOW, WINDOW, 0] * 2
    assert set(loaded.state_dict) == set(g3_state_dict)  # tied: no lm_head.weight
    model = create_model(loaded.config, loaded.state_dict)
    assert isinstance(model, Gemma3ForCausalLM)
    # (1 + w) formed at load time, without touching the caller's tensors
    w = g3_state_dict["model.layers.0.self_attn.q_norm.weight"]
    assert torch.equal(model.layers[0].q_norm, 1.0 + w)
    assert torch.equal(loaded.state_dict["model.layers.0.self_attn.q_norm.weight"], w)


def test_multimodal_folder_keeps_the_text_model(tmp_path, g3_config, g3_state_dict):
    """A Gemma3ForConditionalGeneration folder: sparse text_config over transformers'
    defaults, v4 RoPE keys, the language model under ``language_model.model.``, and a
    vision tower that is dropped."""
    text = {"model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW, "sliding_window_pattern": 3, "max_position_embeddings": 2048,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}))
    sd = {k.replace("model.", "language_model.model.", 1): v for k, v in g3_state_dict.items()}
    sd["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(4)
    sd["multi_modal_projector.mm_input_projection_weight"] = torch.ones(4, 64)
    save_file(sd, str(tmp_path / "model.safetensors"))
    m = load_hf_dir(tmp_path, with_tokenizer=False)
    assert m.config == tiny_random_config("gemma3", rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert m.config.rms_norm_eps == 1e-6 and m.config.tie_word_embeddings  # transformers' defaults
    assert set(m.state_dict) == set(g3_state_dict)


def test_unsupported_gemma_configs_are_refused(tmp_path):
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "num_hidden_layers": 2, "sliding_window": 4}
    for extra, words in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                         ({"use_bidirectional_attention": True}, "bidirectional"),
                         ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked"),
                         ({"hidden_activation": "relu"}, "hidden_act")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(ModelLoadError, match=words):
            load_hf_dir(tmp_path, with_tokenizer=False)


def test_config_validation_names_the_field():
    cfg = tiny_random_config("gemma3")
    for overrides, field in (
        (dict(sliding_window=-1), "sliding_window"),
        (dict(sliding_window=0), "sliding_window"),  # sliding layers need a window
        (dict(layer_types=("full",) * 5), "layer_types"),
        (dict(layer_types=("local",) * 6), "layer_types"),
        (dict(rope_local_theta=0.0), "rope_local_theta"),
        (dict(query_pre_attn_scalar=-1.0), "query_pre_attn_scalar"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(final_logit_softcapping=0.0), "final_logit_softcapping"),
    ):
        with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
            tiny_random_config("gemma3", **overrides)
    assert tiny_random_config("gemma3", layer_types=["full"] * 6).layer_types == ("full",) * 6
    # Llama / Qwen2 defaults: no window anywhere
    llama = tiny_random_config()
    assert llama.layer_types == () and llama.layer_window(1) == 0 and llama.hidden_act == "silu"
    assert cfg.attn_scale == 24**-0.5 and llama.attn_scale == llama.head_dim**-0.5


def test_model_classes_refuse_the_other_arch(g3_config, g3_state_dict):
    with pytest.raises(ValueError, match="create_model"):
        LlamaForCausalLM(g3_config)
    with pytest.raises(ValueError, match="gemma3"):
        Gemma3ForCausalLM(tiny_random_config())
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaForCausalLM(tiny_random_config(hidden_act="gelu_pytorch_tanh"))
    assert type(create_model(tiny_random_config(), tiny_random_state_dict())) is LlamaForCausalLM
    with pytest.raises(ValueError, match="tensor parallelism"):
        plan_shards(g3_config, 2)


# --------------------------------------------------------------------------- against transformers
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_matches_transformers(loaded, prompts, refs, backend):
    runner = _runner(loaded, backend)
    assert runner.attn_backend.uses_kernels == (backend == "torch" and builder.kernels_expected())
    ours = pool_logits_prefill(runner, prompts, shuffled_allocator(1024, seed=1))
    for p, a in zip(prompts, ours):
        assert a.shape == (len(p), 512) and a.dtype == torch.float32
    assert _max_err(ours, refs) <= TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matches_transformers(loaded, prompts, refs, backend):
    runner = _runner(loaded, backend)
    ours = pool_logits_decode(runner, prompts, shuffled_allocator(1024, seed=2))
    assert _max_err(ours, refs) <= TOL


# (cached prefix, rest...) cuts of the 100-token prompt: inside the window, on and off the
# 32-key blocks, chunks smaller than the window, a decode tail
SPLITS = [[5, 95], [37, 63], [64, 36], [7] * 14 + [2], [90] + [1] * 10]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_split_matches_transformers(loaded, prompts, refs, backend):
    runner = _runner(loaded, backend)
    prompt, ref = prompts[-1], refs[-1]
    whole = pool_logits_prefill(runner, [prompt])[0]
    for i, split in enumerate(SPLITS):
        slots = shuffled_allocator(1024, seed=10 + i).alloc(len(prompt))
        rows, done = [], 0
        for n in split:
            batch = ForwardBatch.build([prompt[done : done + n]], [done], [slots[: done + n]],
                                       return_all_logits=[True])
            rows.append(runner.forward(batch).all_logits[0])
            done += n
        got = torch.cat(rows)
        assert (got - ref).abs().max().item() <= TOL, split
        if backend == "torch" and runner.attn_backend.uses_kernels:
            # every layer is row-independent: a cached prefix gives the same bits
            assert torch.equal(got, whole), split


def test_mixed_batch_prefill_tail_and_decode(loaded, prompts, refs):
    """One batch: a decode step, a tail over a cached prefix and a whole prefill."""
    runner = _runner(loaded, "torch")
    alloc = shuffled_allocator(1024, seed=5)
    p40, p100 = prompts[3], prompts[4]
    s40, s100, s13 = alloc.alloc(40), alloc.alloc(100), alloc.alloc(13)
    runner.forward(ForwardBatch.build([p40[:39], p100[:30]], [0, 0], [s40[:39], s100[:30]]))
    out = runner.forward(ForwardBatch.build([p40[39:], p100[30:], prompts[2]], [39, 30, 0],
                                            [s40, s100, s13], return_all_logits=[False, True, True]))
    assert (out.next_token_logits[0] - refs[3][-1]).abs().max().item() <= TOL
    assert (out.all_logits[1] - refs[4][30:]).abs().max().item() <= TOL
    assert (out.all_logits[2] - refs[2]).abs().max().item() <= TOL


def test_the_window_matters(loaded, prompts, refs):
    """A window wider than the prompt gives other logits past the window (so the tests above
    would catch a window that is ignored), the same ones inside it."""
    cfg = tiny_random_config("gemma3", sliding_window=1000)
    runner = ModelRunner.from_config(cfg, loaded.state_dict, kv_capacity=256)
    full = pool_logits_prefill(runner, [prompts[3]])[0]
    assert (full[:WINDOW] - refs[3][:WINDOW]).abs().max().item() <= TOL
    assert (full[WINDOW:] - refs[3][WINDOW:]).abs().max().item() > 0.05


def test_rope_scaling_and_softcapping_match_transformers(tmp_path, g3_state_dict, prompts):
    """Linear RoPE scaling on the full layers (as in Gemma 3 4B+) and a final logit
    softcap (absent from Gemma 3, supported for configs that set it)."""
    cfg = tiny_random_config("gemma3", rope_scaling={"rope_type": "linear", "factor": 8.0},
                             final_logit_softcapping=3.0)
    save_hf_folder(cfg, g3_state_dict, tmp_path)
    m = load_hf_dir(tmp_path, with_tokenizer=False)
    assert m.config == cfg
    ref = hf_logits(tmp_path, prompts[3:4])
    runner = ModelRunner.from_config(m.config, m.state_dict, kv_capacity=256)
    ours = pool_logits_prefill(runner, prompts[3:4])
    assert _max_err(ours, ref) <= TOL
    assert ref[0].abs().max().item() < 3.0


def test_bfloat16_close_to_float32(loaded, prompts, refs):
    runner = _runner(loaded, "torch", dtype=torch.bfloat16)
    ours = pool_logits_prefill(runner, prompts[3:])
    assert _max_err(ours, refs[3:]) < 0.35  # bf16 weights and pool, logits ~10


def test_greedy_equal_with_prefix_cache(loaded, prompts):
    runner = _runner(loaded, "torch")
    one = greedy_generate(runner, prompts[3], 20, allocator=shuffled_allocator(1024, seed=6))
    two = greedy_generate(runner, prompts[3], 20, allocator=shuffled_allocator(1024, seed=7),
                          prefix_split=25)
    assert one == two and len(one) == 20


def test_engine_serves_it_with_the_prefix_cache(loaded, tiny_loaded):
    """The engine runs Gemma 3 unchanged: greedy outputs with the radix cache (prefixes
    reused across requests, beyond the window) equal those without it."""
    import random

    from radixserve import SamplingParams
    from radixserve.engine.engine import Engine
    from radixserve.model.registry import LoadedModel

    model = LoadedModel(loaded.config, loaded.state_dict, tiny_loaded.tokenizer, "tiny-gemma3")
    rng = random.Random(0)
    stems = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(2)]
    prompts = [rng.choice(stems)[: rng.randint(20, 40)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
               for _ in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = Engine(model, kv_cache_tokens=2048, dtype="float32", cache="none").generate(prompts, params)
    eng = Engine(model, kv_cache_tokens=2048, dtype="float32", cache="radix")
    one_by_one = [eng.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in ref]
    assert sum(o.cached_tokens for o in one_by_one) > 100


# --------------------------------------------------------------------------- windowed attention
def _case(prefix, extend, heads, kv_heads, head_dim, dtype, seed, window):
    """A pool (``dtype``) with random K/V, scattered slots, random q/k/v; slot entries before each
    sequence's first new token's window are set to an id far outside the pool (reading one
    would fault, or raise in the eager path)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in zip(prefix, extend)]
    capacity = 2 * sum(lens) + 16
    pool = KVPool(num_layers=1, capacity=capacity, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(dtype))
    perm = torch.randperm(capacity, generator=gen)
    seq_slots, start = [], 0
    for p, n in zip(prefix, lens):
        s = perm[start : start + n].clone()
        s[: max(0, p - window + 1)] = 1 << 40
        seq_slots.append(s)
        start += n
    t = sum(extend)
    qkv = [torch.randn(t, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads)]  # float32
    return pool, ForwardBatch.build([[1] * e for e in extend], list(prefix), seq_slots), qkv


# decodes of very different lengths, a prefill longer than the windows, prefills over a
# prefix (tails shorter and longer than the window), a two-token chunk
PREFIX = [0, 4, 15, 16, 32, 199, 6, 63, 0, 40, 7, 70]
EXTEND = [1, 1, 2, 1, 1, 1, 1, 1, 70, 33, 50, 3]
WINDOWS = [1, 5, 12, 32, 33, 100]


@needs_kernels
@pytest.mark.parametrize("impl", ALL_IMPLS, ids=impl_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 32), (9, 3, 64), (6, 2, 24), (4, 1, 256)])
def test_window_kernel_equals_eager(impl, dtype, heads, kv_heads, head_dim):
    require_impl(impl, dtype, head_dim)
    eager = EagerTorchAttentionBackend()
    kern = TorchAttentionBackend(kernels=True, attention_impl=impl)
    tol = 3e-2 if impl == kernels.IMPL_BF16 else 1e-5
    scale = 0.7 * head_dim**-0.5  # not the default: the scale argument is used
    for window in WINDOWS:
        pool, batch, (q, k, v) = _case(PREFIX, EXTEND, heads, kv_heads, head_dim, dtype, window, window)
        ref = eager.forward(q, k, v, 0, pool, eager.prepare(batch, pool), window=window, scale=scale)
        got = kern.forward(q, k, v, 0, pool, kern.prepare(batch, pool), window=window, scale=scale)
        assert (got.float() - ref).abs().max().item() <= tol, window


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_paths_are_bitwise_equal(dtype):
    """Every float32-mode implementation gives the portable path's bits under a window."""
    outs = {}
    for impl in FLOAT32_MODE_IMPLS:
        k = kernels.load_kernels()
        if not (kernels.isa_allows("auto", kernels.IMPL_ISA[impl]) and k.impl_available(impl, dtype, 32)):
            continue
        backend = TorchAttentionBackend(kernels=True, attention_impl=impl)
        outs[impl] = []
        for window in WINDOWS:
            pool, batch, (q, k_, v) = _case(PREFIX, EXTEND, 4, 1, 32, dtype, window, window)
            outs[impl].append(backend.forward(q, k_, v, 0, pool, backend.prepare(batch, pool), window=window))
    assert kernels.IMPL_GENERIC in outs
    for impl, got in outs.items():
        for a, b, w in zip(got, outs[kernels.IMPL_GENERIC], WINDOWS):
            assert torch.equal(a, b), (impl_id(impl), w)


N = 150
ROW_SPLITS = [[N], [1, N - 1], [33, 117], [100, 49, 1], [17] * 8 + [14], [140] + [1] * 10]


@needs_kernels
@pytest.mark.parametrize("impl", ALL_IMPLS, ids=impl_id)
@pytest.mark.parametrize("window", [12, 40])
def test_window_rows_do_not_depend_on_the_split(impl, window):
    """Under a window a row's bits depend only on its q and the K/V in its window: whole,
    prefix + tail, chunks and decode steps agree bit for bit (every split here reads no
    slot before its first new token's window: those entries are invalid ids)."""
    dtype = torch.bfloat16
    require_impl(impl, dtype, 64)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(400, generator=gen)[:N].clone()
    q = torch.randn(N, 6, 64, generator=gen).to(dtype)
    k = torch.randn(N, 2, 64, generator=gen).to(dtype)
    v = torch.randn(N, 2, 64, generator=gen).to(dtype)
    backend = TorchAttentionBackend(kernels=True, attention_impl=impl)
    results = []
    for split in ROW_SPLITS:
        pool = KVPool(1, 400, 2, 64, dtype=dtype)
        outs, done = [], 0
        for n in split:
            seq = slots[: done + n].clone()
            seq[: max(0, done - window + 1)] = 1 << 40
            batch = ForwardBatch.build([[0] * n], [done], [seq])
            sl = slice(done, done + n)
            outs.append(backend.forward(q[sl], k[sl], v[sl], 0, pool, backend.prepare(batch, pool),
                                        window=window))
            done += n
        results.append(torch.cat(outs))
    for split, got in zip(ROW_SPLITS[1:], results[1:]):
        assert torch.equal(got, results[0]), split


def test_eager_window_reads_only_the_window():
    """The eager backend gathers only the window's slots (an invalid id before it would
    raise in index_select) and equals a dense masked softmax."""
    window = 12
    pool, batch, (q, k, v) = _case(PREFIX, EXTEND, 4, 1, 32, torch.float32, 3, window)
    eager = EagerTorchAttentionBackend()
    meta = eager.prepare(batch, pool)
    got = eager.forward(q, k, v, 0, pool, meta, window=window, scale=0.3)
    assert window in meta.windows  # built once, reused by the next layer
    start = 0
    for i, (p, e) in enumerate(zip(PREFIX, EXTEND)):
        for j in range(e):
            pos = p + j
            lo = max(0, pos - window + 1)
            keys = pool.kv[0, :, batch.seq_slots[i][lo : pos + 1]]  # [2, n, 1, 32]
            s = torch.einsum("hd,nd->hn", q[start + j], keys[0, :, 0]) * 0.3
            ref = torch.softmax(s, -1) @ keys[1, :, 0]
            assert (got[start + j].view(4, 32) - ref).abs().max().item() < 1e-5
        start += e


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["one-pool", "hybrid-pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ISAS)
def test_layers_in_one_call_equal_the_python_loop(g3_config, g3_state_dict, isa, dtype, hybrid, kv, monkeypatch):
    """Kernels.gemma3_layers (every layer in one C++ call) gives the Python loop's bits, in a
    ragged prefill over scattered slots and in batched decode, with every layer on one pool
    or the sliding layers on the window pool (slots mapped through a permutation)."""
    require_kernels()
    require_isa(isa)
    cap = 512
    swa_map = None
    if hybrid:
        swa_map = torch.cat((torch.randperm(cap, generator=torch.Generator().manual_seed(8)), torch.tensor([cap])))
    sd = {k: v.to(dtype) for k, v in g3_state_dict.items()}
    runner = ModelRunner.from_config(g3_config, sd, kv_capacity=cap, dtype=dtype, cpu_isa=isa,
                                     linear_backend="radixserve", kv_dtype=kv, swa_map=swa_map)
    assert isinstance(runner.kv_pool, HybridKVPool) == hybrid
    calls = []
    one_call = Kernels.gemma3_layers
    monkeypatch.setattr(Kernels, "gemma3_layers", lambda self, *a, **kw: calls.append(1) or one_call(self, *a, **kw))
    ps = [_prompt(n, seed=90 + n) for n in (1, 11, 40, 23)]
    outs = {}
    for flag in (True, False):
        monkeypatch.setattr(LlamaForCausalLM, "one_call_layers", flag)
        outs[flag] = (pool_logits_prefill(runner, ps, shuffled_allocator(cap, seed=3)),
                      pool_logits_decode(runner, ps, shuffled_allocator(cap, seed=4)))
    assert len(calls) == 1 + max(len(p) for p in ps)
    for a, b in zip(outs[True][0] + outs[True][1], outs[False][0] + outs[False][1]):
        assert torch.equal(a, b)
