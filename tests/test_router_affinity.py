"""The router's affinity tree against a plain list of what was routed where.

Reference: every record kept as ``(salt, page-aligned tokens, worker, clock)``. For a query,
a worker's affinity is the longest page-aligned common prefix with any of its records, and
its age is the clock minus the latest of its records that reach that length; what earlier
prompts shared is the longest common prefix with any record, and what it continues is the
longest record that is a whole prefix of it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.placement.affinity import Affinity, AffinityTree, Lookup
from radixserve.placement.mirror import pack

toks = st.lists(st.integers(0, 3), min_size=0, max_size=12)
salts = st.sampled_from([None, "a"])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), toks, salts, st.integers(0, 2)),
        st.tuples(st.just("match"), toks, salts, st.none()),
        st.tuples(st.just("extend"), toks, salts, st.integers(0, 2)),
    ),
    max_size=50,
)


def lcp(a: tuple, b: tuple, page: int) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k - k % page


def reference_lookup(records: list, clock: int, q: list, salt, page: int) -> Lookup:
    qt = tuple(q[: len(q) - len(q) % page])
    mine = [r[1] for r in records if r[0] == salt]
    return Lookup(reference_match(records, clock, q, salt, page),
                  max((lcp(qt, r, page) for r in mine), default=0),
                  max((len(r) for r in mine if qt[: len(r)] == r), default=0))


def reference_match(records: list, clock: int, q: list, salt, page: int) -> dict:
    qt = tuple(q[: len(q) - len(q) % page])
    out = {}
    for w in {r[2] for r in records}:
        mine = [(lcp(qt, r[1], page), r[3]) for r in records if r[0] == salt and r[2] == w]
        best = max((k for k, _ in mine), default=0)
        if best:
            out[w] = Affinity(best, clock - max(t for k, t in mine if k >= best))
    return out


@settings(max_examples=300, deadline=None)
@given(ops=ops, page=st.sampled_from([1, 2, 3]))
def test_affinity_tree_equals_the_list_of_records(ops, page):
    tree = AffinityTree(page)
    records: list = []
    for op, q, salt, worker in ops:
        if op == "extend" and records:  # a continuation or a sibling of the latest prompt
            last = list(records[-1][1])
            q = last + q if worker else last[: len(last) // 2] + q
        if op in ("record", "extend"):
            tree.record(pack(q), salt, worker or 0)
            aligned = tuple(q[: len(q) - len(q) % page])
            if aligned:
                records.append((salt, aligned, worker or 0, tree.clock))
        else:
            assert tree.match(pack(q), salt) == reference_match(records, tree.clock, q, salt, page)
            assert tree.lookup(pack(q), salt) == reference_lookup(records, tree.clock, q, salt, page)
        tree.check()
    held = {(r[0], r[1][:k]) for r in records for k in range(page, len(r[1]) + 1, page)}
    assert tree.num_tokens == page * len(held)  # each distinct page-aligned prefix once
    # Every recorded prefix is matched whole, by some worker.
    for salt, path in {(r[0], r[1]) for r in records}:
        assert max(a.tokens for a in tree.match(pack(list(path)), salt).values()) == len(path)


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12), salts,
                               st.integers(0, 2)), min_size=1, max_size=40),
       budget=st.integers(1, 30), page=st.sampled_from([1, 2]),
       probes=st.lists(st.tuples(toks, salts), max_size=8))
def test_trimming_only_forgets_and_keeps_the_latest(seqs, budget, page, probes):
    tree = AffinityTree(page)
    for q, salt, w in seqs:
        tree.record(pack(q), salt, w)
    before = [tree.match(pack(q), s) for q, s in probes]
    looks = [tree.lookup(pack(q), s) for q, s in probes]
    tree.trim(budget)
    tree.check()
    assert tree.num_tokens <= budget
    for (q, s), was, look in zip(probes, before, looks):
        after = tree.lookup(pack(q), s)  # forgetting shortens what was shared, never lengthens it
        assert after.shared <= look.shared and after.continued <= look.continued
        now = tree.match(pack(q), s)
        for w, a in now.items():  # nothing new, nothing longer, no age changed where kept whole
            assert w in was and a.tokens <= was[w].tokens
            if a.tokens == was[w].tokens:
                assert a.age == was[w].age
    # The most recently routed prompt survives a budget that holds it.
    q, salt, w = seqs[-1]
    n = len(q) - len(q) % page
    if n and n <= budget:
        assert tree.match(pack(q), salt)[w] == Affinity(n, 0)


def test_record_trims_past_its_budget_with_slack():
    tree = AffinityTree(1, max_tokens=64)
    for i in range(100):
        tree.record(pack([i % 250 + 3] * 8 + [i]), None, i % 2)
        assert tree.num_tokens <= 64 + 64 // 8
        tree.check()
    # The latest families are still known; the oldest were forgotten.
    assert tree.match(pack([99 % 250 + 3] * 8), None)[1].tokens == 8
    assert tree.match(pack([3] * 8), None) == {}


def test_strengths_halve_per_half_life():
    tree = AffinityTree(1)
    a = pack(list(range(10, 30)))
    tree.record(a, None, 0)
    for k in range(8):
        tree.record(pack([500 + k]), None, 1)
    s = tree.strengths(a, None, half_life=4.0)
    assert s == {0: pytest.approx(20 * 0.25)}
    tree.record(a, None, 1)
    s = tree.strengths(a, None, half_life=4.0)
    assert s[1] == 20 and s[0] == pytest.approx(20 * 0.5 ** (9 / 4))


def test_bad_budget_is_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        AffinityTree(1, max_tokens=0)
