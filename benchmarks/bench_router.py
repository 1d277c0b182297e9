"""Data-parallel routing: hit rate, throughput and balance of each routing policy.

N worker processes (tiny-random by default, or SmolLM2 with one thread each) with a KV pool
smaller than the workload's working set, behind:

* ``radixserve router`` with each policy (``cache_aware`` uses the workers' cache events),
* ``sglang-router --policy cache_aware`` (0.3.2, if found: ``--sglang-router PATH`` or on PATH),
* ``dp``: no router, one ``radixserve serve --dp N`` (N engine cores, each with the workers'
  KV, behind one API process),

and, as the optimum, one worker with N times the KV and no router. Workloads with many
prefixes: ``gsp`` (16 system prompts x 16 questions), ``multi-turn`` (32 conversations),
``tot`` (8 trees of thought), ``pressure`` (16 tenants' 256-token system prompts taking 8
turns, one question each per turn; ``--param pressure.KEY=VALUE`` resizes it): with
``--workers 2 --kv-per-worker 2048`` a worker's pool holds about half the tenants' system
prompts, not all of them, so a tenant scattered over both workers costs hits). Each round of a
workload is sent at once (``--concurrency`` requests in flight); the next round starts when
it has finished (its prompts carry the previous outputs).

Under memory pressure the hit count also depends on timing: a worker's scheduler groups the
requests of one prefix only if they wait in its queue together, so what a router does to
the depth of the workers' queues (how fast it forwards, on a machine whose cores it shares
with them) moves the count as much as where it sends them. ``--concurrency 2`` (about one
request per worker at a time) measures the placement alone.

Per run: hit rate (sum of the workers' reported ``cached_tokens`` / prompt tokens), hit
tokens, requests/s and load imbalance (max / mean requests per worker, from the workers'
own counters); ``--repeat N`` runs every configuration N times, interleaved, and reports
medians (throughput on a shared machine drifts). ``--overhead N`` adds the router's
latency per request (tiny requests, sequential, direct vs through each router, N
interleaved rounds, medians).

    python benchmarks/bench_router.py                       # everything, tiny-random
    python benchmarks/bench_router.py --workloads gsp --policies cache_aware,sglang
    python benchmarks/bench_router.py --workers 2 --kv-per-worker 2048 --workloads pressure \
        --policies cache_aware,sglang,dp --concurrency 2 --repeat 3
    python benchmarks/bench_router.py --model smollm2-135m --kv-per-worker 4096
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.join(_HERE, "..")
sys.path.insert(0, os.path.join(_ROOT, "src"))
sys.path.insert(0, os.path.join(_ROOT, "tests"))  # router_workers: the worker processes

from radixserve.bench.workloads import BenchRequest, make_workload  # noqa: E402
from radixserve.router.tokenize import load_tokenizer  # noqa: E402
from router_workers import WorkerProc, free_port  # noqa: E402

ALL_POLICIES = ("cache_aware", "round_robin", "shortest_queue", "prefix_hash", "sglang", "dp")


# --------------------------------------------------------------------------- workloads
def workload_rounds(name: str, tok: Any, seed: int, params: dict | None = None) -> Callable[[], Any]:
    """A factory of round generators (send(outputs) -> next round), as in bench.workloads."""
    if name == "gsp":
        w = make_workload("gsp", tok, seed, groups=16, prompts_per_group=16, system_tokens=256,
                          question_tokens=32, max_tokens=4)
        return w.rounds
    if name == "pressure":
        kw = dict(num_systems=16, system_tokens=256, questions=8, question_tokens=32, max_tokens=4,
                  order="rounds")
        kw.update(params or {})
        return make_workload("memory-pressure", tok, seed, **kw).rounds
    if name == "multi-turn":
        w = make_workload("multi-turn-short", tok, seed, num_conversations=32, turns=4, turn_tokens=48)
        return w.rounds
    if name == "tot":
        trees = [make_workload("tree-of-thought", tok, seed + k, branching=2, depth=3,
                               question_tokens=160, step_tokens=12) for k in range(8)]

        def merged():  # 8 trees advanced in lockstep: one round holds every tree's level
            gens = [t.rounds() for t in trees]
            rounds = [next(g) for g in gens]
            while True:
                reqs = [BenchRequest(f"t{k}-{r.id}", r.prompt, r.max_tokens, r.temperature, r.seed,
                                     r.ignore_eos, r.round) for k, rs in enumerate(rounds) for r in rs]
                outs = yield reqs
                nxt = []
                for k, g in enumerate(gens):
                    mine = {rid.split("-", 1)[1]: v for rid, v in (outs or {}).items()
                            if rid.startswith(f"t{k}-")}
                    try:
                        nxt.append(g.send(mine))
                    except StopIteration:
                        return
                rounds = nxt
        return merged
    raise ValueError(f"unknown workload {name!r}")


# --------------------------------------------------------------------------- clients
@dataclass
class RunStats:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    seconds: float = 0.0
    per_worker: list = field(default_factory=list)
    predicted_exact: float | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        if not self.per_worker or not sum(self.per_worker):
            return float("nan")
        return max(self.per_worker) / (sum(self.per_worker) / len(self.per_worker))


async def run_workload(url: str, rounds_factory: Callable[[], Any], concurrency: int) -> RunStats:
    st = RunStats()
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as c:
        async def one(r: BenchRequest) -> tuple[str, str]:
            sp = {"max_new_tokens": r.max_tokens, "temperature": r.temperature,
                  "ignore_eos": r.ignore_eos}
            if r.seed is not None:
                sp["seed"] = r.seed
            async with sem:
                resp = await c.post("/generate", json={"text": r.prompt, "sampling_params": sp})
            if resp.status_code != 200:
                st.errors += 1
                return r.id, ""
            out = resp.json()
            st.requests += 1
            st.prompt_tokens += out["meta_info"]["prompt_tokens"]
            st.cached_tokens += out["meta_info"]["cached_tokens"]
            return r.id, out["text"]

        gen = rounds_factory()
        t0 = time.monotonic()
        try:
            reqs = next(gen)
            while True:
                outs = dict(await asyncio.gather(*(one(r) for r in reqs)))
                reqs = gen.send(outs)
        except StopIteration:
            pass
        st.seconds = time.monotonic() - t0
    return st


def worker_counts(workers: list[WorkerProc]) -> list[int]:
    return [httpx.get(w.url + "/server_info", timeout=30).json()["stats"]["finished_requests"]
            for w in workers]


def flush(workers: list[WorkerProc]) -> None:
    for w in workers:
        for _ in range(50):
            if httpx.post(w.url + "/flush_cache", timeout=30).status_code == 200:
                break
            time.sleep(0.1)


# --------------------------------------------------------------------------- routers
class RouterProc:
    def __init__(self, kind: str, workers: list[WorkerProc], model: str, sglang_bin: str | None,
                 log_dir: str, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kind = kind
        self.log_path = os.path.join(log_dir, f"router-{kind}.log")
        log = open(self.log_path, "w")
        if kind == "sglang":
            cmd = [sglang_bin, "launch", "--worker-urls", *[w.url for w in workers], "--host", "127.0.0.1",
                   "--port", str(self.port), "--policy", "cache_aware",
                   "--prometheus-port", str(free_port()), "--log-level", "warn"]
        else:
            cmd = [sys.executable, "-m", "radixserve.router", "--policy", kind, "--port", str(self.port),
                   "--model", model, "--log-level", "warning"]
            for w in workers:
                cmd += ["--worker", w.url, "--worker-events", w.events]
            cmd += extra_args or []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(_ROOT, "src"),
                                                            os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        path = "/readiness" if self.kind == "sglang" else "/router/workers"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router {self.kind} exited:\n{open(self.log_path).read()[-3000:]}")
            try:
                r = httpx.get(self.url + path, timeout=2)
                if r.status_code == 200:
                    if self.kind == "sglang":
                        return
                    ws = r.json()["workers"]
                    if all(w["available"] and (w["mirror"] is None or w["mirror"]["synced"]) for w in ws):
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"router {self.kind} not ready")

    def state(self) -> dict | None:
        if self.kind == "sglang":
            return None
        return httpx.get(self.url + "/router/workers", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --------------------------------------------------------------------------- overhead
def measure_overhead(direct: str, routers: dict[str, str], n: int) -> dict[str, float]:
    """Median latency added per request (tiny request, sequential), interleaved rounds."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    lat: dict[str, list[float]] = {k: [] for k in ["direct", *routers]}
    urls = {"direct": direct, **routers}
    clients = {k: httpx.Client(base_url=u, timeout=30) for k, u in urls.items()}
    for k in urls:  # warm up connections and caches
        for _ in range(5):
            clients[k].post("/generate", json=body)
    for _ in range(n):
        for k in urls:
            t = time.perf_counter()
            clients[k].post("/generate", json=body).raise_for_status()
            lat[k].append(time.perf_counter() - t)
    for c in clients.values():
        c.close()
    base = statistics.median(lat["direct"])
    return {"direct": base * 1e3, **{k: (statistics.median(v) - base) * 1e3 for k, v in lat.items() if k != "direct"}}


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kv-per-worker", type=int, default=2048)
    ap.add_argument("--workloads", default="gsp,multi-turn,tot")
    ap.add_argument("--policies", default=",".join(ALL_POLICIES))
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every configuration this many times, interleaved; report medians")
    ap.add_argument("--sglang-router", default=os.environ.get("SGLANG_ROUTER_BIN") or shutil.which("sglang-router"))
    ap.add_argument("--overhead", type=int, default=0, metavar="N",
                    help="also measure the router's latency per request over N interleaved rounds")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--router-args", default="", help="extra options for radixserve router "
                    "(e.g. '--queue-weight 0.1')")
    ap.add_argument("--param", action="append", default=[], metavar="WORKLOAD.KEY=VALUE",
                    help="a workload generator's parameter (pressure: num_systems, system_tokens, "
                         "questions, question_tokens, max_tokens, order)")
    args = ap.parse_args(argv)
    params: dict[str, dict[str, Any]] = {}
    for item in args.param:
        key, _, value = item.partition("=")
        wl, _, name = key.partition(".")
        params.setdefault(wl, {})[name] = int(value) if value.lstrip("-").isdigit() else value

    policies = [p for p in args.policies.split(",") if p]
    if "sglang" in policies and not args.sglang_router:
        print("sglang-router not found: skipping it (--sglang-router PATH)", file=sys.stderr)
        policies.remove("sglang")
    tok = load_tokenizer(args.model)
    log_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_router_logs")
    os.makedirs(log_dir, exist_ok=True)
    extra = ["--num-threads", "1"]
    if args.model != "tiny-random":
        extra += ["--dtype", "bfloat16"]
    workers = [WorkerProc(f"w{i}", model=args.model, kv_cache_tokens=args.kv_per_worker, extra=extra)
               for i in range(args.workers)]
    single = WorkerProc("single", model=args.model, kv_cache_tokens=args.kv_per_worker * args.workers,
                        extra=extra)
    # serve --dp N: N engine cores (each with the workers' KV) behind one API process.
    dp = (WorkerProc("dp", model=args.model, kv_cache_tokens=args.kv_per_worker,
                     extra=[*extra, "--dp", str(args.workers)]) if "dp" in policies else None)
    if not any(p != "dp" for p in policies):
        workers = []
    procs = [*workers, single, *([dp] if dp else [])]
    for w in procs:
        w.start()
    results: list[dict] = []
    try:
        for w in procs:
            w.wait_ready()
        for wl in args.workloads.split(","):
            factory = workload_rounds(wl, tok, args.seed, params.get(wl))
            runs: dict[str, list] = {}
            for rep in range(args.repeat):  # configurations interleaved: the machine drifts
                flush([single])
                st = asyncio.run(run_workload(single.url, factory, args.concurrency))
                label = f"optimum: 1 worker, {args.workers}x KV"
                runs.setdefault(label, []).append((st, None))
                print_run(wl, label, st)
                for pol in policies:
                    if pol == "dp":
                        assert dp is not None
                        flush([dp])
                        st = asyncio.run(run_workload(dp.url, factory, args.concurrency))
                        label = f"radixserve serve --dp {args.workers}"
                        runs.setdefault(label, []).append((st, None))
                        print_run(wl, label, st)
                        continue
                    flush(workers)
                    before = worker_counts(workers)
                    r = RouterProc(pol, workers, args.model, args.sglang_router, log_dir,
                                   args.router_args.split())
                    try:
                        r.wait_ready()
                        st = asyncio.run(run_workload(r.url, factory, args.concurrency))
                        state = r.state()
                    finally:
                        r.stop()
                    st.per_worker = [a - b for a, b in zip(worker_counts(workers), before)]
                    label = "sglang-router cache_aware" if pol == "sglang" else f"radixserve {pol}"
                    runs.setdefault(label, []).append((st, state))
                    print_run(wl, label, st)
            opt = runs[f"optimum: 1 worker, {args.workers}x KV"]
            for label, rs in runs.items():
                results.append(summarize(wl, label, rs, opt))
        overhead = None
        if args.overhead and workers:
            flush(workers)
            routers = {}
            rprocs = []
            for kind in ("cache_aware", *(["sglang"] if args.sglang_router else [])):
                p = RouterProc(kind, workers[:1], args.model, args.sglang_router, log_dir)
                p.wait_ready()
                rprocs.append(p)
                routers[f"radixserve {kind}" if kind != "sglang" else "sglang-router"] = p.url
            try:
                overhead = measure_overhead(workers[0].url, routers, args.overhead)
            finally:
                for p in rprocs:
                    p.stop()
    finally:
        for w in procs:
            w.stop()
    print()
    print(f"command: python benchmarks/bench_router.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"model {args.model}, {args.workers} workers x {args.kv_per_worker} KV tokens "
          f"(optimum: 1 worker x {args.kv_per_worker * args.workers}), concurrency {args.concurrency}, "
          f"medians of {args.repeat} interleaved run(s)")
    print()
    print("| workload | routing | hit rate | % of optimum | hit tokens | req/s | imbalance (max/mean) | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['routing']} | {r['hit_rate']:.3f} | {r['of_optimum']:.1%} | "
              f"{r['hit_tokens']} | {r['req_per_s']:.1f} | "
              f"{'-' if r['imbalance'] is None else format(r['imbalance'], '.2f')} | {r['errors']} |")
    sg = {r["workload"]: r for r in results if r["routing"].startswith("sglang")}
    ca = {r["workload"]: r for r in results if r["routing"] == "radixserve cache_aware"}
    if sg and ca:
        print()
        for wl in ca:
            if wl in sg and sg[wl]["hit_tokens"]:
                print(f"{wl}: radixserve cache_aware / sglang-router cache_aware hit tokens = "
                      f"{ca[wl]['hit_tokens'] / sg[wl]['hit_tokens']:.2f}x")
    dps = {r["workload"]: r for r in results if r["routing"].startswith("radixserve serve --dp")}
    if dps:
        print()
        for wl, r in dps.items():
            print(f"{wl}: serve --dp {args.workers} / one engine with {args.workers}x KV hit tokens = "
                  f"{r['of_optimum']:.1%} (hit rate {r['hit_rate']:.3f})")
    if overhead:
        print()
        print(f"router latency per request (median, tiny /generate, sequential): direct "
              f"{overhead['direct']:.2f} ms; added: " +
              ", ".join(f"{k} +{v:.2f} ms" for k, v in overhead.items() if k != "direct"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "overhead": overhead}, f, indent=1)
    return 0


