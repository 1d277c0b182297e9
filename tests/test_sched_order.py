"""Cache-aware admission order with a bounded wait (tiny model): the order the scheduler
admits waiting requests in, for pure LPM, urgent requests (waited or passed over too often),
and overdue ones."""

from __future__ import annotations

import time

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.sched.policy import OVERDUE_FACTOR

HOT = list(range(10, 74))  # 64 tokens, cached below


def engine(tiny_loaded, **kw) -> Engine:
    eng = Engine(tiny_loaded, cache="radix", dtype="float32", kv_cache_tokens=4096, **kw)
    eng.generate([HOT + [5]], SamplingParams(max_tokens=1, temperature=0))
    return eng


def queue(eng: Engine) -> dict[str, object]:
    """cold0, hot1, cold2, hot3 in arrival order; hot ones match 64 cached tokens."""
    sp = SamplingParams(max_tokens=1, temperature=0)
    prompts = {"cold0": [400 + i for i in range(40)], "hot1": HOT + [200, 201],
               "cold2": [450 + i for i in range(40)], "hot3": HOT + [300, 301]}
    rids = {name: eng.add_request(p, sp) for name, p in prompts.items()}
    by_rid = {r.rid: r for r in eng.core.scheduler.waiting}
    return {name: by_rid[rid] for name, rid in rids.items()}


def order(eng: Engine) -> list:
    """The waiting queue in the order the scheduler would admit it now."""
    s = eng.core.scheduler
    return s.admission.order(s.waiting, s.rng)


def names(ordered, reqs) -> list[str]:
    back = {id(r): n for n, r in reqs.items()}
    return [back[id(r)] for r in ordered]


def test_pure_lpm_puts_long_matches_first(tiny_loaded):
    eng = engine(tiny_loaded, lpm_max_passes=10**6, lpm_max_wait_s=1e6)
    reqs = queue(eng)
    assert names(order(eng), reqs) == ["hot1", "hot3", "cold0", "cold2"]


def test_urgent_requests_go_ahead_of_longer_matches(tiny_loaded):
    eng = engine(tiny_loaded, lpm_max_passes=3, lpm_max_wait_s=1e6)
    reqs = queue(eng)
    reqs["cold2"].passed_over = 3
    assert names(order(eng), reqs) == ["cold2", "hot1", "hot3", "cold0"]


def test_among_urgent_requests_lpm_still_decides(tiny_loaded):
    """A burst where everyone waited too long must not degrade to FCFS (losing the hits)."""
    eng = engine(tiny_loaded, lpm_max_passes=3, lpm_max_wait_s=1e6)
    reqs = queue(eng)
    for r in reqs.values():
        r.passed_over = 5
    assert names(order(eng), reqs) == ["hot1", "hot3", "cold0", "cold2"]


def test_overdue_requests_go_first_oldest_first(tiny_loaded):
    wait = 10.0
    eng = engine(tiny_loaded, lpm_max_passes=10**6, lpm_max_wait_s=wait)
    reqs = queue(eng)
    now = time.monotonic()
    reqs["cold2"].arrival = now - OVERDUE_FACTOR * wait - 2  # overdue, arrived first
    reqs["cold0"].arrival = now - OVERDUE_FACTOR * wait - 1  # overdue
    reqs["hot3"].arrival = now - wait - 1  # urgent only
    assert names(order(eng), reqs) == ["cold2", "cold0", "hot3", "hot1"]


def test_long_queue_falls_back_to_arrival_order(tiny_loaded):
    eng = engine(tiny_loaded, lpm_fallback_queue_len=3)
    reqs = queue(eng)
    assert names(order(eng), reqs) == ["cold0", "hot1", "cold2", "hot3"]
