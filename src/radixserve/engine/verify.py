"""Verifying a draft: the sampler's own tokens at each draft position, up to the first miss.

A decode row with a draft of ``k`` tokens computes ``k + 1`` positions in one step: its last
token and the draft. With batch-invariant kernels the logits at position ``j`` are the very
bits a plain decode step would compute after the first ``j`` draft tokens (the extend reads
the same K/V in the same order; ``tests/test_speculative.py`` checks the premise). The
scheme is then *exact match*: at each position in order the sampler picks the token plain
decoding would pick there — the same logits, the same penalties over the output so far
(the draft tokens before it included), the same per-request generator, drawn from in the
same order — and the draft's token is kept only if it is that token. The first position
whose token differs from the draft gives the step its last token, and nothing after it is
drawn. So:

* greedy: the tokens are the argmaxes plain decoding takes, and no randomness is used;
* sampling: every token is a draw from the target distribution given the tokens before it,
  so the output distribution is unchanged; with a ``seed`` (every request the engine samples
  has a generator: ``EngineCore.add_request``) the generator advances exactly as in plain
  decoding, one draw per emitted token, so the tokens are identical to decoding without
  speculation, not just equal in distribution. (Rejection sampling as in Leviathan et al.
  would accept more drafts at temperature > 0 but draw a different token stream.)
* logprobs and top logprobs of each emitted token are those of its own position.
* grammar requests: each position gets the constraint plain decoding would apply there (the
  grammar's forced token or its mask after the draft tokens before it,
  ``GrammarGate.draft_constraints``), so a draft the grammar forces is accepted whole and any
  other is kept only where the constrained sampler picks it.

Greedy rows sample all positions in one sampler call (no generator to keep in step: the
argmax of a row does not depend on its neighbours); sampled rows call the sampler once per
position, so each draw comes after the ones before it and none is made past the first miss.
"""

from __future__ import annotations

import torch

from radixserve.request import Req
from radixserve.engine.sampler import RowConstraint, SampleOutput, Sampler
from radixserve.sched.batch import SampledRow

__all__ = ["DraftVerifier", "sampled_row"]


class DraftVerifier:
    """The sampler's tokens at a draft's positions, stopping at the first that differs."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def verify(self, req: Req, draft: list[int], logits: torch.Tensor,
               constraints: list[RowConstraint] | None = None) -> list[SampledRow]:
        """``logits`` [len(draft) + 1, V]: row ``j`` follows the request's tokens and
        ``draft[:j]``; ``constraints``: a grammar request's, one per position. Returns the
        sampled rows of positions ``0 .. a``, where ``draft[:a]`` is accepted and row ``a``
        is the token plain decoding takes next (a miss, or the token after a fully accepted
        draft), or an earlier row with an error."""
        k = len(draft)
        if logits.shape[0] != k + 1:
            raise ValueError(f"verify: {logits.shape[0]} logit rows for a draft of {k} tokens")
        if constraints is not None and len(constraints) != k + 1:
            raise ValueError(f"verify: {len(constraints)} grammar constraints for a draft of {k} tokens")
        p = req.params
        out = req.output_ids
        if p.is_greedy:
            so = self.sampler.sample(logits, [p] * (k + 1), [out + draft[:j] for j in range(k + 1)],
                                     [req.prompt_ids] * (k + 1), [req.generator] * (k + 1), constraints)
            rows = [sampled_row(so, j) for j in range(k + 1)]
            for j, row in enumerate(rows):
                if row.error is not None or j == k or row.token != draft[j]:
                    return rows[: j + 1]
        rows = []
        for j in range(k + 1):
            so = self.sampler.sample(logits[j : j + 1], [p], [out + draft[:j]], [req.prompt_ids],
                                     [req.generator], None if constraints is None else [constraints[j]])
            row = sampled_row(so, 0)
            rows.append(row)
            if row.error is not None or j == k or row.token != draft[j]:
                break
        return rows


def sampled_row(so: SampleOutput, j: int) -> SampledRow:
    """Row ``j`` of a sampler call as the scheduler takes it."""
    lp, top, err = (None if x is None else x[j] for x in (so.logprobs, so.top_logprobs, so.errors))
    return SampledRow(so.token_ids[j], lp, top, err)
