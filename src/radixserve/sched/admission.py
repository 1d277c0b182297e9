"""Admission of waiting requests into a step's prefill: which of them fit, with which cached
prefix, and how much of their prompt each computes now.

:class:`Admission` holds the rules that outlive a step (what a request may match, what it
must keep in reserve to decode); :class:`PrefillAdder` is one step's admission: it walks the
ordered queue against the step's token budget and the pool's room, and for each request in
turn matches it, locks its prefix, loads lower-tier parts back, checks that it fits, and
takes its slots. A request that does not fit ends the step's admission (the queue's order
is kept); one still prefetching from storage, or one that would recompute a prefix an
admitted request is about to put in the tree, is skipped.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from typing import Sequence

from radixserve.cache import PrefixCache
from radixserve.cache.base import MatchResult, TieredCache, common_prefix_tokens
from radixserve.config import EngineConfig
from radixserve.request import Req, ReqStatus
from radixserve.images import clip_match, image_tokens_in
from radixserve.memory import SlotAllocator
from radixserve.sched.batch import SchedulerStats
from radixserve.sched.mamba import RecurrentStates
from radixserve.sched.policy import order_waiting, promote_urgent
from radixserve.sched.slots import EMPTY_SLOTS, RequestSlots
from radixserve.sched.window import WindowKV


def match_key(req: Req) -> array:
    """Tokens the cache may serve: all but the last (its logits are needed), and none
    from the first prompt position whose logprob is asked for."""
    end = req.num_fill - 1
    if req.logprob_start >= 0 and not req.output_ids:
        # The logprob of token p comes from the logits at p - 1: compute from there.
        end = min(end, max(0, req.logprob_start - 1))
    return req.cache_key(max(0, end))


class Admission:
    """The admission rules of one scheduler, and the pieces admission changes."""

    def __init__(self, config: EngineConfig, allocator: SlotAllocator, cache: PrefixCache,
                 slots: RequestSlots, mamba: RecurrentStates, swa: WindowKV,
                 stats: SchedulerStats, max_context_len: int) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.tiers: TieredCache | None = cache if cache.tiered else None
        self.slots = slots
        self.mamba = mamba
        self.swa = swa
        self.stats = stats
        self.max_context_len = max_context_len
        self.page_size = allocator.page_size
        # Only a cache that can serve part of another request's prompt gains from making a
        # request wait for one that shares its uncached prefix.
        self.share = config.in_batch_sharing and cache.can_share_partial_prefix
        self.in_batch_min_tokens = 1 if config.policy == "dfs-weight" else config.in_batch_sharing_min_tokens

    def order(self, waiting: list[Req], rng: random.Random) -> list[Req]:
        """The waiting queue in admission order: the policy's, with LPM's bounded wait
        (:func:`~radixserve.sched.policy.promote_urgent`)."""
        cfg = self.config
        policy = cfg.policy
        if policy == "lpm" and len(waiting) > cfg.lpm_fallback_queue_len:
            policy = "fcfs"
        if policy == "lpm":
            t0 = time.perf_counter()
            for r in waiting:
                m = self.cache.match_prefix(match_key(r), salt=r.salt, low_priority_from=r.low_priority_from)
                r.match_len = m.total_length  # lower tiers count too
            self.slots.tree_time(t0)
        ordered = order_waiting(policy, waiting, rng)
        if policy != "lpm":
            return ordered
        return promote_urgent(ordered, time.monotonic(), cfg.lpm_max_wait_s, cfg.lpm_max_passes)

    def decode_reserve(self, req: Req) -> int:
        """Slots to hold back for ``req``'s decoding (an estimate, within its context)."""
        cfg = self.config
        est = math.ceil(cfg.decode_reserve_ratio * min(req.remaining_tokens, cfg.decode_reserve_clip))
        return max(0, min(est, self.max_context_len - req.num_fill))

    def reserved_for(self, running: Sequence[Req], chunked: Req | None) -> int:
        """Slots the admitted requests still need: decode reserves, the chunked prompt's rest."""
        total = sum(self.decode_reserve(r) for r in running)
        if chunked is not None:
            total += self.decode_reserve(chunked) + chunked.num_fill - chunked.computed_len
        return total

    def chunk_and_reserve(self, req: Req, cached: int, budget: int) -> tuple[int, int, int]:
        """``(extend, chunk, reserve)`` for admitting ``req`` with ``cached`` tokens in L1:
        the tokens to compute, this step's chunk of them, and the slots to hold back for the
        rest (decode estimate plus later chunks)."""
        extend = req.num_fill - cached
        chunk = self.mamba.cut(req, cached, min(extend, budget, self.swa.chunk_cap))
        reserve = self.decode_reserve(req)
        if chunk < extend:
            reserve += extend - chunk  # the rest of the prompt comes in later chunks
        return extend, chunk, reserve


