"""How a KV pool stores one head's K or V row: the storage kinds and the int8 / fp8 codes.

A quantized row is ``head_dim`` one-byte codes followed by the row's float32 scale (4 bytes):
one scale per token, KV head and K-or-V, written with the codes. Inside the slot's row, the
scale goes wherever slots go without anyone knowing (the radix tree, eviction, the HiCache L2
copy of whole slot rows, the L3 objects), so a cached prefix is bit for bit the KV that was
written. No calibration: the scale is the row's own absolute maximum over the largest code,
so no value is clipped.

The arithmetic is fixed (the CPU kernels in ``kernels/csrc`` repeat it exactly):

* ``scale = max_d |x_d| / QMAX`` in float32 (1.0 when that is 0: an all-zero row);
* int8: ``code = clamp(round_half_even(x / scale), -127, 127)``;
  fp8 e4m3: ``code = e4m3fn(clamp(x / scale, -448, 448))`` (round to nearest even);
* dequantized value ``= float(code) * scale`` (one float32 rounding).
"""

from __future__ import annotations

import torch

__all__ = ["KV_DTYPES", "QUANTIZED", "SCALE_BYTES", "storage_dtype", "row_elems", "is_quantized",
           "quantize", "dequantize", "kv_dtype_name", "parse_kv_dtype"]

#: Every KV storage kind, by its config name.
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")
#: The quantized kinds and the largest code magnitude of each.
QUANTIZED = {"int8": 127.0, "fp8_e4m3": 448.0}
SCALE_BYTES = 4

def parse_kv_dtype(kv_dtype: str | torch.dtype) -> str:
    """The name of a KV storage kind: a quantized kind, or a torch floating dtype (the
    configurable ones are float32 and bfloat16; others, e.g. float16, serve the eager path)."""
    if isinstance(kv_dtype, torch.dtype):
        if not kv_dtype.is_floating_point or kv_dtype.itemsize < 2:
            raise ValueError(f"kv dtype must be a float dtype or one of {KV_DTYPES}, got {kv_dtype}")
        return kv_dtype_name(kv_dtype)
    if kv_dtype in KV_DTYPES:
        return kv_dtype
    dt = getattr(torch, kv_dtype, None) if isinstance(kv_dtype, str) else None
    if isinstance(dt, torch.dtype) and dt.is_floating_point and dt.itemsize >= 2:
        return kv_dtype
    raise ValueError(f"kv dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in QUANTIZED


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """The element dtype of the pool tensor: the float dtype itself, or raw bytes."""
    return torch.uint8 if is_quantized(kv_dtype) else getattr(torch, kv_dtype)


def row_elems(kv_dtype: str, head_dim: int) -> int:
    """Elements of one head's row in the pool tensor (codes + the scale's bytes if quantized)."""
    return head_dim + SCALE_BYTES if is_quantized(kv_dtype) else head_dim


def kv_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Rows ``[..., D]`` (any float dtype) as stored rows ``[..., D + 4]`` uint8."""
    qmax = QUANTIZED[kv_dtype]
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / torch.full_like(amax, qmax)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / scale
    if kv_dtype == "int8":
        codes = torch.round(y).clamp_(-127.0, 127.0).to(torch.int8).view(torch.uint8)
    else:
        codes = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat((codes, scale.contiguous().view(torch.uint8)), dim=-1)


def dequantize(rows: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Stored rows ``[..., D + 4]`` uint8 as float32 ``[..., D]``."""
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d].contiguous()
    # A fresh tensor (offset 0) so that the bytes can be viewed as float32.
    scale = rows[..., d:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    vals = codes.view(torch.int8) if kv_dtype == "int8" else codes.view(torch.float8_e4m3fn)
    return vals.float() * scale
