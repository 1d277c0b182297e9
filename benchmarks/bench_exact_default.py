"""The default linear backend against the others it replaced, one model forward at a time (not a test).

    python benchmarks/bench_exact_default.py [--model smollm2-135m] [--rounds 3]
    python benchmarks/bench_exact_default.py --model gemma3-270m --contenders default,onednn

Contenders (a bfloat16 model each, the same weights, the same paged pool and attention):

* ``default``: ``--linear-backend auto`` — the kernels' batch-invariant packed GEMM in bfloat16
  dot products (native AVX512-BF16 where the CPU has it, emulated bit for bit elsewhere);
* ``packed-f32``: ``--linear-backend radixserve-f32`` — the same GEMM in float32 fma chains
  on the bfloat16 weights (what the packed GEMM computed for a bfloat16 model before);
* ``onednn``: ``--linear-backend onednn`` — torch's oneDNN bf16 linears (not batch-invariant);
  only where oneDNN takes bfloat16 (the AVX-512 level);
* ``full-last-layer``: the default with ``last_layer_rows_only`` off — its last layer runs
  o, gate/up and down on every row of a prefill instead of the rows whose logits are returned
  (the same bits for those rows; what the pruning saves);
* ``two-pass-gate``: the default with ``fused_gate_up`` off — gate_up writes its float32
  rows and SiLU·mul / GeGLU reads them back in a second pass, instead of the gate running on
  the GEMM's tiles while they are in cache (the same bits; what the one pass saves);
* ``no-amx``: the default capped at the ``avx512`` level (``cpu_isa="avx512"``) — on an AMX
  CPU, prefill GEMM rows and attention blocks on AVX512-BF16 dot products instead of the
  AMX tiles (the same bits; what the tiles give); elsewhere it runs what the default runs.

Measured: prefill of one 512- and one 2048-token prompt (tok/s), and a decode step of 1 and 8
sequences with 512 tokens of context each (tok/s = sequences / step time). Each round times
every contender on every measurement in turn (median of ``--reps`` runs), so a noisy neighbour
hits all of them alike; the table prints each round's ratios to ``default`` and their median.
``--cpu-time`` runs on one thread and times the thread's CPU time instead of the wall clock:
on a machine shared with other work, time spent descheduled then counts for nobody.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.memory.allocator import SlotAllocator  # noqa: E402
from radixserve.model.arch.forward_batch import ForwardBatch  # noqa: E402
from radixserve.kernels.linear import onednn_supported  # noqa: E402
from radixserve.model.registry import load_model  # noqa: E402

BACKENDS = {"default": "auto", "packed-f32": "radixserve-f32", "onednn": "onednn", "full-last-layer": "auto",
            "two-pass-gate": "auto", "no-amx": "auto"}
CTX = 512


class Contender:
    """One linear backend's runner over its own pool, with the steps it is timed on."""

    def __init__(self, loaded, state_dict, name: str, prefills: list[int], batches: list[int]):
        config = loaded.config
        self.cap = max(prefills) + sum(batches) * (CTX + 2) + 64  # every batch keeps its sequences
        self.runner = ModelRunner.from_config(config, state_dict, kv_capacity=self.cap, dtype=torch.bfloat16,
                                              linear_backend=BACKENDS[name],
                                              **({"cpu_isa": "avx512"} if name == "no-amx" else {}))
        if name == "full-last-layer":
            self.runner.model.last_layer_rows_only = False
        if name == "two-pass-gate":
            self.runner.model.fused_gate_up = False
        gen = torch.Generator().manual_seed(0)
        vocab = config.vocab_size
        self.steps: dict[str, tuple[object, int]] = {}
        alloc = SlotAllocator(self.cap)
        for n in prefills:
            prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
            slots = alloc.alloc(n)
            self.steps[f"prefill {n}"] = (lambda p=prompt, s=slots: self._fwd([p], [0], [s]), n)
            alloc.free(slots)
        ctx = torch.randint(3, vocab, (CTX,), generator=gen).tolist()
        for b in batches:
            seqs = [alloc.alloc(CTX + 1) for _ in range(b)]
            for s in seqs:
                self._fwd([ctx], [0], [s[:CTX]])
            toks = torch.randint(3, vocab, (b,), generator=gen).tolist()
            self.steps[f"decode B={b}"] = (lambda t=toks, ss=seqs, bb=b: self._fwd([[x] for x in t], [CTX] * bb, ss), b)

    def _fwd(self, toks, prefix, slots) -> None:
        self.runner.forward(ForwardBatch.build(toks, prefix, slots))

    def rate(self, what: str, reps: int, clock=time.perf_counter) -> float:  # noqa: ANN001
        fn, tokens = self.steps[what]
        times = []
        for _ in range(reps):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        return tokens / statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contenders", default="default,packed-f32,onednn")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--decode", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    args = ap.parse_args(argv)
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    names = [n for n in args.contenders.split(",")
             if n != "onednn" or onednn_supported(torch.device("cpu"), torch.bfloat16)]
    loaded = load_model(args.model, dtype=torch.bfloat16)
    prefills = [int(x) for x in args.prefill.split(",")]
    batches = [int(x) for x in args.decode.split(",")]
    contenders = {n: Contender(loaded, loaded.state_dict, n, prefills, batches) for n in names}
    print(f"CPU: {describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads"
          f"{', thread CPU time' if args.cpu_time else ''}; "
          f"{args.model} bfloat16; linears: "
          + "; ".join(f"{n} = {c.runner.model.linears.backend} ({c.runner.model.linears.why})"
                      for n, c in contenders.items()) + "\n")
    whats = [f"prefill {n}" for n in prefills] + [f"decode B={b}" for b in batches]
    for c in contenders.values():  # warm every step once
        for w in whats:
            c.rate(w, 1)
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for w in whats:
            for n, c in contenders.items():
                rates.setdefault((w, n), []).append(c.rate(w, args.reps, clock))
    print("| measurement | " + " | ".join(f"{n} tok/s" for n in names)
          + " | " + " | ".join(f"{n} / default (rounds)" for n in names if n != "default") + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for w in whats:
        cells = [f"{statistics.median(rates[(w, n)]):.1f}" for n in names]
        ratios = []
        for n in names:
            if n == "default":
                continue
            per = [a / b for a, b in zip(rates[(w, n)], rates[(w, "default")])]
            ratios.append(f"{statistics.median(per):.2f} ({', '.join(f'{r:.2f}' for r in per)})")
        print(f"| {w} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
