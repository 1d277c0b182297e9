"""Engine and scheduler on the tiny random model: invariants, ablations, DFS bound, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve import SamplingParams
from radixserve.engine.engine import Engine

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def make_engine(tiny_loaded, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("dtype", "float32")
    return Engine(tiny_loaded, **kw)


def prompts_with_shared_prefixes(rng: random.Random, n: int, n_prefixes=3, prefix_len=40, tail=(1, 30)):
    prefixes = [[rng.randrange(3, 500) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    out = []
    for _ in range(n):
        p = rng.choice(prefixes)
        out.append(p[: rng.randint(1, prefix_len)] + [rng.randrange(3, 500) for _ in range(rng.randint(*tail))])
    return out


def assert_idle_clean(engine: Engine) -> None:
    engine.check_integrity()
    s = engine.stats()
    assert s["protected_tokens"] == 0
    assert s["private_tokens"] == 0
    assert s["kv_free_tokens"] + s["evictable_tokens"] == s["kv_capacity_tokens"]


@pytest.mark.parametrize("cache", ["radix", "table", "none"])
def test_greedy_outputs_equal_across_cache_modes(tiny_loaded, cache):
    rng = random.Random(0)
    prompts = prompts_with_shared_prefixes(rng, 12)
    ref = make_engine(tiny_loaded, cache="none").generate(prompts, GREEDY)
    eng = make_engine(tiny_loaded, cache=cache)
    batch = eng.generate(prompts, GREEDY)
    one_by_one = [eng.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in batch] == [o.token_ids for o in ref]
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in ref]
    assert_idle_clean(eng)
    if cache == "radix":
        assert all(o.cached_tokens >= len(p) - 1 for o, p in zip(one_by_one, prompts))


@pytest.mark.parametrize("page_size", [1, 4])
def test_small_pool_forces_eviction_and_retraction_yet_outputs_are_exact(tiny_loaded, page_size):
    rng = random.Random(1)
    prompts = prompts_with_shared_prefixes(rng, 16, prefix_len=60, tail=(5, 40))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_loaded, cache="none", kv_cache_tokens=8192).generate(prompts, params)
    eng = make_engine(tiny_loaded, kv_cache_tokens=400, page_size=page_size, decode_reserve_ratio=0.0)
    outs = eng.generate(prompts, params)
    s = eng.stats()
    assert s["evicted_tokens"] > 0
    assert s["retractions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert_idle_clean(eng)


@pytest.mark.parametrize("seed,cache", [(0, "radix"), (1, "radix"), (2, "radix"), (3, "table"), (4, "none")])
def test_randomized_run_keeps_invariants_every_step(tiny_loaded, seed, cache):
    rng = random.Random(seed)
    eng = make_engine(
        tiny_loaded,
        cache=cache,
        kv_cache_tokens=600,
        page_size=rng.choice([1, 2, 4]),
        max_prefill_tokens=128,
        chunked_prefill_size=64,
        policy=rng.choice(["lpm", "fcfs", "dfs-weight", "random"]),
    )
    live: list[str] = []
    for step in range(150):
        if rng.random() < 0.3:
            p = prompts_with_shared_prefixes(rng, 1, prefix_len=100, tail=(1, 150))[0]
            sp = SamplingParams(max_tokens=rng.randint(0, 30), temperature=rng.choice([0.0, 1.0]), ignore_eos=True)
            live.append(eng.add_request(p, sp))
        if live and rng.random() < 0.08:
            eng.abort(live.pop(rng.randrange(len(live))))
        for o in eng.step():
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
        eng.check_integrity()
    eng.run_until_done()
    assert_idle_clean(eng)


def test_hits_and_stats_totals(tiny_loaded):
    rng = random.Random(3)
    prefix = [rng.randrange(3, 500) for _ in range(300)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(10)] for _ in range(8)]
    eng = make_engine(tiny_loaded)
    first = eng.generate([prompts[0]], GREEDY)[0]
    rest = eng.generate(prompts[1:], GREEDY)
    assert first.cached_tokens == 0
    assert all(o.cached_tokens >= 300 for o in rest)
    s = eng.stats()
    outs = [first] + rest
    assert s["prefix_cache_query_tokens"] == sum(len(p) for p in prompts)
    assert s["prefix_cache_hit_tokens"] == sum(o.cached_tokens for o in outs)
    assert s["generated_tokens"] == sum(len(o.token_ids) for o in outs)


def test_concurrent_requests_with_shared_uncached_prefix_compute_it_once(tiny_loaded):
    rng = random.Random(4)
    prefix = [rng.randrange(3, 500) for _ in range(200)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(5)] for _ in range(6)]
    eng = make_engine(tiny_loaded)
    outs = eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    assert sorted(o.cached_tokens for o in outs)[1:] == [200] * 5
    assert eng.stats()["computed_prefill_tokens"] == 200 + 6 * 5


def distinct_tree_tokens(seqs) -> int:
    seen = set()
    for s in seqs:
        for i in range(1, len(s) + 1):
            seen.add(tuple(s[:i]))
    return len(seen)


def generated_tree_batch(rng: random.Random, depth=3, branching=3, seg=(5, 25)):
    seqs = []

    def grow(prefix, d):
        if d == depth:
            seqs.append(prefix)
            return
        for _ in range(branching):
            grow(prefix + [rng.randrange(3, 500) for _ in range(rng.randint(*seg))], d + 1)

    grow([], 0)
    rng.shuffle(seqs)
    return seqs


def test_offline_dfs_computes_exactly_the_distinct_tree_tokens(tiny_loaded):
    rng = random.Random(5)
    seqs = generated_tree_batch(rng)
    eng = make_engine(tiny_loaded, policy="dfs-weight", kv_cache_tokens=8192)
    eng.generate(seqs, SamplingParams(max_tokens=1, temperature=0))
    assert eng.stats()["computed_prefill_tokens"] == distinct_tree_tokens(seqs)
    assert_idle_clean(eng)


def test_lpm_orders_longest_match_first(tiny_loaded):
    eng = make_engine(tiny_loaded, max_running_requests=1)
    rng = random.Random(6)
    hot = [rng.randrange(3, 500) for _ in range(50)]
    eng.generate([hot + [7]], SamplingParams(max_tokens=1, temperature=0))
    cold = eng.add_request([rng.randrange(3, 500) for _ in range(20)], SamplingParams(max_tokens=1))
    warm = eng.add_request(hot + [9, 9], SamplingParams(max_tokens=1))
    order = [o.request_id for o in eng.run_until_done()]
    assert order == [warm, cold]


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 2, 100000], SamplingParams(), "vocabulary"),
        ([1, -5], SamplingParams(), "vocabulary"),
        (list(range(3, 500)) * 20, SamplingParams(max_tokens=1), "context length|KV pool"),
        ("hi", SamplingParams(max_tokens=10**7), "max_tokens"),
        (12, SamplingParams(), "prompt"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(tiny_loaded, prompt, params, match):
    eng = make_engine(tiny_loaded, max_context_len=4000)
    with pytest.raises(ValueError, match=match):
        eng.add_request(prompt, params)
    out = eng.generate(["still fine"], GREEDY)[0]
    assert out.finish_reason in ("length", "stop")
    assert_idle_clean(eng)


def test_negative_max_tokens_is_a_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_unknown_engine_option_and_bad_config(tiny_loaded):
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(tiny_loaded, no_such_option=1)
    with pytest.raises(ValueError, match="policy"):
        Engine(tiny_loaded, policy="magic")
    with pytest.raises(ValueError, match="cache"):
        Engine(tiny_loaded, cache="lru")


def test_abort_frees_slots_and_locks_at_once(tiny_loaded):
    eng = make_engine(tiny_loaded)
    rid = eng.add_request(list(range(3, 200)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.stats()["protected_tokens"] > 0
    assert eng.abort(rid)
    assert_idle_clean(eng)
    assert not eng.abort(rid)


def test_flush_cache_refused_while_running(tiny_loaded):
    eng = make_engine(tiny_loaded)
    eng.generate(["warm the cache"], GREEDY)
    assert eng.stats()["cached_tokens"] > 0
    eng.add_request("running now", SamplingParams(max_tokens=5))
    assert eng.flush_cache() is False
    eng.run_until_done()
    assert eng.flush_cache() is True
    assert eng.stats()["cached_tokens"] == 0
    assert_idle_clean(eng)


def test_prefill_only_and_prompt_logprobs_equal_full_prefill(tiny_loaded):
    eng = make_engine(tiny_loaded)
    prompt = list(range(10, 60))
    ref = make_engine(tiny_loaded, cache="none").generate(
        [prompt], SamplingParams(max_tokens=0, logprob_start_len=0)
    )[0]
    eng.generate([prompt[:40]], SamplingParams(max_tokens=0))  # warm a prefix
    out = eng.generate([prompt], SamplingParams(max_tokens=0, logprob_start_len=30))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert [t for t, _ in out.prompt_logprobs] == prompt[30:]
    ref_lp = dict(enumerate(lp for _, lp in ref.prompt_logprobs))
    assert ref.prompt_logprobs[0][1] is None
    for k, (_, lp) in enumerate(out.prompt_logprobs):
        assert lp == pytest.approx(ref_lp[30 + k], abs=1e-4)
    assert out.cached_tokens == 29


def test_stream_deltas_concatenate_to_text(tiny_loaded):
    eng = make_engine(tiny_loaded)
    deltas = list(eng.stream("hello there", SamplingParams(max_tokens=12, temperature=0)))
    assert deltas[-1].finished
    assert "".join(d.delta_text for d in deltas) == deltas[-1].text
    assert sum(len(d.delta_token_ids) for d in deltas) == len(deltas[-1].token_ids)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tiny_loaded):
    eng = make_engine(tiny_loaded)
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=123)
    alone = eng.generate(["abc"], sp)[0].token_ids
    together = eng.generate(["abc", "xyz", "abc def"], [sp, SamplingParams(max_tokens=10), sp])
    assert together[0].token_ids == alone


def test_stop_strings_and_stop_token_ids(tiny_loaded):
    eng = make_engine(tiny_loaded)
    free = eng.generate(["qq"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    out = eng.generate(["qq"], SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert stop not in out.text and free.text.startswith(out.text)
    tok = free.token_ids[3]
    out2 = eng.generate(["qq"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[tok], ignore_eos=True))[0]
    assert out2.finish_reason == "stop" and out2.token_ids[-1] == tok
    assert len(out2.token_ids) == free.token_ids.index(tok) + 1


@pytest.mark.parametrize("cache", ["none", "table"])
def test_ablations_do_not_defer_requests_for_in_batch_sharing(tiny_loaded, cache):
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(100)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(5)] for _ in range(4)]
    eng = make_engine(tiny_loaded, cache=cache)
    eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    assert eng.stats()["prefill_steps"] == 1


@pytest.mark.parametrize("prompt", [[1, 2.5], [1, True], ["a", "b"], torch.tensor([1.0, 2.0])])
def test_token_id_prompts_must_be_integers(tiny_loaded, prompt):
    eng = make_engine(tiny_loaded)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request(prompt, GREEDY)
    assert eng.generate([torch.tensor([5, 6, 7])], GREEDY)[0].finish_reason in ("length", "stop")