def summarize(wl: str, label: str, runs: list, opt_runs: list) -> dict:
    """Medians over the repeats of one configuration."""
    med = statistics.median
    sts = [st for st, _ in runs]
    opt_rate = med(st.hit_rate for st, _ in opt_runs)
    imb = [st.imbalance for st in sts if st.per_worker]
    return {
        "workload": wl, "routing": label, "repeats": len(sts),
        "requests": sts[0].requests, "errors": sum(st.errors for st in sts),
        "hit_rate": med(st.hit_rate for st in sts),
        "hit_tokens": int(med(st.cached_tokens for st in sts)),
        "prompt_tokens": sts[0].prompt_tokens,
        "of_optimum": med(st.hit_rate for st in sts) / opt_rate if opt_rate else float("nan"),
        "req_per_s": med(st.requests / st.seconds for st in sts if st.seconds),
        "req_per_s_all": [round(st.requests / st.seconds, 1) for st in sts if st.seconds],
        "imbalance": med(imb) if imb else None,
        "per_worker": [st.per_worker for st in sts],
        "router_state": [state for _, state in runs],
    }


def print_run(wl: str, label: str, st: RunStats) -> None:
    print(f"[{wl}] {label}: hit {st.hit_rate:.3f}, {st.requests / max(st.seconds, 1e-9):.1f} req/s, "
          f"per worker {st.per_worker}, errors {st.errors}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
