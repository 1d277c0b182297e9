"""The router under memory pressure, in front of real tiny-random workers.

Eight tenants' 40-token system prompts take turns with a question of their own, one request
at a time, on two workers whose pools hold each worker's four prompts but not also the
questions. The router keeps each tenant on one worker; with its low-priority hint the
workers evict questions before prompts, and from the third round on every request finds
its whole system prompt. Without the hint (``low_priority_tails=False``: plain LRU, what
any other router gets from these workers) some prompts go with their questions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from router_workers import running_router, running_workers, tenant_turns, wait_for

KV = 192
SYSTEM = 40


@pytest.fixture(scope="module")
def workers():
    with running_workers(2, kv_cache_tokens=KV) as ws:
        yield ws


@contextmanager
def synced_router(workers, tails: bool) -> Iterator:
    """A router in front of the emptied workers, once its mirrors are in sync."""
    for w in workers:
        assert httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200
    with running_router([w.url for w in workers], [w.events for w in workers],
                        health_interval_s=0.2, low_priority_tails=tails) as r:
        wait_for(lambda: r.call(lambda rt: all(w.mirror.synced and w.healthy for w in rt.workers)),
                 30, "mirrors in sync")
        yield r


def run_rounds(url: str, headers: dict | None = None) -> list[list[int]]:
    """Hits per request, per round (requests one at a time)."""
    out = []
    with httpx.Client(base_url=url, timeout=60, headers=headers) as c:
        for prompts in tenant_turns(system=SYSTEM):
            hits = []
            for ids in prompts:
                body = {"input_ids": ids,
                        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
                resp = c.post("/generate", json=body)
                assert resp.status_code == 200, resp.text
                hits.append(resp.json()["meta_info"]["cached_tokens"])
            out.append(hits)
    return out


@pytest.mark.parametrize("tails", [True, False])
def test_questions_go_before_system_prompts(workers, tails):
    with synced_router(workers, tails) as r:
        hits = run_rounds(r.url)
        split = r.call(lambda rt: [w.routed for w in rt.workers])
    assert split == [16, 16]  # four tenants each, every request at home
    later = hits[2] + hits[3]
    if tails:
        assert later == [SYSTEM] * 16, hits
    else:
        assert min(later) < SYSTEM, hits


def test_a_clients_own_hint_goes_through_and_a_bad_one_is_refused(workers):
    with synced_router(workers, False) as r:
        # The client says where its own questions start: the router passes that on.
        hits = run_rounds(r.url, {"X-Cache-Low-Priority-From": str(SYSTEM)})
        assert hits[2] + hits[3] == [SYSTEM] * 16, hits
        bads = ("-1", "x", "1.5", "", "+1", "1_0", "\u00b2", str(1 << 63))
        for url in (r.url, workers[0].url):  # through the router, and a worker's own check
            for bad in bads:
                resp = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3]},
                                  headers={"X-Cache-Low-Priority-From": bad.encode()}, timeout=30)
                assert resp.status_code == 400, (bad, resp.text)
                err = resp.json()["error"]
                assert err["param"] == "X-Cache-Low-Priority-From", err
                assert "X-Cache-Low-Priority-From" in err["message"] and err["type"], err
            resp = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1},
                              headers={"X-Cache-Low-Priority-From": "x"}, timeout=30)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-Cache-Low-Priority-From"
            resp = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3],
                                                       "sampling_params": {"max_new_tokens": 1}},
                              headers={"X-Cache-Low-Priority-From": str((1 << 63) - 1)}, timeout=30)
            assert resp.status_code == 200, resp.text  # past the prompt: lowers nothing
