"""Online runner: Poisson arrivals through the OpenAI-compatible HTTP API.

Any server speaking ``POST /v1/completions`` with streaming works (radixserve, SGLang,
vLLM, llama.cpp's ``llama-server``). Each request streams (``stream_options.include_usage``)
so TTFT is the first content chunk; ``usage.prompt_tokens_details.cached_tokens`` gives
the hit rate where the server reports it (0 otherwise). Within a round, requests arrive
as a Poisson process at ``request_rate`` per second (``inf``: all at once); the next
round starts when every request of the previous one has finished (its prompts depend on
those outputs).

``ignore_eos`` and ``seed`` are sent as extra body fields; a server that rejects them
(HTTP 400/422) is retried once without them and they are dropped for the rest of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable
from typing import Any

from radixserve.bench.metrics import RequestRecord, RunResult
from radixserve.bench.workloads import BenchRequest, Workload

__all__ = ["run_online", "fetch_server_stats", "flush_server_cache"]


class _Client:
    def __init__(self, url: str, model: str, timeout: float):
        import httpx

        self.url = url.rstrip("/")
        self.model = model
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0),
                                      limits=httpx.Limits(max_connections=256))
        self.extras = True

    def body(self, r: BenchRequest, extras: bool) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": self.model, "prompt": r.prompt, "max_tokens": r.max_tokens,
            "temperature": r.temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if extras:
            b["ignore_eos"] = r.ignore_eos
            if r.seed is not None:
                b["seed"] = r.seed
        return b

    async def complete(self, r: BenchRequest, t0: float) -> RequestRecord:
        arrival = time.monotonic()
        first: float | None = None
        parts: list[str] = []
        usage: dict[str, Any] | None = None
        chunks = 0
        error = None
        for attempt in range(2):
            extras = self.extras
            try:
                async with self.http.stream("POST", f"{self.url}/v1/completions",
                                            json=self.body(r, extras)) as resp:
                    if resp.status_code in (400, 422) and extras and attempt == 0:
                        await resp.aread()
                        self.extras = False
                        continue
                    if resp.status_code != 200:
                        error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                        break
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        msg = json.loads(data)
                        if msg.get("usage"):
                            usage = msg["usage"]
                        for ch in msg.get("choices") or []:
                            text = ch.get("text") or ""
                            if text or ch.get("finish_reason") is None:
                                chunks += 1
                            if text:
                                if first is None:
                                    first = time.monotonic()
                                parts.append(text)
                break
            except Exception as e:  # network errors are results, not crashes
                error = f"{type(e).__name__}: {e}"
                break
        fin = time.monotonic()
        u = usage or {}
        details = u.get("prompt_tokens_details") or {}
        return RequestRecord(
            id=r.id, round=r.round, prompt_tokens=int(u.get("prompt_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            completion_tokens=int(u.get("completion_tokens") or chunks),
            arrival=arrival - t0, first_token=(first - t0) if first else None,
            finish=fin - t0, text="".join(parts), error=error,
        )


async def fetch_server_stats(url: str) -> dict[str, Any]:
    """Best-effort engine stats from a radixserve/SGLang-style ``GET /server_info``; {} elsewhere."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=5.0) as c:
            resp = await c.get(f"{url.rstrip('/')}/server_info")
            if resp.status_code == 200:
                data = resp.json()
                stats = data.get("stats") if isinstance(data, dict) else None
                return stats if isinstance(stats, dict) else {}
    except Exception:
        pass
    return {}


async def flush_server_cache(url: str) -> bool:
    """Best-effort ``POST /flush_cache`` (radixserve, SGLang) so a run starts cold."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10.0) as c:
            resp = await c.post(f"{url.rstrip('/')}/flush_cache")
            return resp.status_code == 200
    except Exception:
        return False


async def _run(workload: Workload, url: str, model: str, request_rate: float,
               max_concurrency: int | None, seed: int, timeout: float,
               progress: Callable[[int], Any] | None,
               tokenize: Callable[[str], list[int]] | None, flush: bool) -> tuple[list[RequestRecord], float, dict]:
    client = _Client(url, model, timeout)
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    if flush:
        await flush_server_cache(url)
    before = await fetch_server_stats(url)

    async def one(r: BenchRequest, t0: float) -> RequestRecord:
        async with sem or contextlib.nullcontext():
            rec = await client.complete(r, t0)
        if progress is not None:
            progress(1)
        return rec

    gen = workload.rounds()
    prompts: list[str] = []
    t0 = time.monotonic()
    try:
        reqs = next(gen)
        while True:
            tasks = []
            for i, r in enumerate(reqs):
                if i and math.isfinite(request_rate) and request_rate > 0:
                    await asyncio.sleep(rng.expovariate(request_rate))
                tasks.append(asyncio.create_task(one(r, t0)))
            recs = await asyncio.gather(*tasks)
            prompts.extend(r.prompt for r in reqs)
            records.extend(recs)
            reqs = gen.send({rec.id: rec.text for rec in recs})
    except StopIteration:
        pass
    wall = time.monotonic() - t0
    # Client-side tokenization (for the optimum) after the clock stops: the offline runner
    # gets the ids from the engine for free, and the served figure must not pay for it.
    if tokenize is not None:
        for prompt, rec in zip(prompts, records):
            rec.prompt_token_ids = tokenize(prompt)
            if not rec.prompt_tokens:
                rec.prompt_tokens = len(rec.prompt_token_ids)
    after = await fetch_server_stats(url)
    await client.http.aclose()
    stats = {}
    for k in ("tree_seconds", "forward_seconds", "computed_prefill_tokens", "evicted_tokens"):
        if isinstance(before.get(k), (int, float)) and isinstance(after.get(k), (int, float)):
            stats[k] = after[k] - before[k]
    return records, wall, stats


def run_online(workload: Workload, url: str, served_model: str, request_rate: float = math.inf,
               max_concurrency: int | None = None, seed: int = 0, timeout: float = 600.0,
               progress: Callable[[int], Any] | None = None,
               tokenize: Callable[[str], list[int]] | None = None, tag: str = "main",
               flush: bool = True) -> RunResult:
    """Run ``workload`` against ``url``; ``tokenize`` (local tokenizer) enables the optimum."""
    records, wall, stats = asyncio.run(_run(workload, url, served_model, request_rate,
                                            max_concurrency, seed, timeout, progress, tokenize,
                                            flush))
    cfg = {"mode": "online", "engine": "http", "url": url, "served_model": served_model,
           "request_rate": request_rate, "cache": "server", "policy": "server"}
    return RunResult(workload.name, cfg, records, wall, stats, tag)
