"""Low-priority tails and probation in the radix cache, against a reference that knows
nothing of nodes.

Reference: every cached page-aligned token prefix ``(salt, tokens[:k])`` has a key
``(class, time)``, class 2 normal, 1 probation, 0 low.
A walk (match or insert) at time ``t`` by a request that keeps its first ``r0`` tokens at
normal priority, those up to ``r`` on probation and the rest low gives the prefixes it passes
with ``k <= r0`` the key ``(2, t)``, those with ``r0 < k <= r`` the larger of their key and
``(1, t)`` and the others the larger of their key and ``(0, t)`` (a request never lowers a
key). The
cache must evict whole leaves in key order: whatever one ``evict`` call frees has no larger
key than any cached leaf it leaves behind. Slots are followed through ``on_free`` as in
``test_cache_property.py``; ``check_integrity`` runs after every step.
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache import RadixCache

CAPACITY = 40
SALTS = [None, "s"]
seqs = st.lists(st.sampled_from([0, 1, 2**24, 2**32 - 1]), min_size=1, max_size=12)
lows = st.one_of(st.none(), st.integers(0, 14))
# probation_from: none, a position, or what the request found (as the engine passes it)
probs = st.one_of(st.none(), st.just("found"), st.integers(0, 14))


class PriorityMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.free = set(range(CAPACITY))
        self.prefix_of: dict[int, tuple] = {}  # slot -> (salt, prefix ending at its token)
        self.key: dict[tuple, tuple] = {}  # (salt, page-aligned prefix) -> (normal, time)
        self.time = 0
        self.freed: list[tuple] = []
        self.locked: set = set()  # prefixes on the path the running request holds
        self.seen: list = []  # (seq, salt) served so far
        self.cache = RadixCache(page_size=page_size, on_free=self.on_free)

    def on_free(self, idx: torch.Tensor) -> None:
        for s in idx.tolist():
            salt, p = self.prefix_of.pop(s)
            if len(p) % self.ps == 0:  # a page's last token: the page leaves the tree
                self.freed.append(self.key.pop((salt, p)))
            self.free.add(s)

    # ------------------------------------------------------------------ reference
    def walk(self, seq: list, salt, low, length: int, prob=None) -> None:
        """The reference keys after a walk over the first ``length`` tokens of ``seq``."""
        self.time += 1
        r = length if low is None else low - low % self.ps
        r0 = r if prob is None else min(r, prob - prob % self.ps)
        for k in range(self.ps, length + 1, self.ps):
            p = (salt, tuple(seq[:k]))
            cls = 2 if k <= r0 else 1 if k <= r else 0
            self.key[p] = (2, self.time) if cls == 2 else max(self.key.get(p, (0, 0)), (cls, self.time))

    def ref_match(self, seq: list, salt) -> int:
        best = 0
        for k in range(self.ps, len(seq) + 1, self.ps):
            if (salt, tuple(seq[:k])) in self.key:
                best = k
        return best

    def leaves(self) -> list[tuple]:
        """Keys of the cached prefixes nothing cached extends and no request has locked
        (the evictable leaves)."""
        parents = {(salt, p[: len(p) - self.ps]) for salt, p in self.key}
        return [k for x, k in self.key.items() if x not in parents and x not in self.locked]

    def evict(self, k: int) -> None:
        self.freed = []
        self.cache.evict(k)
        if self.freed:
            assert max(self.freed) <= min(self.leaves(), default=(3, 0)), \
                f"evicted {max(self.freed)} before a leaf keyed {min(self.leaves())}"

    # ------------------------------------------------------------------ rules
    @rule(seq=seqs, salt=st.sampled_from(SALTS), low=lows, prob=st.one_of(st.none(), st.integers(0, 14)))
    def match(self, seq, salt, low, prob=None):
        r = self.cache.match_prefix(seq, salt=salt, low_priority_from=low, probation_from=prob)
        assert r.length == self.ref_match(seq, salt)
        self.walk(seq, salt, low, r.length, prob)

    @rule(seq=seqs, salt=st.sampled_from(SALTS), low=lows, prob=probs)
    def serve(self, seq, salt, low, prob=None):
        """A request as the scheduler runs it: match, lock, take slots, insert, unlock."""
        cache = self.cache
        self.seen.append((seq, salt))
        r = cache.match_prefix(seq, salt=salt, low_priority_from=low)
        assert r.length == self.ref_match(seq, salt)
        self.walk(seq, salt, low, r.length)
        cache.lock(r.node)
        self.locked = {(salt, tuple(seq[:k])) for k in range(self.ps, r.length + 1, self.ps)}
        need = len(seq) - r.length
        if len(self.free) < need:
            self.evict(need - len(self.free))
        if len(self.free) < need:
            cache.unlock(r.node)
            self.locked = set()
            return
        fresh = sorted(self.free)[:need]
        self.free -= set(fresh)
        idx = r.indices.tolist() + fresh
        if prob == "found":
            prob = r.length
        n = cache.insert(seq, torch.tensor(idx, dtype=torch.int64), salt=salt, low_priority_from=low,
                         probation_from=prob)
        assert n == r.length  # the locked prefix stayed; nothing else came in meanwhile
        A = len(seq) - len(seq) % self.ps
        self.walk(seq, salt, low, A, prob)
        for i in range(n, A):
            self.prefix_of[idx[i]] = (salt, tuple(seq[: i + 1]))
        self.free |= set(idx[A:])
        cache.unlock(r.node)
        self.locked = set()

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), extra=seqs, low=lows, prob=probs)
    def serve_again(self, i, extra, low, prob):
        """A sibling or a continuation of an earlier request: what walks over low runs."""
        seq, salt = self.seen[i % len(self.seen)]
        self.serve(seq[: len(seq) // 2] + extra if extra[0] else seq + extra[1:], salt, low, prob)

    @precondition(lambda self: self.seen)
    @rule(i=st.integers(0, 100), low=lows)
    def match_again(self, i, low):
        self.match(*self.seen[i % len(self.seen)], low)

    @rule(k=st.integers(1, CAPACITY))
    def evict_some(self, k):
        self.evict(k)

    @invariant()
    def consistent(self):
        self.cache.check_integrity()
        assert self.cache.total_size == len(self.prefix_of) == CAPACITY - len(self.free)
        assert len(self.key) * self.ps == len(self.prefix_of)


PriorityMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
TestLowPriorityTails = PriorityMachine.TestCase


def test_a_unique_tail_goes_before_the_prompt_it_hangs_from():
    """The case the priorities exist for: two families' system prompts, each with a question
    below it; memory runs short. Plain LRU evicts the older family's question and then its
    prompt (they share a stamp); with the questions low, both questions go first."""
    for low, survivors in ((None, {"b"}), (4, {"a", "b"})):
        freed: list = []
        cache = RadixCache(1, on_free=lambda t: freed.extend(t.tolist()))
        slots = iter(range(100))
        sys_a, sys_b = [1, 2, 3, 4], [5, 6, 7, 8]
        for s in (sys_a + [9, 9], sys_b + [10, 10]):
            cache.insert(s, torch.tensor([next(slots) for _ in s]), low_priority_from=low)
        cache.evict(4)  # what the two questions hold
        held = {name for name, s in (("a", sys_a), ("b", sys_b)) if cache.match_prefix(s).length == 4}
        assert held == survivors, (low, held)
        cache.check_integrity()


def test_a_normal_request_raises_a_low_run_it_reuses():
    freed: list = []
    cache = RadixCache(1, on_free=lambda t: freed.extend(t.tolist()))
    cache.insert([1, 2, 3, 4], torch.arange(4), low_priority_from=0)  # all low
    cache.insert([7, 8], torch.arange(4, 6))  # normal, and older than what follows
    cache.match_prefix([1, 2, 3, 4])  # reused at normal priority
    cache.evict(1)
    assert freed == [4, 5]  # the older normal leaf goes first now


def test_a_prefix_on_probation_goes_after_the_tails_and_before_found_prefixes():
    """Three families' prompts; the third one's was evicted and is computed again under a
    hint: on probation it outlasts every question (low) but goes before the prompts that
    were found (normal), however old; found again it is normal like them."""
    freed: list = []
    cache = RadixCache(1, on_free=lambda t: freed.extend(t.tolist()))
    slots = iter(range(100))
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [11, 12, 13, 14]

    def serve(prompt, q):
        seq = prompt + q
        m = cache.match_prefix(seq, low_priority_from=4)
        idx = m.indices.tolist() + [next(slots) for _ in range(len(seq) - m.length)]
        cache.insert(seq, torch.tensor(idx), low_priority_from=4, probation_from=m.length)
        return m.length

    for p in (a, b):
        cache.insert(p, torch.tensor([next(slots) for _ in p]))  # found before: normal
    assert serve(c, [20, 20]) == 0  # computed under the hint: c on probation, its question low
    assert serve(a, [21, 21]) == 4 and serve(b, [22, 22]) == 4
    # slots: a 0-3, b 4-7, c 8-11 and its question 12-13, a's 14-15, b's 16-17 (a plain
    # match would raise c to normal: what is evicted is told by the slots freed)
    freed.clear()
    cache.evict(6)  # the three questions
    assert sorted(freed) == list(range(12, 18))
    freed.clear()
    cache.evict(1)  # then the prompt on probation, though found less long ago than a and b
    assert sorted(freed) == [8, 9, 10, 11]
    cache.check_integrity()
    assert serve(c, [23]) == 0 and serve(c, [24]) == 4  # c 18-21, questions 22 and 23; found: normal
    freed.clear()
    cache.evict(2)  # the two questions
    assert sorted(freed) == [22, 23]
    freed.clear()
    cache.evict(1)  # the least recently used normal prompt: a
    assert sorted(freed) == [0, 1, 2, 3]
    cache.check_integrity()


def test_an_engine_under_pressure_keeps_every_system_prompt_when_questions_go_first(tiny_loaded):
    """Four tenants' 40-token system prompts take turns (shuffled) with a question each, in a
    pool a little too small for them and their questions. Without the hint the LRU keeps
    evicting a prompt right after its question; with it, from the second round on every
    request finds its whole system prompt."""
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    def run(hint: bool) -> list[int]:
        eng = Engine(tiny_loaded, kv_cache_tokens=192, dtype="float32")
        rng = random.Random(0)
        systems = [[1] + [10 + f] * 39 for f in range(4)]
        hits = []
        for r in range(4):
            order = list(range(4))
            rng.shuffle(order)
            for f in order:
                eng.add_request(systems[f] + [200 + 7 * r + f] * 10,
                                SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                low_priority_from=40 if hint and r else None)
                out = eng.run_until_done()[0]
                if r >= 2:
                    hits.append(out.cached_tokens)
            eng.check_integrity()
        return hits

    assert run(True) == [40] * 8
    assert min(run(False)) < 40
