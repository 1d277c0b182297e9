"""Where a forward pass spends its time: torch.profiler's per-op table for one prefill or
one decode step of the real model through the paged pool (not a test; prints a table).

    python benchmarks/profile_forward.py --dtype bfloat16 --prefill 512
    python benchmarks/profile_forward.py --dtype float32 --decode-batch 32 --ctx 512

    python benchmarks/profile_forward.py --backend torch-eager   # the eager reference path

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
from radixserve.model.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.registry import load_model  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens (when no --decode-batch)")
    ap.add_argument("--decode-batch", type=int, default=0, help="profile one decode step of this batch")
    ap.add_argument("--ctx", type=int, default=512, help="context length per sequence for decode")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--backend", default="torch", choices=["torch", "torch-eager"])
    args = ap.parse_args(argv)
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
        ctx = torch.randint(0, vocab, (args.ctx,), generator=gen).tolist()
        seqs = [alloc.alloc(args.ctx + 1) for _ in range(b)]
        for s in seqs:  # fill every sequence's context through the pool
            runner.forward(ForwardBatch.build([ctx], [0], [s[: args.ctx]]))
        toks = torch.randint(0, vocab, (b,), generator=gen).tolist()

        def step() -> None:
            runner.forward(ForwardBatch.build([[t] for t in toks], [args.ctx] * b, seqs))

        what = f"decode step, batch {b}, context {args.ctx}"
        tokens = b
    else:
        prompt = torch.randint(0, vocab, (args.prefill,), generator=gen).tolist()
        slots = alloc.alloc(args.prefill)

        def step() -> None:
            runner.forward(ForwardBatch.build([prompt], [0], [slots]))

        what = f"prefill of {args.prefill} tokens"
        tokens = args.prefill

    step()  # warm-up
    t0 = time.perf_counter()
    step()
    dt = time.perf_counter() - t0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"{loaded.name} {args.dtype}, {what}, backend {args.backend}, "
          f"{torch.get_num_threads()} threads: "
          f"{dt * 1e3:.1f} ms unprofiled ({tokens / dt:.1f} tok/s)\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
