"""``--weight-dtype auto``: whether a model's linear weights stay in their quantized blocks,
decided by the file, the serving dtype and the CPU's features — never a timing (for the
reason :mod:`~radixserve.kernels.dtype_choice` gives: two servers started alike would hold
different weights).

What the rule encodes (``benchmarks/bench_quant_weights.py`` prints the ratios behind it; a
Zen 4 core, thread CPU time, in benchmarks/README.md):

* a GGUF served as a bfloat16 model on the kernels' GEMM where the CPU has native bfloat16
  dot products (AVX512-BF16): its blocks. A decode step streams every weight once, and a
  block is 4.5-8.5 bits a weight against bfloat16's 16.
  - Q4_0 and Q8_0 tensors are computed on their integer codes (``gguf-codes``: bfloat16
    activations against the codes, exact in bfloat16, the block's scale applied once per block
    and output). No weight is rounded or multiplied per element, so a one-row decode is bound
    by the dot products, not by expanding blocks, and prefill stays near the dense model's
    rate. These answers are not the dense model's bits: they are exact to
    csrc/gemm_codes.cpp's definition (tests/test_gemm_codes.py holds every path to it), and
    batch-invariant like every path here. Their distance from the float32 model is the dense
    bfloat16 model's order (benchmarks/README.md, "Block codes"), and SmolLM2 still answers Paris.
  - Q4_1 (offset blocks) and the k-quants expand to the dense model's bfloat16 weights
    (``gguf``: the same values, the same bits). A Q4_1 block on codes needs a second multiply
    per block and output (its offset times the block's activation sum), which leaves its
    prefill clearly slower than the dense model's; the expansion's is level with it.
* everything else dense: where the dot products are emulated (AVX2, AVX-512 without BF16)
  both the expansion and the codes' conversions cost more than the bytes save (batch-1 decode
  below the dense model on the Zen 4 capped to AVX2); a float32 model (its weights are the
  float32 dequantization, which the blocks do not expand to); another linear backend; the
  portable level; tensor parallelism (the ranks shard dense weights); a Hugging Face folder
  (no blocks to keep). ``--weight-dtype gguf`` serves the blocks on any vector level all the
  same (the dense model's bits, a third of the memory), ``gguf-codes`` every format that has
  codes, ``int8`` makes blocks of any model.
* never ``gguf-q8`` (the integer-dot linears, :mod:`radixserve.kernels.quant_weights`): it is faster
  still, but it rounds the activations to 8 bits and changes answers where a margin is thin:
  SmolLM2 answers "What is the capital of France?" with llama.cpp's words ("L'Étoile, la
  Marseillaise, ..."; the dense model's first token is a near tie, benchmarks/answer_margins.py),
  not Paris.
  Taking it by default is a decision about answers, not speed, so it is asked for by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config import WEIGHT_DTYPES
from radixserve.kernels.isa import describe, effective_isa, native_bf16


#: The block formats ``auto`` computes on their codes (``gguf-codes``); the GGUF's other blocks
#: expand to the dense model's bfloat16 weights (``gguf``). See the module docstring for why
#: Q4_1 is not among them.
AUTO_CODES_FORMATS = frozenset({"Q4_0", "Q8_0"})


@dataclass(frozen=True)
class WeightChoice:
    format: str  # "gguf", "gguf-q8", "gguf-codes", "int8" or "dense"
    reason: str
    #: gguf-codes: the formats computed on their codes (None: every format that has the kernel)
    codes_formats: frozenset[str] | None = None


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
    codes = "+".join(sorted(AUTO_CODES_FORMATS))
    return WeightChoice("gguf-codes", "GGUF blocks computed directly (a decode step reads their 4.5-8.5 bits a "
                                      f"weight, not bfloat16's 16): {codes} on their integer codes with the scale "
                                      "per block (csrc/gemm_codes.cpp's definition), other formats expanded to the "
                                      "dense bfloat16 model's weights; native bfloat16 dot products, by CPU "
                                      f"features, on {describe()}", AUTO_CODES_FORMATS)
