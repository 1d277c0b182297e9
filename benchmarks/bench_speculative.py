"""Speculative decoding drafted by the radix tree, on against off: decode tok/s (not a test).

    python benchmarks/bench_speculative.py [--model smollm2-135m] [--max-tokens 128] [--rounds 1]
        [--workloads code,json,schema,schema-lp,rag,chat,sharegpt] [--batches 1,8] [--instances 8]
        [--num-draft-tokens 4] [--control] [--queued [--interleave]] [--pricing measured|row-cost] [--steps]

Workloads (chat prompts through the model's template, greedy, EOS ends an answer). What a
workload asks for is fixed by rule, the same for every instance; whether the model complies
is what the table's acceptance shows:

* ``code``: a function of this repository's own source, to be rewritten with one name changed
  (the answer repeats most of the prompt);
* ``json``: a record of twenty fields, to be re-emitted with one field changed;
* ``schema``: the same records and instruction, the answer constrained by a JSON schema of
  the record (its keys, in order, each with its value's type): the grammar forces the keys and
  punctuation (fast-forwarded), the values are drafted from the tree;
* ``schema-lp``: ``schema`` with logprobs asked for, so the grammar's fast-forward does not
  run and its forced tokens are verified as drafts instead of taking a step each;
* ``rag``: retrieval-augmented answering in its common production form: a system prompt
  asking to answer only from the passage by quoting the supporting sentences verbatim, then a
  ShareGPT paragraph and the question "Which sentences of the passage mention "W"?", W the
  longest word of one of its sentences (picked by the seeded generator);
* ``chat``: a ShareGPT conversation's first exchange, then the user asks for the previous
  answer repeated word for word with one edit: its first word of six letters or more
  written in capitals;
* ``sharegpt``: first turns of ShareGPT conversations (no repetition to draft from).

``--instances`` prompts per workload (the same ones at every batch size); at batch ``b`` they
run in groups of ``b`` requests decoding together (each group from an empty cache). A group's
steps are as many as its longest answer needs, so at ``b`` > 1 a draft shortens the group
only where every request gets one accepted; a request done early saves only its rows. With
``--queued`` they run instead as a serving benchmark's client sends them: all instances, from
an empty cache, a new request added as soon as one of the ``b`` in flight finishes (chunked
prefills mixed into the decode steps); the steps that compute no prompt token are timed. A
request done early lets the next one in, as in a server with a queue. ``--interleave``
(with ``--queued``) takes the engines' steps in turn, one of each and again, instead of one
engine's run after the other's: the host's memory and caches change from second to second,
and this way the change falls on every engine alike. Two
engines load the same weights, one torch thread each; for every group and round the cache
is flushed and the requests run to the end on one engine, then the other (the order
alternates by round), and the steps after every request of the group has its first token are
timed by the calling thread's CPU time (``time.thread_time``): on a machine shared with
other work, time spent descheduled counts for neither. tok/s = tokens generated in those
steps over all groups / their CPU seconds; the ratio is the median over rounds (``--control``:
a second speculation-off engine runs in every round too, and ``ctl/off`` is the median of its
tok/s over the first's: what two identical engines differ by in this harness). Every
request's tokens must be identical with speculation on and off (the script exits 1
otherwise); it prints tok/s, the ratio, the drafted and accepted tokens, the acceptance rate,
the tokens per verified row and, per instance, the tokens generated and accepted in the last
round, with the share of each answer's 4-grams found in its prompt ("copied": how much of the
answer quotes what the request was given, the thing drafting from the tree profits from).
Per cell it also prints the share of verified drafts whose first token was accepted, by the
length of the suffix match that found them (``--row-cost 0`` verifies every draft found).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import re
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

WORKLOADS = ("code", "json", "schema", "schema-lp", "rag", "chat", "sharegpt")


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


def _records(n: int, rng: random.Random) -> list[dict]:
    words = list(word_pool())
    out = []
    for _ in range(n):
        rec = {"id": rng.randrange(10**6, 10**7), "status": "open"}
        for j in range(18):
            key = rng.choice(words) + (f"_{j}" if j % 3 == 0 else "")
            rec[key] = rng.choice([rng.choice(words), rng.randrange(0, 10_000), round(rng.random() * 100, 2)])
        out.append(rec)
    return out


def _json_task(rec: dict) -> list[dict]:
    text = json.dumps(rec, indent=2)
    return [{"role": "user", "content": f"Here is a JSON record:\n\n{text}\n\nReturn the same record as "
             "JSON with \"status\" changed to \"closed\". Reply with the JSON only."}]


def json_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    return [_json_task(rec) for rec in _records(n, rng)]


def record_schema(rec: dict) -> dict:
    """A JSON schema of ``rec``: its keys, in its order, all required, each with its value's
    type (no other key allowed)."""
    kinds = {str: "string", int: "integer", float: "number"}
    return {"type": "object", "properties": {k: {"type": kinds[type(v)]} for k, v in rec.items()},
            "required": list(rec), "additionalProperties": False}


def schema_prompts(n: int, rng: random.Random) -> list[tuple[list[dict], dict]]:
    return [(_json_task(rec), record_schema(rec)) for rec in _records(n, rng)]


RAG_INSTRUCTION = ("Answer the question using only the passage. Quote the sentences of the passage that "
                   "support your answer word for word, each in double quotes, and add nothing else.")

def rag_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    pool = [p for p in text_pool() if 400 <= len(p) <= 1500]
    rng.shuffle(pool)
    out = []
    for p in pool[:n]:
        sentences = [x for x in re.split(r"(?<=[.!?])\s+", p) if re.search(r"[A-Za-z]{4,}", x)] or [p]
        words = re.findall(r"[A-Za-z]{4,}", rng.choice(sentences))
        word = max(words, key=len)
        out.append([{"role": "system", "content": RAG_INSTRUCTION},
                    {"role": "user", "content": f"Passage: {p}\nQuestion: Which sentences of the passage "
                     f"mention \"{word}\"?"}])
    return out


def chat_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    convs = [c for c in load_conversations(512, min_turns=1) if c.gpt and 300 <= len(c.gpt[0]) <= 1500
             and len(c.human[0]) <= 1500]
    rng.shuffle(convs)
    out = []
    for c in convs[:n]:
        answer = c.gpt[0]
        word = next((w for w in re.findall(r"[A-Za-z]+", answer) if len(w) >= 6), answer.split()[0])
        out.append([{"role": "user", "content": c.human[0]}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"Repeat your previous answer word for word, with one change: "
                     f"write the word \"{word}\" in capital letters (\"{word.upper()}\"). Do not add anything."}])
    return out


def sharegpt_prompts(n: int, rng: random.Random) -> list[list[dict]]:
    convs = [c for c in load_conversations(512) if 20 <= len(c.human[0]) <= 1500]
    rng.shuffle(convs)
    return [[{"role": "user", "content": c.human[0]}] for c in convs[:n]]


PROMPTS = {"code": code_prompts, "json": json_prompts, "schema": schema_prompts, "schema-lp": schema_prompts,
           "rag": rag_prompts, "chat": chat_prompts, "sharegpt": sharegpt_prompts}


# ---------------------------------------------------------------------------------- timing
def decode_run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]
               ) -> tuple[float, int, list[list[int]], list[int]]:
    """Run ``prompts`` together from an empty cache; returns (CPU seconds of the steps after
    every request has its first token, tokens generated in them, every request's tokens, every
    request's accepted draft tokens)."""
    if not engine.flush_cache():
        raise RuntimeError("the engine is not idle")
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    first: set[str] = set()
    done: dict[str, list[int]] = {}
    accepted: dict[str, int] = {}
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
                accepted[o.request_id] = o.accepted_draft_tokens
                first.add(o.request_id)
    return cpu, counted, [done[r] for r in rids], [accepted[r] for r in rids]


class QueuedClient:
    """A client keeping ``concurrency`` requests in flight on one engine (a new one is added
    as soon as one finishes, in order), from an empty cache, one engine step at a time; it
    counts the CPU seconds of the steps that compute no prompt token and the tokens they
    generate."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 concurrency: int) -> None:
        if not engine.flush_cache():
            raise RuntimeError("the engine is not idle")
        self.engine, self.prompts, self.params, self.concurrency = engine, prompts, params, concurrency
        self.queue = list(range(len(prompts)))
        self.rids: dict[str, int] = {}
        self.done: dict[int, list[int]] = {}
        self.accepted: dict[int, int] = {}
        self.counted = 0
        self.cpu = 0.0

    def busy(self) -> bool:
        return bool(self.queue) or self.engine.has_unfinished()

    def step(self) -> None:
        engine, runner = self.engine, self.engine.core.runner
        while self.queue and len(self.rids) - len(self.done) < self.concurrency:
            i = self.queue.pop(0)
            self.rids[engine.add_request(self.prompts[i], self.params[i])] = i
        prefilled = runner.prefill_tokens
        t0 = time.thread_time()
        outs = engine.step()
        dt = time.thread_time() - t0
        timed = runner.prefill_tokens == prefilled
        self.cpu += dt if timed else 0.0
        for o in outs:
            self.counted += len(o.delta_token_ids) if timed else 0
            if o.finished:
                self.done[self.rids[o.request_id]] = list(o.token_ids)
                self.accepted[self.rids[o.request_id]] = o.accepted_draft_tokens

    def result(self) -> tuple[float, int, list[list[int]], list[int]]:
        """(CPU seconds, tokens generated in them, every request's tokens, every request's
        accepted draft tokens)."""
        n = len(self.prompts)
        return self.cpu, self.counted, [self.done[i] for i in range(n)], [self.accepted[i] for i in range(n)]


def queued_run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], concurrency: int
               ) -> tuple[float, int, list[list[int]], list[int]]:
    """:class:`QueuedClient` run to the end on one engine."""
    client = QueuedClient(engine, prompts, params, concurrency)
    while client.busy():
        client.step()
    return client.result()


def interleaved_run(engines: dict[str, Engine], prompts: list[list[int]], params: list[SamplingParams],
                    concurrency: int) -> dict[str, tuple[float, int, list[list[int]], list[int]]]:
    """One :class:`QueuedClient` per engine, their steps taken in turn (a step of each, then
    again), so that whatever the host does to memory or caches in a second falls on every
    engine alike."""
    clients = {name: QueuedClient(e, prompts, params, concurrency) for name, e in engines.items()}
    while any(c.busy() for c in clients.values()):
        for c in clients.values():
            if c.busy():
                c.step()
    return {name: c.result() for name, c in clients.items()}


class StepLog:
    """The CPU time of an engine's model runs (forward, sampling, verification) that compute
    no prompt token, by (decode rows, draft tokens), with the tokens each emitted: what a
    step with drafts costs beside one without (``--steps``)."""

    def __init__(self, engine: Engine) -> None:
        self.runs: dict[tuple[int, int], list[tuple[float, int]]] = {}
        runner = engine.core.runner
        inner = runner.run

        def run(batch, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            t0 = time.thread_time()
            res = inner(batch, *args, **kwargs)
            dt = time.thread_time() - t0
            if batch.num_decode == len(batch.reqs):
                drafted = sum(len(d) for d in batch.drafts) if batch.drafts else 0
                verified = res.verified or [None] * len(batch.reqs)
                made = sum(len(v) if v else int(r is not None) for v, r in zip(verified, res.rows))
                self.runs.setdefault((len(batch.reqs), drafted), []).append((dt, made))
            return res

        runner.run = run

    def report(self, least: int = 5) -> str:
        """Per (rows, drafts) seen at least ``least`` times: the median ms, the tokens per run."""
        cells = []
        for (rows, drafted), v in sorted(self.runs.items()):
            if len(v) >= least:
                ms = statistics.median(t for t, _ in v) * 1e3
                cells.append(f"{rows}+{drafted}: {ms:.2f} ms, {sum(n for _, n in v) / len(v):.2f} tok ({len(v)})")
        self.runs.clear()
        return "; ".join(cells)


def copied_share(prompt: list[int], answer: list[int], n: int = 4) -> float:
    """The share of ``answer``'s n-grams that occur in ``prompt``."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    mine = [tuple(answer[i:i + n]) for i in range(len(answer) - n + 1)]
    return sum(g in grams for g in mine) / len(mine) if mine else 0.0


def workload_requests(w: str, n: int, seed: int, tok: object, max_tokens: int
                      ) -> tuple[list[list[int]], list[SamplingParams]]:
    """The ``n`` instances of workload ``w`` (the same for every batch size: the generator is
    seeded by the workload; ``schema`` and ``schema-lp`` get ``json``'s records) as token ids,
    with their sampling parameters."""
    rng = random.Random(f"{seed}-{'json' if w.startswith('schema') else w}")
    made = PROMPTS[w](n, rng)
    prompts, params = [], []
    for m in made:
        extra: dict = {}
        if w.startswith("schema"):
            m, schema = m
            extra["json_schema"] = json.dumps(schema)
            if w == "schema-lp":
                extra["logprobs"] = True
        prompts.append(tok.encode(tok.apply_chat_template(m), add_special_tokens=False))
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra))
    return prompts, params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--instances", type=int, default=8, help="prompts per workload, run in groups of the batch size")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--row-cost", type=float, default=None, help="--speculative-row-cost (default: the engine's)")
    ap.add_argument("--pricing", choices=("measured", "row-cost"), default=None,
                    help="--speculative-pricing (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control", action="store_true",
                    help="a second speculation-off engine in every round: its tok/s over the first's is the "
                         "benchmark's own noise between two identical engines (column ctl/off)")
    ap.add_argument("--queued", action="store_true",
                    help="at batch b, all instances queued by a client keeping b in flight (every step timed, "
                         "prefills included) instead of groups of b decoding together")
    ap.add_argument("--interleave", action="store_true",
                    help="with --queued: the engines' steps taken in turn (one step of each, then again) "
                         "instead of one engine's run after another's, so the host's noise falls on all alike")
    ap.add_argument("--steps", action="store_true",
                    help="print the speculation engine's decode-only runs by (rows + draft tokens): median CPU ms "
                         "and tokens emitted per run (what the first draft row costs a step)")
    args = ap.parse_args(argv)
    if args.interleave and not args.queued:
        ap.error("--interleave needs --queued")
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
                            **({} if args.row_cost is None else {"speculative_row_cost": args.row_cost}),
                            **({} if args.pricing is None else {"speculative_pricing": args.pricing}), **common)}
    if args.control:
        engines["ctl"] = Engine(loaded, speculative="none", **common)
    step_log = StepLog(engines["on"]) if args.steps else None
    tok = engines["off"].tokenizer
    cpu_name = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                              text=True, check=False).stdout.strip()
    print(f"# {args.model} ({str(dtype).removeprefix('torch.')}), one thread each; CPU: {cpu_name or '?'}; "
          f"{describe()}; max_tokens {args.max_tokens}, num_draft_tokens {args.num_draft_tokens}, "
          f"row cost {engines['on'].core.config.speculative_row_cost} "
          f"({engines['on'].core.config.speculative_pricing}), {args.instances} instances, "
          f"{args.rounds} round(s)")
    print(f"{'workload':<10} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'on/off':>7} {'drafted':>8} "
          f"{'accepted':>9} {'acc.rate':>8} {'tok/row':>8}  identical" + ("  ctl/off" if args.control else ""))
    same_everywhere = True
    for w in workloads:
        prompts, params = workload_requests(w, args.instances, args.seed, tok, args.max_tokens)
        if len(prompts) < args.instances:
            print(f"{w:<10}  (only {len(prompts)} prompts available)")
        for b in batches:
            groups = ([range(len(prompts))] if args.queued else
                      [range(i, min(i + b, len(prompts))) for i in range(0, len(prompts), b)])
            ratios, tps = [], {name: [] for name in engines}
            controls: list[float] = []
            identical = True
            drafted = accepted = rows = 0
            per_instance: list[int] = []
            lengths: list[int] = []
            copied: list[float] = []
            for rnd in range(args.rounds):
                order = tuple(engines) if rnd % 2 == 0 else tuple(reversed(engines))
                cpu = {name: 0.0 for name in engines}
                made = {name: 0 for name in engines}
                per_instance = []
                lengths = []
                copied = []
                for g in groups:
                    outs = {}
                    ps, sps = [prompts[i] for i in g], [params[i] for i in g]
                    s0 = engines["on"].stats()
                    if args.interleave:
                        got = interleaved_run({name: engines[name] for name in order}, ps, sps, b)
                    else:
                        got = {name: queued_run(engines[name], ps, sps, b) if args.queued
                               else decode_run(engines[name], ps, sps) for name in order}
                    for name in order:
                        c, n, outs[name], acc = got[name]
                        cpu[name] += c
                        made[name] += n
                        if name == "on":
                            lengths += [len(t) for t in outs[name]]
                            copied += [round(copied_share(prompts[i], t), 2) for i, t in zip(g, outs[name])]
                            per_instance += acc
                    s1 = engines["on"].stats()
                    drafted += s1["speculative_draft_tokens"] - s0["speculative_draft_tokens"]
                    accepted += s1["speculative_accepted_tokens"] - s0["speculative_accepted_tokens"]
                    rows += s1["speculative_verified_rows"] - s0["speculative_verified_rows"]
                    identical &= outs["off"] == outs["on"]
                for name in order:
                    tps[name].append(made[name] / cpu[name] if cpu[name] else 0.0)
                ratios.append(tps["on"][-1] / tps["off"][-1] if tps["off"][-1] else 0.0)
                if args.control:
                    controls.append(tps["ctl"][-1] / tps["off"][-1] if tps["off"][-1] else 0.0)
            same_everywhere &= identical
            spec = engines["on"].core.scheduler.spec
            by_match = sorted(spec.by_match.items())
            spec.by_match.clear()
            per_row = (rows + accepted) / rows if rows else 0.0
            rate = accepted / drafted if drafted else 0.0
            print(f"{w:<10} {b:>5} {statistics.median(tps['off']):>10.1f} {statistics.median(tps['on']):>9.1f} "
                  f"{statistics.median(ratios):>6.2f}x {drafted:>8} {accepted:>9} {rate:>8.2f} {per_row:>8.2f}  "
                  f"{'yes' if identical else 'NO'}"
                  + (f"  {statistics.median(controls):>6.2f}x" if controls else ""), flush=True)
            print(f"#   per instance (last round): tokens {lengths}, accepted {per_instance}, copied {copied}",
                  flush=True)
            print("#   on/off by round: " + ", ".join(f"{r:.3f}" for r in ratios)
                  + ("; ctl/off by round: " + ", ".join(f"{r:.3f}" for r in controls) if controls else ""),
                  flush=True)
            if step_log is not None:
                print("#   on engine's decode-only runs, rows+draft tokens: " + step_log.report(), flush=True)
            known = spec.costs.snapshot()
            if known:
                print("#   step ms by rows (measured, last): "
                      + ", ".join(f"{r}: {t * 1e3:.1f}" for r, t in sorted(known.items())), flush=True)
            print("#   first draft token accepted, by match length: "
                  + ", ".join(f"{'aligned' if n > 64 else n}: {a / v:.2f} of {v}" for n, (v, a) in by_match),
                  flush=True)
    for e in engines.values():
        e.close()
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
