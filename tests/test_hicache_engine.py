"""Engine-level HiCache tests: the scheduler drives the tiered cache (prefetch on arrival,
load_back on admission, write policies on insert, demotion on eviction).

Exactness: greedy outputs with L1 forced small (prefixes are demoted and loaded back, from
L2, and from L3 after a restart) equal the outputs without any cache.
"""

from __future__ import annotations

import random
import subprocess
import time

import pytest

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from redis_server import RedisServer, redis_server_binary

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def hi_engine(loaded, kv_tokens: int, model_name: str, l2_tokens: int, storage: str | None = None,
              write_policy: str = "write_through", write_through_threshold: int = 2,
              storage_page_tokens: int = 64) -> Engine:
    del model_name  # the engine keys storage by its model name and dtype
    return Engine(loaded, cache="radix", dtype="float32", kv_cache_tokens=kv_tokens,
                  decode_reserve_ratio=0.0, hicache_l2_tokens=l2_tokens, hicache_storage=storage or "",
                  hicache_write_policy=write_policy,
                  hicache_write_through_threshold=write_through_threshold,
                  hicache_storage_page_tokens=storage_page_tokens,
                  hicache_prefetch_policy="wait_complete")


def shared_prompts(seed: int, n: int, prefix_len: int = 48) -> list:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(prefix_len)] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
            for _ in range(n)]


def one_by_one(eng: Engine, prompts) -> list:
    outs = []
    for p in prompts:
        outs.append(eng.generate([p], GREEDY)[0])
        eng.check_integrity()
    return outs


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_tiny_model_l1_tiny_equals_no_cache(tiny_loaded, policy):
    prompts = shared_prompts(0, 10)
    ref = Engine(tiny_loaded, cache="none", dtype="float32", kv_cache_tokens=2048)
    want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    eng = hi_engine(tiny_loaded, 96, "tiny", l2_tokens=1024, write_policy=policy,
                    write_through_threshold=1)
    outs = one_by_one(eng, prompts)
    assert [o.token_ids for o in outs] == want
    batch = eng.generate(prompts[:4], GREEDY)
    assert [o.token_ids for o in batch] == want[:4]
    eng.check_integrity()
    st = eng.cache.stats()
    assert st["tokens_moved"]["load_back"] > 0  # prefixes really came back from L2
    assert sum(o.cached_tokens for o in outs) > 0


def test_tiny_model_warm_restart_from_file_storage(tiny_loaded, tmp_path):
    prompts = shared_prompts(1, 8)
    ref = Engine(tiny_loaded, cache="none", dtype="float32", kv_cache_tokens=2048)
    want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    url = f"file://{tmp_path}/l3"
    a = hi_engine(tiny_loaded, 256, "tiny", l2_tokens=512, storage=url, storage_page_tokens=16)
    assert [o.token_ids for o in one_by_one(a, prompts)] == want
    assert a.cache.wait_storage_idle(10)
    a.cache.close()
    b = hi_engine(tiny_loaded, 256, "tiny", l2_tokens=512, storage=url, storage_page_tokens=16)
    outs = one_by_one(b, prompts)
    assert [o.token_ids for o in outs] == want
    assert outs[0].cached_tokens >= 48  # first request after the restart: served from L3
    assert b.cache.stats()["prefetch"]["tokens"] > 0
    b.cache.close()


# ---------------------------------------------------------------------- SmolLM2 (float32)
SYSTEM = ("You are a careful assistant. Answer briefly and precisely. Facts: the Rhine flows "
          "through Switzerland, Germany and the Netherlands; the Danube flows through Vienna, "
          "Budapest and Belgrade. ")
QUESTIONS = ["Which river flows through Vienna?", "Name a country the Rhine flows through.",
             "Which river passes Budapest?", "Does the Danube flow through Belgrade?"]


