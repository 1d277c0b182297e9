"""Speculative decoding drafted by the radix tree (``--speculative ngram-tree``).

On a CPU a decode step costs about one pass over the weights whether it scores one token
or a few, and the tree already holds every sequence the server has seen. So before a
decode step each running request may propose a *draft*: the tokens that followed, in the
tree of its own namespace or earlier in its own output, the longest suffix of its sequence
(up to ``max_ngram`` tokens) found there. The step then computes the request's last token
and the draft as one extend (``ScheduledBatch.drafts``), the runner keeps the longest
prefix of the draft the sampler agrees with (``engine/verify.py``), and
:func:`radixserve.sched.postprocess.apply_step` appends the kept tokens and gives the
rejected positions' KV slots back at once, before anything reaches the tree.

What it costs and how it stays cheap
------------------------------------
* The lookup is ``O(max_ngram)`` dictionary probes per request and step:
  :class:`~radixserve.cache.draft_index.TreeDraftIndex` over the tree (kept by the tree's
  events), :class:`OwnNgrams` over the request's own generated tokens (which enter the tree
  only when it finishes).
* A draft position costs a row of compute in the step. Each request keeps an estimate of
  how likely its draft tokens are to be accepted (:class:`DraftBudget`), and a step verifies
  only the draft tokens whose expected acceptance pays for their rows given how many rows
  the step already computes (:func:`allocate`, ``--speculative-row-cost``): alone a request
  drafts up to ``num_draft_tokens``, in a full batch only its likely ones. After a draft
  with nothing accepted a request sits out 1, 3, 7 ... up to :data:`MAX_SKIP` steps, so a
  workload without repetition pays about one extra row every ``MAX_SKIP`` steps.
* Drafts take only free slots: when the pool would have to evict cached prefixes (or retract
  a request) to hold them, this step runs without drafts.

Which requests draft: a decoding request with no grammar (its forced tokens are already
computed in one step by the grammar's fast-forward; speculation stays off for grammar
requests), no forced tokens pending, and at least two tokens left to generate.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass

from radixserve.cache.draft_index import TreeDraftIndex
from radixserve.cache.events import fan_out
from radixserve.cache.tree import RadixTree
from radixserve.core import Req

#: Longest run of decode steps a request sits out after repeated drafts with nothing accepted.
MAX_SKIP = 63
#: Acceptance prior (accepted, rejected) of a request that has not drafted yet: 3 of 4.
PRIOR = (3.0, 1.0)
#: Weight of a request's past verifications against its newest one.
DECAY = 0.8


class OwnNgrams:
    """The n-grams ending at a request's own generated positions -> the last such position.

    n-grams may start in the prompt's tail; the prompt itself is in the tree (inserted when
    prefilled) and found there."""

    __slots__ = ("grams", "upto")

    def __init__(self, start: int) -> None:
        self.grams: dict[bytes, int] = {}
        self.upto = start  # the next end position to index

    def catch_up(self, packed: array, end: int, min_n: int, max_n: int) -> None:
        """Index the n-grams ending at positions ``upto .. end - 1`` of ``packed``."""
        if self.upto >= end:
            return
        grams = self.grams
        with memoryview(packed) as mv:
            for e in range(self.upto, end):
                stop = e + 1
                for n in range(min_n, min(max_n, stop) + 1):
                    grams[mv[stop - n : stop].tobytes()] = e
        self.upto = end


class DraftBudget:
    """A request's record as a drafter: how likely its next draft token is to be accepted,
    and whether it sits out this step.

    Acceptance is modelled as geometric: each draft token is accepted with probability ``q``
    while the ones before it were, so the ``j``-th token of a draft is worth ``q ** j``
    expected tokens. ``q`` comes from decayed counts of accepted tokens and of rejections
    (a verified draft not accepted whole), with a prior of :data:`PRIOR` (3 of 4). A draft
    with nothing accepted also makes the request sit out 1, 3, 7, ... (at most
    :data:`MAX_SKIP`) steps, reset by the next accepted token: the cost of drafting in a
    workload without repetition is then about one row every ``MAX_SKIP`` steps."""

    __slots__ = ("accepted_w", "misses", "rejected_w", "skip")

    def __init__(self) -> None:
        self.accepted_w = 0.0
        self.rejected_w = 0.0
        self.skip = 0
        self.misses = 0

    def ready(self) -> bool:
        """Whether the request may draft this step; called once per step."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    @property
    def q(self) -> float:
        a, r = self.accepted_w + PRIOR[0], self.rejected_w + PRIOR[1]
        return a / (a + r)

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted_w = DECAY * self.accepted_w + accepted
        self.rejected_w = DECAY * self.rejected_w + (1.0 if accepted < drafted else 0.0)
        if accepted == 0:
            self.misses += 1
            self.skip = min(MAX_SKIP, (1 << self.misses) - 1)
        else:
            self.misses = 0


