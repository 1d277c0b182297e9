"""Routing policies over real Worker objects whose mirrors are fed real cache events."""

from __future__ import annotations

import pytest

from radixserve.cache.events import CLEARED, REMOVED, STORED, CacheEvent
from radixserve.kv_events import Snapshot
from radixserve.placement.config import RouterConfig
from radixserve.placement.mirror import pack
from radixserve.placement.policies import NOTHING_LOW, RouteRequest, make_policy
from radixserve.placement.worker import Ticket, Worker


def workers(n: int, events: bool = True) -> list[Worker]:
    ws = []
    for i in range(n):
        w = Worker(i, f"http://w{i}", f"tcp://127.0.0.1:{5000 + i}" if events else None)
        w.healthy = True
        if w.mirror is not None:
            w.mirror.apply_message(Snapshot(f"w{i}", 1, 0, 1, 0.0, [], None))
        ws.append(w)
    return ws


def hold(w: Worker, toks: list[int], salt=None, tier: str = "L1") -> None:
    assert w.mirror.apply_event(CacheEvent(STORED, salt, pack(toks), len(toks), tier))


def cfg(n: int, **kw) -> RouterConfig:
    return RouterConfig(workers=tuple(f"http://w{i}" for i in range(n)), **kw)


def req(toks, salt=None) -> RouteRequest:
    return RouteRequest(pack(toks), salt)


def busy(w: Worker, k: int, tokens: int = 0) -> None:
    for _ in range(k):
        w.begin(Ticket(w, b"", None, tokens, 0))


def test_cache_aware_follows_the_mirror():
    ws = workers(3)
    p = make_policy(cfg(3))
    prefix = list(range(100))
    hold(ws[2], prefix)
    c = p.choose(req(prefix + [7, 8]), ws)
    assert c.worker is ws[2] and c.cached_tokens == 100 and c.compute_tokens == 2
    # A salted request only sees its own namespace.
    c = p.choose(req(prefix + [7, 8], salt="tenant"), ws)
    assert c.cached_tokens == 0
    hold(ws[1], prefix[:50], salt="tenant")
    assert p.choose(req(prefix, salt="tenant"), ws).worker is ws[1]


def test_cache_aware_in_flight_prompts_count_before_events():
    ws = workers(2)
    p = make_policy(cfg(2))
    a = list(range(200, 300))
    first = p.choose(req(a + [1]), ws)
    first.worker.begin(Ticket(first.worker, pack(a + [1]), None, 101, 0))
    # Same prefix, nothing confirmed by events yet: still the same worker.
    second = p.choose(req(a + [2]), ws)
    assert second.worker is first.worker and second.cached_tokens == 100


def route(p, toks, ws, salt=None) -> Worker:
    """What the router's pick does: choose, count in flight, record the placement."""
    r = req(toks, salt)
    c = p.choose(r, ws)
    c.worker.begin(Ticket(c.worker, r.tokens, salt, c.compute_tokens, c.cached_tokens), c.new_prefix)
    p.placed(r, c.worker)
    return c.worker


def finish(w: Worker) -> None:
    for t in list(w.tickets):
        w.end(t)


def evict(w: Worker, toks: list[int], salt=None) -> None:
    assert w.mirror.apply_event(CacheEvent(REMOVED, salt, pack(toks), len(toks), "L1"))


def test_cache_aware_a_family_stays_where_it_went_before_its_events_arrive():
    """A request ends (the response is out) before the worker's events say it holds the
    prompt: the family's next request must still go there, not be dealt out as new."""
    ws = workers(2)
    p = make_policy(cfg(2))
    for k in range(6):
        system = [10 + k] * 48
        first = route(p, system + [1, 2, 3], ws)
        finish(first)  # no event yet: both mirrors hold nothing of it
        for q in range(3):
            w = route(p, system + [4 + q] * 5, ws)
            assert w is first, (k, q)
            finish(w)


