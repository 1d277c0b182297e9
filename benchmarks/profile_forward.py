"""Where a forward pass spends its time: torch.profiler's per-op table for one prefill or
one decode step of the real model through the paged pool (not a test; prints a table).

    python benchmarks/profile_forward.py --dtype bfloat16 --prefill 512
    python benchmarks/profile_forward.py --dtype float32 --decode-batch 32 --ctx 512
    python benchmarks/profile_forward.py --decode-batch 8 --ctx 544 --shared 512 --python-loop

    python benchmarks/profile_forward.py --backend torch-eager   # the eager reference path
    python benchmarks/profile_forward.py --decode-batch 1 --python-loop  # layers from Python

Before the table it prints the step's wall time split into our packed GEMM, paged attention
and the rest (row ops, Python, dispatch), median of ``--reps`` steps timed by wrapping the
kernel calls (so with ``--python-loop``; in one call the layers are one C++ call and the split
is not available).

Use it before optimising: the matmuls appear as ``mkldnn::_linear_pointwise``, the CPU
kernels as ``radixserve::*`` (``paged_attention``, ``add_rms_norm``, ``rope_``, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.memory.allocator import SlotAllocator  # noqa: E402
from radixserve.model.arch.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.arch.llama import LlamaForCausalLM  # noqa: E402
from radixserve.model.registry import load_model  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens (when no --decode-batch)")
    ap.add_argument("--decode-batch", type=int, default=0, help="profile one decode step of this batch")
    ap.add_argument("--ctx", type=int, default=512, help="context length per sequence for decode")
    ap.add_argument("--shared", type=int, default=0,
                    help="decode: the first N context tokens are one cached prefix every sequence "
                         "reads (the same slots, as sequences sharing a radix-tree prefix)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--backend", default="torch", choices=["torch", "torch-eager"])
    ap.add_argument("--python-loop", action="store_true",
                    help="run the decoder layers from Python (LlamaForCausalLM.one_call_layers off)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)
    if args.python_loop:
        LlamaForCausalLM.one_call_layers = False
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, dtype=torch.float32)
    dtype = getattr(torch, args.dtype)
    sd = {k: v.to(dtype) for k, v in loaded.state_dict.items()}
    b = max(1, args.decode_batch)
    cap = b * (args.ctx + 2) + args.prefill + 16
    runner = ModelRunner.from_config(loaded.config, sd, kv_capacity=cap, dtype=dtype,
                                     backend=args.backend)
    alloc = SlotAllocator(cap)
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    if args.decode_batch:
        if not 0 <= args.shared <= args.ctx:
            sys.exit(f"--shared must be within 0..--ctx ({args.ctx}), got {args.shared}")
        ctx = torch.randint(0, vocab, (args.ctx,), generator=gen).tolist()
        n = args.shared
        prefix = alloc.alloc(n)[:n]
        if n:
            runner.forward(ForwardBatch.build([ctx[:n]], [0], [prefix]))
        seqs = [torch.cat([prefix, alloc.alloc(args.ctx + 1 - n)[: args.ctx + 1 - n]]) for _ in range(b)]
        for s in seqs:  # fill every sequence's own context through the pool
            if n < args.ctx:
                runner.forward(ForwardBatch.build([ctx[n:]], [n], [s[: args.ctx]]))
        toks = torch.randint(0, vocab, (b,), generator=gen).tolist()

        def step() -> None:
            runner.forward(ForwardBatch.build([[t] for t in toks], [args.ctx] * b, seqs))

        what = f"decode step, batch {b}, context {args.ctx}" + (f" ({n} shared)" if n else "")
        tokens = b
    else:
        prompt = torch.randint(0, vocab, (args.prefill,), generator=gen).tolist()
        slots = alloc.alloc(args.prefill)

        def step() -> None:
            runner.forward(ForwardBatch.build([prompt], [0], [slots]))

        what = f"prefill of {args.prefill} tokens"
        tokens = args.prefill

    step()  # warm-up
    steps = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t0)
    dt = sorted(steps)[len(steps) // 2]
    if args.python_loop:
        print(split_line(step, runner, args.reps))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"{loaded.name} {args.dtype}, {what}, backend {args.backend}, "
          f"{torch.get_num_threads()} threads: "
          f"{dt * 1e3:.1f} ms unprofiled ({tokens / dt:.1f} tok/s)\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


def split_line(step, runner: ModelRunner, reps: int) -> str:
    """The step's median wall time and the medians spent in the packed GEMM and in paged
    attention, timed around each call (the wrappers add a little to the rest)."""
    spent = {"gemm": 0.0, "attention": 0.0}

    def timed(fn, what):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[what] += time.perf_counter() - t0
        return call

    # the callables the forward reaches: the linears' bound GEMM, the lm_head's kernels, the
    # attention backend's kernels (instance attributes shadow the class's methods)
    linears, attn_kernels = runner.model.linears, runner.attn_backend.kernels
    patches = [(linears, "_apply", "gemm")]
    if linears.kernels is not None:
        patches.append((linears.kernels, "packed_linear", "gemm"))
    if attn_kernels is not None:
        patches.append((attn_kernels, "attention", "attention"))
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
    rows = []
    try:
        for obj, name, what in patches:
            setattr(obj, name, timed(getattr(obj, name), what))
        for _ in range(reps):
            spent.update(gemm=0.0, attention=0.0)
            t0 = time.perf_counter()
            step()
            rows.append((time.perf_counter() - t0, spent["gemm"], spent["attention"]))
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    med = [sorted(r[i] for r in rows)[len(rows) // 2] * 1e3 for i in range(3)]
    return (f"split (median of {reps}): step {med[0]:.2f} ms = packed GEMM {med[1]:.2f} + paged attention "
            f"{med[2]:.2f} + the rest {med[0] - med[1] - med[2]:.2f} (row ops, Python, dispatch)")


if __name__ == "__main__":
    main()
