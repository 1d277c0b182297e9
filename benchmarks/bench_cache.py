"""Micro-benchmark of the radix prefix cache (not a test).

Trace (seeded): N sequences of 500 tokens, each = one of 100 shared 200-token prefixes +
a random 300-token tail.  Measures, for page sizes 1 and 16:

* inserts/s        — insert every sequence (slots as a torch int64 tensor) into an empty
                     cache;
* full-hit match/s — match_prefix of every inserted sequence;
* partial match/s  — match_prefix of shared prefix + a fresh random tail;
* full-hit match + indices/s — the same, reading the matched KV slot indices as a tensor
                     (``MatchResult.indices`` builds them when first read; SGLang 0.5.23's
                     ``match_prefix`` does not build them at all, its admission asks
                     ``path_device_indices(node)`` for them);
* evict-all        — time for evict(total_size) on the full tree.

Token ids are given two ways: as plain lists (the cache packs them itself, inside the timed
call) and prepacked as ``array('I')``, the form the engine passes (``Req.cache_key``) and the
counterpart of the ``RadixKey(array('q'))`` SGLang's cache takes.

Each figure is the median of ``--rounds`` rounds on fresh caches, as throughput over this
process's CPU time (headline) and over wall time.  The quoted reference numbers are SGLang
0.5.23's RadixCache on the same trace shape (from the task brief).  With ``--sglang`` the
script also runs SGLang's RadixCache itself on the same trace, rounds interleaved with ours,
and prints the measured ratios (median and range of the per-round ratios) two ways, each
like for like: both sides given packed keys
built outside the timing (our ``array('I')``, SGLang's ``RadixKey(array('q'))``), and both
sides starting from plain lists (our calls pack them; for SGLang the time to build its keys
from the lists, measured separately, is added).

The trace's own objects (20,000 lists of 500 ints) are frozen out of the cyclic GC
(``gc.freeze()``) before timing: otherwise a full collection triggered by whoever allocates
next traverses 10M list entries of benchmark input (~0.2 s, landing in a random round).
Objects the caches allocate are still collected as usual.

    python benchmarks/bench_cache.py            # 10,000 sequences
    python benchmarks/bench_cache.py --quick    # 2,000 sequences, 1 round
    PYTHONPATH=/path/to/sglang python benchmarks/bench_cache.py --sglang
"""

from __future__ import annotations

import argparse
import gc
from array import array
import os
import statistics
import sys
import time

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))
sys.path.insert(0, _HERE)  # for peers.sglang_radix

from radixserve.cache import RadixCache  # noqa: E402

# SGLang 0.5.23 reference: (inserts/s, full-hit/s, partial/s) as quoted ranges (used without
# --sglang; the target is 2x the high end).
SGLANG_REF = {
    1: ((43_000, 45_000), (64_000, 67_000), (94_000, 115_000)),
    16: ((35_000, 40_000), (46_000, 56_000), (71_000, 91_000)),
}
TARGET_FACTOR = 2.0
# With --sglang, measured side by side: the tree's bar is 3x SGLang's rate, both key forms.
SIDE_BY_SIDE_FACTOR = 3.0


def make_trace(num_seqs: int, seed: int = 0, vocab: int = 32000):
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, vocab, size=(100, 200))
    which = rng.integers(0, 100, size=num_seqs)
    tails = rng.integers(0, vocab, size=(num_seqs, 300))
    seqs = [prefixes[w].tolist() + tails[i].tolist() for i, w in enumerate(which)]
    new_tails = rng.integers(0, vocab, size=(num_seqs, 300))
    partial = [prefixes[w].tolist() + new_tails[i].tolist() for i, w in enumerate(which)]
    slots = [torch.arange(i * 500, (i + 1) * 500, dtype=torch.int64) for i in range(num_seqs)]
    return seqs, slots, partial


class _Timer:
    """Measures both wall time and this process's CPU time (user+sys, page faults included).

    CPU time is the headline number because benchmark machines are often shared: it is
    what the cache itself costs, independent of other processes competing for the cores."""

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.cpu = time.process_time() - self.c0


def packed(seqs: list) -> list:
    """The trace as the engine hands it to the cache (``Req.cache_key``)."""
    return [array("I", s) for s in seqs]


