"""A successful step applied to its requests: K/V marked written, prefill chunks into the
tree, sampled tokens appended, and whatever must end ended (stop token, grammar, length).

The scheduler's half after the forward pass, kept apart from its half before it (admission
and batching); every request that ends still goes through ``Scheduler.finish``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

from radixserve.core import Req, ReqStatus
from radixserve.sched.batch import SampledRow, ScheduledBatch
from radixserve.sched.grammar_step import advance_grammar

if TYPE_CHECKING:
    from radixserve.sched.scheduler import Scheduler


def apply_step(s: "Scheduler", batch: ScheduledBatch, rows: Sequence[SampledRow | None]) -> list[Req]:
    """``Scheduler.postprocess``: ``rows[i]`` is the sampler's result for ``batch.reqs[i]``
    (None where nothing was sampled). Returns the requests that ended."""
    ended: list[Req] = []
    now = time.monotonic()
    for i, req in enumerate(batch.reqs):
        if req.finished:  # aborted while the step ran (in-process callers)
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
