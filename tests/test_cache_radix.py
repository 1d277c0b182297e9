"""Unit tests of RadixCache: the paper's Figure 3, eviction order, locks, pages, salts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.cache import MatchResult, NoCache, PrefixCache, RadixCache, TableCache, make_cache


class SlotPool:
    """A fixed-capacity slot allocator that evicts exactly what it lacks (like the engine).

    It also checks ownership: a slot is freed at most once and only if it was allocated."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free = list(range(capacity))
        self.cache: PrefixCache | None = None

    def on_free(self, idx: torch.Tensor) -> None:
        assert idx.dtype == torch.int64 and idx.dim() == 1
        for s in idx.tolist():
            assert s not in self.free, f"slot {s} freed twice"
            self.free.append(s)

    def release(self, slots) -> None:
        self.on_free(torch.as_tensor(list(slots), dtype=torch.int64))

    def alloc(self, k: int) -> list[int]:
        if len(self.free) < k:
            need = k - len(self.free)
            freed = self.cache.evict(need)
            assert freed >= need, "could not evict enough"
        out, self.free = self.free[:k], self.free[k:]
        return out


def make(capacity: int, page_size: int = 1):
    pool = SlotPool(capacity)
    cache = RadixCache(page_size=page_size, on_free=pool.on_free)
    pool.cache = cache
    return cache, pool


def serve(cache: RadixCache, pool: SlotPool, seqs: list[list[int]]) -> None:
    """Run a batch like the scheduler: match + lock all, allocate all tails at once (evicting
    if needed), insert input+output, free duplicates, unlock."""
    matches = []
    for s in seqs:
        r = cache.match_prefix(s)
        cache.lock(r.node)
        matches.append(r)
    fresh = pool.alloc(sum(len(s) - r.length for s, r in zip(seqs, matches)))
    for s, r in zip(seqs, matches):
        mine, fresh = fresh[: len(s) - r.length], fresh[len(s) - r.length :]
        idx = r.indices.tolist() + mine
        n = cache.insert(s, torch.tensor(idx, dtype=torch.int64))
        A = cache.cacheable_length(len(s))
        pool.release(idx[r.length : n] + idx[A:])
        cache.unlock(r.node)
    cache.check_integrity()
    assert cache.protected_size == 0
    assert len(pool.free) + cache.total_size == pool.capacity


def T(*blocks):
    out = []
    for b in blocks:
        out += b
    return tuple(out)


# Synthetic "text": each block is a run of distinct token ids.
SYS = [100, 101, 102, 103]  # "You are a helpful assistant."
H1 = [200, 201, 202]  # "User: Hello!" + "Assistant: Hi!" (2 + 1 tokens)
# Capacity 21 slots is chosen so that exactly the paper's evictions happen.
C2 = list(range(300, 312))  # 1st session, 2nd turn: "Solve this problem ..." + long answer
W1 = [400, 401]  # 2nd session: "What can you do?" + "I can ..."
W2 = [410, 411]  # 2nd session, 2nd turn
EX = [500, 501, 502, 503]  # few-shot examples
QA, QB, QC = [510, 511], [520, 521], [530, 531]  # few-shot questions + answers
J = [600, 601, 602]  # 1st session, new message (node j)
ANS = [[700, 701], [710, 711], [720, 721]]  # self-consistency answer branches


