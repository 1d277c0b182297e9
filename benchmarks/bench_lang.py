"""Frontend-language benchmark: the same programs with the frontend hint on/off, and the same
requests sent one by one without the language (no fork concurrency, no hints).

Programs (a shared few-shot prefix of a few hundred tokens in each):

* ``self-consistency`` — fork 8 reasoning paths (temperature 0.7), majority vote;
* ``tree-of-thought``  — 3 thoughts, each judged by a 2-way ``select``, the best expanded;
* ``few-shot select``  — ``run_batch`` of questions, each answered by a 4-way ``select``.

Each (program, mode) starts from an empty prefix cache; the hit rate is the engine's
``prefix_cache_hit_tokens / prefix_cache_query_tokens`` over that run (hint requests
included — they are real requests the runtime must match).

    python benchmarks/bench_lang.py                      # SmolLM2-135M, < 3 minutes
    python benchmarks/bench_lang.py --model tiny-random  # smoke test
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve import SamplingParams  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.lang import EngineBackend, function, gen, select  # noqa: E402
from radixserve.lang.backend import Backend, GenResult, SelectResult, common_prefix_len, pick_choice  # noqa: E402
from radixserve.lang.ir import GenParams  # noqa: E402

FEW_SHOT = (
    "Answer each question with a short, correct answer.\n\n"
    "Question: What is the capital of France?\nAnswer: Paris\n\n"
    "Question: How many legs does a spider have?\nAnswer: Eight\n\n"
    "Question: What gas do plants take in from the air?\nAnswer: Carbon dioxide\n\n"
    "Question: Who wrote Romeo and Juliet?\nAnswer: William Shakespeare\n\n"
    "Question: What is the boiling point of water at sea level in Celsius?\nAnswer: 100\n\n"
    "Question: Which planet is known as the red planet?\nAnswer: Mars\n\n"
    "Question: What is the largest ocean on Earth?\nAnswer: The Pacific Ocean\n\n"
    "Question: How many days are in a leap year?\nAnswer: 366\n\n"
)


@function
def self_consistency(s, question: str, paths: int, tokens: int):
    s += FEW_SHOT + "Question: " + question + "\nLet's think step by step."
    forks = s.fork(paths)
    for f in forks:
        f += gen("reasoning", max_tokens=tokens, temperature=0.7)
        f += "\nAnswer:" + gen("answer", max_tokens=4, temperature=0, stop="\n")
    forks.join()
    votes = collections.Counter(a.strip() for a in s["answer"])
    s.set_var("vote", votes.most_common(1)[0][0])


@function
def tree_of_thought(s, question: str, tokens: int):
    s += FEW_SHOT + "Question: " + question + "\n"
    thoughts = s.fork(3)
    for i, t in enumerate(thoughts):
        t += f"Thought {i + 1}:" + gen("thought", max_tokens=tokens, temperature=0.7, stop="\n")
        t += "\nIs this thought helpful?" + select("ok", choices=[" yes", " no"])
    thoughts.join()
    scores = [t.get_meta_info("ok").normalized_logprobs[0] for t in thoughts]
    best = thoughts[max(range(3), key=lambda i: scores[i])]
    best += "\nFinal answer:" + gen("final", max_tokens=tokens, temperature=0)
    s.set_var("final", best["final"])


@function
def few_shot_select(s, question: str, choices: list[str]):
    s += FEW_SHOT + "Question: " + question + "\nAnswer:"
    s += select("answer", choices=choices)


QUESTIONS = [
    ("What is the chemical symbol for gold?", [" Au", " Ag", " Gd", " Go"]),
    ("How many continents are there?", [" Seven", " Five", " Nine", " Three"]),
    ("What is the freezing point of water in Celsius?", [" 0", " 32", " 100", " -10"]),
    ("Which animal is known as the king of the jungle?", [" The lion", " The tiger", " The elephant", " The eagle"]),
    ("What color is the sky on a clear day?", [" Blue", " Green", " Red", " Yellow"]),
    ("What is 2 + 2?", [" 4", " 3", " 5", " 22"]),
]


class OneByOne(Backend):
    """The baseline: every request sent alone, waiting for the previous one (a global lock),
    with no frontend hints — what a program does without the language's fork concurrency."""

    def __init__(self, inner: EngineBackend):
        self.inner = inner
        self.chat_format = inner.chat_format
        self._lock = threading.Lock()

    def generate(self, prompt: str, params: GenParams, on_delta: Any = None) -> GenResult:
        with self._lock:
            return self.inner.generate(prompt, params)

    def prefill(self, prompt: str) -> GenResult:  # never called: hints are off
        with self._lock:
            return self.inner.prefill(prompt)

    def select(self, prefix: str, choices: list[str], method: str, hint: bool) -> SelectResult:
        tok = self.inner.tokenizer
        p_ids = tok.encode(prefix)
        lps, cached = [], []
        for c in choices:
            ids = tok.encode(prefix + c)
            start = min(common_prefix_len(p_ids, ids), len(ids) - 1)
            sp = SamplingParams(max_tokens=0, temperature=0, logprob_start_len=start)
            with self._lock:
                o = self.inner._submit(ids, sp).result()
            lps.append([lp for _, lp in o.prompt_logprobs or [] if lp is not None])
            cached.append(o.cached_tokens)
        return pick_choice(choices, lps, method, cached)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def flush_cache(self) -> bool:
        return self.inner.flush_cache()


