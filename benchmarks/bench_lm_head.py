"""A bfloat16 model's lm_head on float32 rows (float32 chains) against bfloat16 rows (the
layers' dot products): its speed and the error each costs against the float32 model (not a
test: prints numbers).

    python benchmarks/bench_lm_head.py [--model gemma3-270m] [--prompts 48] [--rows 1,8,32]

Speed: the model's own lm_head weight (dense bfloat16, and its GGUF blocks where the model is
a GGUF), one torch thread, each call timed by the thread's CPU time (a shared machine's
descheduled time counts for neither), median of the calls in ``--seconds`` per cell.

Error: over first human turns of ShareGPT (chat template, at most 256 tokens), the float32
model's greedy continuation (32 tokens) is fed back, and at each of its positions the greedy
token's log-probability is compared with the float32 model's — mean and max |Δ logprob|, top-1
agreement — plus perplexity on ShareGPT assistant text (windows of 1024 tokens), for the
float32 model and the bfloat16 model with either lm_head (``bench_int8_error.py``'s measure).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))
sys.path.insert(0, _HERE)

from bench_kv_quant import _logprobs, _nll  # noqa: E402
from radixserve import SamplingParams  # noqa: E402
from radixserve.bench.cli import _machine  # noqa: E402
from radixserve.bench.data import load_conversations  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.kernels.linear import Linears, make_linears  # noqa: E402
from radixserve.kernels.quant_weights import QuantTensor  # noqa: E402
from radixserve.model.registry import is_gguf_source, load_model  # noqa: E402

ROWS = {"float32 rows": False, "bfloat16 rows": True}


def _time(fn, seconds: float) -> float:
    fn()
    times = []
    end = time.thread_time() + seconds
    while time.thread_time() < end or len(times) < 3:
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return statistics.median(times)


def speed(model: str, rows: list[int], seconds: float) -> None:
    weights = [("dense", load_model(model, dtype=torch.bfloat16))]
    if is_gguf_source(model):
        weights.append(("gguf blocks", load_model(model, dtype=torch.bfloat16, weights="gguf")))
    lin = make_linears("auto", torch.device("cpu"), torch.bfloat16)
    print("| lm_head weight | rows | float32 rows, ms | bfloat16 rows, ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for label, loaded in weights:
        sd = loaded.state_dict
        w = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        if label == "gguf blocks" and not isinstance(w, QuantTensor):
            continue  # this GGUF's lm_head is not in blocks the kernels keep
        packed = {name: lin.pack_lm_head(w, dot=dot) for name, dot in ROWS.items()}
        n, k = w.shape
        for r in rows:
            x = torch.randn(r, k, generator=torch.Generator().manual_seed(r))
            ms = {name: 1e3 * _time(lambda p=p: lin.logits(x, p), seconds) for name, p in packed.items()}
            a, b = ms["float32 rows"], ms["bfloat16 rows"]
            print(f"| {label} [{n}, {k}] | {r} | {a:.2f} | {b:.2f} | {a / b:.2f}x |", flush=True)


def error(model: str, prompts_n: int) -> None:
    ref = load_model(model, dtype=torch.float32)
    tok = ref.tokenizer
    convs = load_conversations(prompts_n + 64)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c.human[0]}]))[-256:]
               for c in convs[:prompts_n]]
    eng = Engine(ref, cache="none", dtype="float32", kv_cache_tokens=32768)
    cont = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0,
                                                                      ignore_eos=True))]
    del eng
    seqs = [p + c[:-1] for p, c in zip(prompts, cont)]
    starts = [len(p) - 1 for p in prompts]
    ids = tok.encode(" ".join(t for c in convs[prompts_n:] for t in c.gpt))
    windows = [ids[i * 1024:(i + 1) * 1024] for i in range(min(4, len(ids) // 1024))]
    cap = max(len(s) for s in seqs) * 8 + 2048
    print("\n| model | mean \\|Δ logprob\\| | max \\|Δ logprob\\| | top-1 agreement | perplexity |")
    print("|---|---:|---:|---:|---:|")
    ref_lp = None
    original = Linears.pack_lm_head
    for label, dot in [("float32", None), *ROWS.items()]:
        if dot is not None:
            Linears.pack_lm_head = functools.partialmethod(original, dot=dot)
        try:
            loaded = ref if dot is None else load_model(model, dtype=torch.bfloat16)
            dtype = torch.float32 if dot is None else torch.bfloat16
            runner = ModelRunner.from_config(loaded.config, loaded.state_dict, kv_capacity=cap, dtype=dtype)
        finally:
            Linears.pack_lm_head = original
        # Per position: the argmax and the float32 model's greedy token's log-probability (a
        # vocabulary of float64 rows per position would not fit in memory at 262,144 tokens).
        argmax, at_ref = [], []
        for i in range(0, len(seqs), 8):
            lps = _logprobs(runner, seqs[i:i + 8], starts[i:i + 8])
            argmax += [lp.argmax(-1) for lp in lps]
            greedy = argmax[i:i + 8] if ref_lp is None else ref_lp[0][i:i + 8]
            at_ref += [lp.gather(1, g[:, None]).reshape(-1) for lp, g in zip(lps, greedy)]
            del lps
        ref_lp = (argmax, at_ref) if ref_lp is None else ref_lp
        d = torch.cat([(a - r).abs() for a, r in zip(at_ref, ref_lp[1])])
        agree = sum(int((a == g).sum()) for a, g in zip(argmax, ref_lp[0]))
        n = sum(g.numel() for g in ref_lp[0])
        ppl = math.exp(float(_nll(runner, windows).mean()))
        name = label if dot is None else f"bfloat16, lm_head on {label}"
        print(f"| {name} | {float(d.mean()):.5f} | {float(d.max()):.4f} | {100 * agree / n:.2f}% | {ppl:.4f} |",
              flush=True)
        del runner


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--skip-error", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"`python benchmarks/bench_lm_head.py {' '.join(sys.argv[1:])}` — "
          f"{time.strftime('%Y-%m-%dT%H:%M:%S')} — {_machine()} — {args.model}, one thread\n")
    speed(args.model, [int(r) for r in args.rows.split(",")], args.seconds)
    if not args.skip_error:
        error(args.model, args.prompts)


if __name__ == "__main__":
    main()
