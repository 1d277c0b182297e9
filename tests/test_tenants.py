"""Tenants bound to API keys never see each other: no shared cache, no request ids, no counters."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import pytest

from radixserve import Engine
from radixserve.config import ServerConfig
from radixserve.server.auth import KeyRing, Principal, cache_salt, parse_key_lines
from server_utils import running_server

A, B, ADMIN = "key-a", "key-b", "admin-secret"


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _gen(url: str, key: str, ids: list[int], **kw: object) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0}, **kw}
    r = httpx.post(url + "/generate", json=body, headers=_h(key), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text(f"# tenants\n{A}:alice\n\n{B}:bob\n")
    engine = Engine("tiny-random", dtype="float32", kv_cache_tokens=8192)
    cfg = ServerConfig(api_key_file=str(keyfile), admin_key=ADMIN, log_level="warning")
    with running_server(engine=engine, server=cfg) as (url, handle):
        yield url, handle


def test_probe_of_another_tenants_prompt_gets_nothing(server) -> None:
    url, handle = server
    rng = random.Random(3)
    secret = [rng.randrange(3, 500) for _ in range(40)]
    _gen(url, A, secret)
    # Alice's own probe hits (the side channel exists within a tenant, by design) ...
    assert _gen(url, A, secret[:30] + [7])["meta_info"]["cached_tokens"] == 30
    # ... Bob's never does, at any position, with the right next token or a wrong one (each
    # probe in a fresh namespace of Bob's, so his own probes cannot hit each other).
    body = {"model": "tiny-random", "prompt": secret, "max_tokens": 1, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, headers=_h(B), timeout=30).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for k in range(1, 40, 3):
        for nxt in (secret[k], (secret[k] + 1) % 500):
            got = _gen(url, B, secret[:k] + [nxt], cache_salt=f"p{k}-{nxt}")["meta_info"]["cached_tokens"]
            assert got == 0, (k, got)
    # Alice with another cache_salt is another namespace too.
    assert _gen(url, A, secret[:30] + [7], cache_salt="other")["meta_info"]["cached_tokens"] == 0
    r = httpx.post(url + "/v1/completions", json=body, headers=_h(A), timeout=30).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 39


def test_cannot_abort_or_observe_another_tenants_request(server) -> None:
    url, handle = server
    body = {"text": "long", "rid": "job-1", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    done: dict[str, object] = {}

    def alice() -> None:
        last = None
        with httpx.stream("POST", url + "/generate", json=body, headers=_h(A), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    last = line
        done["last"] = last

    t = threading.Thread(target=alice)
    t.start()
    time.sleep(0.3)
    # Bob reusing the id is fine (his own namespace); aborting it does not reach Alice's.
    r = httpx.post(url + "/abort_request", json={"rid": "job-1"}, headers=_h(B), timeout=10)
    assert r.status_code == 200 and r.json() == {"success": False}
    bob = _gen(url, B, [5, 6, 7], rid="job-1")
    assert bob["meta_info"]["id"] == "job-1"
    # Bob cannot flush, read the metrics or the server's stats.
    for method, path in (("POST", "/flush_cache"), ("GET", "/metrics"), ("GET", "/server_info")):
        assert httpx.request(method, url + path, headers=_h(B), timeout=10).status_code == 403
    t.join(60)
    assert '"type": "length"' in str(done["last"]), done["last"]
    # Alice can abort her own; the admin can abort anyone's.
    t = threading.Thread(target=alice)
    t.start()
    time.sleep(0.3)
    r = httpx.post(url + "/abort_request", json={"rid": "job-1"}, headers=_h(ADMIN), timeout=10)
    assert r.json() == {"success": True}
    t.join(60)
    assert '"abort"' in str(done["last"])


def test_per_tenant_metrics_add_up_to_totals(server) -> None:
    url, handle = server
    for key in (A, B, A):
        _gen(url, key, list(range(10, 60)))
    handle.wait_idle()
    assert httpx.get(url + "/metrics", timeout=10).status_code == 401
    text = httpx.get(url + "/metrics", headers=_h(ADMIN), timeout=10).text

    def by_tenant(name: str) -> dict[str, float]:
        return {m.group(1): float(m.group(2)) for m in
                re.finditer(rf'^{name}\{{tenant="([^"]+)"\}} ([0-9.e+]+)$', text, re.M)}

    cached = by_tenant("radixserve_cached_prompt_tokens_total")
    prompt = by_tenant("radixserve_prompt_tokens_total")
    assert {"alice", "bob"} <= set(cached)
    total_hit = float(re.search(r"^radixserve_prefix_cache_hit_tokens_total ([0-9.e+]+)$", text, re.M).group(1))
    total_query = float(re.search(r"^radixserve_prefix_cache_query_tokens_total ([0-9.e+]+)$", text, re.M).group(1))
    assert sum(cached.values()) == total_hit
    assert sum(prompt.values()) == total_query


def test_keys_and_salts() -> None:
    assert parse_key_lines(["k1:t1", "# c", "", "k2"], "x")[0] == ("k1", "t1")
    assert parse_key_lines(["k2"], "x")[0][1].startswith("key-")
    with pytest.raises(ValueError, match="line 1"):
        parse_key_lines([":t"], "keys.txt")
    with pytest.raises(ValueError, match="api_key must not be empty"):
        ServerConfig(api_key=("",))
    ring = KeyRing(["k1:t1", "k2:t2"], admin_key="adm")
    assert ring.authenticate(b"k1") == Principal("t1")
    assert ring.authenticate(b"adm").admin and ring.authenticate(b"nope") is None
    # Salts: per tenant, narrowed by the request's; None only when open and unsalted.
    assert cache_salt(Principal(None), None) is None
    salts = {cache_salt(Principal(t), s) for t in ("t1", "t2", None) for s in (None, "x")} - {None}
    assert len(salts) == 5


def test_hide_cached_tokens() -> None:
    engine = Engine("tiny-random", dtype="float32", kv_cache_tokens=4096)
    with running_server(engine=engine, server=ServerConfig(hide_cached_tokens=True)) as (url, _):
        ids = list(range(10, 60))
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": ids,
                                                          "max_tokens": 1}, timeout=30).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        m = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}},
                       timeout=30).json()["meta_info"]
        assert m["cached_tokens"] == 0
