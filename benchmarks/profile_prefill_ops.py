"""Where one prefill forward of the default path spends its CPU time, kernel by kernel (not a test).

    python benchmarks/profile_prefill_ops.py [--model smollm2-135m] [--prefill 512,2048]

The decoder layers run from Python (``one_call_layers`` off: the same kernels in the same
order as the one C++ call, so the same bits and the same work), and every kernel call is
timed by the calling thread's CPU time, grouped by what it computes: each projection's GEMM
by its weight's shape (qkv, o, gate_up, down; the lm_head of the rows whose logits are
returned), attention, the norms, RoPE, the gated activation, the K/V stores. One torch
thread, so CPU time is the work whatever else the machine runs. ``rest`` is the forward's
CPU time outside those calls (embedding, Python, dispatch).

The GEMM's own split (rounding the float32 rows to bfloat16 once per call, then the dot
products) is printed beside it from the kernel alone: ``Kernels.packed_linear`` on the same
shapes against a ``torch.Tensor.to(torch.bfloat16)`` of the same rows, the same operation
(round to nearest even) on the same bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.kernels.isa import describe  # noqa: E402
from radixserve.kernels.library import Kernels  # noqa: E402
from radixserve.memory.allocator import SlotAllocator  # noqa: E402
from radixserve.model.arch.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.arch.llama import LlamaForCausalLM  # noqa: E402
from radixserve.model.registry import load_model  # noqa: E402

TIMED = ("rms_norm", "add_rms_norm", "rope_", "silu_mul", "gelu_tanh_mul", "qk_norm_rope", "store_kv",
         "attention", "packed_linear", "gated_linear")


class KernelClock:
    """Wraps :class:`Kernels`' methods (on the class, before any runner binds them) so that
    each call adds its thread CPU time to a bucket named by ``name_of``."""

    def __init__(self, name_of: Callable[[str, tuple], str]):
        self.name_of = name_of
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple[str, object]] = []

    def install(self) -> None:
        for name in TIMED:
            fn = getattr(Kernels, name)
            self._saved.append((name, fn))
            setattr(Kernels, name, self._timed(name, fn))

    def _timed(self, name: str, fn):  # noqa: ANN001, ANN202
        clock = self

        def call(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                bucket = clock.name_of(name, a)
                clock.spent[bucket] += time.thread_time() - t0
                clock.calls[bucket] += 1
        return call

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


class Shapes:
    """Names a GEMM by its weight's shape, from the model's config."""

    def __init__(self, cfg):  # noqa: ANN001
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.names = {(qkv, cfg.hidden_size): "gemm qkv", (cfg.hidden_size, cfg.num_heads * cfg.head_dim): "gemm o",
                      (2 * cfg.intermediate_size, cfg.hidden_size): "gemm gate_up",
                      (cfg.hidden_size, cfg.intermediate_size): "gemm down",
                      (cfg.vocab_size, cfg.hidden_size): "gemm lm_head"}

    def __call__(self, op: str, args: tuple) -> str:
        if op == "gated_linear":
            return "gemm gate_up + gate (one pass)"
        if op != "packed_linear":
            return {"add_rms_norm": "rms_norm", "store_kv": "store_kv"}.get(op, op)
        w = args[2]
        return self.names.get((w.n, w.k), f"gemm {w.n}x{w.k}")


def conversion_share(rows: int, k: int, reps: int) -> float:
    """CPU seconds of rounding ``rows x k`` float32 values to bfloat16 (torch's cast: the
    same operation the GEMM applies to its rows once per call)."""
    x = torch.randn(rows, k)
    out = torch.empty(rows, k, dtype=torch.bfloat16)
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        out.copy_(x)
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    LlamaForCausalLM.one_call_layers = False

    loaded = load_model(args.model, dtype=torch.bfloat16)
    cfg = loaded.config
    shapes = Shapes(cfg)
    clock = KernelClock(shapes)
    clock.install()
    prefills = [int(x) for x in args.prefill.split(",")]
    cap = max(prefills) + 64
    runner = ModelRunner.from_config(cfg, loaded.state_dict, kv_capacity=cap, dtype=torch.bfloat16)
    print(f"CPU: {describe()}; torch {torch.__version__}, 1 thread, thread CPU time; {args.model} bfloat16; "
          f"linears: {runner.model.linears.backend} ({runner.model.linears.why})\n")
    gen = torch.Generator().manual_seed(0)
    alloc = SlotAllocator(cap)
    for n in prefills:
        prompt = torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()
        slots = alloc.alloc(n)
        runner.forward(ForwardBatch.build([prompt], [0], [slots]))  # warm
        per: dict[str, list[float]] = defaultdict(list)
        totals = []
        for _ in range(args.reps):
            clock.reset()
            t0 = time.thread_time()
            runner.forward(ForwardBatch.build([prompt], [0], [slots]))
            total = time.thread_time() - t0
            totals.append(total)
            for k, v in clock.spent.items():
                per[k].append(v)
            per["rest"].append(total - sum(clock.spent.values()))
        total = statistics.median(totals)
        print(f"prefill {n}: {total * 1e3:.1f} ms CPU ({n / total:.1f} tok/s), median of {args.reps}\n")
        print("| part | ms | share | calls |")
        print("|---|---:|---:|---:|")
        for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
            ms = statistics.median(v) * 1e3
            print(f"| {k} | {ms:.1f} | {100 * ms / (total * 1e3):.1f}% | {clock.calls.get(k, '')} |")
        widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size)
        conv = sum(conversion_share(n, k, 5) for k in widths) * cfg.num_layers
        print(f"| (inside the GEMMs: rounding their rows to bf16, torch's cast of the same rows) | "
              f"{conv * 1e3:.1f} | {100 * conv / total:.1f}% | |\n")
        alloc.free(slots)


if __name__ == "__main__":
    main()
