"""A GGUF's quantized blocks computed directly against the dense bfloat16 default (not a test).

    python benchmarks/bench_quant_weights.py --model smollm2-135m
    python benchmarks/bench_quant_weights.py --model /work/bench-models/bench-llama-1b-q4_0.gguf --cpu-time

Contenders (a bfloat16 model each, the same file, the same paged pool and attention; ``gguf``
and ``dense`` give the same tokens and logprobs):

* ``gguf``: ``--weight-dtype gguf`` — the linear weights (and the tied embedding / lm_head)
  stay in the file's blocks, repacked into panels; each step expands them to the dense
  model's bfloat16 weights (in registers for a decode's few rows, into an L2 scratch a panel
  group at a time for a prefill's many);
* ``gguf-q8``: ``--weight-dtype gguf-q8`` — the same blocks (Q8_0, Q4_0, Q4_1) computed with
  integer dot products against activation rows quantized to 8 bits per 32-block (its own
  stated definition, csrc/gemm_q8dot.cpp: not the same bits as the two others);
* ``gguf-codes``: ``--weight-dtype gguf-codes`` — the same blocks (Q8_0, Q4_0, Q4_1) computed on
  their integer codes against the bfloat16 activations, the scale applied once per block (its
  own stated definition, csrc/gemm_codes.cpp: near the dense model's bits, not the same);
* ``auto``: what ``--weight-dtype auto`` takes on this CPU for this file (its formats printed);
* ``dense``: ``--weight-dtype dense`` — every weight dequantized at load and kept in bfloat16
  (the default before quantized weights);
* ``auto-two-pass``: ``auto`` with ``fused_gate_up`` off — gate_up writes its float32 rows and the
  gate reads them back in a second pass, instead of running on the expanded panels' tiles in
  cache (the same bits; what the one pass saves on blocks that expand).

Measured as ``bench_exact_default.py`` measures: prefill of one 512-token prompt, a decode
step of 1 and 8 sequences with 512 tokens of context each (tok/s = sequences / step time);
each round times every contender on every measurement in turn (median of ``--reps`` runs)
and the table prints each round's ratio to ``dense`` and their median. ``--cpu-time`` runs on
one thread and times its CPU time (on a machine shared with other work, time spent
descheduled then counts for nobody).

Beside each decode rate: the fraction of the bandwidth bound it reaches — the bytes a step
reads (every linear weight as packed, the lm_head, the context's K/V) per token, against a
read bandwidth measured here, in the same rounds, with as many threads (a sum over a buffer
far larger than the caches).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.kernels.operands import PackedWeight  # noqa: E402
from radixserve.memory.allocator import SlotAllocator  # noqa: E402
from radixserve.model.arch.forward_batch import ForwardBatch  # noqa: E402
from radixserve.kernels.weight_choice import choose_weights  # noqa: E402
from radixserve.model.registry import is_gguf_source, load_model  # noqa: E402

CTX = 512
BANDWIDTH_BYTES = 1 << 30


def weight_bytes(model) -> int:
    """Bytes of every packed linear weight and the lm_head: what a decode step streams."""
    total = 0
    for layer in model.layers:
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            w = getattr(layer, name)
            total += (w.data if isinstance(w, PackedWeight) else w).nbytes
    head = model._lm_head[1] if model._lm_head is not None else model.lm_head_weight
    return total + (head.data if isinstance(head, PackedWeight) else head).nbytes


class Contender:
    """One weight format's runner over its own pool, with the steps it is timed on."""

    def __init__(self, model: str, weights: str, prefills: list[int], batches: list[int], clock):
        two_pass = weights.endswith("-two-pass")
        weights = weights.removesuffix("-two-pass")
        if weights == "auto":  # what --weight-dtype auto takes on this CPU for this file
            choice = choose_weights("auto", gguf_source=is_gguf_source(model), dtype=torch.bfloat16)
            loaded = load_model(model, dtype=torch.bfloat16, weights=choice.format, codes_formats=choice.codes_formats)
        else:
            loaded = load_model(model, dtype=torch.bfloat16, weights=weights)
        config = loaded.config
        self.clock = clock
        self.cap = max(prefills) + sum(batches) * (CTX + 2) + 64  # every batch keeps its sequences
        self.runner = ModelRunner.from_config(config, loaded.state_dict, kv_capacity=self.cap, dtype=torch.bfloat16)
        loaded.release_file_pages()
        del loaded
        gc.collect()
        m = self.runner.model
        if two_pass:
            m.fused_gate_up = False
        pool = self.runner.kv_pool
        self.weights = weight_bytes(m)
        self.kv_per_token = pool.bytes_per_token
        self.formats = m.weight_formats()
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

    def bytes_per_token(self, batch: int) -> float:
        return (self.weights + batch * CTX * self.kv_per_token) / batch

    def rate(self, what: str, reps: int) -> float:
        fn, tokens = self.steps[what]
        times = []
        for _ in range(reps):
            t0 = self.clock()
            fn()
            times.append(self.clock() - t0)
        return tokens / statistics.median(times)


