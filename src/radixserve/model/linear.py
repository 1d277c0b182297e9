"""How the model's linear layers run on this machine: one backend per model, chosen once.

Backends:

* ``radixserve``: the packed GEMM of ``csrc/gemm.cpp`` — weights packed in float32 or
  bfloat16, activations and accumulation in float32, AVX2 and AVX-512 micro-kernels. Where the CPU has no
  native bfloat16 arithmetic it is what makes bfloat16 weights pay (half the bytes a decode
  step reads, computed in float32); on AVX2 it is the float32 default too
  (``benchmarks/bench_linear.py`` compares it with oneDNN per row count).
* ``onednn``: torch's oneDNN linear on weights reordered once into oneDNN's blocked layout
  (what inductor's CPU freezing does): 512-bit FMAs on AVX-512, native bfloat16 dot
  products / AMX where the CPU has them. Activations in the weights' dtype.
* ``torch``: plain ``F.linear`` on the dense weights (any device).

One backend serves every row count of a model, on purpose: a row's result must not depend
on the batch it ran in (a prefix computed in a long prefill must equal the same tokens
computed later), and two GEMM implementations sum in different orders. ``radixserve``
guarantees it by construction (one in-order fma chain per output element); oneDNN's GEMM
does on the shapes tested (``tests/test_attention_split.py``), with a single float32 row run
as two because its GEMV sums in another order.

The logits are float32 in every backend: a bfloat16 lm_head would round them to 8 mantissa
bits, where tokens a few hundredths apart tie and greedy decoding picks by token id.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from radixserve.cpu import effective_isa, native_bf16
from radixserve.memory.kv_pool import zeros_on_huge_pages
from radixserve.model.kernels import Kernels, try_load_kernels

log = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "radixserve", "onednn", "torch")

# Batch-size hint for oneDNN's weight layout: a decode batch; weights are packed once per
# model, and the layout chosen for it serves prefill row counts nearly as well as their own.
PACK_ROWS_HINT = 32
_LM_HEAD_CHUNK = 4096  # vocabulary rows widened to float32 at a time (bf16 lm_head, no kernels)

_onednn_linear = (torch.ops.mkldnn._linear_pointwise.default
                  if hasattr(torch.ops.mkldnn, "_linear_pointwise") else None)


def onednn_supported(device: torch.device, dtype: torch.dtype, cpu_isa: str = "auto") -> bool:
    """Whether oneDNN-packed linears can serve this device and dtype under the instruction-set
    cap: oneDNN packs bfloat16 weights only for AVX-512 (or AVX-NE-CONVERT) CPUs, so below
    the ``avx512`` level bfloat16 never takes it — on every machine, so a capped run takes
    the path an AVX2 CPU takes."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and (dtype == torch.float32 or effective_isa(cpu_isa) == "avx512")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _onednn_linear is not None
    )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a weight packed by ``_reorder_linear_weight``. A single float32 row
    runs as two: oneDNN's one-row GEMV sums in another order than its GEMM."""
    if x.shape[0] == 1 and x.dtype == torch.float32:
        return _onednn_linear(x.expand(2, -1), weight, bias, "none", [], "")[:1]
    return _onednn_linear(x, weight, bias, "none", [], "")


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, cpu_isa: str,
                   kernels: Kernels | None) -> tuple[str, str]:
    """(backend, why) for ``requested`` (one of LINEAR_BACKENDS). ValueError naming
    ``linear_backend`` when a requested backend cannot serve this device / dtype."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {requested!r}")
    ours = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernels is not None
    onednn = onednn_supported(device, dtype, cpu_isa)
    if requested == "radixserve" and not ours:
        raise ValueError("linear_backend 'radixserve' needs the CPU kernels and a float32/bfloat16 model "
                         f"(device {device}, dtype {dtype}, kernels {'built' if kernels else 'unavailable'})")
    if requested == "onednn" and not onednn:
        raise ValueError(f"linear_backend 'onednn' needs a CPU float32 model, or bfloat16 at the avx512 "
                         f"level (device {device}, dtype {dtype}, cpu_isa level {effective_isa(cpu_isa)})")
    if requested != "auto":
        return requested, "set by linear_backend"
    isa = effective_isa(cpu_isa)
    if dtype == torch.bfloat16 and native_bf16(cpu_isa) and onednn:
        return "onednn", "native bfloat16 arithmetic: oneDNN's bf16 dot products"
    if isa == "avx512" and onednn:
        return "onednn", "AVX-512: oneDNN's 512-bit kernels"
    if ours and isa == "avx2":
        return "radixserve", ("AVX2: the packed GEMM of the kernels (float32 compute"
                              + (" on bfloat16 weights)" if dtype == torch.bfloat16 else ")"))
    if onednn:
        return "onednn", f"instruction-set level {isa}: oneDNN"
    if ours:
        return "radixserve", "no oneDNN for this dtype: the portable packed GEMM"
    return "torch", "F.linear"


class Linears:
    """The linear layers of one model: packs its weights for the backend and runs them.

    ``act_dtype`` is the dtype the linears take and give: float32 for ``radixserve`` (its
    weights may be bfloat16), the weights' dtype otherwise."""

    def __init__(self, backend: str, dtype: torch.dtype, kernels: Kernels | None):
        self.backend = backend
        self.dtype = dtype
        self.kernels = kernels
        self.act_dtype = torch.float32 if backend == "radixserve" else dtype
        self.packed = backend != "torch"
        self._apply: Callable[..., torch.Tensor]
        if backend == "radixserve":
            assert kernels is not None
            self._apply = kernels.packed_linear
        elif backend == "onednn":
            self._apply = onednn_linear
        else:
            self._apply = F.linear

    def pack(self, w: torch.Tensor) -> Any:
        """The form of weight ``w [N, K]`` this backend runs (the dense one for ``torch``)."""
        if self.backend == "radixserve":
            return self.kernels.pack_linear(w, self.dtype)
        if self.backend == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        return w

    def pack_many(self, ws: list[torch.Tensor]) -> list[Any]:
        """:meth:`pack` of every weight in ``ws``; for ``radixserve``, all of them in one
        buffer on 2 MB pages. A decode step streams every weight once: on 4 KB pages each
        page of a panel is its own TLB miss, and one buffer spares a partly used huge page
        per weight."""
        if self.backend != "radixserve":
            return [self.pack(w) for w in ws]
        return self._pack_ours(ws)

    def _pack_ours(self, ws: list[torch.Tensor]) -> list[Any]:
        sizes = [self.kernels.packed_numel(*w.shape) for w in ws]
        arena = zeros_on_huge_pages((sum(sizes),), self.dtype, torch.device("cpu"))
        out, off = [], 0
        for w, size in zip(ws, sizes):
            out.append(self.kernels.pack_linear(w, self.dtype, out=arena[off:off + size]))
            off += size
        return out

    def __call__(self, x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._apply(x, w, bias)

    def pack_lm_head(self, w: torch.Tensor) -> tuple[str, Any]:
        """The lm_head as (how :meth:`logits` runs it, weight): our GEMM wherever it can
        give float32 logits from these weights, oneDNN for a float32 model on that backend,
        else the dense weight."""
        if self.kernels is not None and w.device.type == "cpu" and (
                self.backend == "radixserve" or self.dtype == torch.bfloat16):
            return "radixserve", self._pack_ours([w])[0]
        if self.backend == "onednn" and self.dtype == torch.float32:
            return "onednn", self.pack(w)
        return "dense", w

    def logits(self, x: torch.Tensor, lm_head: tuple[str, Any]) -> torch.Tensor:
        """float32 logits of the float32 rows ``x`` (see the module docstring)."""
        kind, w = lm_head
        if kind == "radixserve":
            return self.kernels.packed_linear(x, w)
        if kind == "onednn":
            return onednn_linear(x, w)
        if w.dtype == torch.float32:
            return F.linear(x, w)
        out = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32, device=x.device)
        for n0 in range(0, w.shape[0], _LM_HEAD_CHUNK):
            torch.matmul(x, w[n0:n0 + _LM_HEAD_CHUNK].float().t(), out=out[:, n0:n0 + _LM_HEAD_CHUNK])
        return out


def make_linears(requested: str, device: torch.device, dtype: torch.dtype, cpu_isa: str = "auto") -> Linears:
    """The :class:`Linears` for a model of ``dtype`` on ``device`` (kernels loaded if needed)."""
    kernels = try_load_kernels() if device.type == "cpu" else None
    if kernels is not None:
        kernels = kernels.capped(cpu_isa)
    backend, why = choose_backend(requested, device, dtype, cpu_isa, kernels)
    log.info("linear layers: %s (%s)", backend, why)
    return Linears(backend, dtype, kernels)
