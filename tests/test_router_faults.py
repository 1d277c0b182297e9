"""Workers failing under the router: killed mid-run, restarted, frozen.

No client may hang: non-streamed requests finish on the surviving worker, streams that had
started end with an error chunk and ``[DONE]``; a restarted worker rejoins with its mirror
rebuilt from a snapshot (a new epoch).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixserve.placement.mirror import leaf_paths_of_events
from router_workers import fetch_snapshot, running_router, running_workers, wait_for

TOKENS = 300  # long enough that the failure lands while requests run


@pytest.fixture(scope="module")
def setup():
    with running_workers(2, kv_cache_tokens=8192) as ws:
        with running_router([w.url for w in ws], [w.events for w in ws], health_interval_s=0.2,
                            health_timeout_s=0.5, health_failures=2, max_retries=2) as r:
            yield ws, r


def all_up(r) -> bool:
    return r.call(lambda rt: all(w.available() and w.mirror.synced for w in rt.workers))


def body(rng: random.Random, stream: bool) -> dict:
    ids = [rng.randrange(10, 500) for _ in range(rng.randint(5, 30))]
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}}


def send(url: str, b: dict) -> tuple:
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60.0)) as c:
        r = c.post("/generate", json=b)
        return r.status_code, r.text


def run_with_failure(r, fail) -> tuple:
    """Fire 12 plain + 4 streamed requests; once several run, ``fail(i)`` the worker with
    the most in flight. Returns ``(i, [(body, (status, text)), ...])``."""
    rng = random.Random(7)
    bodies = [body(rng, stream=i % 4 == 3) for i in range(16)]
    with ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(send, r.url, b) for b in bodies]
        wait_for(lambda: r.call(lambda rt: sum(w.outstanding for w in rt.workers)) >= 8, 20, "requests running")
        time.sleep(0.1)
        busy = r.call(lambda rt: [w.outstanding for w in rt.workers])
        i = busy.index(max(busy))
        fail(i)
        return i, [(b, f.result(timeout=90)) for b, f in zip(bodies, futs)]


def check_results(results) -> int:
    """Every request ended; returns how many streams were cut by the failure."""
    cut = 0
    for b, (status, text) in results:
        if not b["stream"]:
            assert status == 200, text
            assert len(json.loads(text)["output_ids"]) == TOKENS
            continue
        assert status == 200, text
        lines = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        last = json.loads(lines[-2])
        if "error" in last:
            assert last["error"]["type"] == "server_error"
            cut += 1
        else:
            assert len(last["output_ids"]) == TOKENS
    return cut


def test_killed_worker_requests_move_and_it_rejoins(setup):
    ws, r = setup
    wait_for(lambda: all_up(r), 30, "workers up")
    epochs = r.call(lambda rt: [w.mirror.status.epoch for w in rt.workers])
    k, results = run_with_failure(r, lambda i: ws[i].kill())
    check_results(results)
    st = r.call(lambda rt: rt.state())
    assert st["retries"] >= 1 and st["failed_requests"] == 0
    assert not st["workers"][k]["available"]
    assert httpx.get(r.url + "/health").status_code == 200  # the other worker still serves
    # Requests keep working while it is out.
    assert send(r.url, body(random.Random(1), False))[0] == 200
    ws[k].start()
    ws[k].wait_ready()
    wait_for(lambda: all_up(r), 30, f"worker {k} back")
    assert r.call(lambda rt: rt.workers[k].mirror.status.epoch) != epochs[k]  # rebuilt from a snapshot
    # It takes new prefixes again, and its mirror matches its real tree.
    rng = random.Random(2)
    for _ in range(6):
        b = body(rng, False)
        b["sampling_params"]["max_new_tokens"] = 4
        assert send(r.url, b)[0] == 200
    assert r.call(lambda rt: rt.workers[k].routed) > st["workers"][k]["routed"]
    snap = fetch_snapshot(ws[k].events)
    wait_for(lambda: r.call(lambda rt: rt.workers[k].mirror.status.seq) >= snap.seq, 10, "caught up")
    assert r.call(lambda rt: rt.workers[k].mirror.tree().leaf_paths()) == \
        leaf_paths_of_events(snap.events).get("L1", set())


def test_frozen_worker_is_taken_out_and_its_requests_move(setup):
    ws, r = setup
    wait_for(lambda: all_up(r), 30, "workers up")
    retries = r.call(lambda rt: rt.retries)
    frozen: list = []

    def freeze(i: int) -> None:
        os.kill(ws[i].proc.pid, signal.SIGSTOP)
        frozen.append(i)

    try:
        k, results = run_with_failure(r, freeze)
        check_results(results)
        assert not r.call(lambda rt: rt.workers[k].available())
        assert r.call(lambda rt: rt.retries) > retries  # its requests were moved, not waited for
    finally:
        for i in frozen:
            os.kill(ws[i].proc.pid, signal.SIGCONT)
    wait_for(lambda: all_up(r), 30, "worker back")


def test_timeout_is_not_retried(setup):
    """A request that times out may still run on its worker: answered 504, never sent twice."""
    ws, r = setup
    wait_for(lambda: all_up(r), 30, "workers up")
    with running_router([ws[0].url], [ws[0].events], health_interval_s=30.0,
                        request_timeout_s=1.0) as slow:
        wait_for(lambda: slow.call(lambda rt: rt.workers[0].available()), 10, "router up")
        os.kill(ws[0].proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            status, text = send(slow.url, body(random.Random(3), False))
            assert status == 504 and "timed out" in text
            assert time.monotonic() - t0 < 10
            assert slow.call(lambda rt: rt.retries) == 0
        finally:
            os.kill(ws[0].proc.pid, signal.SIGCONT)
    wait_for(lambda: all_up(r), 30, "worker back")
