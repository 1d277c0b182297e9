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
    python benchmarks/bench_hybrid.py --budgets 0.35,0.7 --workloads multi-turn-tiered,few-shot

``--budgets`` sweeps the KV bytes as fractions of each workload's working set: the most an
unbounded cache holds on it, measured first by a run with a pool larger than the workload
(printed as its own row: the hit rate no budget can beat). The hybrid pool then splits each
budget between the kinds by ``--swa-ratio`` (SWA tokens per full-attention token), keeping at
least a window per running request.
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
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict  # noqa: E402


def _model(name: str) -> LoadedModel:
    if name == "tiny-gemma3":
        cfg = tiny_random_config("gemma3")
        tok = load_model("tiny-random").tokenizer
        return LoadedModel(cfg, tiny_random_state_dict(seed=0, config=cfg), tok, "tiny-gemma3")
    return load_model(name, dtype=torch.float32)


def _split(mc, budget: int, ratio: float, min_swa: int) -> tuple[int, int]:
    """(full-attention tokens, SWA tokens) of a hybrid pool as large as ``budget`` tokens of
    the full layout with ``swa = ratio * full`` (at least ``min_swa``)."""
    n_swa = sum(1 for i in range(mc.num_layers) if mc.layer_window(i))
    n_full = mc.num_layers - n_swa
    full = int(mc.num_layers * budget / (n_full + n_swa * ratio))
    swa = max(min_swa, int(ratio * full))
    return _sizes(mc, budget, swa)


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
    ap.add_argument("--turns", type=int, default=4, help="multi-turn-tiered: turns per conversation")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--systems", type=int, default=12, help="memory-pressure: system prompts (4 windows each)")
    ap.add_argument("--layouts", default="full,hybrid", help="which of full,hybrid to run")
    ap.add_argument("--dtype", default="float32", help="weights dtype (auto: what the engine picks here)")
    ap.add_argument("--budgets", default=None,
                    help="comma-separated fractions of each workload's working set (instead of --budget-tokens)")
    ap.add_argument("--swa-ratio", type=float, default=0.25,
                    help="with --budgets: the hybrid pool's SWA tokens per full-attention token")
    args = ap.parse_args()
    loaded = _model(args.model)
    mc = loaded.config
    min_swa = 2 * (mc.sliding_window + 1) + 16  # the engine needs a window and a chunk beside it
    tok = loaded.tokenizer
    w = max(1, mc.sliding_window)  # prompts several windows long: where the kinds differ
    params = {"multi-turn-short": dict(num_conversations=args.conversations, turns=4, turn_tokens=w // 2),
              "multi-turn-tiered": dict(num_conversations=args.conversations, turns=args.turns,
                                        turn_tokens=w // 2, reply_tokens=w),
              "few-shot": dict(num_questions=args.questions, prefix_tokens=3 * w, question_tokens=40),
              "memory-pressure": dict(num_systems=args.systems, system_tokens=4 * w, questions=3,
                                      question_tokens=32, max_tokens=8)}
    base = dict(dtype=args.dtype, max_running_requests=args.max_running)

    def configs_for(budget: int, swa: int | None) -> dict[str, dict]:
        out = {"full KV, every layer": dict(base, cache="radix", hybrid_kv=False, kv_cache_tokens=budget)}
        try:
            full, swa = (_sizes(mc, budget, swa) if swa is not None
                         else _split(mc, budget, args.swa_ratio, min_swa))
        except SystemExit as e:  # a budget too small for a window and a chunk: full layout only
            print(f"(no hybrid row at {budget} tokens: {e})", file=sys.stderr)
        else:
            out[f"hybrid tree ({full} full + {swa} SWA)"] = dict(base, cache="radix", kv_cache_tokens=full,
                                                                 swa_kv_cache_tokens=swa)
        return {k: v for k, v in out.items() if ("hybrid" if "hybrid" in k else "full") in args.layouts}

    if args.budgets:
        sizing = (f"KV budgets {args.budgets} of each working set; hybrid SWA:full {args.swa_ratio:g} "
                  f"(at least {min_swa} SWA)")
    else:
        swa = args.swa_tokens or (args.max_running + 4) * (mc.sliding_window + 1)
        full, swa = _sizes(mc, args.budget_tokens, swa)
        sizing = f"KV budget {args.budget_tokens} full-layout tokens; hybrid {full} full + {swa} SWA tokens"
    print(f"`python benchmarks/bench_hybrid.py {' '.join(sys.argv[1:])}` — "
          f"{time.strftime('%Y-%m-%dT%H:%M:%S')} — {_machine()} — model {args.model} "
          f"({mc.num_layers} layers, window {mc.sliding_window}), weights {args.dtype} — {sizing} — "
          f"{args.max_running} in flight — best of {args.repeats}\n")
    lead = "| KV budget " if args.budgets else ""
    print(f"| workload {lead}| KV layout | KV MiB | tokens it can cache | most cached | hit rate | req/s | wall s |")
    print("|---|" + ("---:|" if args.budgets else "") + "---|---:|---:|---:|---:|---:|---:|")

    def row(name: str, budget: str, label: str, r: dict) -> None:
        cell = f"{budget} | " if args.budgets else ""
        print(f"| {name} | {cell}{label} | {r['kv_mib']:.1f} | {r['capacity']} | {r['held']} | "
              f"{100 * r['hit']:.1f}% | {r['req_s']:.2f} | {r['wall']:.1f} |", flush=True)

    for name in args.workloads.split(","):
        wl = make_workload(name, tok, seed=0, **params.get(name, {}))
        if args.budgets:
            # The working set: what a pool larger than the workload ends up holding.
            big = _run(loaded, wl, dict(base, cache="radix", hybrid_kv=False, kv_cache_tokens=1 << 17),
                       args.max_running)
            row(name, "unbounded", "full KV, every layer", big)
            plans = [(f"{f} ({max(64, round(float(f) * big['held']))} tok)",
                      configs_for(max(64, round(float(f) * big["held"])), None)) for f in args.budgets.split(",")]
        else:
            plans = [("", configs_for(args.budget_tokens, swa))]
        for budget, configs in plans:
            best: dict = {}
            for rep in range(args.repeats):
                order = list(configs) if rep % 2 == 0 else list(reversed(configs))
                for label in order:
                    try:
                        r = _run(loaded, wl, configs[label], args.max_running)
                    except ValueError as e:  # a prompt longer than the pool: no row
                        print(f"{name} {budget} {label}: {e}", file=sys.stderr)
                        continue
                    print(f"[{time.strftime('%H:%M:%S')}] {name} {budget} {label} repeat {rep + 1}: hit "
                          f"{100 * r['hit']:.1f}%, {r['wall']:.1f} s", file=sys.stderr, flush=True)
                    if label not in best or r["wall"] < best[label]["wall"]:
                        best[label] = r
            for label in best:
                row(name, budget, label, best[label])

if __name__ == "__main__":
    main()
