"""Mixed steps on and off, side by side: what running requests feel while others are admitted.

Two ``radixserve serve`` processes (``--mixed-steps`` and ``--no-mixed-steps``, otherwise the
same flags) take turns on the same scenario, rounds alternating so both see the same machine
load. The scenario: ``--decoders`` streams generate ``--decode-tokens`` tokens each from the
start; meanwhile ``--arrivals`` requests with distinct ~``--arrival-tokens``-token prompts
(ShareGPT text, nothing shared) arrive every ``--gap`` seconds, streaming ``--arrival-max``
tokens. Reported per configuration (medians over rounds):

* inter-token latency (ITL) of the decoders, p50 / p99 / max: the gaps between streamed
  chunks, which is what a user reading a reply sees while the server admits others;
* TTFT of the arrivals, p50 / p99;
* wall time of the whole scenario and output tokens per second.

    python benchmarks/bench_mixed.py
    python benchmarks/bench_mixed.py --rounds 3 --arrival-tokens 1000 --server-arg=--chunked-prefill-size=512
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

from radixserve.bench.data import load_conversations
from radixserve.model.registry import load_tokenizer


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else float("nan")


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--log-level",
           "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {cmd} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not start")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Times (perf_counter) of the request's start and of every streamed chunk with text."""
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = [time.perf_counter()]
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    return times


async def scenario(url: str, decoders: list[list[int]], arrivals: list[list[int]], args) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await client.post(url + "/flush_cache")
        t0 = time.perf_counter()
        dec = [asyncio.create_task(stream(client, url, p, args.decode_tokens)) for p in decoders]
        await asyncio.sleep(args.gap)  # decoders are past their own prefill
        arr = []
        for p in arrivals:
            arr.append(asyncio.create_task(stream(client, url, p, args.arrival_max)))
            await asyncio.sleep(args.gap)
        dec_times = await asyncio.gather(*dec)
        arr_times = await asyncio.gather(*arr)
        wall = time.perf_counter() - t0
    itl = [b - a for t in dec_times for a, b in itertools.pairwise(t)]
    ttft = [t[1] - t[0] for t in arr_times]
    out_tokens = len(decoders) * args.decode_tokens + len(arrivals) * args.arrival_max
    return {"itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "itl_max": max(itl),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "wall": wall,
            "out_tok_s": out_tokens / wall}


def prompts(tok, n: int, length: int, skip: int = 0) -> list[list[int]]:
    ids: list[int] = []
    for conv in load_conversations(300):
        ids += tok.encode("\n".join(conv.human))
        if len(ids) > (n + skip + 1) * length:
            break
    return [ids[(i + skip) * length:(i + skip + 1) * length] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--arrivals", type=int, default=8)
    ap.add_argument("--arrival-tokens", type=int, default=600)
    ap.add_argument("--arrival-max", type=int, default=16)
    ap.add_argument("--gap", type=float, default=0.4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=31400)
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for both servers")
    args = ap.parse_args()
    print("$ python benchmarks/bench_mixed.py " + " ".join(sys.argv[1:]), flush=True)
    tok = load_tokenizer("smollm2-135m")
    decoders = prompts(tok, args.decoders, 64)
    arrivals = prompts(tok, args.arrivals, args.arrival_tokens, skip=args.decoders * 64 // args.arrival_tokens + 1)
    configs = {"mixed": ["--mixed-steps"], "separate": ["--no-mixed-steps"]}
    servers = {}
    try:
        for i, (name, flags) in enumerate(configs.items()):
            servers[name] = (start_server(args.port + i, flags + args.server_arg), f"http://127.0.0.1:{args.port + i}")
        for name, (_, url) in servers.items():  # warm both (shapes, kernels)
            asyncio.run(scenario(url, decoders[:1], arrivals[:1], argparse.Namespace(**{**vars(args), "gap": 0.1})))
        results: dict[str, list[dict]] = {n: [] for n in configs}
        for r in range(args.rounds):
            for name, (_, url) in servers.items():
                res = asyncio.run(scenario(url, decoders, arrivals, args))
                results[name].append(res)
                print(f"round {r} {name:8s} " + "  ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    keys = ["itl_p50", "itl_p99", "itl_max", "ttft_p50", "ttft_p99", "wall", "out_tok_s"]
    print("\n| steps | decode ITL p50 / p99 / max (ms) | arrival TTFT p50 / p99 (ms) | wall (s) | output tok/s |")
    print("|---|---:|---:|---:|---:|")
    for name in configs:
        m = {k: statistics.median(x[k] for x in results[name]) for k in keys}
        print(f"| {name} | {m['itl_p50'] * 1e3:.0f} / {m['itl_p99'] * 1e3:.0f} / {m['itl_max'] * 1e3:.0f} | "
              f"{m['ttft_p50'] * 1e3:.0f} / {m['ttft_p99'] * 1e3:.0f} | {m['wall']:.2f} | {m['out_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
