"""Admission, batching and KV-slot bookkeeping: the one place where cache, memory and requests meet.

The engine loop is ``schedule()`` -> ``runner.forward(batch.forward)`` -> sample ->
``postprocess(batch, tokens)``. The scheduler decides which requests run, gives each one KV
slots (its cached prefix from the tree plus fresh slots for the tail), and hands slots back
to the tree or the free list when a request is done, aborted or retracted.

Memory is one pool shared by the cache and the running requests, with no fixed reserve for
either: admission counts ``free + evictable`` as available, and allocation evicts
least-recently-used leaves only when the free list runs short.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from radixserve.cache import PrefixCache, RadixCache
from radixserve.config import EngineConfig
from radixserve.core import Req, ReqStatus
from radixserve.memory import SlotAllocator
from radixserve.model.forward_batch import ForwardBatch
from radixserve.sched.policy import order_waiting

_EMPTY = torch.empty(0, dtype=torch.int64)

# Requests sharing at least this many uncached tokens with one already admitted in the
# same step wait one step, so that they hit the shared part instead of recomputing it.
IN_BATCH_SHARING_MIN_TOKENS = 32
# A request's decode reservation is clipped here: a chat request without max_tokens may ask
# for the whole context, and reserving a share of that would starve admission. If the
# estimate is exceeded, decode evicts and, at worst, retracts (as SGLang's clip does).
DECODE_RESERVE_CLIP = 1024


@dataclass
class ScheduledBatch:
    """What one step runs: the requests, how many tokens each computes, the model input."""

    kind: str  # "prefill" or "decode"
    reqs: list[Req]
    extend_lens: list[int]
    forward: ForwardBatch
    # Per request: does this pass end its prompt (or is a decode), so a token is sampled?
    sample: list[bool] = field(default_factory=list)
    # Per request: position of the first new token (for prompt logprobs).
    starts: list[int] = field(default_factory=list)


@dataclass
class SchedulerStats:
    prefix_query_tokens: int = 0  # prompt tokens looked up in the cache at first admission
    prefix_hit_tokens: int = 0  # of those, tokens served from the cache
    computed_prefill_tokens: int = 0  # tokens run through prefill (chunks, recomputation)
    generated_tokens: int = 0
    retractions: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    tree_seconds: float = 0.0  # time spent in prefix-cache operations


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        allocator: SlotAllocator,
        cache: PrefixCache,
        max_context_len: int,
        device: str | torch.device = "cpu",
    ):
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self.max_context_len = max_context_len
        self.device = device
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # admitted, prompt partly computed
        self.stats = SchedulerStats()
        self.rng = random.Random(config.seed)
        self._seq = 0
        self.in_batch_min_tokens = 1 if config.policy == "dfs-weight" else IN_BATCH_SHARING_MIN_TOKENS

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        req.seq_no = self._seq
        self._seq += 1
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + (1 if self.chunked else 0)

    def all_reqs(self) -> list[Req]:
        return self.waiting + self.running + ([self.chunked] if self.chunked else [])

    def find(self, rid: str) -> Req | None:
        for r in self.all_reqs():
            if r.rid == rid:
                return r
        return None

    # ------------------------------------------------------------------ slots
    def _tree_time(self, t0: float) -> None:
        self.stats.tree_seconds += time.perf_counter() - t0

    def _alloc(self, n: int) -> torch.Tensor | None:
        """``n`` fresh slots (whole pages), evicting LRU leaves of the tree if needed."""
        if n == 0:
            return _EMPTY
        need = self.allocator.pages_for(n) * self.page_size
        if self.allocator.available < need:
            t0 = time.perf_counter()
            self.cache.evict(need - self.allocator.available)
            self._tree_time(t0)
        return self.allocator.alloc(n)

    def _take_slots(self, req: Req, n: int) -> bool:
        """Append ``n`` slots to the request: leftovers of its last page first, then new pages."""
        spare = req.spare_slots
        use = min(n, int(spare.numel()))
        fresh = _EMPTY
        rest = n - use
        if rest:
            got = self._alloc(rest)
            if got is None:
                return False
            fresh = got
        req.kv_slots = torch.cat([req.kv_slots, spare[:use], fresh[:rest]])
        req.spare_slots = torch.cat([spare[use:], fresh[rest:]])
        return True

    def _slots_needed(self, req: Req, n: int) -> int:
        """Free slots that taking ``n`` more tokens would consume (page granularity)."""
        rest = n - min(n, int(req.spare_slots.numel()))
        return self.allocator.pages_for(rest) * self.page_size

    def _cache_computed(self, req: Req, keep_lock: bool) -> int:
        """Put the request's computed tokens into the cache; return the length the cache holds.

        Frees the request's duplicates of tokens the cache already had. When ``keep_lock``,
        the request's slots are re-pointed at the cache's and its lock moves to the new node
        (so its whole cached part stays protected while it runs); otherwise the lock is
        released and the private remainder is freed.
        """
        t0 = time.perf_counter()
        key = req.cache_key(req.computed_len)
        n = self.cache.insert(key, req.kv_slots, salt=req.salt)
        if n > req.prefix_len:
            self.allocator.free(req.kv_slots[req.prefix_len : n])
        m = self.cache.match_prefix(key, salt=req.salt)
        if keep_lock:
            self.cache.lock(m.node)
            if req.last_node is not None:
                self.cache.unlock(req.last_node)
            req.kv_slots = torch.cat([m.indices, req.kv_slots[m.length :]])
            req.prefix_len = m.length
            req.last_node = m.node
        else:
            private = torch.cat([req.kv_slots[m.length :], req.spare_slots])
            if req.last_node is not None:
                self.cache.unlock(req.last_node)
            self.allocator.free(private)
            req.kv_slots = _EMPTY
            req.spare_slots = _EMPTY
            req.prefix_len = 0
            req.last_node = None
        self._tree_time(t0)
        return m.length

    def release(self, req: Req) -> None:
        """Give back everything the request holds: computed KV goes to the cache, the rest is freed."""
        if req.computed_len or req.spare_slots.numel() or req.last_node is not None:
            self._cache_computed(req, keep_lock=False)

    # ------------------------------------------------------------------ finish / abort / retract
    def finish(self, req: Req, reason: str) -> None:
        if req.status is ReqStatus.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req is self.chunked:
            self.chunked = None
        self.release(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        if reason == "abort":
            self.stats.aborted_requests += 1
        else:
            self.stats.finished_requests += 1

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its computed tokens stay in the cache."""
        self.running.remove(req)
        self.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.stats.retractions += 1
        self.waiting.insert(0, req)

    # ------------------------------------------------------------------ scheduling
    def _match_key(self, req: Req):
        """Tokens the cache may serve: all but the last (its logits are needed), and none
        from the first prompt position whose logprob is asked for (packed, see
        ``Req.cache_key``)."""
        end = req.num_fill - 1
        if req.logprob_start >= 0 and not req.output_ids:
            # The logprob of token p comes from the logits at p - 1: compute from there.
            end = min(end, max(0, req.logprob_start - 1))
        return req.cache_key(max(0, end))

    def _decode_reserve(self, req: Req) -> int:
        est = math.ceil(self.config.decode_reserve_ratio * min(req.remaining_tokens, DECODE_RESERVE_CLIP))
        room = self.max_context_len - len(req.fill_ids)
        return max(0, min(est, room))

    def _reserved_for_running(self) -> int:
        total = sum(self._decode_reserve(r) for r in self.running)
        if self.chunked is not None:
            total += self._decode_reserve(self.chunked) + len(self.chunked.fill_ids) - self.chunked.computed_len
        return total

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        cfg = self.config
        budget = cfg.max_prefill_tokens
        admitted: list[tuple[Req, int]] = []

        if self.chunked is not None:
            req = self.chunked
            extend = len(req.fill_ids) - req.computed_len
            chunk = min(extend, budget, cfg.chunked_prefill_size)
            if not self._take_slots(req, chunk):
                return None  # decode will make progress or retract; try again next step
            admitted.append((req, chunk))
            budget -= chunk
            if chunk < extend:
                return self._build_prefill(admitted)
            self.chunked = None

        if self.waiting and budget > 0 and len(self.running) + len(admitted) < cfg.max_running_requests:
            self._admit_waiting(admitted, budget)
        if not admitted:
            return None
        return self._build_prefill(admitted)

    def _admit_waiting(self, admitted: list[tuple[Req, int]], budget: int) -> None:
        cfg = self.config
        policy = cfg.policy
        if policy == "lpm" and len(self.waiting) > cfg.lpm_fallback_queue_len:
            policy = "fcfs"
        if policy == "lpm":
            t0 = time.perf_counter()
            for r in self.waiting:
                r.match_len = self.cache.match_prefix(self._match_key(r), salt=r.salt).length
            self._tree_time(t0)
        ordered = order_waiting(policy, self.waiting, self.rng)

        reserved = self._reserved_for_running()
        # Only a tree can serve a shared part of another request's prompt: with the table
        # or no cache, deferring would just serialize the batch.
        share = cfg.in_batch_sharing and isinstance(self.cache, RadixCache)
        batch_trie = RadixCache(page_size=1) if share else None
        if batch_trie is not None:
            for r, _ in admitted:
                batch_trie.insert(r.cache_key(), torch.zeros(r.num_fill, dtype=torch.int64), salt=r.salt)
        for req in ordered:
            if budget <= 0 or len(self.running) + len(admitted) >= cfg.max_running_requests:
                break
            t0 = time.perf_counter()
            m = self.cache.match_prefix(self._match_key(req), salt=req.salt)
            self._tree_time(t0)
            num_fill = req.num_fill
            if batch_trie is not None and admitted:
                shared = batch_trie.match_prefix(req.cache_key(num_fill - 1), salt=req.salt).length
                if shared - m.length >= self.in_batch_min_tokens:
                    continue  # let the admitted one compute the shared part first
            extend = num_fill - m.length
            chunk = min(extend, budget, cfg.chunked_prefill_size)
            self.cache.lock(m.node)
            reserve = self._decode_reserve(req)
            if chunk < extend:
                reserve += extend - chunk  # the rest of the prompt comes in later chunks
            available = self.allocator.available + self.cache.evictable_size - reserved
            if chunk + reserve + self.page_size > available and (admitted or self.running):
                self.cache.unlock(m.node)
                break
            req.kv_slots = m.indices.clone()
            req.spare_slots = _EMPTY
            req.prefix_len = m.length
            req.last_node = m.node
            if not self._take_slots(req, chunk):
                self.cache.unlock(m.node)
                req.kv_slots, req.prefix_len, req.last_node = _EMPTY, 0, None
                break
            if req.cached_tokens < 0:
                req.cached_tokens = min(m.length, len(req.prompt_ids))
                self.stats.prefix_query_tokens += len(req.prompt_ids)
                self.stats.prefix_hit_tokens += req.cached_tokens
            self.waiting.remove(req)
            req.status = ReqStatus.PREFILLING
            admitted.append((req, chunk))
            reserved += reserve
            budget -= chunk
            if batch_trie is not None:
                batch_trie.insert(req.cache_key(), torch.zeros(num_fill, dtype=torch.int64), salt=req.salt)
            if chunk < extend:
                self.chunked = req
                break

    def _build_prefill(self, admitted: list[tuple[Req, int]]) -> ScheduledBatch:
        reqs = [r for r, _ in admitted]
        ext = [c for _, c in admitted]
        starts = [r.computed_len - c for r, c in admitted]  # kv_slots already extended
        token_ids = [r.fill_ids[s : s + c] for r, s, c in zip(reqs, starts, ext)]
        sample = [s + c == len(r.fill_ids) for r, s, c in zip(reqs, starts, ext)]
        want_all = [
            r.logprob_start >= 0 and not r.output_ids and s + c >= r.logprob_start
            for r, s, c in zip(reqs, starts, ext)
        ]
        fb = ForwardBatch.build(
            token_ids=token_ids,
            prefix_lens=starts,
            seq_slots=[r.kv_slots for r in reqs],
            return_all_logits=want_all,
            device=self.device,
        )
        self.stats.prefill_steps += 1
        self.stats.computed_prefill_tokens += sum(ext)
        return ScheduledBatch("prefill", reqs, ext, fb, sample, starts)

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        # Every running request needs one slot (a new page at a page boundary).
        while True:
            need = sum(self._slots_needed(r, 1) for r in self.running)
            if need <= self.allocator.available:
                break
            t0 = time.perf_counter()
            self.cache.evict(need - self.allocator.available)
            self._tree_time(t0)
            if need <= self.allocator.available:
                break
            if len(self.running) == 1:
                # Nothing left to retract: the lone request has the whole pool and still
                # does not fit (its context outgrew the pool). It fails alone.
                req = self.running[0]
                req.error = "out of KV memory: the request's context exceeds the KV pool"
                self.finish(req, "error")
                return None
            victim = max(self.running, key=lambda r: (r.remaining_tokens, -r.seq_no))
            self._retract(victim)
        reqs = list(self.running)
        starts = []
        for r in reqs:
            starts.append(r.computed_len)
            ok = self._take_slots(r, 1)
            if not ok:  # cannot happen after the loop above; fail loudly rather than corrupt
                raise RuntimeError("decode slot allocation failed after reservation")
        fb = ForwardBatch.build(
            token_ids=[[r.fill_ids[s]] for r, s in zip(reqs, starts)],
            prefix_lens=starts,
            seq_slots=[r.kv_slots for r in reqs],
            device=self.device,
        )
        self.stats.decode_steps += 1
        return ScheduledBatch("decode", reqs, [1] * len(reqs), fb, [True] * len(reqs), starts)

    # ------------------------------------------------------------------ after the forward
    def after_prefill(self, batch: ScheduledBatch) -> None:
        """Insert each prefilled chunk into the cache at once so concurrent requests hit it."""
        for req, done in zip(batch.reqs, batch.sample):
            if req.status is ReqStatus.FINISHED:
                continue
            self._cache_computed(req, keep_lock=True)
            if done:
                req.status = ReqStatus.RUNNING
                self.running.append(req)
            else:
                req.status = ReqStatus.PREFILLING

    def append_token(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        self.stats.generated_tokens += 1

    # ------------------------------------------------------------------ cache control
    def flush_cache(self) -> bool:
        """Empty the tree; refused (False) while requests run, since they read its slots."""
        if self.num_unfinished:
            return False
        self.cache.reset()
        return True

    def check_integrity(self) -> None:
        """Every slot is in exactly one place: free list, tree, or one request's private set."""
        self.cache.check_integrity()
        private: list[torch.Tensor] = []
        for r in self.running + ([self.chunked] if self.chunked else []):
            private += [r.kv_slots[r.prefix_len :], r.spare_slots]
        for r in self.waiting:
            if r.computed_len or r.spare_slots.numel() or r.last_node is not None:
                raise AssertionError(f"waiting request {r.rid} holds KV slots")
        n_private = sum(int(p.numel()) for p in private)
        total = self.allocator.available + self.cache.total_size + n_private
        if total != self.allocator.capacity:
            raise AssertionError(
                f"slot leak: free {self.allocator.available} + tree {self.cache.total_size} + "
                f"private {n_private} != capacity {self.allocator.capacity}"
            )
        if private:
            allp = torch.cat(private)
            if allp.unique().numel() != allp.numel():
                raise AssertionError("a private slot is held twice")
            free = self.allocator.free_slot_set()
            if free & set(allp.tolist()):
                raise AssertionError("a private slot is also on the free list")
        if not self.running and self.chunked is None and self.cache.protected_size != 0:
            raise AssertionError(f"idle but {self.cache.protected_size} tokens still protected")
