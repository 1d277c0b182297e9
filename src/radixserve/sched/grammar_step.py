"""A structured-output request's grammar after each sampled token: accept it, then take the
tokens the grammar forces next (fast-forward), so that the next step computes them as one
extend. Kept out of the scheduler's admission code: only grammar rows ever get here."""

from __future__ import annotations

from radixserve.request import Req
from radixserve.sched.batch import SchedulerStats


def accept_grammar(req: Req, tok: int) -> tuple[str, str | None] | None:
    """Feed the sampled ``tok`` to ``req``'s grammar. Returns ``(finish_reason, error)`` when
    the request must end: the grammar is complete ("stop"), or it refused the token ("error")."""
    g = req.grammar
    if not g.accept(tok):
        return "error", f"grammar: token {tok} does not match the grammar ({g.error or 'refused'})"
    if g.stopped:
        return "stop", None
    return None


def fast_forward_grammar(req: Req, max_context_len: int, stats: SchedulerStats) -> tuple[str, str | None] | None:
    """Append the tokens ``req``'s grammar forces now to ``req.output_ids`` (unless the request
    wants logprobs: a forced token's logprob needs its own logits). Returns ``(finish_reason,
    error)`` when the request must end."""
    g = req.grammar
    p = req.params
    if p.wants_logprobs:
        return None
    while len(req.output_ids) < p.max_tokens and req.num_fill < max_context_len:
        t = g.forced_token()
        if t is None:
            break
        if not g.accept(t):  # cannot happen: the grammar forced it
            return "error", f"grammar: forced token {t} refused ({g.error or 'refused'})"
        req.output_ids.append(t)
        stats.generated_tokens += 1
        stats.forced_tokens += 1
        if g.stopped:
            return "stop", None
    return None
