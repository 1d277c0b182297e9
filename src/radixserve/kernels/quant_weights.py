"""Quantized linear weights: GGUF's blocks kept as shipped, and per-output-channel int8.

A decode step reads every weight once, so its speed is the weights' bytes: a GGUF's 4-bit
blocks are a quarter of the bfloat16 copy the loader used to make of them. Here a weight
stays in its blocks (:class:`QuantTensor`, from the loader), is repacked once into the
kernels' panel layout (``csrc/quant.h``) and computed directly (``csrc/gemm_quant.cpp``).

What it is exact to: the dense bfloat16 model loaded from the same GGUF (each tensor
dequantized to float32 by the ``gguf`` package's numpy code, rounded to bfloat16). The
kernels expand a block to exactly those bfloat16 values and run that model's arithmetic on
them, so tokens and logprobs are the same bits, at every instruction-set level and in any
batch. A float32 model does not use them (its weights are the float32 dequantization; it
keeps the dense path).

Integer dot products (``--weight-dtype gguf-q8``; :meth:`QuantTensor.for_integer_dot`, for
Q8_0, Q4_0 and Q4_1 blocks): a weight marked so is repacked into the integer-dot panels of
``csrc/quant.h`` and computed by ``csrc/gemm_q8dot.cpp``, whose header defines what it is
exact to, its own stated reference: each activation row quantized per 32-block to int8 with
one float32 scale (``amax / 127``, codes rounded half to even), each block's products summed
exactly in integers, and one fixed float32 chain over the blocks per output element
(``acc = fma(d_w * d_x, float(I), acc)``; Q4_1 adds ``fma(m_w * d_x, float(sum x_q), acc)``).
Not the dense model's bits, but the same bits alone, in any batch, in a prefill of any length
and on every instruction-set level. Its embedding rows still expand to the dense model's.

Block codes (``--weight-dtype gguf-codes``; :meth:`QuantTensor.for_block_codes`, the same three
formats): the expansion layout's panels in a blob of their own version, computed by
``csrc/gemm_codes.cpp``, whose header defines its reference: the bfloat16 activations' dot
products with each block's integer codes (vdpbf16ps's chain over the block), times the block's
scale, one float32 chain over the blocks per output element (Q4_1 adds its offset times the
block's activation sum). The activations stay bfloat16 as in the dense model; the scale is
applied once per block, not rounded into every weight, so the bits differ from the dense
model's, by the dense model's order (``benchmarks/bench_int8_error.py`` measures it). Its
embedding rows expand to the dense model's.

Per-output-channel int8 (``--weight-dtype int8``, any source): ``q = round(w / s)`` with
``s = max |w[n]| / 127`` per output row; the model it is exact to is the dense bfloat16 model
with weights ``bf16(q * s)`` (:meth:`QuantTensor.dequantize`), and its error against the
float32 model is measured by ``benchmarks/bench_int8_error.py``.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from radixserve.kernels.operands import PackedWeight

if TYPE_CHECKING:
    from radixserve.kernels.library import Kernels

#: GGUF types the kernels compute in their blocks (GGML's type numbers are the format ids).
GGUF_FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
#: GGUF types the integer-dot kernels compute (csrc/gemm_q8dot.cpp); others keep the expansion.
INT_DOT_FORMATS = ("Q8_0", "Q4_0", "Q4_1")
#: GGUF types the block-codes kernels compute (csrc/gemm_codes.cpp); others keep the expansion.
CODES_FORMATS = INT_DOT_FORMATS
#: How a QuantTensor is computed: expanded to the dense model's bfloat16 weights, with integer
#: dot products on 8-bit activations, or on its codes with the scale per block.
EXPAND, INT_DOT, CODES = "expand", "q8", "codes"
COMPUTES = (EXPAND, INT_DOT, CODES)
INT8 = "int8"
_FORMAT_IDS = {**GGUF_FORMATS, INT8: 100}

# "RSQW" and the layout version by computation (csrc/quant.h reads the same header): 1 expands
# to bfloat16, 2 is the integer-dot layout, 3 the expansion's panels computed on their codes.
_MAGIC = 0x57515352
_VERSIONS = {EXPAND: 1, INT_DOT: 2, CODES: 3}
_HEADER, _ENTRY, _ALIGN = 64, 32, 64


@dataclass(frozen=True)
class QuantSegment:
    """Rows of one format: ``qtype`` a GGUF type name (``rows``: its raw blocks, uint8
    ``[n, bytes per row]``, typically a read-only map of the file) or ``int8`` (``rows``:
    int8 codes ``[n, K]``, ``scales`` float32 ``[n]``). ``order``: the row order the weight
    has (row i is ``rows[order[i]]``; None: as stored), applied when the rows are read, so
    a reordered map is not copied while the model waits to be packed."""

    qtype: str
    rows: np.ndarray
    scales: np.ndarray | None = None
    order: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(self.rows.shape[0])

    def ordered(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(rows, scales) in the weight's row order."""
        if self.order is None:
            return self.rows, self.scales
        return self.rows[self.order], None if self.scales is None else self.scales[self.order]


