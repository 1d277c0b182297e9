"""Speculative decoding drafted by the radix tree, on against off: decode tok/s (not a test).

    python benchmarks/bench_speculative.py [--model smollm2-135m] [--max-tokens 128] [--rounds 1]
        [--workloads code,json,rag,chat,sharegpt] [--batches 1,8] [--num-draft-tokens 4]

Workloads (chat prompts through the model's template, greedy, EOS ends an answer):

* ``code``: a function of this repository's own source, to be rewritten with one name changed
  (the answer repeats most of the prompt);
* ``json``: a record of twenty fields, to be re-emitted with one field changed;
* ``rag``: a passage of ShareGPT text, with a question to be answered by quoting it;
* ``chat``: a ShareGPT conversation's first exchange, then "restate your previous answer";
* ``sharegpt``: first turns of ShareGPT conversations (no repetition to draft from).

Each scenario is ``--batches`` requests of one workload (different instances) decoding
together. Two engines load the same weights, one torch thread each; for every scenario and
round the cache is flushed and the requests run to the end on one engine, then the other
(the order alternates by round), and the steps after every request has its first token are
timed by the calling thread's CPU time (``time.thread_time``): on a machine shared with
other work, time spent descheduled counts for neither. tok/s = tokens generated in those
steps / their CPU seconds. Every request's tokens must be identical with speculation on and
off (the script exits 1 otherwise); it prints tok/s, the ratio, the drafted and accepted
tokens and the tokens per verified row.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve import SamplingParams
from radixserve.bench.data import load_conversations, text_pool, word_pool
from radixserve.engine.engine import Engine
from radixserve.kernels.dtype_choice import choose_dtype
from radixserve.kernels.isa import describe
from radixserve.model.registry import load_model

WORKLOADS = ("code", "json", "rag", "chat", "sharegpt")


# ---------------------------------------------------------------------------------- prompts
def _code_samples() -> list[tuple[str, str]]:
    """(function name, source) of functions of this package of 15 to 45 lines."""
    import radixserve.cache.radix as m1
    import radixserve.engine.sampler as m4
    import radixserve.sched.policy as m2
    import radixserve.sched.scheduler as m3

    out = []
    for mod in (m1, m2, m3, m4):
        for obj in vars(mod).values():
            fns = [obj] if inspect.isfunction(obj) else [v for v in vars(obj).values() if inspect.isfunction(v)] \
                if inspect.isclass(obj) and obj.__module__ == mod.__name__ else []
            for fn in fns:
                if fn.__module__ != mod.__name__:
                    continue
                src = inspect.getsource(fn)
                if 15 <= src.count("\n") <= 45:
                    out.append((fn.__name__, inspect.cleandoc("\n" + src) if src.startswith(" ") else src))
    return out


def code_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    samples = _code_samples()
    rng.shuffle(samples)
    return [[{"role": "user", "content": f"Rename the function `{name}` to `{name}_v2` in this code and change "
              f"nothing else. Reply with the whole code.\n\n```python\n{src}```"}] for name, src in samples[:n]]


def json_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    words = list(word_pool())
    out = []
    for _ in range(n):
        rec = {"id": rng.randrange(10**6, 10**7), "status": "open"}
        for j in range(18):
            key = rng.choice(words) + (f"_{j}" if j % 3 == 0 else "")
            rec[key] = rng.choice([rng.choice(words), rng.randrange(0, 10_000), round(rng.random() * 100, 2)])
        text = json.dumps(rec, indent=2)
        out.append([{"role": "user", "content": f"Here is a JSON record:\n\n{text}\n\nReturn the same record as "
                     "JSON with \"status\" changed to \"closed\". Reply with the JSON only."}])
    return out


def rag_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    pool = [p for p in text_pool() if 400 <= len(p) <= 1500]
    rng.shuffle(pool)
    return [[{"role": "user", "content": f"Passage:\n{p}\n\nWhat does the passage say? Answer by quoting it "
              "word for word."}] for p in pool[:n]]


def chat_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    convs = [c for c in load_conversations(512, min_turns=1) if c.gpt and 300 <= len(c.gpt[0]) <= 1500
             and len(c.human[0]) <= 1500]
    rng.shuffle(convs)
    return [[{"role": "user", "content": c.human[0]}, {"role": "assistant", "content": c.gpt[0]},
             {"role": "user", "content": "Please restate your previous answer in full."}] for c in convs[:n]]


def sharegpt_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    convs = [c for c in load_conversations(512) if 20 <= len(c.human[0]) <= 1500]
    rng.shuffle(convs)
    return [[{"role": "user", "content": c.human[0]}] for c in convs[:n]]


PROMPTS = {"code": code_prompts, "json": json_prompts, "rag": rag_prompts, "chat": chat_prompts,
           "sharegpt": sharegpt_prompts}


# ---------------------------------------------------------------------------------- timing
def decode_run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    """Run ``prompts`` together from an empty cache; returns (CPU seconds of the steps after
    every request has its first token, tokens generated in them, every request's tokens)."""
    if not engine.flush_cache():
        raise RuntimeError("the engine is not idle")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rids = [engine.add_request(p, params) for p in prompts]
    first: set[str] = set()
    done: dict[str, list[int]] = {}
    counted = 0
    cpu = 0.0
    while engine.has_unfinished():
        timed = len(first) == len(rids)
        t0 = time.thread_time()
        outs = engine.step()
        if timed:
            cpu += time.thread_time() - t0
        for o in outs:
            if timed:
                counted += len(o.delta_token_ids)
            elif o.delta_token_ids or o.finished:
                first.add(o.request_id)
            if o.finished:
                done[o.request_id] = list(o.token_ids)
                first.add(o.request_id)
    return cpu, counted, [done[r] for r in rids]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--row-cost", type=float, default=None, help="--speculative-row-cost (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in PROMPTS:
            ap.error(f"--workloads: unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    batches = [int(b) for b in args.batches.split(",") if b]

    dtype = choose_dtype(args.dtype, "cpu", "auto").dtype
    loaded = load_model(args.model, dtype=dtype)
    common = {"cache": "radix", "dtype": str(dtype).removeprefix("torch."), "num_threads": 1,
              "kv_cache_tokens": 32768, "max_running_requests": max(batches)}
    engines = {"off": Engine(loaded, speculative="none", **common),
               "on": Engine(loaded, speculative="ngram-tree", num_draft_tokens=args.num_draft_tokens,
                            **({} if args.row_cost is None else {"speculative_row_cost": args.row_cost}), **common)}
    tok = engines["off"].tokenizer
    cpu_name = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                              text=True, check=False).stdout.strip()
    print(f"# {args.model} ({str(dtype).removeprefix('torch.')}), one thread each; CPU: {cpu_name or '?'}; "
          f"{describe()}; max_tokens {args.max_tokens}, num_draft_tokens {args.num_draft_tokens}, "
          f"row cost {engines['on'].core.config.speculative_row_cost}")
    print(f"{'workload':<10} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'drafted':>8} "
          f"{'accepted':>9} {'tok/row':>8}  identical")
    same_everywhere = True
    rng = random.Random(args.seed)
    for w in workloads:
        for b in batches:
            msgs = PROMPTS[w](b, rng)
            if len(msgs) < b:
                print(f"{w:<10} {b:>5}  (only {len(msgs)} prompts available: skipped)")
                continue
            prompts = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in msgs]
            ratios, tps = [], {"off": [], "on": []}
            identical = True
            drafted = accepted = rows = 0
            for rnd in range(args.rounds):
                order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
                outs = {}
                for name in order:
                    eng = engines[name]
                    s0 = eng.stats()
                    cpu, n, outs[name] = decode_run(eng, prompts, args.max_tokens)
                    tps[name].append(n / cpu if cpu else 0.0)
                    if name == "on":
                        s1 = eng.stats()
                        drafted += s1["speculative_draft_tokens"] - s0["speculative_draft_tokens"]
                        accepted += s1["speculative_accepted_tokens"] - s0["speculative_accepted_tokens"]
                        rows += s1["speculative_verified_rows"] - s0["speculative_verified_rows"]
                identical &= outs["off"] == outs["on"]
                ratios.append(tps["on"][-1] / tps["off"][-1] if tps["off"][-1] else 0.0)
            same_everywhere &= identical
            per_row = (rows + accepted) / rows if rows else 0.0
            print(f"{w:<10} {b:>5} {statistics.median(tps['off']):>10.1f} {statistics.median(tps['on']):>9.1f} "
                  f"{statistics.median(ratios):>6.2f}x {drafted:>8} {accepted:>9} {per_row:>8.2f}  "
                  f"{'yes' if identical else 'NO'}", flush=True)
    for e in engines.values():
        e.close()
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
