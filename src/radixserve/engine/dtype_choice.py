"""``--dtype auto``: the serving dtype chosen for the CPU at hand, by measurement, with the reason.

bfloat16 halves the bytes of weights and KV, but how it computes depends on the CPU: with
native bfloat16 arithmetic (AVX512-BF16, AMX-BF16) oneDNN multiplies it directly; without,
the linears run the kernels' packed GEMM in float32 on bfloat16 weights (half the weight
bytes a decode step reads, the same arithmetic as float32 otherwise). Either way bfloat16
is chosen only when a short measurement on this machine, of the model's gate/up projection
at a decode row count (weights streaming from memory, as in a real decode step) and at a
prefill row count, finds it faster at both than float32 — float32 is the more exact model,
so a tie goes to it. The decision and its reason (with the times) are logged at startup and
reported in the engine's stats (``/server_info``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixserve.cpu import describe, effective_isa, native_bf16
from radixserve.model.kernels import kernels_expected
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
                    copies: int, reps: int = 3) -> float:
    """Best time of ``copies`` linears of these shapes (distinct weights, so that together
    they stream from memory when there are many) through the path the model would use."""
    gen = torch.Generator().manual_seed(0)
    linears = make_linears("auto", torch.device("cpu"), dtype, cpu_isa)
    weights = [linears.pack((torch.randn(out_f, in_f, generator=gen) * 0.02).to(dtype)) for _ in range(copies)]
    x = torch.randn(rows, in_f, generator=gen).to(linears.act_dtype)

    def run() -> None:
        for w in weights:
            linears(x, w)

    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
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
    native = native_bf16(cpu_isa)
    if not native and (isa == "generic" or not kernels_expected()):
        return DtypeChoice(torch.float32, f"float32: no native bfloat16 arithmetic (AVX512-BF16 / AMX-BF16) and no "
                                          f"packed float32-compute GEMM at instruction-set level {isa} on {describe()}")
    # The model's own shape when it is known, else a mid-size one (the choice is made before
    # the weights are loaded in their dtype).
    hidden = model_config.hidden_size if model_config else 1024
    inter = model_config.intermediate_size if model_config else 2 * hidden
    key = (isa, native, hidden, inter)
    if key not in _MEASURED:  # once per process: engines built one after another agree
        _MEASURED[key] = _measure(hidden, inter, cpu_isa, native)
    return _MEASURED[key]


_MEASURED: dict[tuple[str, bool, int, int], DtypeChoice] = {}


def _measure(hidden: int, inter: int, cpu_isa: str, native: bool) -> DtypeChoice:
    # Decode: enough distinct weights (~64 MB of float32) to stream from memory; prefill: 512 rows.
    copies = max(1, (64 << 20) // (4 * hidden * 2 * inter))
    times: dict[tuple[torch.dtype, int], float] = {}
    for dt in (torch.float32, torch.bfloat16):
        times[(dt, 4)] = _linear_seconds(dt, 4, hidden, 2 * inter, cpu_isa, copies) / copies
        times[(dt, 512)] = _linear_seconds(dt, 512, hidden, 2 * inter, cpu_isa, 1)
    decode = times[(torch.float32, 4)] / max(times[(torch.bfloat16, 4)], 1e-12)
    prefill = times[(torch.float32, 512)] / max(times[(torch.bfloat16, 512)], 1e-12)
    how = "native bfloat16 dot products" if native else "bfloat16 weights, float32 compute"
    measured = (f"{how}; gate/up [{hidden} -> {2 * inter}], bfloat16 vs float32: {decode:.2f}x at 4 rows "
                f"from memory, {prefill:.2f}x at 512 rows")
    if decode >= _MIN_SPEEDUP and prefill >= _MIN_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"bfloat16: faster at both ({measured})")
    return DtypeChoice(torch.float32, f"float32: bfloat16 not faster at both ({measured})")