def bandwidth(buf: torch.Tensor, clock, reps: int = 3) -> float:
    """Bytes per second of a sum over ``buf`` (best of ``reps``)."""
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        buf.sum()
        best = min(best, clock() - t0)
    return buf.nbytes / best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contenders", default="gguf,dense")
    ap.add_argument("--prefill", default="512")
    ap.add_argument("--decode", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time")
    args = ap.parse_args(argv)
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    names = args.contenders.split(",")
    prefills = [int(x) for x in args.prefill.split(",")] if args.prefill else []
    batches = [int(x) for x in args.decode.split(",")] if args.decode else []
    contenders = {n: Contender(args.model, n, prefills or [16], batches, clock) for n in names}
    buf = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    print(f"CPU: {describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads"
          f"{', thread CPU time' if args.cpu_time else ''}; {args.model} bfloat16; "
          + "; ".join(f"{n}: {', '.join(c.formats) or 'dense bf16'}, {c.weights / 2**20:.0f} MiB of weights a step"
                      for n, c in contenders.items()) + "\n")
    whats = [f"prefill {n}" for n in prefills] + [f"decode B={b}" for b in batches]
    for c in contenders.values():
        for w in whats:
            c.rate(w, 1)
    rates: dict[tuple[str, str], list[float]] = {}
    bws: list[float] = []
    for _ in range(args.rounds):
        bws.append(bandwidth(buf, clock))
        for w in whats:
            for n, c in contenders.items():
                rates.setdefault((w, n), []).append(c.rate(w, args.reps))
    bw = statistics.median(bws)
    base = "dense" if "dense" in names else names[-1]
    print(f"read bandwidth {bw / 1e9:.1f} GB/s (rounds: {', '.join(f'{b / 1e9:.1f}' for b in bws)})\n")
    print("| measurement | " + " | ".join(f"{n} tok/s (of bound)" for n in names)
          + " | " + " | ".join(f"{n} / {base} (rounds)" for n in names if n != base) + " |")
    print("|---|" + "---:|" * (2 * len(names) - 1))
    for w in whats:
        cells = []
        for n in names:
            r = statistics.median(rates[(w, n)])
            if w.startswith("decode"):
                b = int(w.split("=")[1])
                cells.append(f"{r:.1f} ({r * contenders[n].bytes_per_token(b) / bw:.0%})")
            else:
                cells.append(f"{r:.1f}")
        ratios = []
        for n in names:
            if n == base:
                continue
            per = [a / b for a, b in zip(rates[(w, n)], rates[(w, base)])]
            ratios.append(f"{statistics.median(per):.2f} ({', '.join(f'{r:.2f}' for r in per)})")
        print(f"| {w} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
