"""``--dtype auto``: the serving dtype chosen for the CPU at hand, with the reason.

bfloat16 halves the bytes of weights and KV, but only pays where the CPU multiplies it
natively (AVX512-BF16 or AMX-BF16): elsewhere every bfloat16 matmul is converted to float32
in software and runs several times slower than float32 itself. So ``auto`` is float32 unless
the CPU (under the ``cpu_isa`` cap) has native bfloat16, and even then bfloat16 only when a
short measurement of the model's own linear shapes, at a decode and at a prefill row count,
shows it faster. The decision and its reason are logged at startup and reported in the
engine's stats (``/server_info``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixserve.cpu import describe, effective_isa, native_bf16
from radixserve.model.config import ModelConfig
from radixserve.model.linear import make_linears

log = logging.getLogger("radixserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# bfloat16 must beat float32 by this factor to be chosen (a tie is not worth the precision).
_MIN_SPEEDUP = 1.1


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _linear_seconds(dtype: torch.dtype, rows: int, in_f: int, out_f: int, cpu_isa: str,
                    reps: int = 3) -> float:
    """Best time of one linear of these shapes, through the path the model would use."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(out_f, in_f, generator=gen) * 0.02).to(dtype)
    linears = make_linears("auto", torch.device("cpu"), dtype, cpu_isa)
    x = torch.randn(rows, in_f, generator=gen).to(linears.act_dtype)
    packed = linears.pack(w)
    linears(x, packed)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        linears(x, packed)
        best = min(best, time.perf_counter() - t0)
    return best


def choose_dtype(name: str, device: str = "cpu", cpu_isa: str = "auto",
                 model_config: ModelConfig | None = None) -> DtypeChoice:
    """The serving dtype for ``--dtype name`` (see the module docstring)."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {(*_DTYPES, 'auto')}, got {name!r}")
        return DtypeChoice(_DTYPES[name], f"--dtype {name}")
    dev = torch.device(device)
    if dev.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return DtypeChoice(torch.bfloat16 if ok else torch.float32,
                           "CUDA device with bfloat16 support" if ok else "CUDA device without bfloat16")
    if dev.type != "cpu":
        return DtypeChoice(torch.float32, f"device {dev.type}: float32")
    isa = effective_isa(cpu_isa)
    if not native_bf16(cpu_isa):
        return DtypeChoice(torch.float32, f"float32: no native bfloat16 arithmetic (AVX512-BF16 / AMX-BF16) at "
                                          f"instruction-set level {isa} on {describe()}")
    hidden = model_config.hidden_size if model_config else 2048
    inter = model_config.intermediate_size if model_config else 4 * hidden
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        times[dt] = sum(_linear_seconds(dt, rows, hidden, 2 * inter, cpu_isa) for rows in (32, 512))
    speedup = times[torch.float32] / max(times[torch.bfloat16], 1e-12)
    measured = (f"gate/up linear [{hidden} -> {2 * inter}] at 32 + 512 rows: float32 "
                f"{times[torch.float32] * 1e3:.1f} ms, bfloat16 {times[torch.bfloat16] * 1e3:.1f} ms")
    if speedup >= _MIN_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"bfloat16: native on this CPU and {speedup:.2f}x faster ({measured})")
    return DtypeChoice(torch.float32, f"float32: bfloat16 is native here but only {speedup:.2f}x as fast "
                                      f"({measured})")
