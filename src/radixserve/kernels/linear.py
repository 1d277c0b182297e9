"""How the model's linear layers run on this machine: one backend per model, chosen once.

Backends:

* ``radixserve`` (the default wherever the kernels build): the kernels' packed GEMMs, batch-
  invariant by construction: every output element is one chain in a fixed order whatever the
  row count, the tile or the thread, so a row's result never depends on the batch it ran in
  (a prefix computed in a long prefill equals, bit for bit, the same tokens decoded later).
  A float32 model runs float32 fma chains (``csrc/gemm.cpp``); a bfloat16 model runs
  bfloat16 dot products (``csrc/gemm_dot.cpp``: the rows rounded to bfloat16, pairs of
  products accumulated in float32 the way AVX512-BF16's ``vdpbf16ps`` does), natively where
  the CPU has that instruction and emulated bit for bit elsewhere, so a bfloat16 model gives
  the same bits on every instruction-set level.
* ``radixserve-f32``: the same packed GEMM in float32 arithmetic for a bfloat16 model too
  (its weights widened exactly, the rows kept in float32): batch-invariant and closer to the
  float32 model, at the float32 FMA rate, so slower at prefill where the CPU has native
  bfloat16 arithmetic.
* ``onednn``: torch's oneDNN linear on weights reordered once into oneDNN's blocked layout.
  NOT batch-invariant: oneDNN picks its blocking, and with it the order a row's sums are
  taken in, by the row count. Opt-in, for comparison.
* ``torch``: plain ``F.linear`` on the dense weights (any device). NOT batch-invariant on
  CPU for the same reason; the only backend off the CPU.

Quantized weights (:mod:`radixserve.kernels.quant_weights`: a GGUF's blocks, per-channel int8) run on
``radixserve`` for a bfloat16 model only: their blocks expand to the dense model's bfloat16
weights and the same arithmetic runs on them (``Linears.quant``), or, marked for integer dot
products (``--weight-dtype gguf-q8``) or block codes (``--weight-dtype gguf-codes``), run
csrc/gemm_q8dot.cpp's or csrc/gemm_codes.cpp's own definition, the lm_head included (its
logits float32 all the same).

The logits are float32 in every backend. A bfloat16 model's lm_head takes its final hidden
rows as the layers take theirs, rounded to bfloat16 into the same batch-invariant dot products
(float32 sums), as the bfloat16 model in transformers does; a float32 model's, and every
``radixserve-f32`` one's, runs float32 chains. Why not float32 rows for bfloat16 too: the
lm_head is most of a small model's step at a large vocabulary (Gemma 3's 262,144 rows), and
float32 chains on its weights run at half the dot products' rate once a decode batch makes it
compute-bound, while the rounding adds little to the error the bfloat16 layers already make
(``benchmarks/bench_lm_head.py`` prints both).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from radixserve.config import LINEAR_BACKENDS
from radixserve.kernels.isa import ISAS, effective_isa
from radixserve.memory.kv_pool import zeros_on_huge_pages
from radixserve.kernels.library import (AMX_NO_OS, AMX_PROBE_DIFFERS, AMX_PROBE_FAILED, AMX_STATUS, Kernels,
                                        try_load_kernels)
from radixserve.kernels.quant_weights import QuantTensor, blob_nbytes, pack_quant_tensor

log = logging.getLogger(__name__)

#: Backends whose rows depend on the batch they ran in (what --help, logs and /server_info say).
NOT_BATCH_INVARIANT = ("onednn", "torch")

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
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and (dtype == torch.float32 or ISAS.index(effective_isa(cpu_isa)) >= ISAS.index("avx512"))
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and _onednn_linear is not None)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a weight packed by ``_reorder_linear_weight``. A single float32 row
    runs as two: oneDNN's one-row GEMV sums in another order than its GEMM."""
    if x.shape[0] == 1 and x.dtype == torch.float32:
        return _onednn_linear(x.expand(2, -1), weight, bias, "none", [], "")[:1]
    return _onednn_linear(x, weight, bias, "none", [], "")


