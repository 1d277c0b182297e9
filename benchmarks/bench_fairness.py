"""Cache-aware order without starvation: LPM with a bounded wait vs pure LPM vs FCFS.

One hot prefix (most requests share a long system prompt) and a stream of unrelated
requests arrive faster than the engine serves them. Pure longest-prefix-match keeps choosing
the hot requests (their match is long), so an unrelated request can wait for as long as hot
ones keep arriving; FCFS serves everyone in turn but interleaves the hot prefix with others.
``lpm_max_passes`` / ``lpm_max_wait_s`` put a request that has been passed over too often,
or waited too long, ahead of longer matches.

Arrivals are per step (seeded), so every policy sees the same sequence; waits are reported in
steps (deterministic) and seconds.

    python benchmarks/bench_fairness.py                 # tiny-random model, 1,500 arrivals
    python benchmarks/bench_fairness.py --model smollm2-135m --arrivals 600
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from radixserve import Engine, SamplingParams


def run(model: str, arrivals: int, rate: float, hot_share: float, seed: int, **opts: object) -> dict:
    eng = Engine(model, dtype="float32", kv_cache_tokens=16384, max_running_requests=4,
                 lpm_fallback_queue_len=100_000, **opts)
    rng = random.Random(seed)
    hot = [rng.randrange(3, 500) for _ in range(256)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    meta: dict[str, dict] = {}
    step = added = 0
    while added < arrivals or eng.has_unfinished():
        k = 0
        while added < arrivals and rng.random() < rate / (1 + k):
            is_hot = rng.random() < hot_share
            ids = (hot + [rng.randrange(3, 500) for _ in range(8)]) if is_hot else \
                [rng.randrange(3, 500) for _ in range(64)]
            rid = eng.add_request(ids, sp)
            meta[rid] = {"hot": is_hot, "arrive": step, "t": time.monotonic(), "prompt": len(ids)}
            added += 1
            k += 1
        for o in eng.step():
            if o.finished:
                meta[o.request_id]["cached"] = o.cached_tokens
        for rid, req in eng.core.requests.items():
            m = meta[rid]
            if "start" not in m and req.cached_tokens >= 0:
                m["start"], m["t_start"] = step, time.monotonic()
        step += 1
    waits = {True: [], False: []}
    for m in meta.values():
        waits[m["hot"]].append((m["start"] - m["arrive"], m["t_start"] - m["t"]))
    prompt = sum(m["prompt"] for m in meta.values())
    cached = sum(m.get("cached", 0) for m in meta.values())
    out = {"steps": step, "hit_rate": cached / prompt}
    for hot_flag, name in ((True, "hot"), (False, "other")):
        w = sorted(waits[hot_flag])
        out[f"{name}_max_steps"] = max(x for x, _ in w)
        out[f"{name}_p99_steps"] = sorted(x for x, _ in w)[int(0.99 * (len(w) - 1))]
        out[f"{name}_max_s"] = max(s for _, s in w)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--arrivals", type=int, default=1500)
    ap.add_argument("--rate", type=float, default=0.22,
                    help="arrivals per step (the engine serves about 0.25 here: a slight overload)")
    ap.add_argument("--hot-share", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = [
        ("lpm, unbounded (pure)", dict(policy="lpm", lpm_max_passes=10**9, lpm_max_wait_s=1e9)),
        ("lpm, passed over <= 32", dict(policy="lpm", lpm_max_passes=32, lpm_max_wait_s=1e9)),
        ("lpm, passed over <= 64 (default)", dict(policy="lpm")),
        ("lpm, waited <= 0.5 s", dict(policy="lpm", lpm_max_passes=10**9, lpm_max_wait_s=0.5)),
        ("fcfs", dict(policy="fcfs")),
    ]
    print(f"$ python benchmarks/bench_fairness.py --model {args.model} --arrivals {args.arrivals} "
          f"--rate {args.rate} --hot-share {args.hot_share} --seed {args.seed}")
    print("| order | hit rate | vs pure lpm | worst wait, other (steps / s) | p99 other (steps) "
          "| worst wait, hot (steps) | steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    for name, opts in variants:
        r = run(args.model, args.arrivals, args.rate, args.hot_share, args.seed, **opts)
        base = base or r["hit_rate"]
        print(f"| {name} | {r['hit_rate']:.1%} | {r['hit_rate'] / base:.3f} | "
              f"{r['other_max_steps']} / {r['other_max_s']:.2f} | {r['other_p99_steps']} | "
              f"{r['hot_max_steps']} | {r['steps']} |", flush=True)


if __name__ == "__main__":
    main()
