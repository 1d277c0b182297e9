"""What a decode step costs by the number of rows it computes: the price speculative decoding
pays for a draft token's row.

No one line fits a CPU's step times at both ends. Alone, a step is a pass over the weights and
a few more rows are nearly free. In a batch of eight on one thread the step is compute-bound:
the first draft row can cost about a token's share of the step, and each row after it much
less (the GEMM's tiles fill). A linear model priced for one end misprices the other: it lets
single likely-ish draft tokens into a full batch where they lose, or keeps out whole drafts
that win (``bench_speculative.py`` prints the medians it learned).

So :class:`StepCosts` learns the curve from the steps the engine runs: per row count, the
median of its recent decode-only steps' CPU times (a prompt chunk would add a cost of its
own; the wall clock would add the time other work held the cores),
and above a step's own count, the line through those medians (:meth:`StepCosts.table`). Where a
count has no measurement yet, the linear model ``1 + row_cost * rows`` is the prior, scaled
to the measured counts around it; before anything is measured it is the whole price. The
times change only which draft tokens are verified, never a request's tokens or logprobs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from statistics import median

#: Recent steps a row count keeps; its cost is their median. A median, because one step the
#: host or the interpreter paused would otherwise price its count out for as long as the
#: count is not run again (an average of few samples keeps the spike).
WINDOW = 9
#: Samples a row count needs before its median replaces the prior.
MIN_SAMPLES = 3
#: Observed steps after which a count not run since is forgotten. A count whose median came
#: out high (steps that ran while the host was busy) prices itself out of the drafts that
#: would run it again; forgotten, it is priced from its neighbours and measured afresh.
STALE_STEPS = 256
#: Measured counts above a step's own from which :meth:`StepCosts.table` fits a line through
#: their medians instead of reading them one by one.
FIT_POINTS = 3
#: What verifying drafts adds to a step beyond its rows, in rows, in the prior: the extend's
#: own metadata, the logits of every draft position and their verification, paid once by a
#: step with any draft. Without it the prior priced a batch-8 step's first draft row at a row
#: while it costs about 1.6 (``bench_speculative.py --steps``), and single draft tokens
#: accepted 5 times in 6 were verified there at a loss.
VERIFY_ROWS = 0.6
#: Tables :meth:`StepCosts.table` keeps for reuse (its keys are bounded by the batch's rows and
#: drafts, but a server with hundreds of rows and long forced runs could hold many).
MAX_TABLES = 1024


class StepCosts:
    """Step time by row count. ``row_cost``: the prior's cost of one row relative to a step's
    fixed part; ``measured``: False keeps the prior whatever is observed (a fixed price, for
    runs that must draft the same way every time)."""

    __slots__ = ("_known", "_last", "_mean", "_recent", "_steps", "_tables", "measured", "row_cost")

    def __init__(self, row_cost: float, measured: bool = True) -> None:
        if row_cost < 0:
            raise ValueError(f"row_cost must be >= 0, got {row_cost}")
        self.row_cost = row_cost
        self.measured = measured
        self._recent: dict[int, deque[float]] = {}
        self._mean: dict[int, float] = {}  # the median of _recent, for counts in _known
        self._known: list[int] = []  # row counts with MIN_SAMPLES samples, ascending
        self._last: dict[int, int] = {}  # row count -> the observation number of its latest
        self._steps = 0  # observations so far
        #: (rows, extra, verify) -> table, while nothing observed changes them (the prior's
        #: tables are asked for at every step, twice)
        self._tables: dict[tuple[int, int, bool], list[float]] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows took ``seconds``."""
        if not self.measured or rows <= 0 or not seconds > 0.0:
            return
        self._steps += 1
        self._tables.clear()
        if self._steps % STALE_STEPS == 0:
            self._forget_stale()
        recent = self._recent.get(rows)
        if recent is None:
            recent = self._recent[rows] = deque(maxlen=WINDOW)
        recent.append(seconds)
        self._last[rows] = self._steps
        if len(recent) >= MIN_SAMPLES:
            if rows not in self._mean:
                insort(self._known, rows)
            self._mean[rows] = median(recent)

    def _forget_stale(self) -> None:
        stale = [r for r, last in self._last.items() if self._steps - last >= STALE_STEPS]
        for r in stale:
            del self._last[r], self._recent[r]
            if self._mean.pop(r, None) is not None:
                self._known.remove(r)

    def prior(self, rows: int) -> float:
        return 1.0 + self.row_cost * rows

    @property
    def is_prior(self) -> bool:
        """Whether every price is still the prior's linear one (no row count measured)."""
        return not self._known

    @property
    def verify_cost(self) -> float:
        """What a step that verifies drafts costs beyond its rows, in the prior's units; 0 once
        counts are measured (their medians include it)."""
        return 0.0 if self._known else self.row_cost * VERIFY_ROWS

    def __call__(self, rows: int) -> float:
        """The expected time of a step of ``rows`` rows: its median where measured, else
        the prior scaled to the measured counts around it (linearly between two of them);
        in the prior's units while nothing is measured."""
        known = self._known
        if not known:
            return self.prior(rows)
        i = bisect_left(known, rows)
        if i < len(known) and known[i] == rows:
            return self._mean[rows]
        if 0 < i < len(known):
            lo, hi = known[i - 1], known[i]
            t = (rows - lo) / (hi - lo)
            return self._mean[lo] + t * (self._mean[hi] - self._mean[lo])
        anchor = known[0] if i == 0 else known[-1]
        return self._mean[anchor] * self.prior(rows) / self.prior(anchor)

    def table(self, rows: int, extra: int, verify: bool = True) -> list[float]:
        """Costs of steps of ``rows`` .. ``rows + extra`` rows, non-decreasing (a row never
        makes a step cheaper). The first is the cost of ``rows`` (:meth:`__call__`). Where
        at least :data:`FIT_POINTS` counts above it are measured, the others lie on the
        least-squares line through those counts' medians (whatever ``extra`` is, so a
        longer table agrees with a shorter one): the medians carry
        noise of a few percent, and read count by count a dip would make the rows before it
        look free, so tokens worth little would be verified there for nothing. The line
        starts above ``rows`` so that it keeps the step from ``rows`` to the first draft row,
        which can cost more than each row after it (a step with drafts computes extends).
        Otherwise each count's own cost, with :attr:`verify_cost` above ``rows`` while it is
        the prior (``verify`` False leaves it out: each row's own price, the bound
        :func:`radixserve.sched.speculation.first_token_pays` needs). The list is shared
        with later calls until the next observation: read it, do not change it."""
        key = (rows, extra, verify)
        cached = self._tables.get(key)
        if cached is None:
            if len(self._tables) >= MAX_TABLES:
                self._tables.clear()
            cached = self._tables[key] = self._table(rows, extra, verify)
        return cached

    def _table(self, rows: int, extra: int, verify: bool) -> list[float]:
        out = [self(rows)]
        known = self._known
        points = [(r, self._mean[r]) for r in known[bisect_left(known, rows + 1):]]
        if len(points) >= FIT_POINTS:
            n = len(points)
            mx = sum(r for r, _ in points) / n
            my = sum(t for _, t in points) / n
            sxx = sum((r - mx) ** 2 for r, _ in points)
            slope = max(0.0, sum((r - mx) * (t - my) for r, t in points) / sxx)
            for r in range(rows + 1, rows + extra + 1):
                out.append(max(out[-1], my + slope * (r - mx)))
            return out
        verify_cost = self.verify_cost if verify else 0.0
        for r in range(rows + 1, rows + extra + 1):
            out.append(max(out[-1], self(r) + verify_cost))
        return out

    def snapshot(self) -> dict[int, float]:
        """The measured medians (seconds) by row count, for benchmarks and logs."""
        return {r: self._mean[r] for r in self._known}
