"""Served vs in-process throughput, side by side: what the socket and the API process cost.

For each workload and concurrency, the same requests run (1) through ``Engine`` in this
process (``run_offline`` with at most C requests in the engine) and (2) through
``radixserve serve`` started as a subprocess (engine core in its own process), over HTTP
with C concurrent streaming clients. Rounds alternate (offline, online, offline, online...)
so both see the same machine load; the table gives medians and the online/offline ratio.

Also measures the per-request overhead of the server: N one-token requests one at a time,
end-to-end latency through HTTP minus the same request's latency in-process; and how fast
``/health`` answers, idle and while 4 MB bodies are being rejected (413).

    python benchmarks/bench_serving.py                      # SmolLM2 bf16, few-shot gsp sharegpt, C=8 and 1
    python benchmarks/bench_serving.py --workloads few-shot --concurrency 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import httpx

from radixserve.bench.metrics import summarize
from radixserve.bench.offline import run_offline, warm_up
from radixserve.bench.online import run_online
from radixserve.bench.workloads import make_workload
from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams

SIZES = {  # the sets: a long shared few-shot prefix, shared system prompts, no sharing
    "few-shot": {"num_questions": 32},
    "gsp": {},
    "sharegpt": {"num_requests": 32},
}


def start_server(model: str, kv: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", model, "--port", "0",
           "--kv-cache-tokens", str(kv), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        m = re.search(r"at (http://\S+) ", line)
        if m:
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("server did not start")


def overhead(engine: Engine, url: str, model: str, n: int) -> tuple[float, float]:
    """Mean end-to-end seconds of a 1-token request: in-process, and through HTTP."""
    prompt = "The capital of France is"
    sp = SamplingParams(max_tokens=1, temperature=0)
    engine.generate([prompt], sp)
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.generate([prompt], sp)
        t.append(time.perf_counter() - t0)
    local = statistics.median(t)
    t = []
    with httpx.Client(timeout=60) as c:
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        c.post(url + "/v1/completions", json=body)
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json=body)
            t.append(time.perf_counter() - t0)
            r.raise_for_status()
    return local, statistics.median(t)


def health_latency(url: str, model: str, bodies: int = 3) -> tuple[list[float], list[float]]:
    """Seconds per ``GET /health`` (one kept-alive client): 30 on the idle server, then as
    many as fit while another thread sends ``bodies`` 4 MB completions (each rejected 413)."""
    with httpx.Client(base_url=url, timeout=10) as c:
        def probe() -> float:
            t0 = time.perf_counter()
            c.get("/health").raise_for_status()
            return time.perf_counter() - t0

        idle = [probe() for _ in range(30)]
        big = {"model": model, "prompt": "x" * (4 << 20), "max_tokens": 1}
        sender = threading.Thread(target=lambda: [httpx.post(url + "/v1/completions", json=big, timeout=60)
                                                  for _ in range(bodies)])
        sender.start()
        busy = []
        while sender.is_alive():
            busy.append(probe())
        sender.join()
    return idle, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="few-shot,gsp,sharegpt")
    ap.add_argument("--concurrency", default="8,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument("--overhead-requests", type=int, default=30)
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for radixserve serve")
    args = ap.parse_args()
    print("$", " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]), flush=True)

    engine = Engine(args.model, kv_cache_tokens=args.kv_cache_tokens)
    warm_up(engine)
    proc, url = start_server(args.model, args.kv_cache_tokens, args.server_arg)
    try:
        tok = engine.tokenizer
        rows = []
        for name in args.workloads.split(","):
            wl = make_workload(name, tok, seed=0, **SIZES.get(name, {}))
            for c in (int(x) for x in args.concurrency.split(",")):
                off, on, hit_off, hit_on = [], [], [], []
                for _ in range(args.rounds):
                    engine.flush_cache()
                    s = summarize(run_offline(engine, wl, {}, max_concurrency=c))
                    off.append(s["requests_per_s"])
                    hit_off.append(s["hit_rate"])
                    s = summarize(run_online(wl, url, args.model, max_concurrency=c, tokenize=tok.encode))
                    on.append(s["requests_per_s"])
                    hit_on.append(s["hit_rate"])
                mo, mn = statistics.median(off), statistics.median(on)
                rows.append((name, c, mo, mn, mn / mo, statistics.median(hit_off), statistics.median(hit_on)))
                print(f"  {name} c={c}: offline {off} online {on}", flush=True)
        local, served = overhead(engine, url, args.model, args.overhead_requests)
        idle, busy = health_latency(url, args.model)
    finally:
        proc.terminate()
        proc.wait(30)
    print()
    print("| workload | concurrency | in-process req/s | served req/s | served / in-process | hit in-process | hit served |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, c, mo, mn, r, ho, hn in rows:
        print(f"| {name} | {c} | {mo:.2f} | {mn:.2f} | {r:.2f} | {ho:.1%} | {hn:.1%} |")
    print()
    print(f"1-token request, median of {args.overhead_requests}: in-process {local * 1e3:.1f} ms, "
          f"through HTTP {served * 1e3:.1f} ms, overhead {(served - local) * 1e3:.1f} ms")
    print(f"/health: idle median {statistics.median(idle) * 1e3:.1f} ms (max {max(idle) * 1e3:.1f}); "
          f"while 4 MB bodies are rejected median {statistics.median(busy) * 1e3:.1f} ms "
          f"(max {max(busy) * 1e3:.1f}, {len(busy)} probes)")


if __name__ == "__main__":
    main()