def measure(backend: EngineBackend, run_backend: Backend, hint: bool, fn) -> dict[str, float]:
    """Run ``fn(backend, hint)`` from a cold cache; wall time and prefix-cache hit rate."""
    if not backend.flush_cache():
        raise RuntimeError("could not flush the cache (requests in flight)")
    s0 = backend.stats()
    t0 = time.perf_counter()
    fn(run_backend, hint)
    dt = time.perf_counter() - t0
    s1 = backend.stats()
    q = s1["prefix_cache_query_tokens"] - s0["prefix_cache_query_tokens"]
    h = s1["prefix_cache_hit_tokens"] - s0["prefix_cache_hit_tokens"]
    return {
        "time": dt,
        "hit_rate": h / q if q else 0.0,
        "computed": s1["computed_prefill_tokens"] - s0["computed_prefill_tokens"],
        "requests": s1["finished_requests"] - s0["finished_requests"],
        # Steps are the noise-free view of batching (times on a shared CPU are not).
        "steps": (s1["prefill_steps"] + s1["decode_steps"]) - (s0["prefill_steps"] + s0["decode_steps"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kv-cache-tokens", type=int, default=8192)
    ap.add_argument("--paths", type=int, default=8, help="self-consistency forks")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per reasoning step")
    ap.add_argument("--questions", type=int, default=4, help="few-shot select questions")
    ap.add_argument("--repeat", type=int, default=2, help="runs per cell; the fastest is reported")
    args = ap.parse_args()

    t_load = time.perf_counter()
    backend = EngineBackend(Engine(args.model, kv_cache_tokens=args.kv_cache_tokens))
    print(f"loaded {args.model} in {time.perf_counter() - t_load:.1f}s", file=sys.stderr)
    serial = OneByOne(backend)
    qs = QUESTIONS[: args.questions]

    programs = {
        f"self-consistency ({args.paths} forks)": lambda b, h: self_consistency.run(
            question="A farmer has 3 pens with 4 sheep each. How many sheep are there?",
            paths=args.paths, tokens=args.tokens, backend=b, hint=h),
        "tree-of-thought (3 thoughts + select)": lambda b, h: tree_of_thought.run(
            question="How can a small team ship a reliable web service quickly?",
            tokens=args.tokens, backend=b, hint=h),
        f"few-shot select ({len(qs)} q x 4 choices)": lambda b, h: few_shot_select.run_batch(
            [{"question": q, "choices": c} for q, c in qs], num_threads=len(qs), backend=b, hint=h),
    }
    # Warm-up (first-call overheads are not what we measure).
    few_shot_select.run(question="Warm up?", choices=[" a", " b"], backend=backend)

    modes = [("lang, hint on", backend, True), ("lang, hint off", backend, False), ("one by one", serial, False)]
    rows = []
    for pname, fn in programs.items():
        for mname, b, hint in modes:
            runs = [measure(backend, b, hint, fn) for _ in range(args.repeat)]
            r = min(runs, key=lambda x: x["time"])
            rows.append((pname, mname, r))
            print(f"  {pname:40s} {mname:15s} {r['time']:6.2f}s hit {r['hit_rate']:.1%}", file=sys.stderr)
    torch_version = __import__("torch").__version__
    print(f"\nModel {args.model}, CPU, torch {torch_version}; each cell from a cold cache, "
          f"fastest of {args.repeat} runs.\n")
    print("| program | mode | time (s) | prefix hit rate | prefill tokens computed | requests | engine steps |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for pname, mname, r in rows:
        print(f"| {pname} | {mname} | {r['time']:.2f} | {r['hit_rate']:.1%} | {r['computed']} "
              f"| {r['requests']} | {r['steps']} |")
    backend.close()


if __name__ == "__main__":
    main()