class PrefillAdder:
    """One step's admission: a token budget, the slots held back so far, what was admitted.

    ``admitted`` may already hold the chunked request's next chunk; ``running`` is how many
    requests decode this step. After :meth:`run`, ``admitted`` holds this step's prefill rows
    and ``chunked`` the request whose prompt continues in later steps (or None)."""

    def __init__(self, rules: Admission, admitted: list[tuple[Req, int]], budget: int,
                 reserved: int, running: int) -> None:
        self.rules = rules
        self.admitted = admitted
        self.budget = budget
        self.reserved = reserved
        self.running = running
        self.chunked: Req | None = None
        self.new_keys: list[tuple[str | None, bytes]] = [
            (r.salt, r.cache_key().tobytes()) for r, _ in admitted] if rules.share else []

    def run(self, ordered: Sequence[Req], waiting: list[Req]) -> None:
        """Admit from ``ordered`` (the waiting queue in admission order) while they fit;
        admitted requests leave ``waiting``."""
        tiers = self.rules.tiers
        for req in ordered:
            if self._full():
                break
            if req.prefetch is not None and not tiers.prefetch_ready(req.prefetch):
                continue  # its prefix is still coming from storage (per the prefetch policy)
            key, m = self._match(req)
            if self._waits_for_shared(req, m):
                continue  # let the admitted one compute the shared part first
            m = self._lock_and_load(req, m)
            if m is None or not self._take(req, key, m):
                break
            waiting.remove(req)
            if self.chunked is not None:
                break
        self._count_passed_over(waiting)

    @property
    def _busy(self) -> bool:
        """Whether anything runs this step: then a request that does not fit waits."""
        return bool(self.admitted) or self.running > 0

    def _full(self) -> bool:
        return (self.budget <= 0
                or self.running + len(self.admitted) >= self.rules.config.max_running_requests)

    def _match(self, req: Req) -> tuple[array, MatchResult]:
        """The request's cached prefix, cut back to whole images (too few key bits would
        vouch for a part image's KV: ``radixserve.images.clip_match``)."""
        r = self.rules
        t0 = time.perf_counter()
        key = match_key(req)
        m = r.cache.match_prefix(key, salt=req.salt, low_priority_from=req.low_priority_from)
        if req.images is not None:
            end = m.length + m.host_length
            cut = clip_match(end, req.images.spans)
            if cut != end:
                key = key[:cut]
                m = r.cache.match_prefix(key, salt=req.salt, low_priority_from=req.low_priority_from)
        r.mamba.plan(req, key, m.length)
        r.slots.tree_time(t0)
        return key, m

    def _waits_for_shared(self, req: Req, m: MatchResult) -> bool:
        """Whether an admitted request will put enough more of this prompt in the tree."""
        if not (self.rules.share and self.new_keys):
            return False
        q = req.cache_key(req.num_fill - 1).tobytes()
        shared = max((common_prefix_tokens(k, q) for s, k in self.new_keys if s == req.salt), default=0)
        return shared - m.length - m.host_length >= self.rules.in_batch_min_tokens

    def _room(self) -> int:
        r = self.rules
        return r.allocator.available + r.cache.evictable_size - self.reserved

    def _lock_and_load(self, req: Req, m: MatchResult) -> MatchResult | None:
        """Lock the match and bring its lower-tier part into L1; None (nothing locked) when
        that part and the request do not fit. The load waits until the request is sure to
        fit: a load for a request that then waits takes the slots running requests decode
        into, gets evicted again, and comes back at every step."""
        r = self.rules
        r.cache.lock(m.node)
        host = m.host_length
        if host:
            _, chunk, reserve = r.chunk_and_reserve(req, m.length + host, self.budget)
            if host + chunk + reserve + r.page_size > self._room() and self._busy:
                r.cache.unlock(m.node)
                return None
        if r.tiers is None:
            return m
        t0 = time.perf_counter()
        loaded = r.tiers.load_back(m)  # m.node is locked: making room keeps the prefix
        if loaded.node is not m.node:
            r.cache.lock(loaded.node)
            r.cache.unlock(m.node)
        r.slots.tree_time(t0)
        return loaded

    def _take(self, req: Req, key: array, m: MatchResult) -> bool:
        """Admit ``req`` on its locked match ``m`` if its chunk and reserve fit (in the SWA
        pool too); False (the lock released) if not."""
        r = self.rules
        extend, chunk, reserve = r.chunk_and_reserve(req, m.length, self.budget)
        fits = (chunk + reserve + r.page_size <= self._room()
                and (not r.swa.window or r.swa.admits(chunk)))
        if not fits and self._busy:
            r.cache.unlock(m.node)
            return False
        req.kv_slots, req.prefix_len, req.kv_written, req.last_node = m.indices.clone(), m.length, m.length, m.node
        req.swa_released, req.spare_slots = 0, EMPTY_SLOTS
        if not r.slots.take(req, chunk):
            r.cache.unlock(m.node)
            req.kv_slots, req.prefix_len, req.kv_written, req.last_node = EMPTY_SLOTS, 0, 0, None
            return False
        r.mamba.admit(req, m.node, m.length)
        if req.cached_tokens < 0:
            self._first_admission(req, key, m)
        req.status = ReqStatus.PREFILLING
        self.admitted.append((req, chunk))
        self.reserved += reserve
        self.budget -= chunk
        if r.share:
            self.new_keys.append((req.salt, req.cache_key().tobytes()))
        if chunk < extend:
            self.chunked = req
        return True

    def _first_admission(self, req: Req, key: array, m: MatchResult) -> None:
        """What the cache served the request at its first admission (the prefix statistics)."""
        r, st = self.rules, self.rules.stats
        if r.tiers is not None:
            req.tier_report = r.tiers.record_admission(key, m, req.salt, req.prefetch)
            req.prefetch = None
        n_prompt = len(req.prompt_ids)
        req.cached_tokens = min(m.length, n_prompt)
        st.prefix_query_tokens += n_prompt
        st.prefix_hit_tokens += req.cached_tokens
        if req.images is not None:
            st.image_query_tokens += image_tokens_in(n_prompt, req.images.spans)
            st.image_hit_tokens += image_tokens_in(req.cached_tokens, req.images.spans)
        st.max_wait_seconds = max(st.max_wait_seconds, time.monotonic() - req.arrival)

    def _count_passed_over(self, waiting: Sequence[Req]) -> None:
        """Requests still waiting that a later arrival went ahead of (LPM's bounded wait)."""
        if self.admitted:
            last = max(r.seq_no for r, _ in self.admitted)
            for r in waiting:
                if r.seq_no < last:
                    r.passed_over += 1