class QuantTensor:
    """An ``[N, K]`` linear weight kept quantized: one or more row segments, each in one format
    (a fused q/k/v of Gemma 3 has its q and k in Q5_0 and v in Q8_0). It stands in a state dict
    where a dense weight would; :meth:`dequantize` gives the dense float32 values."""

    def __init__(self, segments: Sequence[QuantSegment], k: int, compute: str = EXPAND):
        if not segments:
            raise ValueError("a QuantTensor needs at least one segment")
        for s in segments:
            if s.qtype not in _FORMAT_IDS:
                raise ValueError(f"format {s.qtype!r} is not computed quantized (have {sorted(_FORMAT_IDS)})")
        if compute not in COMPUTES:
            raise ValueError(f"compute must be one of {COMPUTES}, got {compute!r}")
        self.segments = tuple(segments)
        self.k = int(k)
        if compute == INT_DOT and not self.int_dot_capable:
            raise ValueError(f"integer dot products compute {INT_DOT_FORMATS}, not {'+'.join(self.formats)}")
        if compute == CODES and not self.codes_capable:
            raise ValueError(f"block codes compute {CODES_FORMATS}, not {'+'.join(self.formats)}")
        #: how the kernels compute it (:data:`COMPUTES`)
        self.compute = compute

    @property
    def int_dot(self) -> bool:
        """Computed with integer dot products (csrc/gemm_q8dot.cpp)."""
        return self.compute == INT_DOT

    @property
    def int_dot_capable(self) -> bool:
        """Whether every segment is a format the integer-dot kernels compute (K whole 32-blocks)."""
        return all(s.qtype in INT_DOT_FORMATS for s in self.segments) and self.k % 32 == 0

    @property
    def codes_capable(self) -> bool:
        """Whether every segment is a format the block-codes kernels compute (K whole 32-blocks)."""
        return all(s.qtype in CODES_FORMATS for s in self.segments) and self.k % 32 == 0

    def for_integer_dot(self) -> "QuantTensor":
        """The same blocks, computed with integer dot products (ValueError for other formats)."""
        return QuantTensor(self.segments, self.k, INT_DOT)

    def for_block_codes(self) -> "QuantTensor":
        """The same blocks, computed on their codes with the scale per block (ValueError for others)."""
        return QuantTensor(self.segments, self.k, CODES)

    @property
    def labels(self) -> tuple[str, ...]:
        """:attr:`formats`, each marked ``/q8`` or ``/codes`` when not expanded (what a cache
        fingerprint must tell apart: they give different bits)."""
        return tuple(f if self.compute == EXPAND else f"{f}/{self.compute}" for f in self.formats)

    @classmethod
    def from_gguf(cls, qtype: str, raw: np.ndarray, shape: tuple[int, int]) -> "QuantTensor":
        """A GGUF tensor's raw blocks (uint8 ``[N, bytes per row]``) of torch-order ``shape``."""
        n, k = shape
        return cls([QuantSegment(qtype, np.asarray(raw, dtype=np.uint8).reshape(n, -1))], k)

    @classmethod
    def int8_channels(cls, w: torch.Tensor) -> "QuantTensor":
        """Per-output-channel int8 of a dense weight ``w [N, K]``: ``s = max |w[n]| / 127``
        (1 for an all-zero row), ``q = round(w / s)`` in float32."""
        w32 = w.detach().to(torch.float32)
        s = w32.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(w32 / s[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls([QuantSegment(INT8, q.numpy().copy(), s.numpy().astype(np.float32).copy())], w.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(s.n for s in self.segments), self.k)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.qtype for s in self.segments))

    @property
    def nbytes(self) -> int:
        return sum(s.rows.nbytes + (0 if s.scales is None else s.scales.nbytes) for s in self.segments)

    def permute_rows(self, order: np.ndarray) -> "QuantTensor":
        """The same weight with its rows reordered: row i of the result is row ``order[i]``."""
        order = np.asarray(order, dtype=np.int64)
        if sorted(order.tolist()) != list(range(self.shape[0])):
            raise ValueError("order must be a permutation of the rows")
        if len(self.segments) != 1:
            raise ValueError("permute_rows needs a single-segment QuantTensor")
        s = self.segments[0]
        composed = order if s.order is None else s.order[order]
        return QuantTensor([QuantSegment(s.qtype, s.rows, s.scales, composed)], self.k, self.compute)

    @staticmethod
    def cat(parts: Sequence["QuantTensor"]) -> "QuantTensor":
        """Rows of ``parts`` one after another (a fused projection)."""
        if len({p.k for p in parts}) != 1:
            raise ValueError("QuantTensor.cat needs the same K in every part")
        computes = {p.compute for p in parts}
        return QuantTensor([s for p in parts for s in p.segments], parts[0].k,
                           computes.pop() if len(computes) == 1 else EXPAND)

    def dequantize(self) -> torch.Tensor:
        """The dense float32 weight: gguf-py's dequantization of each segment (int8: q * s)."""
        import gguf

        out = []
        for s in self.segments:
            rows, scales = s.ordered()
            if s.qtype == INT8:
                out.append(torch.from_numpy(rows.astype(np.float32)) * torch.from_numpy(scales)[:, None])
            else:
                arr = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[s.qtype])
                out.append(torch.from_numpy(np.asarray(arr, dtype=np.float32).reshape(s.n, self.k).copy()))
        return torch.cat(out) if len(out) > 1 else out[0]

    def __repr__(self) -> str:
        return f"QuantTensor({list(self.shape)}, {'+'.join(self.labels)})"


