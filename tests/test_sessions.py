"""Sessions: a conversation's cached tokens (for a hybrid model, its sliding window) stay
servable between turns while other traffic presses on the SWA pool; the lock a session
holds goes on its next turn, TTL expiry, close, the session bound, memory pressure and
flush, and never leaks (the scheduler's integrity check counts every lock).

The tiny Gemma 3 (window 12) runs with a full pool far larger than its SWA pool, so it is
the SWA budget that unrelated requests exhaust: without a session the previous turn's
window is tombstoned and the next turn misses; with one, it hits the whole conversation.
Greedy outputs equal the no-cache run either way (free SWA slots are NaN-poisoned).
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.model.registry import LoadedModel
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict

from server_utils import running_server

TURN = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tiny_loaded) -> LoadedModel:
    cfg = tiny_random_config("gemma3")
    return LoadedModel(cfg, tiny_random_state_dict(seed=0, config=cfg), tiny_loaded.tokenizer, "tiny-gemma3")


def _poison_free_swa(eng: Engine) -> None:
    alloc, pool = eng.core.allocator, eng.core.runner.kv_pool
    used = torch.zeros(alloc.swa.capacity + 1, dtype=torch.bool)
    m = alloc.swa_map[: alloc.capacity]
    used[m[m >= 0]] = True
    used[alloc.swa.capacity] = True
    pool.swa.kv[:, :, ~used] = float("nan")


def _hybrid(gemma: LoadedModel, **kw) -> Engine:
    opts = dict(cache="radix", kv_cache_tokens=4096, swa_kv_cache_tokens=160, dtype="float32")
    opts.update(kw)
    return Engine(gemma, **opts)


def _conversations(eng: Engine, sessions: bool, n: int = 3, turns: int = 3, seed: int = 0,
                   poison: bool = False):
    """``n`` conversations of ``turns`` turns, each turn followed by two unrelated 40-token
    requests (more than the SWA pool keeps beside them). Returns per turn
    ``(conversation, turn, cached tokens, tokens of the previous turn with KV, output ids)``."""
    rng = random.Random(seed)
    convs = [[rng.randrange(3, 500) for _ in range(30)] for _ in range(n)]
    prev = [0] * n
    ps = eng.config.page_size
    out = []
    for t in range(turns):
        for c in range(n):
            if poison:
                _poison_free_swa(eng)
                eng.core.step_hooks.append(lambda: _poison_free_swa(eng))
            o = eng.generate([convs[c]], TURN, session_id=f"conv-{c}" if sessions else None)[0]
            eng.core.step_hooks.clear()
            eng.check_integrity()
            out.append((c, t, o.cached_tokens, prev[c], o.token_ids))
            prev[c] = (len(convs[c]) + len(o.token_ids) - 1) // ps * ps  # the last token has no KV
            convs[c] = convs[c] + o.token_ids + [rng.randrange(3, 500) for _ in range(10)]
            eng.generate([[rng.randrange(3, 500) for _ in range(40)] for _ in range(2)], TURN)
            eng.check_integrity()
    return out


@pytest.mark.parametrize("page_size", [1, 4])
def test_sessions_keep_the_window_under_swa_pressure(gemma, page_size):
    ref = _conversations(_hybrid(gemma, cache="none", swa_kv_cache_tokens=512, page_size=page_size), False)
    with_s = _hybrid(gemma, page_size=page_size)
    a = _conversations(with_s, True, poison=True)
    b = _conversations(_hybrid(gemma, page_size=page_size), False, poison=True)
    assert [r[4] for r in a] == [r[4] for r in ref] == [r[4] for r in b]
    later = [(x, y) for x, y in zip(a, b) if x[1] > 0]
    assert all(x[2] == x[3] for x, _ in later), [(x[2], x[3]) for x, _ in later]  # the whole conversation
    assert sum(y[2] for _, y in later) < sum(x[3] for x, _ in later) // 2  # without: most of it missed
    st = with_s.stats()
    assert st["sessions_open"] == 3 and st["sessions_holding"] == 3 and st["sessions_shed"] == 0
    assert with_s.cache.swa_kv.tombstoned_tokens > 0  # the pressure was there
    # An idle engine protects exactly the sessions' paths (checked by check_integrity too).
    assert with_s.cache.protected_size == st["session_retained_tokens"]
    for c in range(3):
        assert with_s.close_session(f"conv-{c}")
    assert with_s.cache.protected_size == 0 and with_s.stats()["sessions_open"] == 0
    with_s.check_integrity()


def test_ttl_expiry_releases_the_lock(gemma):
    eng = _hybrid(gemma, session_ttl_s=60.0)
    now = [1000.0]
    table = eng.scheduler.sessions
    table.clock = lambda: now[0]
    prompt = [5 + i % 400 for i in range(30)]
    eng.generate([prompt], TURN, session_id="a")
    assert table.held_tokens("a") == 30 + 7 and eng.cache.protected_size == 37
    now[0] += 59.0
    eng.generate([[7] * 20], TURN)  # a step: not expired yet
    assert "a" in table and table.held_tokens("a") == 37
    now[0] += 2.0
    eng.generate([[9] * 20], TURN)  # the next step's schedule() expires it
    assert "a" not in table and eng.cache.protected_size == 0
    assert eng.stats()["sessions_expired"] == 1
    eng.check_integrity()
    # A session opened with its own timeout uses it.
    assert eng.open_session("b", ttl_s=5.0) and not eng.open_session("b")
    eng.generate([prompt], TURN, session_id="b")
    now[0] += 6.0
    eng.generate([[11] * 20], TURN)
    assert "b" not in table and eng.cache.protected_size == 0
    eng.check_integrity()


def test_a_request_refreshes_its_sessions_ttl(gemma):
    eng = _hybrid(gemma, session_ttl_s=10.0)
    now = [0.0]
    eng.scheduler.sessions.clock = lambda: now[0]
    p = [5 + i % 400 for i in range(30)]
    o = eng.generate([p], TURN, session_id="s")[0]
    for _ in range(3):
        now[0] += 8.0
        p = p + o.token_ids + [3, 4, 5]
        rid = eng.add_request(p, TURN, session_id="s")  # the TTL starts again here
        now[0] += 5.0  # 13 s after the last turn, 5 after this one arrived
        o = next(x for x in eng.run_until_done() if x.request_id == rid)
        assert o.cached_tokens == len(p) - 3 - 1
    assert "s" in eng.scheduler.sessions
    eng.check_integrity()


def test_close_session_releases_and_in_flight_requests_keep_nothing(gemma):
    eng = _hybrid(gemma)
    prompt = [5 + i % 400 for i in range(30)]
    eng.generate([prompt], TURN, session_id="a")
    assert eng.cache.protected_size > 0
    assert eng.close_session("a") and not eng.close_session("a")
    assert eng.cache.protected_size == 0
    eng.check_integrity()
    # Closed while its next turn runs: the turn finishes, the session stays closed.
    rid = eng.add_request(prompt + [9, 9, 9], TURN, session_id="b")
    eng.step()
    eng.check_integrity()
    assert not eng.close_session("b")  # not open yet (nothing finished), but the request forgets it
    eng.run_until_done()
    assert "b" not in eng.scheduler.sessions and eng.cache.protected_size == 0
    assert rid not in eng.core.requests
    eng.check_integrity()


def test_max_sessions_evicts_the_least_recently_used(gemma):
    eng = _hybrid(gemma, max_sessions=2)
    for i in range(3):
        eng.generate([[5 + i] * 30], TURN, session_id=f"s{i}")
        eng.check_integrity()
    table = eng.scheduler.sessions
    assert "s0" not in table and "s1" in table and "s2" in table
    assert eng.stats()["sessions_evicted"] == 1
    assert eng.cache.protected_size == 2 * 37


def test_flush_releases_every_session_and_keeps_them_open(gemma):
    eng = _hybrid(gemma)
    for i in range(2):
        eng.generate([[5 + i] * 30], TURN, session_id=f"s{i}")
    assert eng.flush_cache()
    st = eng.stats()
    assert st["sessions_open"] == 2 and st["sessions_holding"] == 0 and st["cached_tokens"] == 0
    eng.check_integrity()
    eng.generate([[5] * 30], TURN, session_id="s0")  # holds again
    assert eng.stats()["sessions_holding"] == 1
    eng.check_integrity()


def test_aborts_and_failures_keep_the_last_finished_turn(gemma):
    eng = _hybrid(gemma)
    prompt = [5 + i % 400 for i in range(30)]
    eng.generate([prompt], TURN, session_id="a")
    table = eng.scheduler.sessions
    held = table.held_tokens("a")
    rid = eng.add_request(prompt + [1, 2, 3], TURN, session_id="a")
    eng.step()
    eng.step()
    eng.abort(rid)
    eng.run_until_done()
    assert table.held_tokens("a") == held
    eng.check_integrity()
    runner = eng.core.runner
    real_run = type(runner).run

    def fail(self, batch, *args):
        raise RuntimeError("boom")

    runner.run = fail.__get__(runner)
    out = eng.generate([prompt + [4, 5, 6]], TURN, session_id="a")[0]
    runner.run = real_run.__get__(runner)
    assert out.finish_reason == "error"
    assert table.held_tokens("a") == held
    eng.check_integrity()
    assert eng.close_session("a") and eng.cache.protected_size == 0
    eng.check_integrity()


def test_sessions_yield_to_requests_under_memory_pressure(tiny_loaded):
    """A plain radix cache: sessions keep whole conversations, but a request that needs the
    pool gets it (sessions are shed, least recently used first) instead of failing."""
    eng = Engine(tiny_loaded, kv_cache_tokens=160, dtype="float32", decode_reserve_ratio=0.0)
    for i in range(3):
        eng.generate([[5 + i] * 40], TURN, session_id=f"s{i}")
    assert eng.stats()["sessions_holding"] == 3 and eng.cache.protected_size == 3 * 47
    out = eng.generate([list(range(3, 123))], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    st = eng.stats()
    assert st["sessions_shed"] >= 2 and st["sessions_open"] == 3
    eng.check_integrity()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_sessions_aborts_and_retractions_leak_no_lock(tiny_loaded, seed):
    """Concurrent turns of many sessions in a small pool (evictions, retractions, sheds),
    random aborts and closes: the integrity check (every tree lock owned by a running
    request or a session) holds after every step, and outputs equal the no-cache run."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    eng = Engine(tiny_loaded, kv_cache_tokens=256, dtype="float32", decode_reserve_ratio=0.0,
                 page_size=1 + seed * 3, max_sessions=4)
    ref = Engine(tiny_loaded, cache="none", kv_cache_tokens=4096, dtype="float32")
    convs = {f"s{i}": [rng.randrange(3, 500) for _ in range(rng.randint(10, 40))] for i in range(6)}
    want: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    pending: dict[str, str] = {}
    for _ in range(120):
        if len(pending) < 6 and rng.random() < 0.6:
            sid = rng.choice(sorted(convs))
            if sid not in pending.values():
                if len(convs[sid]) > 120:  # a new conversation under the same id
                    convs[sid] = [rng.randrange(3, 500) for _ in range(20)]
                p = convs[sid] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 8))]
                convs[sid] = p
                rid = eng.add_request(p, params, session_id=sid)
                pending[rid] = sid
                want[rid] = ref.generate([p], params)[0].token_ids
        if pending and rng.random() < 0.05:
            eng.abort(rng.choice(list(pending)))  # insertion order: request ids are random
        if rng.random() < 0.03:
            eng.close_session(rng.choice(sorted(convs)))
        for o in eng.step():
            if o.finished:
                sid = pending.pop(o.request_id)
                if o.finish_reason == "length":
                    got[o.request_id] = o.token_ids
                    convs[sid] = convs[sid] + o.token_ids
        eng.check_integrity()
    for o in eng.run_until_done():
        if o.finish_reason == "length":
            got[o.request_id] = o.token_ids
        eng.check_integrity()
    assert got and all(got[r] == want[r] for r in got)
    st = eng.stats()
    assert st["retractions"] > 0 and st["evicted_tokens"] > 0
    assert st["sessions_retained_turns"] > 0


