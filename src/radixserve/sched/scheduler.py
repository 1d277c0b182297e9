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

import random
import time
from typing import Sequence

from radixserve.cache import PrefixCache
from radixserve.cache.base import TieredCache
from radixserve.config import EngineConfig
from radixserve.request import Req, ReqStatus
from radixserve.memory import SlotAllocator
from radixserve.memory.mamba import MambaStatePool
from radixserve.sched.admission import Admission, PrefillAdder, match_key
from radixserve.sched.batch import SampledRow, ScheduledBatch, SchedulerOutput, SchedulerStats
from radixserve.sched.integrity import Auditor
from radixserve.sched.mamba import RecurrentStates
from radixserve.sched.postprocess import StepApplier
from radixserve.sched.sessions import SessionTable
from radixserve.sched.slots import RequestSlots
from radixserve.sched.speculation import Speculator
from radixserve.sched.step_costs import StepCosts
from radixserve.sched.window import WindowKV


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: SlotAllocator, cache: PrefixCache, max_context_len: int,
                 eos_ids: Sequence[int] = (), vocab_size: int | None = None, states: MambaStatePool | None = None):
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
        self.max_context_len = max_context_len
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # admitted, prompt partly computed
        self.stats = SchedulerStats()
        self.rng = random.Random(config.seed)
        self._seq = 0
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
            costs = StepCosts(config.speculative_row_cost, measured=config.speculative_pricing == "measured")
            self.spec = Speculator(cache, config.num_draft_tokens, config.speculative_min_ngram,
                                   config.speculative_max_ngram, vocab_size, max_context_len, costs)
        #: Which waiting requests a step admits (``sched/admission.py``).
        self.admission = Admission(config, allocator, cache, self.slots, self.mamba, self.swa,
                                   self.stats, max_context_len)
        #: A step's results applied to its requests (``sched/postprocess.py``).
        self.applier = StepApplier(allocator, self.slots, self.mamba, self.swa, self.stats, self.spec,
                                   frozenset(eos_ids), config.grammar_fast_forward, max_context_len,
                                   start=self.running.append, finish=self.finish)
        self.auditor = Auditor(allocator, cache, self.sessions, self.mamba)

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        req.seq_no = self._seq
        self._seq += 1
        req.status = ReqStatus.WAITING
        self.sessions.touch(req.session_id)
        # A tiered cache starts fetching from storage what it does not hold locally.
        if self.tiers is not None:
            req.prefetch = self.tiers.prefetch(match_key(req), salt=req.salt)
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
        req.end(reason, error)
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
        self.stats.retractions += 1
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. With ``mixed_steps``, the running requests decode and a
        prefill chunk rides along in the same forward; otherwise a step is all prefill (when
        anything can be admitted) or all decode."""
        self.cache.poll()
        self.sessions.expire()
        failed: list[Req] = []
        decodes: list[Req] = []
        drafts: dict[Req, list[int]] = {}
        mixed = self.config.mixed_steps
        if mixed:
            decodes, drafts = self._take_decode_slots(failed)
        prefill = self._schedule_prefill()
        if not mixed and not prefill:
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
            chunk = self.mamba.cut(req, req.computed_len, min(extend, budget, self.swa.chunk_cap))
            if not self.slots.take(req, chunk):
                return []  # decode will make progress or retract; try again next step
            admitted.append((req, chunk))
            budget -= chunk
            if chunk < extend:
                return admitted
            self.chunked = None

        if self.waiting and budget > 0 and len(self.running) + len(admitted) < cfg.max_running_requests:
            reserved = self.admission.reserved_for(self.running, self.chunked)
            adder = PrefillAdder(self.admission, admitted, budget, reserved, len(self.running))
            adder.run(self.admission.order(self.waiting, self.rng), self.waiting)
            self.chunked = adder.chunked
        return admitted

    # ------------------------------------------------------------------ after the forward
    def postprocess(self, batch: ScheduledBatch, rows: Sequence[SampledRow | None],
                    verified: Sequence[Sequence[SampledRow] | None] | None = None) -> list[Req]:
        """Apply a successful step: mark its K/V written, put prefill chunks into the tree,
        append sampled tokens, end what must end. ``rows[i]`` is the sampler's result for
        ``batch.reqs[i]`` (None where nothing was sampled); ``verified[i]``, for a row with
        a draft, the sampler's tokens at its positions up to the first that differs from the
        draft. Returns the requests that ended."""
        return self.applier.apply(batch, rows, verified)

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """The run of ``batch`` took ``seconds`` of CPU: a decode-only step's time prices
        the next steps' draft rows (speculative decoding)."""
        if self.spec is not None and batch.num_decode == len(batch.reqs):
            self.spec.observe(sum(batch.extend_lens), seconds)

    def fail_batch(self, batch: ScheduledBatch, error: str) -> list[Req]:
        """The step raised for a reason no single request explains: fail the requests it
        ran (their slots for this step were never written, so they never reach the tree);
        the waiting queue is untouched."""
        self.stats.failed_steps += 1
        ended = [req for req in batch.reqs if not req.finished]
        for req in ended:
            self.finish(req, "error", error)
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
        self.auditor.check(self.running + ([self.chunked] if self.chunked else []), self.waiting)