def test_figure3_nine_steps():
    cache, pool = make(capacity=21)
    # (1) empty
    assert cache.as_dict() == {} and cache.total_size == 0
    # (2) first request: system prompt + "Hello!" + "Hi!" as one node under the root
    serve(cache, pool, [SYS + H1])
    assert cache.as_dict() == {T(SYS, H1): {}}
    # (3) 2nd turn of the same chat: full hit, the new turn is a child node
    serve(cache, pool, [SYS + H1 + C2])
    assert cache.as_dict() == {T(SYS, H1): {T(C2): {}}}
    # (4) a new chat session: node b splits, both sessions share the system prompt
    serve(cache, pool, [SYS + W1])
    assert cache.as_dict() == {T(SYS): {T(H1): {T(C2): {}}, T(W1): {}}}
    assert cache.total_size == 21 and not pool.free  # memory is now full
    # (5) 2nd session continues; memory is short: the LRU leaf c (C2) is evicted
    serve(cache, pool, [SYS + W1 + W2])
    assert cache.as_dict() == {T(SYS): {T(H1): {}, T(W1): {T(W2): {}}}}
    assert cache.evicted_tokens == len(C2)
    # (6) a few-shot query sharing nothing: a new child of the root, no eviction
    serve(cache, pool, [EX + QA])
    assert cache.as_dict() == {T(SYS): {T(H1): {}, T(W1): {T(W2): {}}}, T(EX, QA): {}}
    assert cache.evicted_tokens == len(C2)
    # (7) a batch of few-shot queries sharing the examples: node e splits
    serve(cache, pool, [EX + QB, EX + QC])
    assert cache.as_dict() == {
        T(SYS): {T(H1): {}, T(W1): {T(W2): {}}},
        T(EX): {T(QA): {}, T(QB): {}, T(QC): {}},
    }
    assert cache.evicted_tokens == len(C2) and cache.total_size == 21
    # (8) 1st session, new message: the 2nd session's nodes (W2, then W1) are evicted (LRU)
    serve(cache, pool, [SYS + H1 + J])
    assert cache.as_dict() == {
        T(SYS): {T(H1): {T(J): {}}},
        T(EX): {T(QA): {}, T(QB): {}, T(QC): {}},
    }
    assert cache.evicted_tokens == len(C2) + len(W1) + len(W2)
    # (9) self-consistency sampling on the question in node j: evict the three few-shot
    # leaves (i, k, l), add several answer branches under j; the shared examples survive.
    serve(cache, pool, [SYS + H1 + J + a for a in ANS])
    assert cache.as_dict() == {
        T(SYS): {T(H1): {T(J): {T(a): {} for a in ANS}}},
        T(EX): {},
    }
    assert cache.evicted_tokens == len(C2) + len(W1) + len(W2) + len(QA) + len(QB) + len(QC)
    assert cache.total_size == 20 and len(pool.free) == 1
    # Every cached path still maps to the right slots.
    r = cache.match_prefix(SYS + H1 + J + ANS[1])
    assert r.length == 4 + 3 + 3 + 2
    cache.check_integrity()


def test_match_result_type_and_contents():
    cache = RadixCache()
    seq = list(range(10))
    slots = torch.arange(100, 110, dtype=torch.int64)
    assert cache.insert(seq, slots) == 0
    r = cache.match_prefix(seq + [99])
    assert isinstance(r, MatchResult)
    assert r.length == 10 and isinstance(r.length, int)
    assert r.indices.dtype == torch.int64 and r.indices.dim() == 1
    assert r.indices.tolist() == list(range(100, 110))
    # The result never aliases the tree's storage.
    r.indices.fill_(-1)
    assert cache.match_prefix(seq).indices.tolist() == list(range(100, 110))
    miss = cache.match_prefix([42, 43])
    assert miss.length == 0 and miss.indices.shape == (0,) and miss.indices.dtype == torch.int64
    assert miss.node is cache.root
    e = cache.match_prefix([])
    assert e.length == 0


def test_input_types_are_equivalent():
    cache = RadixCache()
    cache.insert(np.arange(8), np.arange(8, dtype=np.int32) + 50)
    for q in (list(range(8)), tuple(range(8)), np.arange(8, dtype=np.int64), torch.arange(8)):
        r = cache.match_prefix(q)
        assert r.length == 8 and r.indices.tolist() == list(range(50, 58))
    assert cache.insert(torch.arange(10), list(range(60, 70))) == 8
    assert cache.match_prefix(range(10)).indices.tolist() == list(range(50, 58)) + [68, 69]
    cache.check_integrity()


def test_insert_return_value_and_split():
    cache = RadixCache()
    assert cache.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    assert cache.insert([1, 2, 3, 4], [20, 21, 22, 23]) == 4  # all duplicates
    assert cache.insert([1, 2], [30, 31]) == 2  # prefix of an edge: split, nothing new
    assert cache.as_dict() == {(1, 2): {(3, 4): {}}}
    assert cache.insert([1, 2, 5], [40, 41, 42]) == 2
    assert cache.as_dict() == {(1, 2): {(3, 4): {}, (5,): {}}}
    assert cache.match_prefix([1, 2, 5, 6]).indices.tolist() == [10, 11, 42]
    assert cache.total_size == 5 and cache.num_nodes == 3
    cache.check_integrity()