def test_cache_aware_an_evicted_family_goes_home_not_to_the_least_loaded():
    ws = workers(2)
    p = make_policy(cfg(2))
    fam = list(range(200, 300))
    home = route(p, fam + [1], ws)
    finish(home)
    hold(home, fam + [1])
    other = ws[1 - home.index]
    busy(home, 2, tokens=50)  # home is a bit busier ...
    evict(home, fam + [1])  # ... and its cache no longer holds the family
    assert route(p, fam + [2], ws) is home
    finish(home)
    # With affinity off it is dealt out as a new prefix (the other worker started none).
    p0 = make_policy(cfg(2, affinity_weight=0.0))
    assert route(p0, fam + [3], ws) is other


def test_cache_aware_what_is_held_beats_where_a_family_lived():
    ws = workers(2)
    p = make_policy(cfg(2))
    fam = list(range(300, 400))
    home = route(p, fam + [1], ws)
    finish(home)
    other = ws[1 - home.index]
    hold(other, fam)  # e.g. after a failover: the other worker holds it now, home does not
    assert route(p, fam + [2], ws) is other


def test_cache_aware_affinity_fades():
    ws = workers(2)
    p = make_policy(cfg(2, affinity_half_life=2.0))
    fam = list(range(400, 500))
    home = route(p, fam + [1], ws)
    finish(home)
    for k in range(6):  # other traffic: the family's pull halves every 2 requests
        finish(route(p, [600 + k] * 30, ws))
    busy(home, 1)
    assert route(p, fam + [2], ws) is not home  # a new prefix again: the idle worker


def test_cache_aware_no_locality_spreads_by_load_then_room():
    ws = workers(3)
    p = make_policy(cfg(3))
    hold(ws[0], list(range(1000, 1400)))
    busy(ws[1], 1)
    # Nothing shared: least loaded (0 and 2 are idle), then the one holding less (2).
    assert p.choose(req([5, 6, 7]), ws).worker is ws[2]


def test_cache_aware_a_prefix_everyone_shares_does_not_attract_everything():
    """A short system line every request starts with, held by one worker: the queue term
    moves requests to the others, which then hold the line too, and from then on it is no
    reason to prefer anyone (SGLang's router, with no queue term, sends them all to the
    first worker: ``queue_weight=0`` here)."""

    def run(**kw) -> list:
        ws = workers(4)
        p = make_policy(cfg(4, balance_abs_threshold=1000, **kw))
        system = list(range(10))
        hold(ws[0], system)
        got = []
        for k in range(16):
            toks = system + [100 + k] * 20
            c = p.choose(req(toks), ws)
            c.worker.begin(Ticket(c.worker, pack(toks), None, c.compute_tokens, c.cached_tokens),
                           c.new_prefix)
            got.append(c.worker.index)
        return [got.count(i) for i in range(4)]

    spread = run()
    assert min(spread) >= 3 and max(spread) <= 5, spread
    assert run(queue_weight=0.0) == [16, 0, 0, 0]


def test_cache_aware_load_wins_when_imbalanced():
    ws = workers(2)
    p = make_policy(cfg(2, balance_abs_threshold=4, balance_rel_threshold=1.5))
    prefix = list(range(60))
    hold(ws[0], prefix)
    busy(ws[0], 4)
    assert p.choose(req(prefix + [1]), ws).worker is ws[0]  # spread 4: not above the threshold
    busy(ws[0], 1)
    assert p.choose(req(prefix + [1]), ws).worker is ws[1]


def test_cache_aware_queue_term():
    ws = workers(2)
    p = make_policy(cfg(2, queue_weight=1.0, balance_abs_threshold=1000))
    prefix = list(range(40))
    hold(ws[0], prefix)
    busy(ws[0], 1, tokens=30)
    assert p.choose(req(prefix + [1, 2]), ws).worker is ws[0]  # 2 + 30 < 42
    busy(ws[0], 1, tokens=20)
    assert p.choose(req(prefix + [1, 2]), ws).worker is ws[1]  # 2 + 50 > 42


