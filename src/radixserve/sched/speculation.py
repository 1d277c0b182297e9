"""Speculative decoding drafted by the radix tree (``--speculative ngram-tree``).

On a CPU a decode step costs about one pass over the weights whether it scores one token
or a few, and the tree already holds every sequence the server has seen. So before a
decode step each running request may propose a *draft*: the tokens that followed, in the
tree of its own namespace or earlier in its own output, the longest suffix of its sequence
(up to ``max_ngram`` tokens) found there. The step then computes the request's last token
and the draft as one extend (``ScheduledBatch.drafts``), the runner keeps the longest
prefix of the draft the sampler agrees with (``engine/verify.py``), and
:class:`radixserve.sched.postprocess.StepApplier` appends the kept tokens and gives the
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
  the step already computes (:func:`allocate`), priced by ``--speculative-row-cost`` or, with
  ``--speculative-pricing measured``, by the step times the engine measures per row count
  (``sched/step_costs.py``, the row cost as the prior): alone a request
  drafts up to ``num_draft_tokens``, in a full batch only its likely ones; after a draft with
  nothing accepted it sits out a few steps (:class:`DraftBudget`). What matches of a draft's
  length have earned on this server (:class:`MatchOdds`) is the prior its request's own
  record moves: a short match is held to what short matches earn, and a request new to
  drafting starts from what long ones earn rather than from a fixed guess.
* Drafts take only free slots: when the pool would have to evict cached prefixes (or retract
  a request) to hold them, this step runs without drafts.

Draft sources, best first: an explicit prediction the request brought (OpenAI's Predicted
Outputs, :class:`PredictionDrafts`) while its output is still the prediction's beginning;
then the longest suffix match, found in its own prompt and output, its prediction or the tree
(in that order at equal length).

Which requests draft: a decoding request with at least two tokens left to generate.
Structured-output requests too: where the grammar forces the next tokens (a schema's key
names and punctuation) and its fast-forward did not already append them (a request asking
for logprobs, or ``--no-grammar-fast-forward``), those tokens are the draft (certain to be
accepted, so they bypass the budget; verified for their logprobs and KV); otherwise an n-gram
draft cut to the prefix the grammar accepts, verified under the grammar's constraint at each
position (``GrammarGate.draft_constraints``). A request whose grammar fast-forwarded forced
tokens this step drafts after them.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_left
from dataclasses import dataclass

from radixserve.cache.draft_index import TreeDraftIndex
from radixserve.cache.events import fan_out
from radixserve.cache.tree import RadixTree
from radixserve.request import Req
from radixserve.sched.step_costs import StepCosts

#: Longest run of decode steps a request sits out after repeated drafts with nothing accepted.
MAX_SKIP = 63
#: Namespaces (``cache_salt`` values) whose :class:`MatchOdds` a speculator keeps.
MAX_ODDS_NAMESPACES = 4096
#: Acceptance prior (accepted, rejected) of a request that has not drafted yet: 3 of 4.
PRIOR = (3.0, 1.0)
#: Weight of a request's past verifications against its newest one.
DECAY = 0.8
#: Weight of the server's past verifications at one match length against its newest one
#: (:class:`MatchOdds`: every request's verifications feed it, so it can remember longer).
ODDS_DECAY = 0.95
#: What a request's past verifications keep of their weight at each decode step it verifies
#: nothing: its estimate drifts back to the prior, so a request priced out of a full batch by
#: one early miss drafts again (at most every other step while it keeps missing in part; its
#: total misses still back off through ``skip``).
IDLE_DECAY = 0.9
#: Most tokens of a grammar's forced run verified in one step (a longer run takes several):
#: they are always accepted, so only the rows' cost and free KV slots limit them.
FORCED_DRAFT_MAX = 32
#: Relative margin by which draft tokens must raise a step's tokens per unit of time: a tie
#: (to rounding) does not pay, whichever way the arithmetic rounds it.
TIE = 1e-9
#: The match length a prediction reports while the output is still its beginning: above any
#: suffix match, so the prediction's next tokens win.
ALIGNED = 1 << 30


class OwnNgrams:
    """The n-grams ending at a request's own positions, prompt and output -> the last such
    position. The prompt is in the tree too, but the tree's index keeps each n-gram's most
    recent insertion: in a batch of look-alike requests (records of one format, one template)
    that is usually another request's, whose continuation misses. A request's own text first
    keeps its drafts its own; the prompt is indexed once, at the request's first lookup."""

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


