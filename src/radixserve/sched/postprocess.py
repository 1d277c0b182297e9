"""A successful step applied to its requests: K/V marked written, prefill chunks into the
tree, sampled tokens appended, and whatever must end ended (stop token, grammar, length).

A decode row that verified a draft (speculative decoding, ``sched/speculation.py``) appends
the sampler's tokens at its positions, stopping where one differs from the draft or ends
the request, exactly as that many one-token steps would (a grammar request's grammar takes
each of them, and fast-forwards after the last one only); the KV of its positions past the
last kept token is given back before anything is marked written or enters the tree.

The scheduler's half after the forward pass, kept apart from its half before it (admission
and batching); every request that ends still goes through ``Scheduler.finish``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from radixserve.core import Req, ReqStatus
from radixserve.sched.batch import SampledRow, ScheduledBatch
from radixserve.sched.grammar_step import accept_grammar, advance_grammar, fast_forward_grammar

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def apply_step(s: "Scheduler", batch: ScheduledBatch, rows: Sequence[SampledRow | None],
               verified: Sequence[Sequence[SampledRow] | None] | None = None) -> list[Req]:
    """``Scheduler.postprocess``: ``rows[i]`` is the sampler's result for ``batch.reqs[i]``
    (None where nothing was sampled), ``verified[i]`` its results at a draft's positions.
    Returns the requests that ended."""
    ended: list[Req] = []
    now = time.monotonic()
    for i, req in enumerate(batch.reqs):
        if req.finished:  # aborted while the step ran (in-process callers)
            continue
        draft = batch.draft(i)
        if draft:
            if verified is None or verified[i] is None:
                raise RuntimeError(f"request {req.rid} ran a draft that was not verified")
            if _apply_verified(s, req, draft, verified[i]):
                ended.append(req)
            continue
        s.allocator.mark_written(req.kv_slots[req.kv_written :])
        req.kv_written = req.computed_len
        if i >= batch.num_decode:
            # Each prefilled chunk enters the tree at once so concurrent requests hit it.
            s.slots.cache_written(req, keep_lock=True)
            s.mamba.after_chunk(req)
            if batch.sample[i]:
                req.status = ReqStatus.RUNNING
                s.running.append(req)
            else:
                continue
        elif s.window:  # prompts enter the tree with their SWA KV (it may be hit);
            s.swa.release_window(req)  # generated tokens give it back out of the window
        row = rows[i]
        p = req.params
        if row is None or p.max_tokens <= len(req.output_ids):
            s.finish(req, "length")  # prefill only (max_tokens == 0)
            ended.append(req)
            continue
        if row.error is not None:
            s.finish(req, "error", row.error)
            ended.append(req)
            continue
        tok = row.token
        req.output_ids.append(tok)
        s.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        if (not p.ignore_eos and tok in s.eos_ids) or tok in p.stop_token_ids:
            req.matched_stop = tok
            s.finish(req, "stop")
            ended.append(req)
        elif req.grammar is not None and (end := advance_grammar(
                req, tok, s.fast_forward, s.max_context_len, s.stats)) is not None:
            s.finish(req, *end)
            ended.append(req)
        elif len(req.output_ids) >= p.max_tokens or req.num_fill >= s.max_context_len:
            s.finish(req, "length")
            ended.append(req)
    return ended


def _stop_reason(s: Scheduler, req: Req, tok: int) -> tuple[str, str | None] | None:
    """Why ``req`` ends now that ``tok`` is its last token, or None: the checks of
    :func:`apply_step` in its order (stop token, grammar without fast-forward, length)."""
    p = req.params
    if (not p.ignore_eos and tok in s.eos_ids) or tok in p.stop_token_ids:
        req.matched_stop = tok
        return "stop", None
    if req.grammar is not None and (end := accept_grammar(req, tok)) is not None:
        return end
    if len(req.output_ids) >= p.max_tokens or req.num_fill >= s.max_context_len:
        return "length", None
    return None


def _apply_verified(s: Scheduler, req: Req, draft: list[int], rows: Sequence[SampledRow]) -> bool:
    """A decode row that computed its last token and ``draft``: append the sampler's tokens
    ``rows`` (each position's, up to the first that is not the draft's next token), as one
    decode step per token would, and keep the KV of the positions those tokens follow.
    Returns whether the request ended."""
    reason: str | None = None
    error: str | None = None
    appended = 0
    sampled_error = False
    for row in rows:
        if row.error is not None:
            reason, error = "error", row.error
            sampled_error = True
            break
        req.output_ids.append(row.token)
        appended += 1
        end = _stop_reason(s, req, row.token)
        if end is not None:
            reason, error = end
            break
    accepted = max(0, appended - 1) if not sampled_error else appended
    s.stats.generated_tokens += appended
    s.stats.draft_tokens += len(draft)
    s.stats.accepted_draft_tokens += accepted
    s.stats.verified_rows += 1
    s.spec.record(req, len(draft), accepted)
    # The K/V computed for the last token and the accepted draft tokens stays; the positions
    # after them (rejected, or past the end) go back now, unwritten.
    s.slots.drop_tail(req, req.num_fill - 1 if not sampled_error else req.num_fill)
    s.allocator.mark_written(req.kv_slots[req.kv_written :])
    req.kv_written = req.computed_len
    if s.window:
        s.swa.release_window(req)
    if reason is None and req.grammar is not None and s.fast_forward:
        end = fast_forward_grammar(req, s.max_context_len, s.stats)
        if end is not None:
            reason, error = end
    if reason is not None:
        s.finish(req, reason, error)
        return True
    return False
