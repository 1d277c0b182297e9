"""A hybrid (sliding-window + full) model in the engine: a KV pool per kind, the one tree with
SWA tombstones, exact output.

The tiny Gemma 3 (window 12, two sliding layers to one full) runs with the radix cache and an
SWA pool far smaller than the full one, so the tree tombstones SWA KV and requests give back
their out-of-window KV as they decode; greedy output must equal the no-cache run token for
token. Every free SWA slot is filled with NaN before each step: a kernel that read a slot
outside some window would turn the logits into NaN and the outputs would differ.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import SamplingParams
from radixserve.cache.swa import SWARadixCache
from radixserve.engine.engine import Engine
from radixserve.memory.swa_pool import HybridAllocator, HybridKVPool
from radixserve.model.registry import LoadedModel
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict


@pytest.fixture(scope="module")
def gemma(tiny_loaded) -> LoadedModel:
    cfg = tiny_random_config("gemma3")
    return LoadedModel(cfg, tiny_random_state_dict(seed=0, config=cfg), tiny_loaded.tokenizer, "tiny-gemma3")


def _poison_free_swa(eng: Engine) -> None:
    core = eng.core
    pool = core.runner.kv_pool
    alloc = core.allocator
    used = torch.zeros(alloc.swa.capacity + 1, dtype=torch.bool)
    m = alloc.swa_map[: alloc.capacity]
    used[m[m >= 0]] = True
    used[alloc.swa.capacity] = True  # the pad slot is written by padded rows
    # (a quantized pool: all-ones bytes, whose scale is a NaN)
    pool.swa.kv[:, :, ~used] = 255 if pool.quantized else float("nan")


def _conversations(seed: int, n: int) -> list[list[int]]:
    """Multi-turn prompts: each turn extends the previous one, well past the window."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(3, 500) for _ in range(rng.randint(10, 30))]
        for _ in range(3):
            p = p + [rng.randrange(3, 500) for _ in range(rng.randint(5, 25))]
            out.append(list(p))
    rng.shuffle(out)
    return out


def _run(eng: Engine, prompts, params, poison: bool):
    outs = []
    for i in range(0, len(prompts), 3):  # a few at a time: batches mix prefill and decode
        if poison:
            _poison_free_swa(eng)
            eng.core.step_hooks.append(lambda: _poison_free_swa(eng))
        outs += eng.generate(prompts[i : i + 3], params)
        eng.core.step_hooks.clear()
        eng.core.scheduler.check_integrity()
        eng.core.cache.check_integrity()
    return outs


@pytest.mark.parametrize("page_size,kv_dtype", [(1, "auto"), (4, "auto"), (4, "int8")])
def test_hybrid_cache_on_equals_off_with_tombstones(gemma, page_size, kv_dtype):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = _conversations(1, 6)
    common = dict(kv_cache_tokens=1024, dtype="float32", page_size=page_size, max_running_requests=4,
                  kv_cache_dtype=kv_dtype)
    ref = Engine(gemma, cache="none", swa_kv_cache_tokens=512, **common)
    assert isinstance(ref.core.allocator, HybridAllocator)
    want = [o.token_ids for o in _run(ref, prompts, params, poison=False)]
    eng = Engine(gemma, cache="radix", swa_kv_cache_tokens=160, **common)
    core = eng.core
    assert isinstance(core.cache, SWARadixCache) and isinstance(core.runner.kv_pool, HybridKVPool)
    outs = _run(eng, prompts, params, poison=True)
    assert [o.token_ids for o in outs] == want
    assert core.runner.kv_pool.quantized == (kv_dtype == "int8")
    eng.check_integrity()
    hits = sum(o.cached_tokens for o in outs)
    assert hits > 50, hits  # later turns reuse earlier ones
    assert core.cache.swa_kv.tombstoned_tokens > 0  # the SWA budget was exceeded and held
    assert core.allocator.swa.capacity == 160 - 160 % page_size


def test_hybrid_model_refuses_what_cannot_carry_window_kv(gemma):
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(gemma, cache="table", kv_cache_tokens=512, dtype="float32")
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(gemma, cache="radix", kv_cache_tokens=512, dtype="float32", hicache_l2_tokens=512)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_finished_conversation_is_matched_whole_by_its_next_turn(gemma, page_size):
    """A request gives back the window KV of its generated tokens as it decodes, but keeps
    what a match at its cacheable end needs: the next turn hits all of it."""
    eng = Engine(gemma, cache="radix", kv_cache_tokens=1024, swa_kv_cache_tokens=512,
                 dtype="float32", page_size=page_size)
    prompt = [5 + i % 400 for i in range(30)]
    out = eng.generate([prompt], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True))[0]
    turn = prompt + out.token_ids + [7, 8, 9]
    held = (len(prompt) + 24) // page_size * page_size  # the last sampled token has no KV yet
    nxt = eng.generate([turn], SamplingParams(max_tokens=1, temperature=0))[0]
    assert nxt.cached_tokens == held
    assert eng.core.cache.swa_size < eng.core.cache.total_size  # generated tokens were given back


def test_hybrid_exact_under_eviction_retraction_and_chunked_prefill(gemma):
    """Prompts of more than three windows, a pool so small that the tree evicts and running
    requests are retracted, prompts prefilled in chunks: still the no-cache output."""
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    rng = random.Random(3)
    stem = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [stem[: rng.randint(25, 40)] + [rng.randrange(3, 500) for _ in range(rng.randint(12, 30))]
               for _ in range(10)]
    assert all(len(p) > 3 * 12 for p in prompts)
    common = dict(dtype="float32", chunked_prefill_size=16, max_prefill_tokens=32, decode_reserve_ratio=0.0)
    want = [o.token_ids for o in Engine(gemma, cache="none", kv_cache_tokens=4096, **common).generate(prompts, params)]
    eng = Engine(gemma, cache="radix", kv_cache_tokens=288, swa_kv_cache_tokens=160, max_running_requests=8, **common)
    eng.core.step_hooks.append(lambda: _poison_free_swa(eng))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    st = eng.core.scheduler.stats
    assert st.retractions > 0 and eng.core.cache.evicted_tokens > 0
    assert sum(o.cached_tokens for o in outs) > 0
    eng.core.scheduler.check_integrity()