def test_match_ending_inside_an_edge_splits_it():
    cache = RadixCache()
    cache.insert(list(range(10)), list(range(10)))
    r = cache.match_prefix([0, 1, 2, 3, 99])
    assert r.length == 4
    assert cache.as_dict() == {(0, 1, 2, 3): {(4, 5, 6, 7, 8, 9): {}}}
    cache.lock(r.node)
    assert cache.protected_size == 4 and cache.evictable_size == 6
    assert cache.evict(100) == 6  # only the unlocked tail can go
    assert cache.as_dict() == {(0, 1, 2, 3): {}}
    cache.unlock(r.node)
    assert cache.evictable_size == 4 and cache.protected_size == 0
    cache.check_integrity()


def test_split_of_a_locked_node_keeps_accounting():
    cache = RadixCache()
    cache.insert(list(range(10)), list(range(10)))
    r = cache.match_prefix(list(range(10)))
    cache.lock(r.node)
    cache.insert([0, 1, 2, 7], [20, 21, 22, 23])  # splits the locked edge
    cache.check_integrity()
    assert cache.protected_size == 10 and cache.evictable_size == 1
    cache.unlock(r.node)
    assert cache.protected_size == 0 and cache.evictable_size == 11
    cache.check_integrity()


def test_eviction_is_lru_among_leaves_and_spares_internal_nodes():
    freed = []
    cache = RadixCache(on_free=lambda t: freed.append(t.tolist()))
    cache.insert([1, 2, 3], [1, 2, 3])  # becomes internal
    cache.insert([1, 2, 3, 4], [1, 2, 3, 4])
    cache.insert([1, 2, 3, 5], [1, 2, 3, 5])
    cache.insert([9], [9])
    cache.match_prefix([1, 2, 3, 4])  # refresh the [4] leaf
    # Leaves by age: [5], [9], [4]; the internal [1,2,3] is not a candidate.
    assert cache.evict(1) == 1 and freed[-1] == [5]
    assert cache.evict(1) == 1 and freed[-1] == [9]
    assert cache.evict(1) == 1 and freed[-1] == [4]
    # Now [1,2,3] is a leaf and finally evictable.
    assert cache.evict(1) == 3 and freed[-1] == [1, 2, 3]
    assert cache.total_size == 0 and cache.evict(5) == 0
    cache.check_integrity()


def test_parent_becomes_candidate_in_same_evict_call():
    freed = []
    cache = RadixCache(on_free=lambda t: freed.extend(t.tolist()))
    cache.insert([1, 2], [1, 2])
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([7, 8, 9], [7, 8, 9])
    cache.match_prefix([7, 8, 9])  # newest
    assert cache.evict(2) == 3  # [3] then its parent [1,2]
    assert sorted(freed) == [1, 2, 3]
    assert cache.as_dict() == {(7, 8, 9): {}}


def test_lock_protects_the_whole_root_path():
    cache = RadixCache()
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    cache.insert([1, 2, 3, 6], [1, 2, 3, 6])
    r = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(r.node)
    assert cache.protected_size == 5 and cache.evictable_size == 1
    cache.lock(r.node)  # ref-counted
    assert cache.protected_size == 5
    assert cache.evict(100) == 1  # only the [6] leaf
    assert cache.as_dict() == {(1, 2, 3): {(4, 5): {}}}
    cache.unlock(r.node)
    assert cache.protected_size == 5 and cache.evict(100) == 0
    cache.unlock(r.node)
    assert cache.protected_size == 0 and cache.evictable_size == 5
    with pytest.raises(RuntimeError):
        cache.unlock(r.node)
    assert cache.evict(100) == 5
    cache.check_integrity()


def test_locking_root_is_a_noop():
    cache = RadixCache()
    cache.insert([1], [1])
    r = cache.match_prefix([5])
    assert r.node is cache.root
    cache.lock(r.node)
    cache.unlock(r.node)
    cache.unlock(r.node)
    assert cache.protected_size == 0 and cache.evictable_size == 1


def test_handles_of_evicted_nodes_are_rejected():
    cache = RadixCache()
    cache.insert([1, 2], [1, 2])
    r = cache.match_prefix([1, 2])
    cache.evict(2)
    with pytest.raises(ValueError):
        cache.lock(r.node)
    with pytest.raises(ValueError):
        cache.lock("not a node")