def _tiles_note(kernels: Kernels, level: int) -> str:
    """What the AMX tiles do for the native dot products at ``level`` (an index of ISAS), for
    the startup log: used, capped off, or why an AMX CPU does not use them."""
    if "amx" in kernels.available_isas():
        return ", prefill on AMX tiles" if level >= ISAS.index("amx") else "; AMX tiles capped off"
    if kernels.amx_status in (AMX_NO_OS, AMX_PROBE_DIFFERS, AMX_PROBE_FAILED):
        return f"; AMX tiles not used: {AMX_STATUS[kernels.amx_status]}"
    return ""


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, cpu_isa: str,
                   kernels: Kernels | None) -> tuple[str, str]:
    """(backend, why) for ``requested`` (one of LINEAR_BACKENDS). ValueError naming
    ``linear_backend`` when a requested backend cannot serve this device / dtype."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {requested!r}")
    ours = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and kernels is not None
    onednn = onednn_supported(device, dtype, cpu_isa)
    if requested.startswith("radixserve") and not ours:
        raise ValueError(f"linear_backend {requested!r} needs the CPU kernels and a float32/bfloat16 model "
                         f"(device {device}, dtype {dtype}, kernels {'built' if kernels else 'unavailable'})")
    if requested == "onednn" and not onednn:
        raise ValueError(f"linear_backend 'onednn' needs a CPU float32 model, or bfloat16 at the avx512 "
                         f"level (device {device}, dtype {dtype}, cpu_isa level {effective_isa(cpu_isa)})")
    if requested != "auto":
        why = "set by linear_backend"
        return requested, why + (": not batch-invariant" if requested in NOT_BATCH_INVARIANT else "")
    if ours:
        level = ISAS.index(effective_isa(cpu_isa))
        native = kernels.native_dot and level >= ISAS.index("avx512")
        how = ("bfloat16 dot products, " + ("native (AVX512-BF16" + _tiles_note(kernels, level) + ")"
                                            if native else "emulated bit for bit")
               if dtype == torch.bfloat16 else "float32 fma chains")
        return "radixserve", f"the kernels' batch-invariant packed GEMM ({how})"
    if onednn:
        return "onednn", "no CPU kernels here: oneDNN, not batch-invariant"
    return "torch", "F.linear" + (", not batch-invariant" if device.type == "cpu" else "")


class Linears:
    """The linear layers of one model: packs its weights for the backend and runs them.
    ``act_dtype`` is the dtype the linears take and give: float32 for ``radixserve`` (a bfloat16
    model's rows are rounded inside its GEMM), the weights' dtype otherwise. ``dot``: the layer
    weights are packed for bfloat16 dot products."""

    def __init__(self, backend: str, dtype: torch.dtype, kernels: Kernels | None, why: str = ""):
        self.backend = backend
        self.why = why
        self.dtype = dtype
        self.kernels = kernels
        self.act_dtype = torch.float32 if backend.startswith("radixserve") else dtype
        self.dot = backend == "radixserve" and dtype == torch.bfloat16
        self.batch_invariant = backend not in NOT_BATCH_INVARIANT
        self.ours = backend.startswith("radixserve")  # the kernels' packed GEMM
        self.packed = backend != "torch"
        # Quantized weights (kernels.quant_weights) run here: their blocks expand to the bfloat16
        # weights and the same dot products run on them (a bfloat16 model on our GEMM).
        self.quant = self.dot
        self._apply: Callable[..., torch.Tensor]
        if backend.startswith("radixserve"):
            assert kernels is not None
            self._apply = kernels.packed_linear
        elif backend == "onednn":
            self._apply = onednn_linear
        else:
            self._apply = F.linear

    def pack_for_backend(self, w: torch.Tensor) -> Any:
        """The form of weight ``w [N, K]`` this backend runs (the dense one for ``torch``)."""
        if self.ours:
            return self.kernels.pack_linear(w, self.dtype, dot=self.dot)
        if self.backend == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        return w

    def pack_many(self, ws: list[torch.Tensor | QuantTensor]) -> list[Any]:
        """:meth:`pack_for_backend` of every weight in ``ws``; for ``radixserve``, all of them in one
        buffer on 2 MB pages (the quantized ones in another). A decode step streams every
        weight once: on 4 KB pages each page of a panel is its own TLB miss, and one buffer
        spares a partly used huge page per weight."""
        quant = [i for i, w in enumerate(ws) if isinstance(w, QuantTensor)]
        if quant and not self.quant:
            raise ValueError(f"quantized weights need the bfloat16 dot products (backend {self.backend}, "
                             f"dtype {self.dtype})")
        if not self.ours:
            return [self.pack_for_backend(w) for w in ws]
        dense = [i for i in range(len(ws)) if i not in set(quant)]
        out: list[Any] = [None] * len(ws)
        for i, pw in zip(dense, self._pack_ours([ws[i] for i in dense]) if dense else []):
            out[i] = pw
        for i, pw in zip(quant, self._pack_quant([ws[i] for i in quant], dot=True) if quant else []):
            out[i] = pw
        return out

    def _pack_quant(self, qts: list[QuantTensor], dot: bool) -> list[Any]:
        return _pack_in_one_buffer(qts, [blob_nbytes(self.kernels, q) for q in qts], torch.uint8,
                                   lambda q, out: pack_quant_tensor(self.kernels, q, dot, out=out))

    def pack_table(self, q: QuantTensor) -> Any:
        """A quantized embedding table packed for its row lookups (``Kernels.quant_rows``)."""
        return self._pack_quant([q], dot=False)[0]

    def _pack_ours(self, ws: list[torch.Tensor], dot: bool | None = None) -> list[Any]:
        dot = self.dot if dot is None else dot
        return _pack_in_one_buffer(ws, [self.kernels.packed_numel(*w.shape, dot=dot) for w in ws], self.dtype,
                                   lambda w, out: self.kernels.pack_linear(w, self.dtype, out=out, dot=dot))

    def __call__(self, x: torch.Tensor, w: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._apply(x, w, bias)

    def pack_lm_head(self, w: torch.Tensor | QuantTensor, dot: bool | None = None) -> tuple[str, Any]:
        """The lm_head as (how :meth:`logits` runs it, weight): our GEMM wherever it can give float32
        logits from these weights, oneDNN for a float32 model on that backend, else the dense weight.
        ``dot`` (default: as the layers run) packs it for the bfloat16 dot products, else for float32
        chains (see the module docstring). A quantized lm_head expands to the dense bfloat16 model's
        weights either way."""
        dot = self.dot if dot is None else dot
        if isinstance(w, QuantTensor):
            if not self.quant:
                raise ValueError("a quantized lm_head needs the kernels' bfloat16 model")
            return "radixserve", self._pack_quant([w], dot=dot)[0]
        if self.kernels is not None and w.device.type == "cpu" and (
                self.ours or self.dtype == torch.bfloat16):
            return "radixserve", self._pack_ours([w], dot=dot and self.dtype == torch.bfloat16)[0]
        if self.backend == "onednn" and self.dtype == torch.float32:
            return "onednn", self.pack_for_backend(w)
        return "dense", w

    def logits(self, x: torch.Tensor, lm_head: tuple[str, Any]) -> torch.Tensor:
        """float32 logits of the float32 rows ``x`` (rounded to bfloat16 first where the
        lm_head was packed for the dot products; see the module docstring)."""
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


def _pack_in_one_buffer(items: list[Any], sizes: list[int], dtype: torch.dtype,
                        pack: Callable[[Any, torch.Tensor], Any]) -> list[Any]:
    """``pack(item, out)`` of each item into consecutive slices of one buffer on huge pages."""
    arena = zeros_on_huge_pages((sum(sizes),), dtype, torch.device("cpu"))
    offsets = [0, *itertools.accumulate(sizes)]
    return [pack(item, arena[offsets[i]:offsets[i + 1]]) for i, item in enumerate(items)]


def make_linears(requested: str, device: torch.device, dtype: torch.dtype, cpu_isa: str = "auto") -> Linears:
    """The :class:`Linears` for a model of ``dtype`` on ``device`` (kernels loaded if needed)."""
    kernels = try_load_kernels() if device.type == "cpu" else None
    if kernels is not None:
        kernels = kernels.capped(cpu_isa)
    backend, why = choose_backend(requested, device, dtype, cpu_isa, kernels)
    (log.warning if backend in NOT_BATCH_INVARIANT and device.type == "cpu" else log.info)(
        "linear layers: %s (%s)", backend, why)
    return Linears(backend, dtype, kernels, why)
