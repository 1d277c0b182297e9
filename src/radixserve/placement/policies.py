"""Routing policies: pick one worker among the available ones for a tokenized request.

Each policy is a small class with ``choose(req, workers) -> Choice``; ``workers`` is never
empty and holds only available workers. :data:`POLICY_CLASSES` maps the config names.

``cache_aware`` prices each worker by what the request would cost there::

    cost = (tokens not held in any tier)          # computed
         + tier_load_cost * (tokens held only in L2/L3)   # loaded, not recomputed
         + queue_weight * (prompt tokens already queued there)
         - affinity_weight * (tokens last routed there beyond those held, decayed)

where "held" is the worker's event-fed mirror plus the prompts in flight to it (which the
worker will hold once they are prefilled), and the last term is the family's home
(:class:`~radixserve.placement.affinity.AffinityTree`: where the router sent this prefix
before, halved every ``affinity_half_life`` requests). The mirror alone forgets a family
the moment its worker evicts it, or before the worker's events about it arrive; routed by
load then, a family ends up on every worker and each cache holds every family, which is
what does not fit under memory pressure. Weighted below one, what a worker holds now still
beats where a family lived.

Load wins over locality in two cases, with SGLang's router's thresholds: when the
in-flight counts are imbalanced (spread above ``balance_abs_threshold`` *and* ratio above
``balance_rel_threshold``) only the least loaded workers are considered; when the best
worker's locality (held, or lived there) exceeds the worst one's by less than
``cache_threshold`` of the prompt, locality is not worth a choice: the request starts a new
prefix (a family of requests to come), and new prefixes are dealt out evenly (the worker
that started the fewest recently), then to the least loaded worker, then to the one
holding the fewest tokens (the most room). (SGLang compares the best match alone with the
threshold: then a short prefix every request shares, a chat's system line, pulls all
traffic to the first worker that saw it.) While an available worker's mirror is
resynchronising, no mirror is consulted (an empty one would repel requests from its worker):
prompts in flight and the affinity record still place families, load the rest.

Where a request goes is half of what decides its family's hits under memory pressure; the
other half is what its worker evicts. A worker's LRU stamps a request's own tail (its
question, after a system prompt it shares with its siblings) with the shared prompt's
stamp, so when the tail goes the prompt is the oldest leaf and goes next: each miss then
costs a prefix that was about to be hit. With ``low_priority_tails`` the choice carries,
for a prompt that shares at least ``cache_threshold`` of itself with earlier prompts
without continuing one of them, the position where it leaves what they share
(``Choice.low_priority_from``); the worker keeps what it caches past that point at low
priority, evicted before any shared prefix (``radixserve.cache.radix``). A prompt that
continues an earlier one whole (a conversation's next turn, a branch of a tree of thought)
has no low tail: the turn after will continue it (its hint is :data:`NOTHING_LOW`). With
any hint the worker keeps what the request computed, rather than found, on probation:
evicted after the low tails and before what was found, raised to normal when found.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import time
from dataclasses import dataclass
from typing import Dict, Hashable, List, NamedTuple, Optional, Sequence

from radixserve.placement.affinity import AffinityTree, Lookup
from radixserve.placement.config import RouterConfig
from radixserve.placement.mirror import TIERS
from radixserve.placement.worker import Worker

__all__ = ["RouteRequest", "Choice", "POLICY_CLASSES", "make_policy"]


@dataclass
class RouteRequest:
    tokens: bytes  # packed uint32 prompt (b"" when it could not be tokenized)
    salt: Hashable = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) >> 2


#: The hint for a prompt with no tail of its own: a position past any prompt.
NOTHING_LOW = 1 << 62


class Choice(NamedTuple):
    worker: Worker
    cached_tokens: int  # prompt tokens predicted to be found there (any tier)
    compute_tokens: int  # prompt tokens predicted to be computed there
    new_prefix: bool = False  # chosen as the start of a new prefix (cache_aware)
    low_priority_from: Optional[int] = None  # what the worker caches from here is evicted first


def _held(w: Worker, req: RouteRequest, mirrors: bool = True) -> Dict[str, int]:
    """Held prefix per tier at ``w``: mirror (unless ``mirrors`` is False) plus in-flight prompts (counted as L1)."""
    held: Dict[str, int] = {}
    if mirrors and w.mirror is not None and w.mirror.synced:
        held = w.mirror.match(req.tokens, req.salt)
    if w.inflight.roots:
        f = w.inflight.match(req.tokens, req.salt)
        if f > held.get("L1", 0):
            held["L1"] = f
    return held


def _price(held: Dict[str, int], n: int, tier_cost: float) -> tuple:
    """``(compute tokens, load-cost tokens, covered tokens)`` given the held lengths."""
    covered, load = held.get("L1", 0), 0.0
    # L2, L3, then tiers this router does not know (priced like L3).
    for t in [held.get(tier, 0) for tier in TIERS[1:]] + [t for tier, t in held.items() if tier not in TIERS]:
        if t > covered:
            load += (t - covered) * tier_cost
            covered = t
    return n - covered, load, covered


class Policy:
    name = ""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self._rr = 0

    def choose(self, req: RouteRequest, workers: Sequence[Worker]) -> Choice:
        raise NotImplementedError

    def placed(self, req: RouteRequest, worker: Worker) -> None:
        """``req`` was sent to ``worker`` (after :meth:`choose`, and again for each retry)."""

    def state(self) -> Dict[str, object]:
        """What the policy keeps, for ``/router/workers``."""
        return {}

    def forget(self) -> None:
        """The workers' caches were flushed: drop what was learnt about the prompts routed so far."""

    def _next(self, workers: Sequence[Worker]) -> Worker:
        w = workers[self._rr % len(workers)]
        self._rr += 1
        return w

    def _shortest(self, workers: Sequence[Worker]) -> Worker:
        """Fewest requests in flight, then fewest queued tokens, then round robin."""
        best = min((w.outstanding, w.queued_tokens) for w in workers)
        tied = [w for w in workers if (w.outstanding, w.queued_tokens) == best]
        return tied[0] if len(tied) == 1 else self._next(tied)

    def _plain(self, w: Worker, req: RouteRequest) -> Choice:
        """A choice made without looking at caches; the prediction is still recorded."""
        _, _, covered = _price(_held(w, req), req.num_tokens, self.cfg.tier_load_cost)
        return Choice(w, covered, req.num_tokens - covered)


