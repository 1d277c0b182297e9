"""The draft index of speculative decoding (``radixserve/cache/draft_index.py``): what follows
a suffix in a real radix tree, kept by the tree's own events through splits and evictions,
one namespace per salt, never holding an entry for a node the tree let go."""

from __future__ import annotations

from array import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.cache.draft_index import MAX_FORK, TreeDraftIndex
from radixserve.cache.events import fan_out
from radixserve.cache.radix import RadixCache


def _packed(ids: list[int]) -> bytes:
    return array("I", ids).tobytes()


def _cache() -> tuple[RadixCache, TreeDraftIndex, list]:
    freed: list = []
    cache = RadixCache(on_free=freed.append)
    index = TreeDraftIndex(cache, 2, 4)
    cache.listener = fan_out(cache.listener, index.on_event)
    return cache, index, freed


def _insert(cache: RadixCache, ids: list[int], salt: str | None = None, base: int = 0) -> None:
    cache.insert(ids, torch.arange(base, base + len(ids)), salt=salt)


def test_index_follows_the_tree() -> None:
    cache, index, _ = _cache()
    _insert(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert index.lookup(None, _packed([9, 3, 4]), 3) == (2, [5, 6, 7])  # the longest suffix found
    assert index.lookup(None, _packed([2, 3, 4]), 10) == (3, [5, 6, 7, 8])
    assert index.lookup(None, _packed([8]), 3) == (0, [])  # shorter than min_ngram
    assert index.lookup(None, _packed([7, 8]), 3) == (0, [])  # nothing follows
    # A branch splits the node; positions above the split still resolve, and the draft
    # continues down the child used last.
    _insert(cache, [1, 2, 3, 4, 50, 51], base=100)
    assert index.lookup(None, _packed([2, 3]), 4) == (2, [4, 50, 51])  # the newest occurrence
    cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert index.lookup(None, _packed([1, 2, 3]), 4) == (3, [4, 5, 6, 7])
    assert index.lookup(None, _packed([5, 6]), 4) == (2, [7, 8])


def test_index_is_per_salt_and_forgets_what_the_tree_evicts() -> None:
    cache, index, freed = _cache()
    _insert(cache, [1, 2, 3, 4, 5], salt="alice")
    assert not freed
    assert index.lookup("bob", _packed([2, 3]), 3) == (0, [])
    assert index.lookup(None, _packed([2, 3]), 3) == (0, [])
    assert index.lookup("alice", _packed([2, 3]), 3) == (2, [4, 5])
    _insert(cache, [9, 2, 3, 7, 7, 7], salt="bob", base=10)
    assert index.lookup("bob", _packed([2, 3]), 3) == (2, [7, 7, 7])
    assert index.lookup("alice", _packed([2, 3]), 3) == (2, [4, 5])
    assert index.num_entries() == 9 + 11  # [7, 7] ends twice in bob's run: one entry
    cache.evict(100)
    assert index.num_entries() == 0 and index.salts() == []
    assert sum(int(f.numel()) for f in freed) == 11
    _insert(cache, [1, 2, 3, 4, 5])
    cache.reset()  # cleared: everything goes
    assert index.num_entries() == 0


def test_index_keeps_other_occurrences_when_a_leaf_goes() -> None:
    """Evicting one branch drops the entries pointing into it, not an entry for the same
    tokens pointing at a live occurrence elsewhere, and no entry outlives its node."""
    cache, index, _ = _cache()
    _insert(cache, [1, 2, 9, 5, 6, 8])
    _insert(cache, [1, 2, 3, 4, 5, 6, 7], base=10)  # [5, 6] again, newer: the entry points here
    assert index.lookup(None, _packed([5, 6]), 2) == (2, [7])
    assert index.lookup(None, _packed([2, 9]), 2) == (2, [5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    cache.lock(m.node)
    assert cache.evict(4) == 4  # the [9, 5, 6, 8] branch: the only unlocked leaf
    assert index.lookup(None, _packed([2, 9]), 2) == (0, [])
    assert index.lookup(None, _packed([6, 8]), 2) == (0, [])
    assert index.lookup(None, _packed([5, 6]), 2) == (2, [7])
    cache.unlock(m.node)
    cache.evict(100)
    assert index.num_entries() == 0


def test_index_stops_at_a_wide_fork() -> None:
    cache, index, _ = _cache()
    _insert(cache, [1, 2, 3])
    for i in range(MAX_FORK + 1):
        _insert(cache, [1, 2, 3, 100 + i, 7], base=10 * (i + 1))
    assert index.lookup(None, _packed([1, 2]), 4) == (2, [3])


# ---------------------------------------------------------------------------------- prediction
def _reference_prediction(pred: list[int], outputs: list[list[int]], prompt: list[int], lo: int, hi: int,
                          k: int) -> list[tuple[int, list[int]]]:
    """What PredictionDrafts answers for each successive output, by brute force: the
    prediction's next tokens while the output is its beginning, else the longest suffix of
    prompt + output (lo..hi tokens) that occurs in the prediction followed by a token, at its
    first occurrence ending at or after where the previous draft started (else the last one
    before that)."""
    answers = []
    aligned, cursor = True, 0
    for out in outputs:
        aligned = aligned and out == pred[: len(out)]
        if aligned:
            d = pred[len(out) : len(out) + k]
            answers.append((1 << 30, d) if d else (0, []))
            continue
        seq = prompt + out
        found = (0, [])
        for n in range(min(hi, len(seq)), lo - 1, -1):
            gram = seq[len(seq) - n :]
            ends = [e for e in range(n - 1, len(pred) - 1) if pred[e - n + 1 : e + 1] == gram]
            if ends:
                after = [e for e in ends if e >= cursor]
                e = after[0] if after else ends[-1]
                cursor = e + 1
                found = (n, pred[e + 1 : e + 1 + k])
                break
        answers.append(found)
    return answers


@settings(max_examples=300, deadline=None)
@given(pred=st.lists(st.integers(0, 5), max_size=40), out=st.lists(st.integers(0, 5), max_size=30),
       prompt=st.lists(st.integers(0, 5), min_size=1, max_size=8), k=st.integers(1, 6))
def test_prediction_drafts_match_a_brute_force_reference(pred: list[int], out: list[int], prompt: list[int],
                                                         k: int) -> None:
    """Over a growing output (tokens from a small alphabet: many repeats, partial matches),
    each lookup equals the reference; an output that starts as the prediction is drafted
    from the prediction's next tokens."""
    from radixserve.sched.speculation import PredictionDrafts

    lo, hi = 2, 4
    if pred:  # half the time, the output starts as the prediction
        out = pred[: len(out)] + out[len(pred) :] if len(out) % 2 else out
    pd = PredictionDrafts(pred, lo, hi)
    outputs = [out[:i] for i in range(len(out) + 1)]
    got = []
    for o in outputs:
        suffix = _packed((prompt + o)[-hi:])
        got.append(pd.lookup(o, suffix, lo, hi, k))
    assert got == _reference_prediction(pred, outputs, prompt, lo, hi, k)