def one_round(page_size: int, seqs, slots, partial) -> dict:
    freed = [0]

    def on_free(idx: torch.Tensor) -> None:
        freed[0] += idx.numel()

    cache = RadixCache(page_size=page_size, on_free=on_free)
    insert = cache.insert
    match = cache.match_prefix
    n = len(seqs)
    out = {}
    with _Timer() as t:
        for s, idx in zip(seqs, slots):
            insert(s, idx)
    out["insert"], out["insert_wall"] = n / t.cpu, n / t.wall
    with _Timer() as t:
        for s in seqs:
            match(s)
    out["full"], out["full_wall"] = n / t.cpu, n / t.wall
    with _Timer() as t:
        for s in partial:
            match(s)
    out["partial"], out["partial_wall"] = n / t.cpu, n / t.wall
    with _Timer() as t:
        for s in seqs:
            match(s).indices
    out["full_idx"], out["full_idx_wall"] = n / t.cpu, n / t.wall
    total = cache.total_size
    with _Timer() as t:
        cache.evict(total)
    out["evict_s"], out["evict_wall"] = t.cpu, t.wall
    out["tokens"] = total
    assert freed[0] == total and cache.total_size == 0
    return out


def sglang_round(page_size: int, seqs, slots, partial) -> dict:
    """The same four measurements on SGLang's RadixCache (see benchmarks/peers/sglang_radix.py)."""
    from peers.sglang_radix import SGLangContender

    c = SGLangContender(page_size)
    with _Timer() as tk:
        keys = c.keys(seqs)
    with _Timer() as tp:
        pkeys = c.keys(partial)
    n = len(seqs)
    out = {"key_s": tk.cpu, "pkey_s": tp.cpu}
    with _Timer() as t:
        c.insert_all(keys, slots)
    out["insert"], out["insert_wall"] = n / t.cpu, n / t.wall
    with _Timer() as t:
        got = c.match_all(keys)
    out["full"], out["full_wall"] = n / t.cpu, n / t.wall
    assert got[0] == 500 - 500 % page_size
    with _Timer() as t:
        c.match_all(pkeys)
    out["partial"], out["partial_wall"] = n / t.cpu, n / t.wall
    with _Timer() as t:
        got = c.match_indices_all(keys)
    out["full_idx"], out["full_idx_wall"] = n / t.cpu, n / t.wall
    assert len(got[0]) == 500 - 500 % page_size
    total = c.total_size()
    with _Timer() as t:
        freed = c.evict_all()
    out["evict_s"], out["evict_wall"] = t.cpu, t.wall
    out["tokens"] = total
    assert freed == total
    return out


def _from_lists(sg: dict, k: str, n: int) -> float:
    """SGLang's rate for operation ``k`` in one round with the time to build its keys from
    the lists added (the counterpart of our calls that pack lists themselves)."""
    key_s = sg["pkey_s"] if k == "partial" else sg["key_s"]
    return n / (n / sg[k] + key_s)