class RoundRobin(Policy):
    name = "round_robin"

    def choose(self, req: RouteRequest, workers: Sequence[Worker]) -> Choice:
        return self._plain(self._next(workers), req)


class Random(Policy):
    name = "random"

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__(cfg)
        self.rng = random.Random(cfg.seed)

    def choose(self, req: RouteRequest, workers: Sequence[Worker]) -> Choice:
        return self._plain(self.rng.choice(list(workers)), req)


class ShortestQueue(Policy):
    name = "shortest_queue"

    def choose(self, req: RouteRequest, workers: Sequence[Worker]) -> Choice:
        return self._plain(self._shortest(workers), req)


class PrefixHash(Policy):
    """Consistent hashing of the first ``prefix_hash_tokens`` tokens (and the salt): the
    same prefix always lands on the same worker, and a worker leaving moves only its own
    keys (to the next worker on the ring)."""

    name = "prefix_hash"
    VNODES = 64

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__(cfg)
        points = sorted((self._h(f"{url}#{v}".encode()), i) for i, url in enumerate(cfg.workers)
                        for v in range(self.VNODES))
        self._ring: List[int] = [p for p, _ in points]
        self._owner: List[int] = [i for _, i in points]

    @staticmethod
    def _h(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def choose(self, req: RouteRequest, workers: Sequence[Worker]) -> Choice:
        if not req.tokens:
            return self._plain(self._shortest(workers), req)
        key = req.tokens[: 4 * self.cfg.prefix_hash_tokens]
        if req.salt is not None:
            key = str(req.salt).encode() + b"\0" + key
        start = bisect.bisect(self._ring, self._h(key))
        by_index = {w.index: w for w in workers}
        n = len(self._ring)
        for k in range(n):
            w = by_index.get(self._owner[(start + k) % n])
            if w is not None:
                return self._plain(w, req)
        return self._plain(self._shortest(workers), req)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, cfg: RouterConfig) -> None:
        super().__init__(cfg)
        #: Where each prefix was routed (the family's home), beside the mirrors (what is held);
        #: also how each prompt relates to the earlier ones (for ``low_priority_tails``).
        self.affinity = AffinityTree(1, cfg.affinity_max_tokens)
        self._recording = bool(cfg.affinity_weight) or cfg.low_priority_tails

    def placed(self, req: RouteRequest, worker: Worker) -> None:
        if req.tokens and self._recording:
            self.affinity.record(req.tokens, req.salt, worker.index)

    def _low_priority_from(self, look: Lookup, n: int) -> Optional[int]:
        """Where the prompt's own tail starts (why: the module doc), when it shares at least
        ``cache_threshold`` of itself with earlier prompts and continues none of them. Any
        other prompt gets :data:`NOTHING_LOW`: its hint still puts what it computes on
        probation, so a first request's own question does not outlast a family prefix
        computed again later. None without ``low_priority_tails``."""
        if not self.cfg.low_priority_tails:
            return None
        least = self.cfg.cache_threshold * n
        if look.shared < max(least, 1) or look.continued >= least or look.shared >= n:
            return NOTHING_LOW
        return look.shared

    def state(self) -> Dict[str, object]:
        return {"affinity_tokens": self.affinity.num_tokens}

    def forget(self) -> None:
        # Nothing routed before a flush is held anywhere: no family has a home, and a prompt
        # sent again is not a repeat worth keeping whole.
        self.affinity = AffinityTree(1, self.cfg.affinity_max_tokens)

    def choose(self, req: RouteRequest, workers: Sequence[Worker]) -> Choice:
        cfg = self.cfg
        n = req.num_tokens
        if n == 0:
            return self._plain(self._shortest(workers), req)
        # A mirror resynchronising (a worker restarted, events lost, the server just started):
        # compare no mirrors (module doc); what the router sent where still counts.
        mirrors = not any(w.mirror is not None and not w.mirror.synced for w in workers)
        loads = [w.outstanding for w in workers]
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            workers = [w for w in workers if w.outstanding == lo]
        look = self.affinity.lookup(req.tokens, req.salt)
        lived = AffinityTree.decayed(look.affinities, cfg.affinity_half_life) if cfg.affinity_weight else {}
        low = self._low_priority_from(look, n)
        priced = []
        for w in workers:
            compute, load, covered = _price(_held(w, req, mirrors), n, cfg.tier_load_cost)
            # Tokens of this prompt last routed here that the worker does not hold now.
            extra = max(0.0, lived.get(w.index, 0.0) - covered)
            priced.append((w, compute, load, covered, extra))
        local = [p[3] + p[4] for p in priced]
        if max(local) - min(local) < cfg.cache_threshold * n:
            # No locality worth having: a new prefix, dealt out as the module doc says.
            now = time.monotonic()

            def spread(p: tuple) -> tuple:
                w = p[0]
                held = w.mirror.held_tokens() if w.mirror is not None else 0
                return (round(w.recent_new_prefixes(now)), w.outstanding, held + w.inflight.num_tokens)
            key = min(spread(p) for p in priced)
            tied = [p for p in priced if spread(p) == key]
            p = self._next(tied)
            return Choice(p[0], p[3], p[1], True, low)

        def cost(p: tuple) -> tuple:
            w, compute, load, _, extra = p
            return compute + load + cfg.queue_weight * w.queued_tokens - cfg.affinity_weight * extra, w.outstanding
        best = min(priced, key=cost)  # the cheapest; among equals, the first with the fewest in flight
        return Choice(best[0], best[3], best[1], False, low)


POLICY_CLASSES = {c.name: c for c in (CacheAware, RoundRobin, ShortestQueue, PrefixHash, Random)}


def make_policy(cfg: RouterConfig) -> Policy:
    return POLICY_CLASSES[cfg.policy](cfg)