def allocate(qs: list[float], lengths: list[int], decode_rows: int, row_cost: float) -> list[int]:
    """How many tokens of each candidate draft to verify this step.

    A step's time is modelled as ``T0 * (1 + row_cost * rows)``: a fixed part (one pass over
    the weights, the step's overheads) and a part per row it computes. Candidate ``i`` offers
    ``lengths[i]`` tokens; its ``j``-th is worth ``qs[i] ** j`` expected tokens. Tokens are
    taken best first while each one raises the step's expected tokens per unit of time: a
    token worth ``v`` is taken while ``v > tokens * row_cost / (1 + rows * row_cost)``. Alone,
    a request drafts long; in a big batch, whose rows already fill the step, only drafts
    likely to be accepted pay for their rows, so a batch is not slowed down by drafting."""
    take = [0] * len(qs)
    tokens = rows = float(decode_rows)
    heap = [(-q, i) for i, (q, n) in enumerate(zip(qs, lengths)) if n > 0]
    heapq.heapify(heap)
    while heap:
        neg, i = heapq.heappop(heap)
        v = -neg
        if v * (1.0 + rows * row_cost) <= tokens * row_cost:
            break
        take[i] += 1
        tokens += v
        rows += 1.0
        if take[i] < lengths[i]:
            heapq.heappush(heap, (-(v * qs[i]), i))
    return take


@dataclass
class DraftState:
    """A request's speculation: its own n-grams, its budget and its counters."""

    own: OwnNgrams
    budget: DraftBudget
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    verify_steps: int = 0  # decode steps that verified a draft


class Speculator:
    """Proposes drafts for the scheduler's decoding requests and keeps their accounting.

    ``tree``: the radix cache (its listener is chained to feed the draft index);
    ``num_draft_tokens``: the longest draft; ``min_ngram`` / ``max_ngram``: the suffix
    lengths looked up; ``vocab_size``: drafts stop before an id the model cannot embed (an
    image's content key in the tree); ``max_context_len``: no draft position past it;
    ``row_cost``: a decode row's cost relative to a step's fixed cost (:func:`allocate`)."""

    def __init__(self, tree: RadixTree, num_draft_tokens: int, min_ngram: int, max_ngram: int,
                 vocab_size: int, max_context_len: int, row_cost: float) -> None:
        if not hasattr(tree, "listener"):
            raise ValueError("speculative decoding drafts from a radix tree with cache events")
        self.index = TreeDraftIndex(tree, min_ngram, max_ngram)
        tree.listener = fan_out(tree.listener, self.index.on_event)
        self.num_draft_tokens = num_draft_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.row_cost = row_cost

    @staticmethod
    def eligible(req: Req) -> bool:
        """Whether ``req`` drafts at all: no grammar, and more than one token left to make."""
        return req.grammar is None and req.remaining_tokens > 1

    def state(self, req: Req) -> DraftState:
        st = req.spec
        if st is None:
            st = req.spec = DraftState(OwnNgrams(len(req.prompt_ids)), DraftBudget())
        return st

    def propose(self, reqs: list[Req], pending: dict[Req, int]) -> dict[Req, list[int]]:
        """Drafts for the decoding requests ``reqs`` (``pending[r]``: tokens ``r`` computes
        this step without one), as long as :func:`allocate` finds them worth their rows;
        requests without a draft are left out."""
        cands: list[tuple[Req, DraftState, list[int]]] = []
        for r in reqs:
            if pending[r] != 1 or not self.eligible(r):
                continue
            st = self.state(r)
            if not st.budget.ready():
                continue
            k = min(self.num_draft_tokens, r.remaining_tokens - 1, self.max_context_len - r.num_fill)
            draft = self._lookup(r, st, k) if k > 0 else []
            if draft:
                cands.append((r, st, draft))
        if not cands:
            return {}
        take = allocate([st.budget.q for _, st, _ in cands], [len(d) for _, _, d in cands], len(reqs),
                        self.row_cost)
        return {r: d[:n] for (r, _, d), n in zip(cands, take) if n}

    def _lookup(self, req: Req, st: DraftState, k: int) -> list[int]:
        """The longest suffix match (own output first at equal length) and what followed it."""
        packed = req.cache_key()
        end = len(packed)
        lo, hi = self.min_ngram, self.max_ngram
        st.own.catch_up(packed, end - 1, lo, hi)  # earlier occurrences only, not the suffix itself
        with memoryview(packed) as mv:
            suffix = mv[max(0, end - hi) :].tobytes()
        grams = st.own.grams
        best_tree, tree_draft = self.index.lookup(req.salt, suffix, k)
        draft: list[int] = []
        for n in range(min(hi, len(suffix) >> 2), max(lo, best_tree) - 1, -1):
            e = grams.get(suffix[len(suffix) - (n << 2) :])
            if e is not None:
                draft = req.tokens(e + 1, min(end, e + 1 + k))
                # Past the sequence's end the match predicts its own continuation: the
                # sequence repeats with period ``end - 1 - e`` (a loop drafts whole turns).
                period = end - 1 - e
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                break
        if not draft:
            draft = tree_draft
        vocab = self.vocab_size
        for i, t in enumerate(draft):
            if t >= vocab:
                return draft[:i]
        return draft

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` draft tokens of ``req`` and kept ``accepted``."""
        st = self.state(req)
        st.drafted += drafted
        st.accepted += accepted
        st.verify_steps += 1
        st.budget.record(drafted, accepted)
