"""``--weight-dtype auto``: whether a model's linear weights stay in their quantized blocks,
decided by the file, the serving dtype and the CPU's features — never a timing (for the
reason :mod:`~radixserve.kernels.dtype_choice` gives: two servers started alike would hold
different weights).

What the rule encodes (``benchmarks/bench_quant_weights.py`` prints the ratios behind it; a
Zen 4 core, thread CPU time, in benchmarks/README.md):

* a GGUF served as a bfloat16 model on the kernels' GEMM where the CPU has native bfloat16
  dot products (AVX512-BF16): its blocks. A decode step streams every weight once, and a
  block is 4.5–8.5 bits a weight against bfloat16's 16; expanding a block to its bfloat16
  weights (the same values as the dense model's: nothing else changes, not a bit) costs a
  few vector instructions per 32 weights, which the native conversion and dot product keep
  below the bytes saved. Decode at batch 1: 1.2–1.4x the dense model; prefill 0.98x (each
  panel group expanded once per step, amortised over its rows); batch 8: 0.7–0.9x on that
  core (compute-bound there: the expansion competes with the dot products); resident
  memory a third or less.
* everything else dense: where the dot products are emulated (AVX2, AVX-512 without BF16)
  the expansion rounds every weight with integer instructions and costs more than the bytes
  save (batch-1 decode 0.6–0.8x the dense model on the Zen 4 capped to AVX2); a float32 model
  (its weights are the float32 dequantization, which the blocks do not expand to); another
  linear backend; the portable level; tensor parallelism (the ranks shard dense weights);
  a Hugging Face folder (no blocks to keep). ``--weight-dtype gguf`` serves the blocks on any
  vector level all the same (the same bits, a third of the memory), ``int8`` makes blocks of
  any model.
* never ``gguf-q8`` (the integer-dot linears, :mod:`radixserve.kernels.quant_weights`): it is faster
  than ``gguf`` where the two were measured side by side (benchmarks/README.md), but exact to its own
  definition, not to the dense model, and it changes answers where a margin is thin: SmolLM2
  answers "What is the capital of France?" with llama.cpp's words ("L'Étoile, la Marseillaise,
  ..."; the dense model's top-2 margin at the first token is 0.069), not Paris. Taking it by
  default is a decision about answers, not speed, so it is asked for by name.
* never ``gguf-codes`` (the block-codes linears: bfloat16 activations against each block's integer
  codes, the scale applied once per block): faster than ``gguf`` at decode where the two were
  measured side by side, near the dense model but not its bits (its own stated definition,
  csrc/gemm_codes.cpp), so it too is asked for by name; whether ``auto`` should take it is
  benchmarks/README.md's open question ("Block codes").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config import WEIGHT_DTYPES
from radixserve.kernels.isa import describe, effective_isa, native_bf16


@dataclass(frozen=True)
class WeightChoice:
    format: str  # "gguf", "gguf-q8", "gguf-codes", "int8" or "dense"
    reason: str


def choose_weights(requested: str, *, gguf_source: bool, dtype: torch.dtype, device: str = "cpu",
                   cpu_isa: str = "auto", linear_backend: str = "auto", tp_size: int = 1,
                   kernels_available: bool = True) -> WeightChoice:
    """How to hold the linear weights for ``--weight-dtype requested`` (see the module
    docstring). ValueError, naming ``weight_dtype``, when an explicit request cannot be served."""
    if requested not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {requested!r}")
    if requested == "dense":
        return WeightChoice("dense", "--weight-dtype dense")
    blockers = []
    if torch.device(device).type != "cpu" or not kernels_available:
        blockers.append("needs the CPU kernels")
    if dtype != torch.bfloat16:
        blockers.append(f"computes the bfloat16 model (dtype is {str(dtype).removeprefix('torch.')})")
    if linear_backend not in ("auto", "radixserve"):
        blockers.append(f"runs on the radixserve linear backend (not {linear_backend})")
    if tp_size > 1:
        blockers.append("is not sharded over tensor-parallel ranks")
    if requested in ("gguf", "gguf-q8", "gguf-codes") and not gguf_source:
        blockers.append("needs a GGUF file")
    if requested in ("gguf", "gguf-q8", "gguf-codes", "int8"):
        if blockers:
            raise ValueError(f"weight_dtype {requested!r}: the quantized path {'; '.join(blockers)}")
        return WeightChoice(requested, f"--weight-dtype {requested}")
    if not gguf_source:
        return WeightChoice("dense", "not a GGUF: weights in the serving dtype")
    isa = effective_isa(cpu_isa)
    if isa == "generic":
        blockers.append(f"has no vector kernels at level {isa}")
    elif not native_bf16(cpu_isa):
        blockers.append(f"emulates the bfloat16 dot products at level {isa}, where expanding the blocks "
                        "costs more than the bytes it saves (--weight-dtype gguf serves them all the same)")
    if blockers:
        return WeightChoice("dense", "GGUF dequantized at load: the quantized path " + "; ".join(blockers))
    return WeightChoice("gguf", "GGUF blocks computed directly (a decode step reads their 4.5-8.5 bits a weight, "
                                "not bfloat16's 16; the same bits as the dense bfloat16 model; native bfloat16 "
                                f"dot products, by CPU features) on {describe()}")