def test_bad_session_ids_and_options_are_refused(gemma, tiny_loaded):
    eng = Engine(tiny_loaded, kv_cache_tokens=512, dtype="float32")
    for bad in (123, "", "x" * 257, "a\nb"):
        with pytest.raises(ValueError, match="session_id"):
            eng.generate([[5] * 10], TURN, session_id=bad)
    assert not eng.core.requests and eng.stats()["sessions_open"] == 0
    with pytest.raises(ValueError, match="timeout"):
        eng.open_session("x", ttl_s=-1)
    with pytest.raises(ValueError, match="session_ttl_s"):
        EngineConfig(session_ttl_s=-1)
    with pytest.raises(ValueError, match="max_sessions"):
        EngineConfig(max_sessions=0)
    off = Engine(tiny_loaded, kv_cache_tokens=512, dtype="float32", session_ttl_s=0)
    off.generate([[5] * 10], TURN, session_id="ignored")
    assert off.stats()["sessions_open"] == 0 and off.cache.protected_size == 0
    with pytest.raises(ValueError, match="sessions are off"):
        off.open_session("x")


def test_http_session_ids(tiny_loaded):
    eng = Engine(tiny_loaded, kv_cache_tokens=2048, dtype="float32")
    with running_server(engine=eng) as (url, handle):
        prompt = list(range(3, 43))
        c = httpx.Client(base_url=url, timeout=60)
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = c.post("/v1/completions", json=body, headers={"X-Session-Id": "h1"})
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json={**body, "session_id": "b1"})
        assert r.status_code == 200, r.text
        chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
        r = c.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": "c1"})
        assert r.status_code == 200, r.text
        gen = {"input_ids": prompt + [9], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
               "session_params": {"id": "g1", "rid": None, "offset": None, "replace": None,
                                  "drop_previous_output": None}}
        r = c.post("/generate", json=gen)
        assert r.status_code == 200, r.text
        handle.wait_idle()
        st = handle.stats()
        assert st["sessions_open"] == 4 and st["sessions_holding"] == 4
        handle.check_integrity()
        # Refusals name the field.
        for path, payload, headers, param in [
            ("/v1/completions", {**body, "session_id": "a"}, {"X-Session-Id": "b"}, "session_id"),
            ("/v1/completions", {**body, "session_id": "x" * 300}, {}, "session_id"),
            ("/v1/completions", body, {"X-Session-Id": ""}, "X-Session-Id"),
            ("/generate", {**gen, "session_params": {"id": "g1", "rid": "r0"}}, {}, None),
            ("/generate", {**gen, "session_params": {"id": "g1", "offset": 5}}, {}, None),
            ("/generate", {**gen, "session_params": {"id": "g1", "bogus": 1}}, {}, None),
            ("/generate", {**gen, "session_params": {"id": 7}}, {}, None),
            ("/open_session", {"session_id": "o1", "timeout": -1}, {}, "timeout"),
        ]:
            r = c.post(path, json=payload, headers=headers)
            assert r.status_code == 400, (path, payload, r.text)
            err = r.json()["error"]
            assert "session" in err["message"].lower() or "timeout" in err["message"], err
            if param is not None:
                assert err["param"] == param, err
        # SGLang's open/close.
        r = c.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": "o1"})
        assert r.status_code == 200 and r.json() == "o1"
        assert c.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": "o1"}).status_code == 400
        gen_id = c.post("/open_session", json={"capacity_of_str_len": 1000}).json()
        assert isinstance(gen_id, str) and gen_id
        for sid in ("h1", "b1", "c1", "g1", "o1", gen_id):
            r = c.post("/close_session", json={"session_id": sid})
            assert r.status_code == 200 and r.json() == {"success": True}, (sid, r.text)
        assert c.post("/close_session", json={"session_id": "h1"}).json() == {"success": False}
        st = handle.stats()
        assert st["sessions_open"] == 0 and st["protected_tokens"] == 0
        handle.check_integrity()


