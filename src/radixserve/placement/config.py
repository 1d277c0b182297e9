"""The router's settings: one frozen dataclass, validated where it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from radixserve.config_rules import (DEFAULT_ROUTER_POLICY, ROUTER_POLICIES, check_api_keys, check_bools,
                                     check_choice, check_float, check_int, check_positive)

__all__ = ["RouterConfig", "POLICIES", "FIELD_HELP"]

POLICIES = ROUTER_POLICIES

FIELD_HELP = {
    "workers": "worker base URLs (http://host:port; plain HTTP/1.1)",
    "worker_events": "each worker's cache-event endpoint (tcp://host:port), in --worker order; "
                     "empty: no mirrors (cache_aware then routes on what it sent, like SGLang's router)",
    "policy": "routing policy",
    "model": "model (or tokenizer) name/path to tokenize with; default: ask the first worker",
    "cache_threshold": "cache_aware: below this predicted hit rate a request has no locality "
                       "and goes to the least-loaded worker with the most free KV",
    "balance_abs_threshold": "cache_aware: load (in-flight requests) spread above which load "
                             "wins over locality (with --balance-rel-threshold)",
    "balance_rel_threshold": "cache_aware: max load / min load above which load wins over "
                             "locality (with --balance-abs-threshold)",
    "queue_weight": "cache_aware: tokens of cost per token of prefill already queued on a worker",
    "tier_load_cost": "cache_aware: cost of a token found in L2/L3 (a load) relative to "
                      "computing it (1.0)",
    "affinity_weight": "cache_aware: cost saved per prompt token last routed to a worker beyond "
                       "what it holds now (the family lives there, maybe evicted for the moment), "
                       "relative to a token it holds (1.0); 0: route by what is held only",
    "affinity_half_life": "cache_aware: requests after which a prefix's pull to the worker it "
                          "was last routed to halves",
    "affinity_max_tokens": "cache_aware: prompt tokens the affinity record keeps (least recently "
                           "routed forgotten first)",
    "low_priority_tails": "cache_aware: a prompt that shares at least --cache-threshold of itself "
                          "with earlier ones without continuing one (a system prompt, then its own "
                          "question) asks its worker to keep what follows the shared part at low "
                          "priority, evicted before any shared prefix (the X-Cache-Low-Priority-From "
                          "header); with the header, what a worker computes of the shared part is "
                          "kept on probation until a later request finds it",
    "prefix_hash_tokens": "prefix_hash: hash this many leading tokens",
    "health_interval_s": "seconds between health checks of each worker",
    "health_timeout_s": "timeout of one health check",
    "health_failures": "consecutive failed checks that take a worker out",
    "health_successes": "consecutive good checks that bring it back",
    "breaker_failures": "consecutive failed requests that open a worker's circuit breaker",
    "breaker_cooldown_s": "seconds an open breaker keeps the worker out before a health check "
                          "may close it",
    "max_retries": "other workers a failed non-streamed request is retried on",
    "request_timeout_s": "upstream timeout per request (0: none)",
    "mirror_stale_s": "seconds without a message from a worker's event stream after which "
                      "its mirror is stale",
    "seed": "seed of the random policy",
    "api_key": "the workers' API keys, KEY or KEY:TENANT (repeat): a request's cache namespace "
               "is its key's tenant's, so the router needs them to find its prefix (it checks "
               "no key itself; the workers do)",
    "api_key_file": "the workers' --api-key-file (one 'KEY[:TENANT]' per line)",
    "admin_key": "the workers' --admin-key (its requests have a cache namespace of their own)",
}


@dataclass(frozen=True)
class RouterConfig:
    workers: Tuple[str, ...] = ()
    worker_events: Tuple[str, ...] = ()
    policy: str = DEFAULT_ROUTER_POLICY
    model: Optional[str] = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    queue_weight: float = 0.25
    tier_load_cost: float = 0.1
    affinity_weight: float = 0.5
    affinity_half_life: float = 1000.0
    affinity_max_tokens: int = 1 << 22
    low_priority_tails: bool = True
    prefix_hash_tokens: int = 64
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    health_failures: int = 2
    health_successes: int = 1
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    max_retries: int = 2
    request_timeout_s: float = 600.0
    mirror_stale_s: float = 5.0
    seed: int = 0
    api_key: Tuple[str, ...] = ()
    api_key_file: str = ""
    admin_key: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(self.workers))
        object.__setattr__(self, "worker_events", tuple(self.worker_events))
        if not self.workers:
            raise ValueError("workers: at least one worker URL is required")
        for u in self.workers:
            if not isinstance(u, str) or not u.startswith("http://"):
                raise ValueError(f"workers: {u!r} is not an http://host:port URL")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("workers: a URL is listed twice")
        if self.worker_events and len(self.worker_events) != len(self.workers):
            raise ValueError(f"worker_events: {len(self.worker_events)} endpoints for {len(self.workers)} "
                             "workers (give one per worker, in the same order, or none)")
        for e in self.worker_events:
            if not isinstance(e, str) or "://" not in e:
                raise ValueError(f"worker_events: {e!r} is not a ZMQ endpoint like tcp://host:port")
        check_choice(self, "policy", POLICIES)
        check_float(self, "cache_threshold", 0.0, 1.0)
        check_int(self, "balance_abs_threshold", 0)
        for name in ("prefix_hash_tokens", "health_failures", "affinity_max_tokens", "health_successes",
                     "breaker_failures"):
            check_int(self, name, 1)
        check_int(self, "max_retries", 0)
        check_float(self, "balance_rel_threshold", 1.0, math.inf)
        check_bools(self, ("low_priority_tails",))
        for name in ("queue_weight", "tier_load_cost", "request_timeout_s", "affinity_weight"):
            check_float(self, name, 0.0, math.inf)
        for name in ("health_interval_s", "health_timeout_s", "breaker_cooldown_s", "mirror_stale_s",
                     "affinity_half_life"):
            check_positive(self, name)
        check_api_keys(self)