def test_page_size_alignment():
    cache = RadixCache(page_size=4)
    seq = list(range(10))
    assert cache.cacheable_length(10) == 8
    assert cache.insert(seq, list(range(100, 110))) == 0
    assert cache.total_size == 8  # the 2-token tail is not cached; caller frees 108, 109
    assert cache.match_prefix(seq).length == 8
    assert cache.match_prefix(seq[:7]).length == 4
    assert cache.match_prefix(seq[:3]).length == 0
    # Divergence inside a page: the match stops at the page boundary, and the split is aligned.
    r = cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7])
    assert r.length == 4 and r.indices.tolist() == [100, 101, 102, 103]
    assert cache.as_dict() == {(0, 1, 2, 3): {(4, 5, 6, 7): {}}}
    assert cache.insert([0, 1, 2, 3, 4, 5, 99, 7, 8], list(range(200, 209))) == 4
    assert cache.as_dict() == {(0, 1, 2, 3): {(4, 5, 6, 7): {}, (4, 5, 99, 7): {}}}
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7]).indices.tolist() == [100, 101, 102, 103, 204, 205, 206, 207]
    cache.check_integrity()


def test_salt_isolation():
    cache = RadixCache()
    cache.insert([1, 2, 3], [1, 2, 3], salt="alice")
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], salt="bob").length == 0
    assert cache.match_prefix([1, 2, 3], salt="alice").length == 3
    assert cache.insert([1, 2, 3], [4, 5, 6]) == 0  # default namespace: no sharing
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == [4, 5, 6]
    assert cache.total_size == 6 and cache.num_nodes == 2
    r = cache.match_prefix([1, 2, 3], salt="alice")
    cache.lock(r.node)
    assert cache.evict(10) == 3 and cache.match_prefix([1, 2, 3]).length == 0
    cache.unlock(r.node)
    assert cache.evict(10) == 3
    cache.check_integrity()


def test_reset_frees_everything_and_refuses_while_locked():
    freed = []
    cache = RadixCache(on_free=lambda t: freed.extend(t.tolist()))
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([1, 5], [1, 5])
    cache.insert([8], [8], salt=1)
    r = cache.match_prefix([1, 2, 3])
    cache.lock(r.node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.total_size == 5 and not freed
    cache.unlock(r.node)
    cache.reset()
    assert sorted(freed) == [1, 2, 3, 5, 8]
    assert cache.total_size == 0 and cache.num_nodes == 0
    assert cache.match_prefix([1, 2, 3]).length == 0
    cache.check_integrity()


def test_hit_counts_stats_and_dump():
    cache = RadixCache()
    cache.insert([1, 2, 3], [1, 2, 3])
    for _ in range(3):
        r = cache.match_prefix([1, 2, 3])
    assert r.node.hit_count == 3
    st = cache.stats()
    assert st["total_size"] == 3 and st["num_nodes"] == 1 and st["evictable_size"] == 3
    assert st["protected_size"] == 0 and st["evicted_tokens"] == 0 and st["page_size"] == 1
    text = cache.dump()
    assert "hits=3" in text and "1,2,3" in text
    assert cache.pretty == text


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=1.5)
    with pytest.raises(ValueError, match="on_free"):
        RadixCache(on_free=3)
    cache = RadixCache()
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2, 3], torch.arange(2))
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2], torch.zeros(2, 2, dtype=torch.int64).view(-1)[:3])
    with pytest.raises(ValueError, match="indices"):
        cache.insert([1, 2], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="token_ids"):
        cache.match_prefix(torch.tensor([1.0]))
    for bad in ([1, -1], [2**32], [1, 2.5], [1, "a"], [None]):
        with pytest.raises(ValueError, match="token_ids"):
            cache.match_prefix(bad)
        with pytest.raises(ValueError, match="token_ids"):
            cache.insert(bad, list(range(len(bad))))
    with pytest.raises(ValueError, match="num_tokens"):
        cache.evict(-1)
    with pytest.raises(ValueError, match="kind"):
        make_cache("tree")
    assert cache.total_size == 0
    cache.check_integrity()


def test_make_cache_factory():
    assert isinstance(make_cache("radix", 4, None), RadixCache)
    assert isinstance(make_cache("table", 1, None), TableCache)
    assert isinstance(make_cache("none", 1, None), NoCache)
    assert make_cache("radix", page_size=16).page_size == 16


def test_check_integrity_detects_corruption():
    cache = RadixCache()
    cache.insert([1, 2, 3], [1, 2, 3])
    cache.insert([1, 2, 4], [1, 2, 4])
    cache.check_integrity()
    node = cache.match_prefix([1, 2, 4]).node
    node.value = np.array([1], dtype=np.int64)  # slot 1 now held twice
    with pytest.raises(AssertionError):
        cache.check_integrity()