def test_http_sessions_are_per_tenant(tiny_loaded):
    eng = Engine(tiny_loaded, kv_cache_tokens=2048, dtype="float32")
    with running_server(engine=eng, api_key=["ka:alice", "kb:bob"]) as (url, handle):
        c = httpx.Client(base_url=url, timeout=60)
        body = {"prompt": list(range(3, 33)), "max_tokens": 2, "temperature": 0}
        r = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer ka", "X-Session-Id": "s"})
        assert r.status_code == 200, r.text
        handle.wait_idle()
        r = c.post("/close_session", json={"session_id": "s"}, headers={"Authorization": "Bearer kb"})
        assert r.json() == {"success": False}  # bob's "s" is not alice's
        r = c.post("/close_session", json={"session_id": "s"}, headers={"Authorization": "Bearer ka"})
        assert r.json() == {"success": True}


def test_session_table_deadlines_with_mixed_ttls():
    """The table alone, over a plain radix cache: per-session TTLs expire in deadline order,
    refreshes push a deadline back, the deadline heap stays bounded."""
    from radixserve.cache import RadixCache
    from radixserve.sched.sessions import SessionTable

    cache = RadixCache()
    now = [0.0]
    t = SessionTable(cache, ttl_s=10.0, max_sessions=8, clock=lambda: now[0])
    for i in range(3):
        cache.insert(list(range(i * 100, i * 100 + 20)), list(range(i * 20, i * 20 + 20)))
    assert t.open("short", ttl_s=2.0)
    t.retain("short", list(range(0, 20)))
    t.retain("long", list(range(100, 120)))
    t.retain("mid", list(range(200, 220)))
    assert cache.protected_size == 60
    now[0] = 3.0
    assert t.expire() == 1 and "short" not in t and cache.protected_size == 40
    for _ in range(500):  # refreshes of one session: old deadlines go stale, the heap stays small
        now[0] += 0.01
        t.touch("mid")
    assert len(t._deadlines) <= 4 * len(t) + 64
    now[0] = 10.5
    assert t.expire() == 1 and "long" not in t and "mid" in t
    now[0] = 30.0
    assert t.expire() == 1 and len(t) == 0 and cache.protected_size == 0
    cache.check_integrity()