def test_cache_aware_prices_tiers():
    ws = workers(3)
    p = make_policy(cfg(3, tier_load_cost=0.1))
    prefix = list(range(100))
    hold(ws[0], prefix[:30])
    hold(ws[1], prefix, tier="L2")  # held on the host: a load, not a recompute
    c = p.choose(req(prefix), ws)
    assert c.worker is ws[1] and c.compute_tokens == 0 and c.cached_tokens == 100
    hold(ws[2], prefix)
    assert p.choose(req(prefix), ws).worker is ws[2]


def test_cache_aware_a_family_stays_home_while_a_mirror_resyncs():
    """Right after the server starts, or while a worker's mirror rebuilds, holdings are
    unknown: families still go where they were sent, not wherever load says."""
    ws = workers(2)
    ws[1].mirror.invalidate()
    p = make_policy(cfg(2))
    for k in range(4):
        fam = [40 + k] * 40
        first = route(p, fam + [1], ws)
        finish(first)
        for q in range(3):
            w = route(p, fam + [2 + q], ws)
            assert w is first, (k, q)
            finish(w)


def test_cache_aware_stale_mirror_routes_by_load():
    ws = workers(2)
    p = make_policy(cfg(2))
    prefix = list(range(50))
    hold(ws[0], prefix)
    busy(ws[0], 1)
    ws[1].mirror.invalidate()
    assert p.choose(req(prefix), ws).worker is ws[1]


def placed(p, toks, ws, salt=None, keep=True):
    """``route``, returning the whole choice; with ``keep`` the worker then caches the prompt
    (its mirror gets the event), as one whose pool has room."""
    r = req(toks, salt)
    c = p.choose(r, ws)
    c.worker.begin(Ticket(c.worker, r.tokens, salt, c.compute_tokens, c.cached_tokens), c.new_prefix)
    p.placed(r, c.worker)
    finish(c.worker)
    if keep:
        had = c.worker.mirror.match(r.tokens, salt).get("L1", 0)
        assert c.worker.mirror.apply_event(CacheEvent(STORED, salt, r.tokens, len(toks) - had))
    return c


def test_cache_aware_a_family_member_keeps_its_own_question_at_low_priority():
    """16 tenants' system prompts, each taking turns with a question of its own: the first
    request of a tenant is all new (nothing low: what its family will share is unknown), every
    later one asks for its question, past the shared system prompt, to be evicted first."""
    ws = workers(2)
    p = make_policy(cfg(2))
    systems = [[1] + [100 + t] * 40 for t in range(16)]  # one shared first token, as a BOS
    for turn in range(3):
        for t, system in enumerate(systems):
            c = placed(p, system + [1000 + 16 * turn + t] * 8, ws)
            assert c.low_priority_from == (NOTHING_LOW if turn == 0 else 41), (turn, t)


def test_cache_aware_a_continuation_is_kept_whole():
    """A conversation's next turn continues the previous prompt, and the turn after will
    continue this one: nothing is asked to go first. Nor for a branch of a tree of thought
    (its parent's prompt is a whole prefix of it), nor for a repeat."""
    ws = workers(2)
    p = make_policy(cfg(2))
    conv = list(range(500, 540))
    for turn in range(4):
        assert placed(p, conv, ws).low_priority_from == NOTHING_LOW
        conv = conv + [900 + turn] * 12
    parent = list(range(2000, 2060))
    placed(p, parent, ws)
    for b in range(3):
        assert placed(p, parent + [3000 + b, 7, 7], ws).low_priority_from == NOTHING_LOW
    assert placed(p, parent + [3000, 7, 7], ws).low_priority_from == NOTHING_LOW  # a repeat


def test_cache_aware_shares_below_the_threshold_are_a_new_family():
    ws = workers(2)
    p = make_policy(cfg(2, cache_threshold=0.5))
    placed(p, [1] * 10 + [2] * 30, ws)
    assert placed(p, [1] * 10 + [3] * 30, ws).low_priority_from == NOTHING_LOW  # 10 of 40 shared
    assert placed(p, [1] * 10 + [3] * 20 + [4] * 10, ws).low_priority_from == 30


