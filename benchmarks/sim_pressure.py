"""The ``pressure`` workload of ``bench_router.py`` replayed on radix caches alone: where each
tenant goes, what the workers keep, and how deep their queues are, taken apart.

No model, no HTTP, no timing: each worker is a :class:`radixserve.cache.RadixCache` with a
KV pool of ``--kv`` slots, serving its requests as the engine does one at a time (match,
take slots, evicting least recently used leaves; cache prompt + output; release). With
``--queue 1`` this reproduces the engine's hit counts exactly (``--check`` replays the same
requests through two real tiny-random ``Engine`` s and compares); a deeper queue lets a
worker pick, among the next ``Q`` of its requests of a round, the one with the longest
cached prefix first, as its LPM scheduler does when requests wait together (a model of
the batching, not the engine's exact order). Same prompts as the benchmark (same seed,
same tokenizer).

Placements (tenant -> worker, decided at a tenant's first request, kept after):

* ``even``: new tenants dealt out in turn (radixserve's router: fewest new prefixes first);
* ``smallest-tree``: a new tenant to the worker whose text tree is smallest (sglang-router's
  ``cache_aware`` below its threshold; its trees count characters of the routed texts);
* ``first-K``: the first K tenants to seen to worker 0, the others to worker 1;
* ``--search N``: the best of N random tenant splits (an upper bound for placement alone).

Priorities: ``lru`` (every token at one priority), ``tails`` (a request's tokens past what
it shares with earlier prompts at low priority, as ``radixserve router`` asks) and ``tails +
probation`` (also the shared part the worker did not find and computed again on probation,
above the tails and below everything found, as the engine does with the router's hint).

    python benchmarks/sim_pressure.py                      # the table
    python benchmarks/sim_pressure.py --search 2000        # + best random split, LRU, Q=1
    python benchmarks/sim_pressure.py --check              # Q=1 against real engines
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
from typing import Callable, Optional

import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(_ROOT, "src"))

from radixserve.bench.workloads import make_workload  # noqa: E402
from radixserve.cache import RadixCache  # noqa: E402
from radixserve.router.tokenize import load_tokenizer  # noqa: E402


class SimWorker:
    """A KV pool and its radix cache, serving one request at a time."""

    def __init__(self, kv: int) -> None:
        self.free = kv
        self.cache = RadixCache(1, on_free=self._freed)
        self.slots = itertools.count()
        self.out = itertools.count(1 << 30)  # output tokens: never in any prompt
        self.hits = 0
        self.requests = 0

    def _freed(self, t: torch.Tensor) -> None:
        self.free += len(t)

    def matched(self, ids: list[int]) -> int:
        return self.cache.match_prefix(ids[:-1]).length

    def serve(self, ids: list[int], max_tokens: int, low: Optional[int], probation: bool = False) -> int:
        m = self.cache.match_prefix(ids[:-1], low_priority_from=low)  # the last token is computed
        self.cache.lock(m.node)
        total = len(ids) + max_tokens - 1  # the last output token's K/V is never written
        need = total - m.length
        if self.free < need:
            self.cache.evict(need - self.free)
        assert self.free >= need, "a request larger than the pool"
        self.free -= need
        seq = ids + [next(self.out) for _ in range(max_tokens - 1)]
        slots = m.indices.tolist() + [next(self.slots) for _ in range(need)]
        # As the engine does (``RequestSlots.cache_written``): with a hint, what it computed
        # of the shared part enters on probation.
        prob = m.length if probation and low is not None else None
        n = self.cache.insert(seq, torch.tensor(slots, dtype=torch.int64), low_priority_from=low,
                              probation_from=prob)
        self.free += n - m.length  # duplicates of what another request cached meanwhile
        self.cache.unlock(m.node)
        self.hits += m.length
        self.requests += 1
        return m.length


def lcp(a: list[int], b: list[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def tail_hints(rounds: list, threshold: float = 0.3) -> dict:
    """The router's rule (``CacheAware._low_priority_from``) per request: shared with earlier
    prompts, none of them a whole prefix of it."""
    seen: list[list[int]] = []
    out = {}
    for rnd in rounds:
        for rid, _, ids, _ in rnd:
            shared = max((lcp(ids, s) for s in seen), default=0)
            continued = max((len(s) for s in seen if ids[: len(s)] == s), default=0)
            least = threshold * len(ids)
            ok = shared >= max(least, 1) and continued < least and shared < len(ids)
            out[rid] = shared if ok else None
            seen.append(ids)
    return out


def placement(kind: str, rounds: list, k: int = 0, mask: int = 0) -> dict:
    """Tenant -> worker for two workers."""
    home: dict = {}
    size = [0, 0]
    texts: list[list[str]] = [[], []]
    for rnd in rounds:
        for _, tenant, _, text in rnd:
            if tenant in home:
                w = home[tenant]
            elif kind == "even":
                w = len(home) % 2
            elif kind == "smallest-tree":
                w = 0 if size[0] <= size[1] else 1
            elif kind == "first":
                w = 0 if len(home) < k else 1
            else:  # a random split
                w = (mask >> tenant) & 1
            home.setdefault(tenant, w)
            if kind == "smallest-tree":  # characters the routed text adds to that worker's tree
                size[w] += len(text) - max((len(os.path.commonprefix([text, t])) for t in texts[w]), default=0)
                texts[w].append(text)
    return home


def simulate(rounds: list, home: dict, kv: int, queue: int, hints: Optional[dict],
             max_tokens: int, probation: bool = False) -> tuple[int, list[int]]:
    ws = [SimWorker(kv), SimWorker(kv)]
    for rnd in rounds:
        for i, w in enumerate(ws):
            pending = [r for r in rnd if home[r[1]] == i]
            while pending:
                window = pending[:queue]
                j = max(range(len(window)), key=lambda j: (w.matched(window[j][2]), -j))
                rid, _, ids, _ = pending.pop(j)
                w.serve(ids, max_tokens, hints.get(rid) if hints else None, probation)
    return sum(w.hits for w in ws), [w.requests for w in ws]


def load_rounds(args: argparse.Namespace) -> list:
    tok = load_tokenizer(args.model)
    wl = make_workload("memory-pressure", tok, args.seed, num_systems=args.tenants, system_tokens=256,
                       questions=args.turns, question_tokens=32, max_tokens=args.max_tokens, order="rounds")
    return [[(r.id, int(r.id.split("-")[1]), tok.encode_prompt(r.prompt), r.prompt) for r in rnd]
            for rnd in wl.rounds()]


def check(rounds: list, args: argparse.Namespace) -> None:
    """Queue 1 against two real engines: the same hit counts, request by request."""
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for kind, hinted in (("even", False), ("even", True), ("smallest-tree", False)):
        home = placement(kind, rounds)
        hints = tail_hints(rounds) if hinted else {}
        engines = [Engine("tiny-random", kv_cache_tokens=args.kv, dtype="float32", num_threads=1) for _ in range(2)]
        real = 0
        for rnd in rounds:
            for rid, tenant, ids, _ in rnd:
                e = engines[home[tenant]]
                e.add_request(ids, sp, low_priority_from=hints.get(rid))
                real += e.run_until_done()[0].cached_tokens
        sim = simulate(rounds, home, args.kv, 1, hints, args.max_tokens, hinted)[0]
        print(f"{kind}, {'tails + probation' if hinted else 'lru'}: engines {real}, simulation {sim}")
        assert real == sim


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random", help="tokenizer (as bench_router.py's --model)")
    ap.add_argument("--kv", type=int, default=2048, help="KV slots per worker")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--queues", default="1,2,4,8", help="queue depths to model")
    ap.add_argument("--search", type=int, default=0, metavar="N",
                    help="also the best of N random tenant splits (LRU, queue 1)")
    ap.add_argument("--check", action="store_true", help="compare queue 1 with real engines")
    args = ap.parse_args(argv)
    rounds = load_rounds(args)
    if args.check:
        check(rounds, args)
        return 0
    queues = [int(q) for q in args.queues.split(",")]
    hints = tail_hints(rounds)
    placements: list[tuple[str, Callable[[], dict]]] = [
        ("even (radixserve)", lambda: placement("even", rounds)),
        ("smallest tree (sglang-router)", lambda: placement("smallest-tree", rounds)),
        *[(f"first {k} / {args.tenants - k}", lambda k=k: placement("first", rounds, k))
          for k in range(args.tenants // 2 - 2, args.tenants // 2 + 1)],
    ]
    print(f"2 workers x {args.kv} KV slots, {args.tenants} tenants x {args.turns} turns; hit tokens "
          f"by queue depth ({', '.join(map(str, queues))})")
    print()
    print("| placement | tenants per worker | priorities | " + " | ".join(f"Q={q}" for q in queues) + " |")
    print("|---|---|---|" + "---:|" * len(queues))
    for name, make in placements:
        home = make()
        split = f"{sum(1 for w in home.values() if w == 0)}/{sum(1 for w in home.values() if w == 1)}"
        for prio, h, prob in (("lru", None, False), ("tails", hints, False), ("tails + probation", hints, True)):
            cells = [simulate(rounds, home, args.kv, q, h, args.max_tokens, prob)[0] for q in queues]
            print(f"| {name} | {split} | {prio} | " + " | ".join(f"{c:,}" for c in cells) + " |")
    if args.search:
        rng = random.Random(args.seed)
        best = max((simulate(rounds, placement("mask", rounds, mask=m), args.kv, 1, None, args.max_tokens)[0], m)
                   for m in (rng.getrandbits(args.tenants) for _ in range(args.search)))
        print()
        print(f"best of {args.search} random tenant splits, lru, Q=1: {best[0]:,} "
              f"({bin(best[1]).count('1')} tenants on one worker)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
