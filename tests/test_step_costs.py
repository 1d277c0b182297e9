"""Draft rows priced by measured step times (``sched/step_costs.py``) and the allocation that
spends them (``sched/speculation.allocate``).

* :class:`StepCosts` before any measurement is the linear prior; a fixed price never moves;
  a measured count's cost is the median of its recent steps (a spike does not move it);
  between measured counts it interpolates, outside them it scales the prior; its table
  never decreases.
* :func:`allocate` gives the step the most expected tokens per unit of time of every
  allocation of draft tokens (checked against all of them for small cases); under the linear
  prior it is the old rule (take tokens best first until one does not pay).
* The engine feeds the speculator its decode-only steps' times, and speculation with measured
  prices leaves outputs unchanged.
"""

from __future__ import annotations

import itertools
import math
import random
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cpu_paths import require_kernels

from radixserve import SamplingParams
from radixserve.engine.engine import Engine
from radixserve.sched import step_costs
from radixserve.sched.speculation import allocate, first_token_pays
from radixserve.sched.step_costs import StepCosts


# ---------------------------------------------------------------------------------- StepCosts
def test_unmeasured_is_the_linear_prior() -> None:
    c = StepCosts(0.25)
    assert [c(r) for r in (1, 8, 9)] == [1.25, 3.0, 3.25]
    fixed = StepCosts(0.25, measured=False)
    for _ in range(10):
        fixed.observe(8, 0.5)
    assert fixed(8) == 3.0 and fixed.snapshot() == {}
    with pytest.raises(ValueError, match="row_cost"):
        StepCosts(-0.1)


def test_the_prior_charges_a_verifying_step_once() -> None:
    """Drafts cost their rows and, once per step, their verification (VERIFY_ROWS rows in the
    prior); the bound that decides lookups prices each row alone. Once counts are measured
    their medians hold the verification's cost and nothing is added."""
    c = StepCosts(0.25)
    extra = 0.25 * step_costs.VERIFY_ROWS
    assert c.table(8, 2) == [3.0, 3.25 + extra, 3.5 + extra]
    assert c.table(8, 2, verify=False) == [3.0, 3.25, 3.5]
    for _ in range(step_costs.MIN_SAMPLES):
        c.observe(8, 0.02)
    assert c.verify_cost == 0.0


def test_a_count_is_used_once_it_has_enough_samples() -> None:
    c = StepCosts(0.25)
    for i in range(step_costs.MIN_SAMPLES - 1):
        c.observe(8, 0.03)
        assert c(8) == 3.0  # still the prior
    c.observe(8, 0.03)
    assert c(8) == pytest.approx(0.03)
    # The prior scaled to the one measured count, on both sides of it.
    assert c(12) == pytest.approx(0.03 * 4.0 / 3.0)
    assert c(4) == pytest.approx(0.03 * 2.0 / 3.0)


def test_medians_interpolate_and_follow() -> None:
    c = StepCosts(0.25)
    for _ in range(step_costs.MIN_SAMPLES):
        c.observe(8, 1.0)
        c.observe(12, 2.0)
    assert c(10) == pytest.approx(1.5)  # between two measured counts: linear
    c.observe(8, 100.0)  # a pause of the host: one spike does not move the median
    assert c(8) == 1.0
    for _ in range(step_costs.WINDOW):  # the step got dearer for good: the median follows
        c.observe(8, 1.8)
    assert c(8) == 1.8


def test_a_count_not_run_for_long_is_measured_afresh() -> None:
    """A count whose median came out high prices itself out of the drafts that would run it;
    after STALE_STEPS observations without it, it is forgotten (priced from its neighbours)."""
    c = StepCosts(0.25)
    for _ in range(step_costs.MIN_SAMPLES):
        c.observe(5, 0.040)  # steps that ran while the host was busy
    for _ in range(step_costs.MIN_SAMPLES):
        c.observe(1, 0.013)
        c.observe(4, 0.016)
    assert c(5) == 0.040
    for _ in range(step_costs.STALE_STEPS):
        c.observe(1, 0.013)
        c.observe(4, 0.016)
    assert 5 not in c.snapshot() and c(5) == pytest.approx(0.016 * c.prior(5) / c.prior(4))
    assert c(4) == 0.016 and c(1) == 0.013  # counts still run are kept


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 48), st.floats(1e-4, 1.0)), max_size=80),
       st.sampled_from([0.0, 0.25, 2.0]), st.integers(1, 40), st.integers(0, 40))
def test_table_never_decreases(obs, row_cost, rows, extra) -> None:
    c = StepCosts(row_cost)
    for r, t in obs:
        c.observe(r, t)
    table = c.table(rows, extra)
    assert len(table) == extra + 1
    assert all(x > 0 for x in table)
    assert all(a <= b for a, b in zip(table, table[1:]))
    assert table[0] == c(rows)
    assert c.table(rows, extra + 5)[: extra + 1] == table  # a longer table agrees with a shorter one


# ---------------------------------------------------------------------------------- allocate
def reference_best(qs: list[float], lengths: list[int], rows: int, costs: StepCosts) -> float:
    """The best expected tokens per unit of time over every allocation (brute force)."""
    table = costs.table(rows, sum(lengths))
    best = rows / table[0]
    for take in itertools.product(*(range(n + 1) for n in lengths)):
        tokens = rows + sum(sum(q ** j for j in range(1, k + 1)) for q, k in zip(qs, take))
        best = max(best, tokens / table[sum(take)])
    return best


