"""A successful step applied to its requests: K/V marked written, prefill chunks into the
tree, sampled tokens appended, and whatever must end ended (stop token, grammar, length).

A decode row that verified a draft (speculative decoding, ``sched/speculation.py``) appends
the sampler's tokens at its positions, stopping where one differs from the draft or ends
the request, exactly as that many one-token steps would (a grammar request's grammar takes
each of them, and fast-forwards after the last one only); the KV of its positions past the
last kept token is given back before anything is marked written or enters the tree, and a
hybrid Mamba model's state becomes the state after the kept positions only.

The scheduler's half after the forward pass, kept apart from its half before it (admission
and batching): :class:`StepApplier` is given the pieces it changes (the slots, the Mamba
states, the window KV, the counters) and two calls back into the scheduler, ``start``
(a prefilled request starts decoding) and ``finish`` (every request that ends still goes
through ``Scheduler.finish``).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from radixserve.request import Req, ReqStatus
from radixserve.memory import SlotAllocator
from radixserve.sched.batch import SampledRow, ScheduledBatch, SchedulerStats
from radixserve.sched.grammar_step import accept_grammar, fast_forward_grammar
from radixserve.sched.mamba import RecurrentStates
from radixserve.sched.slots import RequestSlots
from radixserve.sched.speculation import Speculator
from radixserve.sched.window import WindowKV

#: Why a request ends, and the error message if it failed.
End = tuple[str, "str | None"]


class StepApplier:
    """Applies each successful step's results to its requests (``Scheduler.postprocess``)."""

    def __init__(self, allocator: SlotAllocator, slots: RequestSlots, mamba: RecurrentStates,
                 swa: WindowKV, stats: SchedulerStats, spec: Speculator | None,
                 eos_ids: frozenset[int], fast_forward: bool, max_context_len: int,
                 start: Callable[[Req], None], finish: Callable[..., None]) -> None:
        self.allocator = allocator
        self.slots = slots
        self.mamba = mamba
        self.swa = swa
        self.stats = stats
        self.spec = spec
        self.eos_ids = eos_ids
        self.fast_forward = fast_forward
        self.max_context_len = max_context_len
        self._start = start
        self._finish = finish

    def apply(self, batch: ScheduledBatch, rows: Sequence[SampledRow | None],
              verified: Sequence[Sequence[SampledRow] | None] | None = None) -> list[Req]:
        """See :meth:`Scheduler.postprocess`; returns the requests that ended."""
        ended: list[Req] = []
        now = time.monotonic()
        for i, req in enumerate(batch.reqs):
            if req.finished:  # aborted while the step ran (in-process callers)
                continue
            draft = batch.draft(i)
            if draft:
                if verified is None or verified[i] is None:
                    raise RuntimeError(f"request {req.rid} ran a draft that was not verified")
                end = self._apply_verified(req, draft, verified[i])
            elif self._mark_written(req, i >= batch.num_decode, batch.sample[i]):
                end = self._append(req, rows[i], now)
            else:
                continue
            if end is not None:
                self._finish(req, *end)
                ended.append(req)
        return ended

    def _mark_written(self, req: Req, prefill: bool, sampled: bool) -> bool:
        """The step's K/V of ``req`` is written: a prefill chunk enters the tree at once (so
        concurrent requests hit it). Returns whether a token was sampled for it."""
        self.allocator.mark_written(req.kv_slots[req.kv_written :])
        req.kv_written = req.computed_len
        if prefill:
            self.slots.cache_written(req, keep_lock=True)
            self.mamba.after_chunk(req)
            if sampled:
                req.status = ReqStatus.RUNNING
                self._start(req)
            return sampled
        if self.swa.window:  # prompts enter the tree with their SWA KV (it may be hit);
            self.swa.release_window(req)  # generated tokens give it back out of the window
        return True

    def _append(self, req: Req, row: SampledRow | None, now: float) -> End | None:
        """Append the sampled token of ``row``; why the request ends now, or None."""
        if row is None or req.params.max_tokens <= len(req.output_ids):
            return "length", None  # prefill only (max_tokens == 0)
        if row.error is not None:
            return "error", row.error
        tok = row.token
        req.output_ids.append(tok)
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        return self._end_after(req, tok, self.fast_forward)

    def _end_after(self, req: Req, tok: int, fast_forward: bool) -> End | None:
        """Why ``req`` ends now that ``tok`` is its last token, or None: a stop token, its
        grammar (which takes ``tok``, then with ``fast_forward`` the tokens it forces), length."""
        p = req.params
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            req.matched_stop = tok
            return "stop", None
        if req.grammar is not None:
            end = accept_grammar(req, tok)
            if end is None and fast_forward:
                end = fast_forward_grammar(req, self.max_context_len, self.stats)
            if end is not None:
                return end
        if len(req.output_ids) >= p.max_tokens or req.num_fill >= self.max_context_len:
            return "length", None
        return None

    def _apply_verified(self, req: Req, draft: list[int], rows: Sequence[SampledRow]) -> End | None:
        """A decode row that computed its last token and ``draft``: append the sampler's tokens
        ``rows`` (each position's, up to the first that is not the draft's next token), as one
        decode step per token would, and keep the KV of the positions those tokens follow.
        Returns why the request ends, or None."""
        end: End | None = None
        appended = 0
        sampled_error = False
        for row in rows:
            if row.error is not None:
                end, sampled_error = ("error", row.error), True
                break
            req.output_ids.append(row.token)
            appended += 1
            end = self._end_after(req, row.token, False)
            if end is not None:
                break
        accepted = appended if sampled_error else max(0, appended - 1)
        self._count_verified(req, len(draft), appended, accepted)
        # The K/V computed for the last token and the accepted draft tokens stays; the positions
        # after them (rejected, or past the end) go back now, unwritten.
        self.slots.drop_tail(req, req.num_fill if sampled_error else req.num_fill - 1)
        self.allocator.mark_written(req.kv_slots[req.kv_written :])
        start, req.kv_written = req.kv_written, req.computed_len
        self.mamba.settle(req, req.kv_written - start)  # the state after exactly the kept positions
        if self.swa.window:
            self.swa.release_window(req)
        if end is None and req.grammar is not None and self.fast_forward:
            end = fast_forward_grammar(req, self.max_context_len, self.stats)
        return end

    def _count_verified(self, req: Req, drafted: int, appended: int, accepted: int) -> None:
        st = self.stats
        st.generated_tokens += appended
        st.draft_tokens += drafted
        st.accepted_draft_tokens += accepted
        st.verified_rows += 1
        self.spec.record(req, drafted, accepted)