class PredictionDrafts:
    """A request's explicit prediction of its output (OpenAI's ``prediction`` field) as a
    draft source. While the output so far is the prediction's beginning, the draft is the
    prediction's next tokens: an answer that starts as predicted has no earlier context to
    match. Once it departs, the longest suffix of the request's sequence (``min_ngram ..
    max_ngram`` tokens) found in the prediction (followed by at least one token) is matched
    at its first occurrence ending at or after where the last draft started (an edited text
    keeps the prediction's order; with none there, the nearest before it), and the tokens
    after it are the draft. n-grams are indexed once, when the request first drafts:
    ``O(len(prediction) * (max_ngram - min_ngram + 1))`` entries."""

    __slots__ = ("aligned", "checked", "cursor", "grams", "tokens")

    def __init__(self, tokens: list[int], min_n: int, max_n: int) -> None:
        self.tokens = list(tokens)
        packed = array("I", self.tokens)
        grams: dict[bytes, list[int]] = {}
        with memoryview(packed) as mv:
            for e in range(len(packed) - 1):  # an n-gram ending at the last token predicts nothing
                for n in range(min_n, min(max_n, e + 1) + 1):
                    grams.setdefault(mv[e + 1 - n : e + 1].tobytes(), []).append(e)
        self.grams = grams
        self.aligned = True  # the output so far is the prediction's beginning
        self.checked = 0  # output tokens compared with the prediction so far
        self.cursor = 0  # where the last draft started in the prediction

    def _follow(self, output: list[int]) -> None:
        if not self.aligned:
            return
        toks = self.tokens
        for i in range(self.checked, len(output)):
            if i >= len(toks) or output[i] != toks[i]:
                self.aligned = False
                break
        self.checked = len(output)

    def lookup(self, output: list[int], suffix: bytes, min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
        """``(n, draft)``: up to ``k`` predicted tokens and the length of the match they follow
        (:data:`ALIGNED` while the output is the prediction's beginning); ``(0, [])``."""
        self._follow(output)
        if self.aligned:
            pos = len(output)
            draft = self.tokens[pos : pos + k]
            return (ALIGNED, draft) if draft else (0, [])
        for n in range(min(max_n, len(suffix) >> 2), min_n - 1, -1):
            ends = self.grams.get(suffix[len(suffix) - (n << 2) :])
            if ends:
                i = bisect_left(ends, self.cursor)
                e = ends[i] if i < len(ends) else ends[-1]  # else the nearest before it
                self.cursor = e + 1
                return n, self.tokens[e + 1 : e + 1 + k]
        return 0, []


class DraftBudget:
    """A request's record as a drafter: how likely its next draft token is to be accepted,
    and whether it sits out this step. Acceptance is modelled as geometric: each draft token
    is accepted with probability ``q`` while the ones before it were, so the ``j``-th token
    of a draft is worth ``q ** j`` expected tokens. ``q`` comes from decayed counts of
    accepted tokens and of rejections (a verified draft not accepted whole), with a prior as
    strong as :data:`PRIOR`'s counts: the server's odds for the draft's match length
    (:meth:`given`), or 3 of 4 (:attr:`q`). A draft with nothing accepted also makes the request sit out 1,
    3, 7, ... (at most :data:`MAX_SKIP`) steps, reset by the next accepted token: the cost of
    drafting in a workload without repetition is then about one row every ``MAX_SKIP`` steps.
    A step in which the request verifies nothing lets the counts fade (:meth:`rest`): without
    it, one early miss in a full batch (where a token must be likelier than the batch's bar
    to pay for its row) would keep ``q`` under the bar, and the request from drafting, for
    good."""

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

    def rest(self) -> None:
        """A decode step in which the request verified no draft."""
        self.accepted_w *= IDLE_DECAY
        self.rejected_w *= IDLE_DECAY

    @property
    def q(self) -> float:
        """The estimate with the fixed prior (:data:`PRIOR`)."""
        return self.given(MatchOdds.PRIOR_Q)

    def given(self, base: float) -> float:
        """The estimate when what the server has learned says ``base`` (:class:`MatchOdds`):
        ``base`` is the prior, as strong as :data:`PRIOR`'s counts, and the request's own
        record moves it. A request that has verified nothing yet is estimated by the server's
        odds alone: a fixed prior in their place would hold it at 3 in 4, under what a full
        batch needs to verify anything, so it would never draft there to learn better."""
        w = PRIOR[0] + PRIOR[1]
        return (self.accepted_w + w * base) / (self.accepted_w + self.rejected_w + w)

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted_w = DECAY * self.accepted_w + accepted
        self.rejected_w = DECAY * self.rejected_w + (1.0 if accepted < drafted else 0.0)
        if accepted == 0:
            self.misses += 1
            self.skip = min(MAX_SKIP, (1 << self.misses) - 1)
        else:
            self.misses = 0


class MatchOdds:
    """How likely a draft token is accepted given the length of the suffix match that found
    it, learned from this server's own verifications. Two matching tokens are weak evidence
    (a common phrase: what followed it once is often not what follows now), six are strong
    (the answer is quoting something). A request's own record (:class:`DraftBudget`) cannot
    tell its short matches from its long ones, and in a full batch, where a token must be
    likely to pay for its row, the short ones would keep costing rows; a draft's estimate is
    the request's record with these odds as its prior (:meth:`DraftBudget.given`). One per
    namespace, as the tree's draft index. The estimator is the
    request's (accepted tokens against rejections, the same prior) per match length, with its
    own decay :data:`ODDS_DECAY` (a prediction aligned with the output is a length of its
    own)."""

    __slots__ = ("accepted_w", "rejected_w")

    #: What any match length is worth before one is verified.
    PRIOR_Q = PRIOR[0] / (PRIOR[0] + PRIOR[1])

    def __init__(self) -> None:
        self.accepted_w: dict[int, float] = {}
        self.rejected_w: dict[int, float] = {}

    def q(self, match: int) -> float:
        a = self.accepted_w.get(match, 0.0) + PRIOR[0]
        r = self.rejected_w.get(match, 0.0) + PRIOR[1]
        return a / (a + r)

    def best(self) -> float:
        """The highest :meth:`q` of any match length (one never verified is at the prior):
        what a draft can be worth before the lookup says its match."""
        return max([self.q(m) for m in self.accepted_w] + [self.PRIOR_Q])

    def record(self, match: int, drafted: int, accepted: int) -> None:
        self.accepted_w[match] = ODDS_DECAY * self.accepted_w.get(match, 0.0) + accepted
        self.rejected_w[match] = ODDS_DECAY * self.rejected_w.get(match, 0.0) + (1.0 if accepted < drafted else 0.0)


def allocate(qs: list[float], lengths: list[int], decode_rows: int, costs: StepCosts) -> list[int]:
    """How many tokens of each candidate draft to verify this step. Candidate ``i`` offers
    ``lengths[i]`` tokens; its ``j``-th is worth ``qs[i] ** j`` expected tokens. Taking
    tokens best first, the count kept is the one that gives the step the most expected
    tokens per unit of its time (``costs``: the step's time by rows). Alone, a request
    drafts long; in a big batch, whose rows already fill the step, only drafts likely to be
    accepted pay for their rows, so a batch is not slowed down by drafting; where many rows
    cost less each than one (a GEMM's tiles filling), a batch of likely drafts is taken
    whole even though its first token alone would not pay. Under the linear prior this is
    the first token that does not pay: each later one is worth less and the bar only rises."""
    take = [0] * len(qs)
    if costs.is_prior:
        # Under the prior's prices a draft whose first token does not pay would be given
        # nothing (first_token_pays), but the tie margin is relative to the whole step: many
        # such tokens, each a tie, could clear it together by rounding. Left out here.
        lengths = [n if n > 0 and first_token_pays(q, decode_rows, costs, n) else 0 for q, n in zip(qs, lengths)]
    heap = [(-q, i) for i, (q, n) in enumerate(zip(qs, lengths)) if n > 0]
    if not heap:
        return take
    heapq.heapify(heap)
    table = costs.table(decode_rows, sum(n for q, n in zip(qs, lengths) if n > 0))
    tokens = float(decode_rows)
    best_rate, best = tokens / table[0], 0
    order: list[int] = []
    given = [0] * len(qs)
    while heap:
        neg, i = heapq.heappop(heap)
        order.append(i)
        tokens -= neg
        given[i] += 1
        rate = tokens / table[len(order)]
        if rate > best_rate * (1.0 + TIE):
            best_rate, best = rate, len(order)
        if given[i] < lengths[i]:
            heapq.heappush(heap, (neg * qs[i], i))
    for i in order[:best]:
        take[i] += 1
    return take


def first_token_pays(q: float, decode_rows: int, costs: StepCosts, most: int) -> bool:
    """Whether up to ``most`` draft tokens each worth ``q`` (an upper bound on a draft whose
    first token is worth ``q``) would raise the expected tokens per unit of time of a step of
    ``decode_rows`` rows, each row at its own price (the prior's verification cost left out:
    another request's draft may pay it). A request failing it is not looked up: under the
    prior :func:`allocate` would give it nothing whatever the other candidates (a token it
    keeps is worth at least its row's price times the step's rate, which is at least the
    rate without drafts); with measured prices it could only have been given rows that
    others' drafts paid for."""
    return pays(q, decode_rows, costs.table(decode_rows, most, verify=False))


def pays(q: float, rows: int, table: list[float]) -> bool:
    """:func:`first_token_pays` with the step's cost table (``table[n]``: ``rows + n`` rows)
    already made."""
    return q > pay_bar(rows, table)


def pay_bar(rows: int, table: list[float]) -> float:
    """The ``q`` that :func:`pays` must exceed: ``n`` tokens worth ``q`` raise the rate
    ``rows / table[0]`` when ``q > (rate * table[n] - rows) / n``, for some ``n``. The
    speculator computes it once per step and compares each request's estimate with it."""
    bar = rows / table[0] * (1.0 + TIE)
    return min(((bar * table[n] - rows) / n for n in range(1, len(table))), default=math.inf)


@dataclass
class DraftState:
    """A request's speculation: its own n-grams, its prediction, its budget and its counters."""

    own: OwnNgrams
    budget: DraftBudget
    prediction: PredictionDrafts | None = None
    forced: bool = False  # this step's draft is the grammar's forced run (kept out of the budget)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    match: int = 0  # the length of the suffix match that found this step's draft


class Speculator:
    """Proposes drafts for the scheduler's decoding requests and keeps their accounting.
    ``tree``: the radix cache (its listener is chained to feed the draft index);
    ``num_draft_tokens``: the longest draft; ``min_ngram`` / ``max_ngram``: the suffix
    lengths looked up; ``vocab_size``: drafts stop before an id the model cannot embed (an
    image's content key in the tree); ``max_context_len``: no draft position past it;
    ``costs``: a decode step's time by its rows, the price of a draft token (:func:`allocate`;
    the engine feeds it the steps it runs, :meth:`observe`)."""

    def __init__(self, tree: RadixTree, num_draft_tokens: int, min_ngram: int, max_ngram: int,
                 vocab_size: int, max_context_len: int, costs: StepCosts) -> None:
        if not hasattr(tree, "listener"):
            raise ValueError("speculative decoding drafts from a radix tree with cache events")
        self.index = TreeDraftIndex(tree, min_ngram, max_ngram)
        tree.listener = fan_out(tree.listener, self.index.on_event)
        self.num_draft_tokens = num_draft_tokens
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len
        self.costs = costs
        self._odds: dict[str | None, MatchOdds] = {}
        #: Per match length: [verified drafts, those whose first token was accepted] (all
        #: namespaces; what ``MatchOdds`` learns from, for benchmarks to print).
        self.by_match: dict[int, list[int]] = {}

    @staticmethod
    def eligible(req: Req) -> bool:
        """Whether ``req`` drafts at all: more than one token left to make, and a grammar (if
        any) that neither failed nor ended."""
        g = req.grammar
        return req.remaining_tokens > 1 and (g is None or (g.error is None and not g.stopped))

    def state(self, req: Req) -> DraftState:
        st = req.spec
        if st is None:
            pred = req.params.prediction
            st = req.spec = DraftState(OwnNgrams(0), DraftBudget(),
                                       PredictionDrafts(pred, self.min_ngram, self.max_ngram) if pred else None)
        return st

    def propose(self, reqs: list[Req], pending: dict[Req, int]) -> dict[Req, list[int]]:
        """Drafts for the decoding requests ``reqs`` (``pending[r]``: tokens ``r`` computes
        this step without one: its last sampled token and any forced ones fast-forwarded
        after it), as long as :func:`allocate` finds them worth their rows; requests without
        a draft are left out."""
        cands: list[tuple[Req, list[int], float]] = []
        budgets: list[tuple[Req, DraftBudget]] = []  # the adaptive ones: each rests unless it drafts
        rows = len(reqs)
        bar = pay_bar(rows, self.costs.table(rows, self.num_draft_tokens, verify=False))
        bests: dict[str | None, float] = {}  # per namespace: MatchOdds.best, once a step
        for r in reqs:
            if not self.eligible(r):
                continue
            st = self.state(r)
            room = min(r.remaining_tokens - 1, self.max_context_len - r.num_fill)
            g = r.grammar
            if g is not None and pending[r] == 1:
                forced = g.forced_run(min(FORCED_DRAFT_MAX, room))
                if forced:  # certain: no budget asked, none recorded
                    st.forced = True
                    cands.append((r, forced, 1.0))
                    continue
            st.forced = False
            budgets.append((r, st.budget))
            if not st.budget.ready():
                continue  # sitting out
            best = bests.get(r.salt)
            if best is None:  # a namespace that has verified nothing has no odds yet: the prior's
                known = self._odds.get(r.salt)
                best = bests[r.salt] = known.best() if known is not None else MatchOdds.PRIOR_Q
            if not st.budget.given(best) > bar:
                continue  # even its first draft token would not pay for its row
            k = min(self.num_draft_tokens, room)
            draft, st.match = self._lookup(r, st, k) if k > 0 else ([], 0)
            if draft and g is not None:
                draft = draft[: g.valid_prefix(draft)]
            if draft:
                cands.append((r, draft, st.budget.given(self.odds(r.salt).q(st.match))))
        take = allocate([q for _, _, q in cands], [len(d) for _, d, _ in cands], rows, self.costs)
        drafts = {r: d[:n] for (r, d, _), n in zip(cands, take) if n}
        for r, budget in budgets:
            if r not in drafts:
                budget.rest()
        return drafts

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step computed ``rows`` rows (decode tokens, forced runs and draft
        positions) in ``seconds``: what the next steps' drafts are priced by."""
        self.costs.observe(rows, seconds)

    def odds(self, salt: str | None) -> MatchOdds:
        """The match-length odds of namespace ``salt``: one tenant's verifications never
        change what another's drafts are held to. The most recently created
        :data:`MAX_ODDS_NAMESPACES` are kept."""
        odds = self._odds.get(salt)
        if odds is None:
            if len(self._odds) >= MAX_ODDS_NAMESPACES:
                del self._odds[next(iter(self._odds))]
            odds = self._odds[salt] = MatchOdds()
        return odds

    def _lookup(self, req: Req, st: DraftState, k: int) -> tuple[list[int], int]:
        """The draft from the best source (the module docstring's order) and its match length."""
        packed = req.cache_key()
        end = len(packed)
        lo, hi = self.min_ngram, self.max_ngram
        st.own.catch_up(packed, end - 1, lo, hi)  # earlier occurrences only, not the suffix itself
        with memoryview(packed) as mv:
            suffix = mv[max(0, end - hi) :].tobytes()
        best, found = self.index.lookup(req.salt, suffix, k)  # the tree's
        if st.prediction is not None:
            n, d = st.prediction.lookup(req.output_ids, suffix, lo, hi, k)
            if d and n >= best:
                best, found = n, d
        draft: list[int] = []
        match = best
        for n in range(min(hi, len(suffix) >> 2), max(lo, best) - 1, -1):
            e = st.own.grams.get(suffix[len(suffix) - (n << 2) :])
            if e is not None:
                draft = req.tokens(e + 1, min(end, e + 1 + k))
                # Past the sequence's end the match predicts its own continuation: the
                # sequence repeats with period ``end - 1 - e`` (a loop drafts whole turns).
                period = end - 1 - e
                match = n
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                break
        if not draft:
            draft = found
        cut = next((i for i, t in enumerate(draft) if t >= self.vocab_size), len(draft))
        return draft[:cut], match

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A step verified ``drafted`` draft tokens of ``req`` and kept ``accepted``."""
        st = self.state(req)
        st.drafted += drafted
        st.accepted += accepted
        if not st.forced:
            st.budget.record(drafted, accepted)
            self.odds(req.salt).record(st.match, drafted, accepted)
            seen = self.by_match.setdefault(st.match, [0, 0])
            seen[0] += 1
            seen[1] += accepted > 0
