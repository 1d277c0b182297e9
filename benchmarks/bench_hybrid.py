"""A hybrid model's KV at equal bytes: one pool per kind with the sliding-window tree (SWA KV
kept only where a window reads it) against "full KV for every layer" (one pool, the plain
radix cache), on multi-turn chat and few-shot workloads (not a test: prints numbers).

Per configuration: the KV bytes, the tokens the cache can hold in them, the most it held,
hit rate (cached prompt tokens / prompt tokens), requests/s and wall time. Both
configurations run the same workload, one after the other, then again in the other order
(``--repeats``), and each reports its best repeat (the machine is shared).

    python benchmarks/bench_hybrid.py                        # Gemma 3 270M (PyPI), 2 workloads
    python benchmarks/bench_hybrid.py --model tiny-gemma3    # the tiny random Gemma 3 (smoke)
    python benchmarks/bench_hybrid.py --budget-tokens 8192 --swa-tokens 6200 --workloads memory-pressure
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))

from radixserve.bench.cli import _machine  # noqa: E402
from radixserve.bench.offline import run_offline  # noqa: E402
from radixserve.bench.workloads import make_workload  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model.registry import LoadedModel, load_model  # noqa: E402
from radixserve.model.tiny import tiny_random_config, tiny_random_state_dict  # noqa: E402


def _model(name: str) -> LoadedModel:
    if name == "tiny-gemma3":
        cfg = tiny_random_config("gemma3")
        tok = load_model("tiny-random").tokenizer
        return LoadedModel(cfg, tiny_random_state_dict(seed=0, config=cfg), tok, "tiny-gemma3")
    return load_model(name, dtype=torch.float32)


def _sizes(mc, budget: int, swa: int) -> tuple[int, int]:
    """(full-attention tokens, SWA tokens) of a hybrid pool as large as ``budget`` tokens of
    the full layout: n_full * F + n_swa * S = n_layers * budget."""
    n_swa = sum(1 for i in range(mc.num_layers) if mc.layer_window(i))
    n_full = mc.num_layers - n_swa
    full = (mc.num_layers * budget - n_swa * swa) // n_full
    if full < swa:
        raise SystemExit(f"--swa-tokens {swa} leaves {full} full-attention tokens: raise --budget-tokens")
    return full, swa


def _run(loaded, workload, kw: dict, concurrency: int | None = None) -> dict:
    eng = Engine(loaded, **kw)
    core = eng.core
    held = [0]
    core.step_hooks.append(lambda: held.__setitem__(0, max(held[0], core.cache.total_size)))
    res = run_offline(eng, workload, max_concurrency=concurrency)
    recs = res.records
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    pool = core.runner.kv_pool
    return {"kv_mib": pool.nbytes() / 2**20, "capacity": core.allocator.capacity, "held": held[0],
            "hit": cached / max(1, prompt), "req_s": len(recs) / res.wall_seconds, "wall": res.wall_seconds,
            "swa": getattr(core.allocator, "swa", None) and core.allocator.swa.capacity}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--budget-tokens", type=int, default=8192,
                    help="KV bytes, as tokens of the full layout (every layer)")
    ap.add_argument("--swa-tokens", type=int, default=0,
                    help="the hybrid pool's SWA tokens (default: a window per running request, plus 4)")
    ap.add_argument("--workloads", default="memory-pressure,multi-turn-short,few-shot")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--systems", type=int, default=12, help="memory-pressure: system prompts (4 windows each)")
    ap.add_argument("--layouts", default="full,hybrid", help="which of full,hybrid to run")
    args = ap.parse_args()
    loaded = _model(args.model)
    mc = loaded.config
    swa = args.swa_tokens or (args.max_running + 4) * (mc.sliding_window + 1)
    full, swa = _sizes(mc, args.budget_tokens, swa)
    tok = loaded.tokenizer
    w = max(1, mc.sliding_window)  # prompts several windows long: where the kinds differ
    params = {"multi-turn-short": dict(num_conversations=args.conversations, turns=4, turn_tokens=w // 2),
              "few-shot": dict(num_questions=args.questions, prefix_tokens=3 * w, question_tokens=40),
              "memory-pressure": dict(num_systems=args.systems, system_tokens=4 * w, questions=3,
                                      question_tokens=32, max_tokens=8)}
    base = dict(dtype="float32", max_running_requests=args.max_running)
    configs = {"full KV, every layer": dict(base, cache="radix", hybrid_kv=False, kv_cache_tokens=args.budget_tokens),
               "hybrid tree": dict(base, cache="radix", kv_cache_tokens=full, swa_kv_cache_tokens=swa)}
    configs = {k: v for k, v in configs.items() if ("hybrid" if "hybrid" in k else "full") in args.layouts}
    print(f"`python benchmarks/bench_hybrid.py {' '.join(sys.argv[1:])}` — "
          f"{time.strftime('%Y-%m-%dT%H:%M:%S')} — {_machine()} — model {args.model} "
          f"({mc.num_layers} layers, window {mc.sliding_window}) — KV budget {args.budget_tokens} "
          f"full-layout tokens; hybrid {full} full + {swa} SWA tokens — best of {args.repeats}\n")
    print("| workload | KV layout | KV MiB | tokens it can cache | most cached | hit rate | req/s | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.workloads.split(","):
        wl = make_workload(name, tok, seed=0, **params.get(name, {}))
        best: dict = {}
        for rep in range(args.repeats):
            order = list(configs) if rep % 2 == 0 else list(reversed(configs))
            for label in order:
                r = _run(loaded, wl, configs[label], args.max_running)
                if label not in best or r["wall"] < best[label]["wall"]:
                    best[label] = r
        for label in configs:
            r = best[label]
            print(f"| {name} | {label} | {r['kv_mib']:.1f} | {r['capacity']} | {r['held']} | "
                  f"{100 * r['hit']:.1f}% | {r['req_s']:.2f} | {r['wall']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