def blob_layout(kernels: "Kernels", qt: QuantTensor) -> tuple[int, list[int]]:
    """(total bytes, byte offset of each segment's panels) of ``qt``'s packed form."""
    off = _HEADER + _ENTRY * len(qt.segments)
    offsets = []
    panel_bytes = kernels.q8dot_panel_bytes if qt.int_dot else kernels.quant_panel_bytes
    for s in qt.segments:
        off = (off + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets.append(off)
        off += (s.n + 15) // 16 * int(panel_bytes(_FORMAT_IDS[s.qtype], qt.k))
    return (off + _ALIGN - 1) // _ALIGN * _ALIGN, offsets


def blob_nbytes(kernels: "Kernels", qt: QuantTensor) -> int:
    return blob_layout(kernels, qt)[0]


def pack_quant_tensor(kernels: "Kernels", qt: QuantTensor, dot: bool, out: torch.Tensor | None = None) -> PackedWeight:
    """``qt`` repacked into the kernels' panels (into ``out``, uint8 of :func:`blob_nbytes`,
    when given): a :class:`PackedWeight` whose ``packed_linear`` runs bfloat16 dot products
    (``dot``) or float32 chains on the expanded bfloat16 weights, or, for a weight marked
    :attr:`QuantTensor.int_dot` or block codes, its own arithmetic whatever ``dot`` says."""
    total, offsets = blob_layout(kernels, qt)
    if out is None:
        out = torch.empty((total,), dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != total or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {total} bytes")
    n, k = qt.shape
    header = bytearray(_HEADER + _ENTRY * len(qt.segments))
    struct.pack_into("<IIqqi", header, 0, _MAGIC, _VERSIONS[qt.compute], n, k, len(qt.segments))
    panel_bytes = kernels.q8dot_panel_bytes if qt.int_dot else kernels.quant_panel_bytes
    n0 = 0
    for i, (s, off) in enumerate(zip(qt.segments, offsets)):
        fmt = _FORMAT_IDS[s.qtype]
        struct.pack_into("<iiqqq", header, _HEADER + _ENTRY * i, fmt, 0, n0, s.n, off)
        panels = out[off: off + (s.n + 15) // 16 * int(panel_bytes(fmt, k))]
        rows, scales = s.ordered()
        if qt.int_dot:
            kernels.pack_q8dot_panels(_torch_view(rows), fmt, k, panels)
        elif qt.compute == CODES:
            kernels.pack_codes_panels(_torch_view(rows), fmt, k, panels)
        elif s.qtype == INT8:
            kernels.pack_int8_panels(_torch_view(rows), _torch_view(scales), panels)
        else:
            kernels.pack_quant_panels(_torch_view(rows), fmt, k, panels)
        n0 += s.n
    out[: len(header)] = torch.frombuffer(header, dtype=torch.uint8)
    return PackedWeight(out, n, k, dot)


def _torch_view(a: np.ndarray) -> torch.Tensor:
    """``a`` as a torch tensor for the packing ops, which only read it: without a copy where it
    is contiguous, a read-only map of the file included (a copy of each tensor's blocks would
    leave freed heap in the process's resident memory after load)."""
    if not a.flags.c_contiguous:
        a = np.array(a, copy=True, order="C")
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():  # torch warns that it cannot protect a read-only array
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)
