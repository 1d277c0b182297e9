"""The router in front of real tiny-random worker processes, over real HTTP and ZMQ.

Three workers with a small KV pool (so the randomized run evicts); the router runs in this
process (its state is read on its own loop with ``RouterHandle.call``).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixserve.placement.mirror import leaf_paths_of_events
from router_workers import fetch_snapshot, running_router, running_workers, wait_for

KV = 700  # tokens per worker: the randomized run below holds more than that


@pytest.fixture(scope="module")
def workers():
    with running_workers(3, kv_cache_tokens=KV) as ws:
        yield ws


@pytest.fixture(scope="module")
def router(workers):
    with running_router([w.url for w in workers], [w.events for w in workers],
                        health_interval_s=0.2) as r:
        wait_for(lambda: r.call(lambda rt: all(w.mirror.synced and w.healthy for w in rt.workers)),
                 30, "mirrors in sync")
        yield r


@pytest.fixture
def client(router):
    with httpx.Client(base_url=router.url, timeout=60) as c:
        yield c


def sse(text: str) -> list:
    """The data lines of an SSE body; asserts it ends with [DONE]."""
    lines = [ln[len("data: "):] for ln in text.split("\n") if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-200:]
    return [json.loads(x) for x in lines[:-1]]


def test_openai_and_native_pass_through(workers, client):
    direct = httpx.Client(base_url=workers[0].url, timeout=60)
    cases = [
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}),
        ("/v1/completions", {"prompt": ["a b c", "d e f"], "max_tokens": 3, "temperature": 0, "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hello there"}],
                                  "max_tokens": 6, "temperature": 0}),
        ("/generate", {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}),
        ("/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}),
    ]
    for path, body in cases:
        via = client.post(path, json=body)
        ref = direct.post(path, json=body)
        assert via.status_code == ref.status_code == 200, via.text
        a, b = via.json(), ref.json()
        if path == "/generate":
            a, b = (a if isinstance(a, list) else [a]), (b if isinstance(b, list) else [b])
            assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
            assert all("cached_tokens" in x["meta_info"] for x in a)
        else:
            assert [c.get("text", c.get("message")) for c in a["choices"]] == \
                   [c.get("text", c.get("message")) for c in b["choices"]]
            assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
            assert "cached_tokens" in a["usage"]["prompt_tokens_details"]
    # Errors are the worker's, passed through.
    bad = client.post("/v1/completions", json={"prompt": "x", "max_tokens": -3})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    garbage = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert garbage.status_code == 400 and "error" in garbage.json()
    direct.close()


def test_streams_pass_through_chunk_by_chunk(client):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
            "temperature": 0}
    full = client.post("/v1/chat/completions", json=body).json()
    chunks = []
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    chunks = sse(text)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == full["choices"][0]["message"]["content"]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    # Completions and native streams too.
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}) as r:
        parts = sse("".join(r.iter_text()))
    assert parts[-1]["choices"][0]["finish_reason"] == "length"
    with client.stream("POST", "/generate",
                       json={"text": "abc", "stream": True, "sampling_params": {"max_new_tokens": 4}}) as r:
        parts = sse("".join(r.iter_text()))
    assert len(parts[-1]["output_ids"]) == 4


def test_cached_tokens_come_from_the_worker_and_follow_the_prefix(router, client):
    rng = random.Random(5)
    prefix = [rng.randrange(10, 500) for _ in range(120)]
    before = router.call(lambda rt: [w.routed for w in rt.workers])
    outs = [client.post("/generate", json={"input_ids": prefix + [rng.randrange(10, 500) for _ in range(5)],
                                           "sampling_params": {"max_new_tokens": 2}}).json()
            for _ in range(4)]
    after = router.call(lambda rt: [w.routed for w in rt.workers])
    moved = [a - b for a, b in zip(after, before)]
    assert sorted(moved) == [0, 0, 4]  # one worker took the whole prefix family
    assert outs[0]["meta_info"]["cached_tokens"] < 120
    assert all(o["meta_info"]["cached_tokens"] >= 120 for o in outs[1:])


def test_other_endpoints(workers, router, client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-random"
    assert client.get("/get_model_info").json()["model_path"] == "tiny-random"
    info = client.get("/model_info").json()
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert "max_total_num_tokens" in client.get("/server_info").json()
    assert client.post("/abort_request", json={"rid": "nope"}).json() == {"success": False}
    missing = client.get("/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # /metrics: the workers' counters summed, plus the router's own series.
    client.post("/v1/completions", json={"prompt": "count me", "max_tokens": 2})
    text = client.get("/metrics").text

    def value(t: str, name: str) -> float:
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in t.splitlines() if ln.startswith(name + " "))

    per_worker = [httpx.get(w.url + "/metrics").text for w in workers]
    assert value(text, "radixserve_prompt_tokens_total") == \
        sum(value(t, "radixserve_prompt_tokens_total") for t in per_worker)
    assert value(text, "radixserve_router_requests_total") >= 1
    assert "radixserve_router_mirror_synced{" in text
    # /flush_cache reaches every worker, and the mirrors hear of it.
    assert client.post("/flush_cache").status_code == 200
    wait_for(lambda: router.call(lambda rt: sum(w.mirror.held_tokens() for w in rt.workers)) == 0,
             10, "empty mirrors")


def test_greedy_outputs_equal_a_single_engine(tiny_loaded, client):
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    rng = random.Random(11)
    shared = [rng.randrange(10, 500) for _ in range(40)]
    prompts = [shared[: rng.randint(5, 40)] + [rng.randrange(10, 500) for _ in range(rng.randint(1, 10))]
               for _ in range(12)]

    def one(p):
        with httpx.Client(base_url=client.base_url, timeout=60) as c:
            return c.post("/generate", json={"input_ids": p, "sampling_params":
                                             {"max_new_tokens": 8, "temperature": 0}}).json()["output_ids"]

    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(one, prompts))
    eng = Engine(tiny_loaded, kv_cache_tokens=4096, dtype="float32")
    want = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    assert got == want


def test_mirrors_equal_worker_trees_after_a_random_run_with_evictions(workers, router, client):
    rng = random.Random(3)
    systems = [[rng.randrange(10, 500) for _ in range(rng.randint(60, 140))] for _ in range(8)]
    reqs = []
    for i in range(60):
        p = rng.choice(systems) + [rng.randrange(10, 500) for _ in range(rng.randint(3, 40))]
        reqs.append({"input_ids": p, "sampling_params": {"max_new_tokens": rng.randint(1, 12)},
                     "stream": rng.random() < 0.3})

    def one(body):
        with httpx.Client(base_url=client.base_url, timeout=60) as c:
            r = c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return r

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, reqs))
    evicted = 0
    for i, w in enumerate(workers):
        snap = fetch_snapshot(w.events)
        wait_for(lambda: router.call(lambda rt: rt.workers[i].mirror.status.seq) >= snap.seq, 10,
                 f"mirror {i} caught up")
        mirror = router.call(lambda rt: rt.workers[i].mirror.tree("L1").leaf_paths())
        assert mirror == leaf_paths_of_events(snap.events).get("L1", set())
        assert router.call(lambda rt: rt.workers[i].mirror.status.mismatches) == 0
        stats = httpx.get(w.url + "/server_info").json()["stats"]
        evicted += stats["evicted_tokens"]
        assert httpx.get(w.url + "/debug/integrity").status_code == 200
    assert evicted > 0  # the run did exercise evictions
