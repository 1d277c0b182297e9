"""Admission, batching and the life of a request: the one place where cache, memory and requests meet.

The engine loop is three calls::

    out = scheduler.schedule()                    # which requests run, with which KV slots
    result = runner.run(out.batch)                # forward + sampling (engine/runner.py)
    ended = scheduler.postprocess(out.batch, result)   # append, stop, finish, cache insert

(``fail_batch`` replaces ``postprocess`` when the forward raised). Everything that ends a
request goes through :meth:`Scheduler.finish`, whatever the reason (stop, length, abort,
error, out of memory), and everything that gives KV back goes through :meth:`release`.

Memory is one pool shared by the cache and the running requests, with no fixed reserve for
either: admission counts ``free + evictable`` as available, and allocation evicts
least-recently-used leaves only when the free list runs short. Only slots whose K/V a
successful forward pass wrote (``Req.kv_written``) may ever enter the prefix cache.

A request with a session id that finishes normally leaves the node at its cached end locked
for its session (``sched/sessions.py``); those locks are released before a request would be
retracted or failed for want of slots (``RequestSlots.make_room``, ``sched/slots.py``).
"""

from __future__ import annotations

import math
import random
import time
from typing import Sequence

from radixserve.cache import PrefixCache
from radixserve.cache.base import TieredCache, common_prefix_tokens
from radixserve.config import EngineConfig
from radixserve.core import Req, ReqStatus
from radixserve.images import clip_match, image_tokens_in
from radixserve.memory import SlotAllocator
from radixserve.memory.mamba import MambaStatePool
from radixserve.sched.batch import SampledRow, ScheduledBatch, SchedulerOutput, SchedulerStats
from radixserve.sched.integrity import check_scheduler
from radixserve.sched.mamba import RecurrentStates
from radixserve.sched.postprocess import apply_step
from radixserve.sched.sessions import SessionTable
from radixserve.sched.slots import EMPTY_SLOTS, RequestSlots
from radixserve.sched.speculation import Speculator
from radixserve.sched.window import WindowKV
from radixserve.sched.policy import order_waiting, promote_urgent


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: SlotAllocator,
        cache: PrefixCache,
        max_context_len: int,
        eos_ids: Sequence[int] = (),
        vocab_size: int | None = None,
        states: MambaStatePool | None = None,
    ):
        """``vocab_size``: the model's, needed with ``config.speculative`` (a draft never
        holds an id the model cannot embed). ``states``: a hybrid Mamba model's state pool;
        each admitted request holds a slot of it (``sched/mamba.py``)."""
        self.config = config
        self.allocator = allocator
        self.cache = cache
        #: The tier calls (prefetch, load_back, ...) of a cache with tiers below the KV pool.
        self.tiers: TieredCache | None = cache if cache.tiered else None
        #: Hybrid (sliding-window) models: the window KV's budget (``sched/window.py``).
        self.swa = WindowKV(allocator, cache, config.chunked_prefill_size)
        self.window = self.swa.window
        self.chunk_cap = self.swa.chunk_cap
        self.page_size = allocator.page_size
        self.max_context_len = max_context_len
        self.eos_ids = frozenset(eos_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # admitted, prompt partly computed
        self.stats = SchedulerStats()
        self.rng = random.Random(config.seed)
        self._seq = 0
        self.in_batch_min_tokens = 1 if config.policy == "dfs-weight" else config.in_batch_sharing_min_tokens
        #: Structured outputs: append the tokens a grammar forces as one extend step.
        self.fast_forward: bool = config.grammar_fast_forward
        #: Conversations whose cached tokens are kept between turns (``sched/sessions.py``).
        self.sessions = SessionTable(cache, config.session_ttl_s, config.max_sessions)
        #: Taking, caching and giving back the requests' KV slots (``sched/slots.py``).
        self.slots = RequestSlots(allocator, cache, self.swa, self.sessions, self.stats)
        #: Hybrid Mamba models: the requests' state slots and where snapshots are taken.
        self.mamba = RecurrentStates(states, cache, config.mamba_snapshot_interval)
        #: Speculative decoding drafted by the tree (``sched/speculation.py``), or None.
        self.spec: Speculator | None = None
        if config.speculative == "ngram-tree":
            if vocab_size is None:
                raise ValueError("speculative decoding needs the model's vocab_size")
            self.spec = Speculator(cache, config.num_draft_tokens, config.speculative_min_ngram,
                                   config.speculative_max_ngram, vocab_size, max_context_len,
                                   config.speculative_row_cost)

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        req.seq_no = self._seq
        self._seq += 1
        req.status = ReqStatus.WAITING
        self.sessions.touch(req.session_id)
        # A tiered cache starts fetching from storage what it does not hold locally.
        if self.tiers is not None:
            req.prefetch = self.tiers.prefetch(self._match_key(req), salt=req.salt)
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + (1 if self.chunked else 0)

    def all_reqs(self) -> list[Req]:
        return self.waiting + self.running + ([self.chunked] if self.chunked else [])

    def release(self, req: Req, keep_state: bool = False) -> None:
        """Give back everything the request holds: written KV goes to the cache, the rest is
        freed. ``keep_state``: a Mamba model's state after the written tokens is snapshotted
        there (the request ended cleanly or is retracted: its state is that of those tokens)."""
        keep = req.cache_key(req.kv_written) if keep_state and req.kv_written else None
        self.slots.release(req)
        self.mamba.release(req, keep)

    # ------------------------------------------------------------------ finish / abort / retract
    def finish(self, req: Req, reason: str, error: str | None = None) -> None:
        """End a request for any reason; its slots and locks are released at once."""
        if req.status is ReqStatus.FINISHED:
            return
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
            if req.prefetch is not None:
                self.tiers.cancel_prefetch(req.prefetch)
                req.prefetch = None
        keep = req.cache_key(req.kv_written) if (
            req.session_id is not None and req.kv_written and reason in ("stop", "length")) else None
        self.release(req, keep_state=reason in ("stop", "length"))
        if keep is not None:
            t0 = time.perf_counter()
            self.sessions.retain(req.session_id, keep, req.salt)
            self.slots.tree_time(t0)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if error is not None:
            req.error = error
        req.finish_time = time.monotonic()
        s = self.stats
        s.finish_reasons[reason] = s.finish_reasons.get(reason, 0) + 1
        if reason == "abort":
            s.aborted_requests += 1
        elif reason == "error":
            s.failed_requests += 1
        else:
            s.finished_requests += 1

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its written tokens stay in the cache."""
        self.running.remove(req)
        self.release(req, keep_state=True)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.stats.retractions += 1
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ scheduling
    def _match_key(self, req: Req):
        """Tokens the cache may serve: all but the last (its logits are needed), and none
        from the first prompt position whose logprob is asked for."""
        end = req.num_fill - 1
        if req.logprob_start >= 0 and not req.output_ids:
            # The logprob of token p comes from the logits at p - 1: compute from there.
            end = min(end, max(0, req.logprob_start - 1))
        return req.cache_key(max(0, end))

    def _match_whole_images(self, req: Req, key, m):  # noqa: ANN001, ANN202 - the cache's types
        """A match that ends a few positions into an image is cut back to the image's start
        (too few key bits would vouch for its KV: ``radixserve.images.clip_match``)."""
        end = m.length + m.host_length
        cut = clip_match(end, req.image_spans)
        if cut == end:
            return key, m
        key = key[:cut]
        return key, self.cache.match_prefix(key, salt=req.salt, low_priority_from=req.low_priority_from)

    def _decode_reserve(self, req: Req) -> int:
        cfg = self.config
        est = math.ceil(cfg.decode_reserve_ratio * min(req.remaining_tokens, cfg.decode_reserve_clip))
        room = self.max_context_len - req.num_fill
        return max(0, min(est, room))

    def _reserved_for_running(self) -> int:
        total = sum(self._decode_reserve(r) for r in self.running)
        if self.chunked is not None:
            total += self._decode_reserve(self.chunked) + self.chunked.num_fill - self.chunked.computed_len
        return total

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. With ``mixed_steps``, the running requests decode and a
        prefill chunk rides along in the same forward; otherwise a step is all prefill (when
        anything can be admitted) or all decode."""
        self.cache.poll()
        self.sessions.expire()
        failed: list[Req] = []
        decodes: list[Req] = []
        drafts: dict[Req, list[int]] = {}
        prefill: list[tuple[Req, int]] = []
        if self.config.mixed_steps:
            decodes, drafts = self._take_decode_slots(failed)
            prefill = self._schedule_prefill()
        else:
            prefill = self._schedule_prefill()
            if not prefill:
                decodes, drafts = self._take_decode_slots(failed)
        if not decodes and not prefill:
            return SchedulerOutput(None, failed)
        if self.tiers is not None:
            self.tiers.flush_loads()  # the lower-tier copies of this step's admissions
        reqs = decodes + [r for r, _ in prefill]
        # Slots for this step's tokens are taken now; they hold K/V only once the forward
        # succeeded (postprocess marks them written). A running request computes one token,
        # or its sampled token plus the grammar's forced ones (fast-forward), or plus its
        # draft (speculative decoding), as one extend.
        starts = [r.kv_written for r in decodes] + [r.computed_len - c for r, c in prefill]
        ext = [r.computed_len - r.kv_written for r in decodes] + [c for _, c in prefill]
        sample, want_all = [True] * len(decodes), [False] * len(decodes)
        for r, c in prefill:
            s = r.computed_len - c
            sample.append(s + c == r.num_fill)
            want_all.append(r.logprob_start >= 0 and not r.output_ids and s + c >= r.logprob_start)
        st = self.stats
        if decodes and prefill:
            st.mixed_steps += 1
        elif decodes:
            st.decode_steps += 1
        else:
            st.prefill_steps += 1
        st.computed_prefill_tokens += sum(c for _, c in prefill)
        batch = ScheduledBatch(reqs, ext, starts, sample, want_all, len(decodes),
                               [drafts.get(r, []) for r in reqs] if drafts else [])
        return SchedulerOutput(batch, failed)

    def _take_decode_slots(self, failed: list[Req]) -> tuple[list[Req], dict[Req, list[int]]]:
        """One slot for the next token of every running request (evicting, then retracting
        the request with the most work left), plus one per draft token where free slots
        hold them all; returns the requests that decode this step and their drafts."""
        drafts: dict[Req, list[int]] = {}
        if self.spec is not None and self.running:
            drafts = self.spec.propose(self.running, {r: self._pending(r) for r in self.running})
        while self.running:
            need = sum(self.slots.needed(r, self._pending(r) + len(drafts.get(r, ()))) for r in self.running)
            if drafts and (need > self.allocator.available
                           or (self.window and need > self.allocator.swa_available)):
                drafts = {}  # drafts never evict cached prefixes (or their windows), nor retract anyone
                continue
            if self.slots.make_room(need):
                break
            if len(self.running) == 1:
                # Nothing left to retract: the lone request has the whole pool and still
                # does not fit (its context outgrew the pool). It fails alone.
                req = self.running[0]
                self.finish(req, "error", "out of KV memory: the request's context exceeds the KV pool")
                failed.append(req)
                break
            victim = max(self.running, key=lambda r: (r.remaining_tokens, -r.seq_no))
            self._retract(victim)
        for r in self.running:
            if not self.slots.take(r, self._pending(r) + len(drafts.get(r, ()))):  # cannot happen
                raise RuntimeError("decode slot allocation failed after reservation")
        return list(self.running), drafts

    @staticmethod
    def _pending(req: Req) -> int:
        """Tokens a running request computes next: its last sampled token, plus any forced
        tokens fast-forwarded after it."""
        return max(1, req.num_fill - req.computed_len)

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        if not self.waiting and self.chunked is None:
            return []
        cfg = self.config
        budget = cfg.max_prefill_tokens
        admitted: list[tuple[Req, int]] = []

        if self.chunked is not None:
            req = self.chunked
            extend = req.num_fill - req.computed_len
            chunk = self.mamba.cut(req, req.computed_len, min(extend, budget, self.chunk_cap))
            if not self.slots.take(req, chunk):
                return []  # decode will make progress or retract; try again next step
            admitted.append((req, chunk))
            budget -= chunk
            if chunk < extend:
                return admitted
            self.chunked = None

        if self.waiting and budget > 0 and len(self.running) + len(admitted) < cfg.max_running_requests:
            self._admit_waiting(admitted, budget)
        return admitted

    def _order(self) -> list[Req]:
        """The waiting queue in admission order: the policy's, with LPM's bounded wait
        (:func:`~radixserve.sched.policy.promote_urgent`)."""
        cfg = self.config
        policy = cfg.policy
        if policy == "lpm" and len(self.waiting) > cfg.lpm_fallback_queue_len:
            policy = "fcfs"
        if policy == "lpm":
            t0 = time.perf_counter()
            for r in self.waiting:
                m = self.cache.match_prefix(self._match_key(r), salt=r.salt,
                                            low_priority_from=r.low_priority_from)
                r.match_len = m.total_length  # lower tiers count too
            self.slots.tree_time(t0)
        ordered = order_waiting(policy, self.waiting, self.rng)
        if policy != "lpm":
            return ordered
        return promote_urgent(ordered, time.monotonic(), cfg.lpm_max_wait_s, cfg.lpm_max_passes)

    def _chunk_and_reserve(self, req: Req, cached: int, budget: int) -> tuple[int, int, int]:
        """``(extend, chunk, reserve)`` for admitting ``req`` with ``cached`` tokens in L1:
        the tokens to compute, this step's chunk of them, and the slots to hold back for the
        rest (decode estimate plus later chunks)."""
        extend = req.num_fill - cached
        chunk = self.mamba.cut(req, cached, min(extend, budget, self.chunk_cap))
        reserve = self._decode_reserve(req)
        if chunk < extend:
            reserve += extend - chunk  # the rest of the prompt comes in later chunks
        return extend, chunk, reserve

    def _admit_waiting(self, admitted: list[tuple[Req, int]], budget: int) -> None:
        cfg = self.config
        ordered = self._order()
        reserved = self._reserved_for_running()
        # Only a cache that can serve part of another request's prompt gains from making a
        # request wait for one that shares its uncached prefix.
        share = cfg.in_batch_sharing and self.cache.can_share_partial_prefix
        new_keys: list[tuple[str | None, bytes]] = [
            (r.salt, r.cache_key().tobytes()) for r, _ in admitted] if share else []
        for req in ordered:
            if budget <= 0 or len(self.running) + len(admitted) >= cfg.max_running_requests:
                break
            if req.prefetch is not None and not self.tiers.prefetch_ready(req.prefetch):
                continue  # its prefix is still coming from storage (per the prefetch policy)
            t0 = time.perf_counter()
            key = self._match_key(req)
            m = self.cache.match_prefix(key, salt=req.salt, low_priority_from=req.low_priority_from)
            if req.image_spans:
                key, m = self._match_whole_images(req, key, m)
            self.mamba.plan(req, key, m.length)
            self.slots.tree_time(t0)
            # A tiered cache holds ``host`` more tokens of the prefix in a lower tier; they
            # need L1 slots too, so they are loaded only once the request is sure to fit
            # (a load for a request that then waits takes the slots running requests decode
            # into, gets evicted again, and comes back at every step).
            host = m.host_length
            num_fill = req.num_fill
            if share and new_keys:
                q = req.cache_key(num_fill - 1).tobytes()
                shared = max((common_prefix_tokens(k, q) for s, k in new_keys if s == req.salt), default=0)
                if shared - m.length - host >= self.in_batch_min_tokens:
                    continue  # let the admitted one compute the shared part first
            self.cache.lock(m.node)
            if host:
                _, chunk, reserve = self._chunk_and_reserve(req, m.length + host, budget)
                room = self.allocator.available + self.cache.evictable_size - reserved
                if host + chunk + reserve + self.page_size > room and (admitted or self.running):
                    self.cache.unlock(m.node)
                    break
            if self.tiers is not None:
                t0 = time.perf_counter()
                loaded = self.tiers.load_back(m)  # m.node is locked: making room keeps the prefix
                if loaded.node is not m.node:
                    self.cache.lock(loaded.node)
                    self.cache.unlock(m.node)
                m = loaded
                self.slots.tree_time(t0)
            extend, chunk, reserve = self._chunk_and_reserve(req, m.length, budget)
            available = self.allocator.available + self.cache.evictable_size - reserved
            if chunk + reserve + self.page_size > available and (admitted or self.running):
                self.cache.unlock(m.node)
                break
            if self.window and not self.swa.admits(chunk) and (admitted or self.running):
                self.cache.unlock(m.node)
                break
            req.kv_slots = m.indices.clone()
            req.swa_released = 0
            req.spare_slots = EMPTY_SLOTS
            req.prefix_len = m.length
            req.kv_written = m.length
            req.last_node = m.node
            if not self.slots.take(req, chunk):
                self.cache.unlock(m.node)
                req.kv_slots, req.prefix_len, req.kv_written, req.last_node = EMPTY_SLOTS, 0, 0, None
                break
            self.mamba.admit(req, m.node, m.length)
            if req.cached_tokens < 0:
                if self.tiers is not None:
                    req.tier_report = self.tiers.record_admission(key, m, req.salt, req.prefetch)
                    req.prefetch = None
                req.cached_tokens = min(m.length, len(req.prompt_ids))
                self.stats.prefix_query_tokens += len(req.prompt_ids)
                self.stats.prefix_hit_tokens += req.cached_tokens
                if req.image_spans:
                    self.stats.image_query_tokens += image_tokens_in(len(req.prompt_ids), req.image_spans)
                    self.stats.image_hit_tokens += image_tokens_in(req.cached_tokens, req.image_spans)
                self.stats.max_wait_seconds = max(self.stats.max_wait_seconds,
                                                  time.monotonic() - req.arrival)
            self.waiting.remove(req)
            req.status = ReqStatus.PREFILLING
            admitted.append((req, chunk))
            reserved += reserve
            budget -= chunk
            if share:
                new_keys.append((req.salt, req.cache_key().tobytes()))
            if chunk < extend:
                self.chunked = req
                break
        if admitted:
            last = max(r.seq_no for r, _ in admitted)
            for r in self.waiting:
                if r.seq_no < last:  # a later arrival went ahead of it
                    r.passed_over += 1

    # ------------------------------------------------------------------ after the forward
    def postprocess(self, batch: ScheduledBatch, rows: Sequence[SampledRow | None],
                    verified: Sequence[Sequence[SampledRow] | None] | None = None) -> list[Req]:
        """Apply a successful step: mark its K/V written, put prefill chunks into the tree,
        append sampled tokens, end what must end. ``rows[i]`` is the sampler's result for
        ``batch.reqs[i]`` (None where nothing was sampled); ``verified[i]``, for a row with
        a draft, the sampler's tokens at its positions up to the first that differs from the
        draft. Returns the requests that ended."""
        return apply_step(self, batch, rows, verified)

    def fail_batch(self, batch: ScheduledBatch, error: str) -> list[Req]:
        """The step raised for a reason no single request explains: fail the requests it
        ran (their slots for this step were never written, so they never reach the tree);
        the waiting queue is untouched."""
        self.stats.failed_steps += 1
        ended = []
        for req in batch.reqs:
            if not req.finished:
                self.finish(req, "error", error)
                ended.append(req)
        return ended

    # ------------------------------------------------------------------ cache control
    def flush_cache(self) -> bool:
        """Empty the tree; refused (False) while requests run, since they read its slots."""
        if self.num_unfinished:
            return False
        self.sessions.release_all()  # the sessions stay open, holding nothing
        self.cache.reset()
        return True

    def open_session(self, session_id: str, ttl_s: float | None = None) -> bool:
        """Open a session with its own TTL (requests open theirs implicitly); False if open."""
        return self.sessions.open(session_id, ttl_s)

    def close_session(self, session_id: str) -> bool:
        """End a session: its lock goes now, and its requests still in flight keep nothing
        when they finish. False if it was not open."""
        for r in self.all_reqs():
            if r.session_id == session_id:
                r.session_id = None
        return self.sessions.close(session_id)

    def check_integrity(self) -> None:
        """Raise AssertionError if a slot or lock invariant is broken (``sched/integrity.py``)."""
        check_scheduler(self)