def rate_of(take: list[int], qs: list[float], rows: int, costs: StepCosts) -> float:
    tokens = rows + sum(sum(q ** j for j in range(1, k + 1)) for q, k in zip(qs, take))
    return tokens / costs.table(rows, sum(take))[-1]


def measured(points: list[tuple[int, float]], row_cost: float = 0.25) -> StepCosts:
    c = StepCosts(row_cost)
    for r, t in points:
        for _ in range(step_costs.MIN_SAMPLES):
            c.observe(r, t)
    return c


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 3)), min_size=1, max_size=4),
       st.integers(1, 12),
       st.lists(st.tuples(st.integers(1, 24), st.floats(0.01, 1.0)), max_size=6))
def test_allocation_is_the_best_of_every_allocation(cands, rows, points) -> None:
    qs, lengths = [q for q, _ in cands], [n for _, n in cands]
    costs = measured(points)
    take = allocate(qs, lengths, rows, costs)
    assert all(0 <= k <= n for k, n in zip(take, lengths))
    assert rate_of(take, qs, rows, costs) == pytest.approx(reference_best(qs, lengths, rows, costs), rel=1e-8)


def first_not_paying(qs: list[float], lengths: list[int], rows: int, row_cost: float) -> list[int]:
    """The linear model's rule: best first, while a token worth ``v`` pays for its row."""
    take = [0] * len(qs)
    tokens = n = float(rows)
    offers = sorted(((q ** j, i) for i, (q, k) in enumerate(zip(qs, lengths)) for j in range(1, k + 1)),
                    key=lambda x: -x[0])
    for v, i in offers:
        if v * (1.0 + n * row_cost) <= tokens * row_cost:
            break
        take[i] += 1
        tokens += v
        n += 1
    return take


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 0.99), st.integers(0, 6)), min_size=1, max_size=10),
       st.integers(1, 64), st.sampled_from([0.05, 0.25, 1.0, 7.5]))
def test_linear_prices_give_the_first_token_that_does_not_pay_rule(cands, rows, row_cost) -> None:
    """Without the prior's verification cost the prices are linear, and the best count is
    where the first token that does not pay for its row stops the take."""
    qs, lengths = [q for q, _ in cands], [n for _, n in cands]
    with mock.patch.object(step_costs, "VERIFY_ROWS", 0.0):
        costs = StepCosts(row_cost)
        take, ref = allocate(qs, lengths, rows, costs), first_not_paying(qs, lengths, rows, row_cost)
    if take != ref:  # only where two rates tie to rounding
        with mock.patch.object(step_costs, "VERIFY_ROWS", 0.0):
            assert math.isclose(rate_of(take, qs, rows, costs), rate_of(ref, qs, rows, costs), rel_tol=1e-12)


def test_a_ninth_row_dear_and_the_next_ones_cheap() -> None:
    """Measured: the first draft row costs a fifth of an 8-row step, rows after it little. No
    single draft token pays for the ninth row, but likely drafts taken whole do; unlikely
    ones do not, and a request whose drafts are unlikely is not looked up. The prior, with
    its verification cost, keeps the single token out too; its line alone let it in."""
    costs = measured([(8, 1.0), (9, 1.2), (20, 1.5), (40, 2.0)])
    assert allocate([0.96], [1], 8, costs) == [0]
    assert allocate([0.96] * 8, [4] * 8, 8, costs) == [4] * 8
    assert first_token_pays(0.96, 8, costs, 4)
    assert allocate([0.2] * 8, [4] * 8, 8, costs) == [0] * 8
    assert not first_token_pays(0.2, 8, costs, 4)
    assert allocate([0.96], [1], 8, StepCosts(0.25)) == [0]
    with mock.patch.object(step_costs, "VERIFY_ROWS", 0.0):
        assert allocate([0.96], [1], 8, StepCosts(0.25)) == [1]


def test_a_dip_in_the_medians_does_not_make_rows_free() -> None:
    """Above a step's own count the medians are read through their line: a noisy dip (the
    11th row's median level with the 10th's) does not price the 11th row at nothing, so a
    token worth little is not verified there."""
    costs = measured([(8, 1.0), (9, 1.1), (10, 1.2), (11, 1.2), (12, 1.4), (13, 1.5)])
    table = costs.table(8, 5)
    assert all(b > a for a, b in zip(table, table[1:]))
    assert table[0] == 1.0
    assert allocate([0.99, 0.99, 0.99, 0.05], [1, 1, 1, 1], 8, costs) == [1, 1, 1, 0]
    assert allocate([0.05], [1], 8, costs) == [0]


# ---------------------------------------------------------------------------------- the engine
def test_the_engine_prices_drafts_by_its_own_steps() -> None:
    """With measured prices the speculator learns decode-only steps' times by row count;
    outputs are those without speculation."""
    require_kernels()
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 500) for _ in range(30)] for _ in range(3)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = []
    for spec in ("none", "ngram-tree"):
        eng = Engine("tiny-random", cache="radix", dtype="float32", kv_cache_tokens=4096, speculative=spec,
                     speculative_pricing="measured")
        try:
            got = [(o.token_ids, o.logprobs) for o in eng.generate(prompts, sp)]
            got += [(o.token_ids, o.logprobs) for o in eng.generate(prompts, sp)]  # drafted from the tree
            outs.append(got)
            if spec != "none":
                known = eng.core.scheduler.spec.costs.snapshot()
                assert known and all(t > 0 for t in known.values()), known
                assert eng.stats()["speculative_accepted_tokens"] > 0
            eng.check_integrity()
        finally:
            eng.close()
    assert outs[0] == outs[1]
