"""The scheduler driving the tiered cache under pressure (tiny model): concurrent admissions
that load from L2 while L1 is short, retraction, chunked prefill, mixed steps, aborts of
requests whose prefetch is in flight; the scheduler's and the tree's invariants after every
step, and greedy outputs equal to the no-cache outputs."""

from __future__ import annotations

import random

import pytest

from radixserve import SamplingParams
from radixserve.engine.engine import Engine


def hi_engine(tiny_loaded, **kw) -> Engine:
    kw.setdefault("kv_cache_tokens", 400)
    kw.setdefault("hicache_l2_tokens", 2048)
    kw.setdefault("hicache_prefetch_policy", "wait_complete")
    return Engine(tiny_loaded, cache="radix", dtype="float32", **kw)


def shared_prompts(rng: random.Random, n: int, n_prefixes: int = 4, prefix_len: int = 64,
                   tail=(1, 30)) -> list:
    prefixes = [[rng.randrange(3, 500) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    return [rng.choice(prefixes)[: rng.randint(prefix_len // 2, prefix_len)]
            + [rng.randrange(3, 500) for _ in range(rng.randint(*tail))] for _ in range(n)]


def assert_idle_clean(eng: Engine) -> None:
    eng.check_integrity()
    s = eng.stats()
    assert s["protected_tokens"] == 0 and s["private_tokens"] == 0
    assert s["hicache"]["prefetch"]["in_flight"] == 0


@pytest.mark.parametrize("page_size,policy,mixed", [(1, "write_through", False),
                                                    (4, "write_back", True),
                                                    (2, "write_through_selective", False)])
def test_concurrent_batch_under_l1_pressure_equals_no_cache(tiny_loaded, page_size, policy, mixed):
    """Many requests at once, L1 a fraction of their prefixes: admissions load from L2 while
    others decode, running requests are retracted, and every output is still exact."""
    rng = random.Random(page_size)
    prompts = shared_prompts(rng, 24, tail=(5, 40))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = Engine(tiny_loaded, cache="none", dtype="float32", kv_cache_tokens=8192)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    eng = hi_engine(tiny_loaded, page_size=page_size, hicache_write_policy=policy,
                    hicache_write_through_threshold=1, decode_reserve_ratio=0.0, mixed_steps=mixed)
    eng.generate(prompts[:8], params)  # fill L1 and L2
    rids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.check_integrity()
    assert [done[r].token_ids for r in rids] == want
    s = eng.stats()
    assert s["hicache"]["tokens_moved"]["load_back"] > 0
    assert_idle_clean(eng)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_randomized_run_keeps_invariants_every_step(tiny_loaded, seed, tmp_path):
    rng = random.Random(seed)
    storage = f"file://{tmp_path}/l3" if seed % 2 else ""
    eng = hi_engine(
        tiny_loaded,
        kv_cache_tokens=320,
        hicache_l2_tokens=rng.choice([256, 1024]),
        hicache_storage=storage,
        hicache_storage_page_tokens=16,
        hicache_write_policy=rng.choice(["write_through", "write_back", "write_through_selective"]),
        hicache_prefetch_policy=rng.choice(["wait_complete", "best_effort", "timeout"]),
        page_size=rng.choice([1, 2, 4]),
        max_prefill_tokens=128,
        chunked_prefill_size=64,
        mixed_steps=rng.random() < 0.5,
        policy=rng.choice(["lpm", "fcfs", "dfs-weight"]),
    )
    live: list[str] = []
    for _ in range(150):
        if rng.random() < 0.35:
            p = shared_prompts(rng, 1, n_prefixes=3, prefix_len=96, tail=(1, 80))[0]
            sp = SamplingParams(max_tokens=rng.randint(0, 24), temperature=rng.choice([0.0, 1.0]),
                                ignore_eos=True)
            live.append(eng.add_request(p, sp))
        if live and rng.random() < 0.1:
            eng.abort(live.pop(rng.randrange(len(live))))
        for o in eng.step():
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
        eng.check_integrity()
    eng.run_until_done()
    assert_idle_clean(eng)
    eng.core.close()


def test_abort_while_prefetch_in_flight_cancels_it(tiny_loaded, tmp_path):
    url = f"file://{tmp_path}/l3"
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompt = [rng_tok for rng_tok in range(3, 3 + 80)]
    a = hi_engine(tiny_loaded, hicache_storage=url, hicache_storage_page_tokens=16)
    a.generate([prompt], params)
    a.core.close()
    b = hi_engine(tiny_loaded, hicache_storage=url, hicache_storage_page_tokens=16)
    rid = b.add_request(prompt, params)
    assert b.stats()["hicache"]["prefetch"]["in_flight"] == 1
    assert b.abort(rid)
    st = b.stats()["hicache"]["prefetch"]
    assert st["in_flight"] == 0 and st["cancelled"] == 1
    b.run_until_done()
    assert_idle_clean(b)
    b.core.close()


def test_a_request_that_cannot_be_admitted_loads_nothing_from_l2(tiny_loaded):
    """While memory is short (a running request's decode reserve), a waiting request whose
    prefix is in L2 must not load it: the load would take the free slots the running request
    decodes into, get evicted again, and come back at every step."""
    eng = hi_engine(tiny_loaded, decode_reserve_ratio=1.0, hicache_write_policy="write_through")
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(64)]
    eng.generate([prefix + [5, 6, 7]], SamplingParams(max_tokens=1, temperature=0))
    eng.cache.evict(eng.cache.evictable_size)  # the prefix is now in L2 only
    assert eng.cache.host_size >= 64 and eng.cache.total_size == 0
    long_params = SamplingParams(max_tokens=250, temperature=0, ignore_eos=True)
    runner = eng.add_request([rng.randrange(3, 500) for _ in range(100)], long_params)
    eng.step()  # the long request is admitted and holds a large decode reserve
    waiter = eng.add_request(prefix + [9, 9, 9, 9], SamplingParams(max_tokens=4, temperature=0))
    finished = {}
    loaded_while_blocked = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o
        eng.check_integrity()
        if runner not in finished:
            loaded_while_blocked = eng.cache.stats()["tokens_moved"]["load_back"]
    assert loaded_while_blocked == 0
    assert finished[waiter].cached_tokens >= 64  # loaded once, when it could run
    assert_idle_clean(eng)