def test_cache_aware_forgets_on_a_flush():
    """After the workers' caches are flushed nothing routed before is held anywhere: a prompt
    sent again is not a repeat (kept whole) but a family member like any other."""
    ws = workers(2)
    p = make_policy(cfg(2))
    system = [1] + [100] * 40
    for q in (7, 8):
        placed(p, system + [q] * 8, ws)
    assert placed(p, system + [8] * 8, ws).low_priority_from == NOTHING_LOW  # a repeat
    p.forget()
    for w in ws:
        w.mirror.apply_event(CacheEvent(CLEARED, None, b"", 0))
    assert p.state() == {"affinity_tokens": 0}
    assert placed(p, system + [7] * 8, ws).low_priority_from == NOTHING_LOW  # all new again
    assert placed(p, system + [8] * 8, ws).low_priority_from == 41


def test_cache_aware_low_priority_tails_can_be_turned_off():
    ws = workers(2)
    p = make_policy(cfg(2, low_priority_tails=False, affinity_weight=0.0))
    system = [7] * 40
    placed(p, system + [1] * 5, ws)
    assert placed(p, system + [2] * 5, ws).low_priority_from is None


def test_round_robin_and_shortest_queue():
    ws = workers(3, events=False)
    rr = make_policy(cfg(3, policy="round_robin"))
    assert [rr.choose(req([1]), ws).worker.index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    sq = make_policy(cfg(3, policy="shortest_queue"))
    busy(ws[0], 2)
    busy(ws[1], 1)
    assert sq.choose(req([1]), ws).worker is ws[2]


def test_prefix_hash_is_consistent():
    ws = workers(4, events=False)
    p = make_policy(cfg(4, policy="prefix_hash", prefix_hash_tokens=8))
    keys = [list(range(k, k + 8)) for k in range(0, 400, 8)]
    owner = {tuple(k): p.choose(req(k + [99, k[0]]), ws).worker.index for k in keys}
    assert len(set(owner.values())) == 4  # spread over every worker
    # Only the first 8 tokens count.
    assert all(p.choose(req(list(k) + [1, 2, 3]), ws).worker.index == o for k, o in owner.items())
    # A worker leaving moves only its own keys.
    rest = [w for w in ws if w.index != 1]
    for k, o in owner.items():
        now = p.choose(req(list(k)), rest).worker.index
        assert now == o or o == 1


def test_random_is_seeded():
    ws = workers(4, events=False)
    a = make_policy(cfg(4, policy="random", seed=3))
    b = make_policy(cfg(4, policy="random", seed=3))
    assert [a.choose(req([1]), ws).worker.index for _ in range(20)] == \
           [b.choose(req([1]), ws).worker.index for _ in range(20)]


@pytest.mark.parametrize("kw,field", [
    ({"workers": ()}, "workers"),
    ({"workers": ("ftp://x",)}, "workers"),
    ({"workers": ("http://a",), "worker_events": ("tcp://a:1", "tcp://b:2")}, "worker_events"),
    ({"workers": ("http://a",), "policy": "best"}, "policy"),
    ({"workers": ("http://a",), "cache_threshold": 1.5}, "cache_threshold"),
    ({"workers": ("http://a",), "balance_rel_threshold": 0.5}, "balance_rel_threshold"),
    ({"workers": ("http://a",), "max_retries": -1}, "max_retries"),
    ({"workers": ("http://a",), "affinity_weight": -1.0}, "affinity_weight"),
    ({"workers": ("http://a",), "affinity_half_life": 0.0}, "affinity_half_life"),
    ({"workers": ("http://a",), "affinity_max_tokens": 0}, "affinity_max_tokens"),
    ({"workers": ("http://a",), "low_priority_tails": 1}, "low_priority_tails"),
    ({"workers": ("http://a",), "api_key": ("",)}, "api_key"),
    ({"workers": ("http://a",), "api_key_file": "/nonexistent/keys"}, "api_key_file"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kw)
