"""What a request reports after a step (:class:`~radixserve.engine.messages.ReqDelta`): the
tokens it added, their logprobs, and what it reports once (its tier report, its prompt
logprobs, its end). Built from the request and the step's result alone."""

from __future__ import annotations

from radixserve.engine.messages import ReqDelta
from radixserve.request import Req
from radixserve.sched.batch import SampledRow

TopLogprobs = list[list[tuple[int, float]]]


def delta_of(req: Req, new: list[int], lps: list[float] | None = None,
             tops: TopLogprobs | None = None) -> ReqDelta:
    """``req``'s delta with the tokens ``new`` (and their logprobs) this step added."""
    d = ReqDelta(req.rid, new, max(0, req.cached_tokens), logprobs=lps, top_logprobs=tops)
    if req.first_token_time is not None and (new and len(req.output_ids) == len(new)):
        d.first_token_time = req.first_token_time
    if req.tier_report is not None:
        d.cached_by_tier = req.tier_report.get("cached")
        d.uncached_by_reason = req.tier_report.get("uncached")
        req.tier_report = None  # sent once
    if req.logprob_start >= 0 and not req.prompt_logprobs_sent and (req.output_ids or req.finished):
        d.prompt_logprobs = req.prompt_logprobs
        d.prompt_top_logprobs = req.prompt_top_logprobs
        req.prompt_logprobs_sent = True
    if req.spec is not None and req.spec.drafted:  # running totals: a stop string ends it API-side
        d.draft_tokens, d.accepted_draft_tokens = req.spec.drafted, req.spec.accepted
    if req.finished:
        _finish(d, req)
    return d


def _finish(d: ReqDelta, req: Req) -> None:
    d.finished = True
    d.finish_reason = req.finish_reason
    d.matched_stop = req.matched_stop
    d.error = req.error
    d.finish_time = req.finish_time
    if req.first_token_time is not None:
        d.first_token_time = req.first_token_time


def sampled_delta(req: Req, new: list[int], rows: list[SampledRow]) -> ReqDelta:
    """The delta of a request that appended ``new`` this step; ``rows`` are the sampled rows
    of those tokens (one per token, except a grammar's forced tokens, which have none)."""
    rows = rows[: len(new)] if new else []
    p = req.params
    lp = [0.0 if r.logprob is None else r.logprob for r in rows] if rows and p.wants_logprobs else None
    tlp = [r.top_logprobs or [] for r in rows] if rows and p.top_logprobs else None
    return delta_of(req, new, lp, tlp)