def sanity(page_size: int, seqs, slots) -> None:
    """The benchmark must measure correct work: spot-check match results."""
    cache = RadixCache(page_size=page_size)
    for s, idx in zip(seqs[:200], slots[:200]):
        cache.insert(s, idx)
    for s in seqs[:200]:
        r = cache.match_prefix(s)
        assert r.length == 500 - 500 % page_size
    cache.check_integrity()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2,000 sequences, 1 round")
    ap.add_argument("--num-seqs", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--sglang", action="store_true",
                    help="also run SGLang's RadixCache side by side (sglang must be importable)")
    args = ap.parse_args(argv)
    num = args.num_seqs or (2000 if args.quick else 10_000)
    rounds = args.rounds or (1 if args.quick else 3)

    t_start = time.perf_counter()
    seqs, slots, partial = make_trace(num)
    pseqs, ppartial = packed(seqs), packed(partial)
    gc.collect()
    gc.freeze()  # see the module docstring
    sg_version = None
    if args.sglang:
        from peers.sglang_radix import version

        sg_version = version()
    print(f"trace: {num} sequences x 500 tokens (100 shared 200-token prefixes + random 300-token tails), "
          f"median of {rounds} round(s); python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average before start {os.getloadavg()[0]:.2f}"
          + (f"; SGLang {sg_version} side by side" if sg_version else "") + "\n")
    rows = []
    for ps in args.page_sizes:
        sanity(ps, seqs, slots)
        res: dict = {"lists": [], "packed": [], "sglang": []}
        for _ in range(rounds):  # interleaved, so load bursts hit every contender alike
            # Each round starts from a collected heap: a previous contender's garbage (SGLang's
            # tree nodes are reference cycles) must not be collected on the next one's time.
            gc.collect()
            res["lists"].append(one_round(ps, seqs, slots, partial))
            gc.collect()
            res["packed"].append(one_round(ps, pseqs, slots, ppartial))
            if args.sglang:
                gc.collect()
                res["sglang"].append(sglang_round(ps, seqs, slots, partial))
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for name, rs in res.items() if rs}
        rows.append((ps, med, res))

    names = [("insert", "inserts/s"), ("full", "full-hit match/s"), ("partial", "partial-hit match/s"),
             ("full_idx", "full-hit match + indices/s")]
    print("Throughput over process CPU time (wall-clock figures in the lines below the table).\n")
    if args.sglang:
        print("| page | metric | radixserve, lists | radixserve, packed | SGLang, keys from lists "
              "| SGLang, prebuilt keys | ratio from lists, median [range] | ratio packed/prebuilt, median [range] "
              "| target | met |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
    else:
        print("| page | metric | radixserve, lists | radixserve, packed | SGLang 0.5.23 (quoted) "
              "| ratio lists vs quoted | ratio packed vs quoted | target (2x quoted high) | met (packed) |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|:---:|")
    for ps, med, res in rows:
        L, P, S = med["lists"], med["packed"], med.get("sglang")
        ref = SGLANG_REF.get(ps)
        for i, (k, label) in enumerate(names):
            if S:
                key_s = S["pkey_s"] if k == "partial" else S["key_s"]
                s_lists = num / (num / S[k] + key_s)  # its operation time plus building its keys
                per_l = [lr[k] / _from_lists(sr, k, num) for lr, sr in zip(res["lists"], res["sglang"])]
                per_p = [pr[k] / sr[k] for pr, sr in zip(res["packed"], res["sglang"])]
                rl, rp = statistics.median(per_l), statistics.median(per_p)
                met = "yes" if min(rl, rp) >= SIDE_BY_SIDE_FACTOR else "NO"
                print(f"| {ps} | {label} | {L[k]:,.0f} | {P[k]:,.0f} | {s_lists:,.0f} | {S[k]:,.0f} "
                      f"| {rl:.2f}x [{min(per_l):.2f}–{max(per_l):.2f}] | {rp:.2f}x [{min(per_p):.2f}–{max(per_p):.2f}] "
                      f"| ≥{SIDE_BY_SIDE_FACTOR:.1f}x | {met} |")
            elif ref and i < len(ref):
                lo, hi = ref[i]
                print(f"| {ps} | {label} | {L[k]:,.0f} | {P[k]:,.0f} | {lo:,}–{hi:,} "
                      f"| {L[k] / hi:.2f}x–{L[k] / lo:.2f}x | {P[k] / hi:.2f}x–{P[k] / lo:.2f}x "
                      f"| ≥{TARGET_FACTOR * hi:,.0f} | {'yes' if P[k] >= TARGET_FACTOR * hi else 'NO'} |")
        ev = f"| {ps} | evict all ({L['tokens']:,.0f} tokens), ms | {L['evict_s'] * 1e3:.1f} | {P['evict_s'] * 1e3:.1f} "
        if S:
            ev += (f"| – | {S['evict_s'] * 1e3:.1f} | {S['evict_s'] / L['evict_s']:.2f}x "
                   f"| {S['evict_s'] / P['evict_s']:.2f}x | – | – |")
        else:
            ev += "| – | – | – | – | – |"
        print(ev)
    print("\nwall-clock throughput:")
    for ps, med, _ in rows:
        print(f"  page {ps}: " + "; ".join(
            f"{name} " + ", ".join(f"{k} {m[k + '_wall']:,.0f}/s" for k, _ in names)
            for name, m in med.items()))
    print(f"\n(total wall time {time.perf_counter() - t_start:.1f} s)")


if __name__ == "__main__":
    main()
