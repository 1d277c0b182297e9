"""``serve --dp N``: several engine cores behind one API process, routed by their caches."""

from __future__ import annotations

import dataclasses
import os
import random
import signal

import httpx
import pytest

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig, ServerConfig
from server_utils import running_server

CFG = EngineConfig(model="tiny-random", dtype="float32", kv_cache_tokens=4096, num_threads=2)
SP = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def _gen(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": SP}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_dp_routes_by_cache_and_keeps_outputs(kv_dtype: str) -> None:
    cfg = dataclasses.replace(CFG, kv_cache_dtype=kv_dtype)
    rng = random.Random(0)
    systems = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(6)]
    prompts = [s + [rng.randrange(3, 500) for _ in range(5)] for s in systems for _ in range(4)]
    rng.shuffle(prompts)
    want = [o.token_ids for o in Engine(config=cfg).generate(
        prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]
    with running_server(engine=cfg, server=ServerConfig(dp=2, log_level="warning")) as (url, handle):
        cores = handle.app.state.cores
        assert len(cores) == 2 and len({c.pid for c in cores}) == 2
        outs = [_gen(url, p) for p in prompts]
        assert [o["output_ids"] for o in outs] == want
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        # Each system prompt is computed once (on one core), then hit: 3 of every 4, each
        # whole. A repeat may be routed before the core's cache events for its system prompt
        # reach the API process (they travel on another socket than the response): the
        # dispatcher's record of where it sent the family keeps it on that core.
        assert cached >= 18 * 48, cached
        per_core = [c.load for c in handle.client.clients]
        stats = handle.stats()
        assert stats["dp_size"] == 2 and stats["finished_requests"] == len(prompts)
        handle.check_integrity()
        # Both cores served (new prefixes are dealt out).
        served = [c for c in handle.client.clients if c.load is not None]
        assert len(served) == 2, per_core


def test_dp_survives_a_core_dying() -> None:
    with running_server(engine=CFG, server=ServerConfig(dp=2, log_level="warning")) as (url, handle):
        _gen(url, [5] * 20)
        os.kill(handle.app.state.cores[0].pid, signal.SIGKILL)
        import time

        deadline = time.monotonic() + 10
        while handle.client.clients[0].dead_reason is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=5).status_code == 200  # one core still serves
        for i in range(6):
            assert _gen(url, [7 + i] * 20)["meta_info"]["completion_tokens"] == 4


def test_dp_under_memory_pressure_keeps_every_system_prompt() -> None:
    """Eight tenants' system prompts taking turns on two cores whose pools hold four prompts
    each but not also their questions (``test_router_pressure.py``, one request at a time):
    the dispatcher keeps each tenant on one core and asks it to keep the questions at low
    priority, so from the third round on every request finds its whole system prompt. After
    a flush the same prompts are new again (not repeats kept whole): the first round's hits
    are the first run's. (The second round's depend on whether a core's events for the first
    round reached the dispatcher before the next request: timing, not the cache.)"""
    from router_workers import tenant_turns

    cfg = dataclasses.replace(CFG, kv_cache_tokens=192, num_threads=1)
    with running_server(engine=cfg, server=ServerConfig(dp=2, log_level="warning")) as (url, handle):
        runs = []
        for _ in range(2):
            assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            runs.append([[_gen(url, ids)["meta_info"]["cached_tokens"] for ids in prompts]
                         for prompts in tenant_turns()])
        handle.check_integrity()
    for hits in runs:
        assert hits[2] + hits[3] == [40] * 16, runs
    assert runs[0][0] == runs[1][0], runs


def test_merged_stats_keep_nested_families_and_sum_histograms() -> None:
    """``dp_size`` is a top-level fact: a nested dict is a labelled family (``/metrics`` turns
    its keys into label values), so it must not gain a ``dp_size`` member; histograms' buckets
    of the same bounds add up bound by bound; strings and flags keep the first core's."""
    from radixserve.server.dp_client import merge_stats

    hist = lambda c1, c2, s: {"buckets": [[0.1, c1], [float("inf"), c2]], "count": c2, "sum": s}  # noqa: E731
    a = {"hicache": {"hit_tokens": {"L1": 3}, "latency_s": hist(1, 2, 0.5)}, "dtype": "bfloat16",
         "batch_invariant": True, "prefix_cache_query_tokens": 10, "prefix_cache_hit_tokens": 4}
    b = {"hicache": {"hit_tokens": {"L1": 5, "L2": 1}, "latency_s": hist(0, 3, 1.0)}, "dtype": "other",
         "batch_invariant": False, "prefix_cache_query_tokens": 30, "prefix_cache_hit_tokens": 6}
    m = merge_stats([a, b])
    assert m["hicache"]["hit_tokens"] == {"L1": 8, "L2": 1}
    assert m["hicache"]["latency_s"] == {"buckets": [(0.1, 1), (float("inf"), 5)], "count": 5, "sum": 1.5}
    assert "dp_size" not in m["hicache"] and "dp_size" not in m["hicache"]["hit_tokens"]
    assert m["dp_size"] == 2 and m["dtype"] == "bfloat16" and m["batch_invariant"] is True
    assert m["prefix_cache_hit_rate"] == 10 / 40
    assert a["hicache"]["hit_tokens"] == {"L1": 3}  # the parts are not changed