def chat_prompts(eng: Engine) -> list:
    return [eng.tokenizer.encode(eng.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def smol_reference(smollm2_loaded):
    eng = Engine(smollm2_loaded, cache="none", dtype="float32", kv_cache_tokens=4096)
    prompts = chat_prompts(eng)
    return prompts, [o.token_ids for o in eng.generate(prompts, GREEDY)]


@pytest.mark.slow
def test_smollm2_tiny_l1_equals_no_cache_via_l2(smollm2_loaded, smol_reference):
    prompts, want = smol_reference
    kv = max(len(p) for p in prompts) + 16  # one request at a time: each evicts the last
    eng = hi_engine(smollm2_loaded, kv, "smollm2-135m", l2_tokens=4096)
    outs = one_by_one(eng, prompts)
    assert [o.token_ids for o in outs] == want
    assert all(o.cached_tokens > 0 for o in outs[1:])  # the system prompt, back from L2
    assert eng.cache.stats()["tokens_moved"]["load_back"] > 0


@pytest.mark.slow
def test_smollm2_l3_and_warm_restart_equal_no_cache(smollm2_loaded, smol_reference, tmp_path):
    """L2 smaller than one request: prefixes come back from the file store within the run,
    and after a restart (new engine, same store) from L3 again; outputs never change."""
    prompts, want = smol_reference
    kv = max(len(p) for p in prompts) + 16
    url = f"file://{tmp_path}/l3"
    eng = hi_engine(smollm2_loaded, kv, "smollm2-135m", l2_tokens=64, storage=url,
                    storage_page_tokens=16)
    outs = one_by_one(eng, prompts)
    assert [o.token_ids for o in outs] == want
    assert eng.cache.wait_storage_idle(10)
    eng.cache.close()
    eng2 = hi_engine(smollm2_loaded, kv, "smollm2-135m", l2_tokens=kv, storage=url,
                     storage_page_tokens=16)
    outs2 = one_by_one(eng2, prompts[:2])
    assert [o.token_ids for o in outs2] == want[:2]
    assert outs2[0].cached_tokens >= 32
    assert eng2.cache.stats()["prefetch"]["tokens"] >= outs2[0].cached_tokens
    eng2.cache.close()


@pytest.mark.slow
def test_smollm2_two_servers_one_redis(smollm2_loaded, smol_reference):
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary")
    prompts, want = smol_reference
    with RedisServer() as srv:
        a = hi_engine(smollm2_loaded, 2048, "smollm2-135m", l2_tokens=2048, storage=srv.url,
                      storage_page_tokens=16)
        b = hi_engine(smollm2_loaded, 2048, "smollm2-135m", l2_tokens=2048, storage=srv.url,
                      storage_page_tokens=16)
        assert a.generate([prompts[0]], GREEDY)[0].token_ids == want[0]
        assert a.cache.wait_storage_idle(10)
        out = b.generate([prompts[1]], GREEDY)[0]
        assert out.token_ids == want[1]
        # The shared system prompt, computed on a, is a hit on b (whole storage pages of it).
        assert out.cached_tokens >= 16 * (len(SYSTEM) // 100)
        assert b.cache.stats()["prefetch"]["tokens"] == out.cached_tokens
        a.cache.close()
        b.cache.close()


def test_program_leaving_storage_threads_open_exits_cleanly(tmp_path):
    """A program that leaves an engine with busy storage threads open exits with status 0
    (a storage thread inside torch at finalization aborts the process; without the exit
    hook this program was seen to abort, though rarely: this guards, it cannot reproduce).
    Run in subprocesses because the exit itself is the behaviour under test."""
    import sys

    program = """
import sys
from radixserve import SamplingParams
from radixserve.engine.engine import Engine

def engine(store):
    return Engine("tiny-random", dtype="float32", kv_cache_tokens=256, decode_reserve_ratio=0.0,
                  hicache_l2_tokens=4096, hicache_storage="file://" + store,
                  hicache_write_policy="write_through", hicache_write_through_threshold=1,
                  hicache_storage_page_tokens=16, hicache_prefetch_policy="wait_complete")

params = SamplingParams(max_tokens=2, temperature=0.0)
left_open = engine(sys.argv[1])
for seed in range(40):
    left_open.generate([[seed % 250 + 3] * 200 + [9, 10]], params)
print("leaving with storage threads running", flush=True)
"""
    for run_no in range(8):
        run = subprocess.run([sys.executable, "-c", program, str(tmp_path / f"store{run_no}")],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "leaving with storage threads running" in run.stdout


def test_engine_close_is_idempotent(tiny_loaded, tmp_path):
    eng = hi_engine(tiny_loaded, 96, "tiny", l2_tokens=1024, storage=f"file://{tmp_path}")
    eng.generate(shared_prompts(1, 2), GREEDY)
    eng.close()
    eng.close()
    assert not eng.core._finalizer.alive  # what the interpreter's exit would call: nothing left to do
    eng.core._finalizer()


def test_an_engine_dropped_without_close_is_freed_and_its_threads_stop(tiny_loaded, tmp_path):
    """Nothing keeps a core alive behind its user's back (an exit hook bound to it kept every
    engine's weights and KV pool until the interpreter ended); collecting it stops its
    storage threads as close() would."""
    import gc
    import threading
    import weakref

    before = set(threading.enumerate())
    eng = hi_engine(tiny_loaded, 96, "tiny", l2_tokens=1024, storage=f"file://{tmp_path}")
    eng.generate(shared_prompts(1, 2), GREEDY)
    assert set(threading.enumerate()) - before, "expected the engine's storage threads"
    core = weakref.ref(eng.core)
    del eng
    gc.collect()
    assert core() is None
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not {t for t in set(threading.enumerate()) - before if t.is_alive()}
