"""``--dtype auto``: the serving dtype chosen for the CPU at hand, by measurement, with the reason.

bfloat16 halves the bytes of weights and KV, but how it computes depends on the CPU: with
native bfloat16 arithmetic (AVX512-BF16, AMX-BF16) oneDNN multiplies it directly; without,
the linears run the kernels' packed GEMM in float32 on bfloat16 weights (half the weight
bytes a decode step reads, the same arithmetic as float32 otherwise). Either way bfloat16
is chosen only when a short measurement on this machine, of the model's gate/up projection,
finds it clearly faster at a decode row count (weights streaming from memory, as in a real
decode step) and not clearly slower at a prefill row count (:func:`decide`); float32 is the
more exact model, so a tie at decode goes to it. Each comparison is the median of
interleaved float32/bfloat16 pairs, so a noisy neighbour slows both sides of a pair alike. The decision and its reason (with the
ratios) are logged at startup and reported in the engine's stats (``/server_info``).
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
# bfloat16 is chosen when it is clearly faster where it can gain (decode, whose steps stream
# the weights from memory: half the bytes) and not clearly slower where it cannot (prefill,
# compute-bound): a tie at decode is not worth the precision. The prefill bar leaves room for
# the widening pass of bf16 weights computed in float32 (a few percent at 512 rows, by design)
# plus the noise of a short measurement on a shared machine: a bar inside that band makes the
# same machine pick float32 on one start and bfloat16 on the next, and decode speed halve.
_MIN_DECODE_SPEEDUP = 1.2
_MIN_PREFILL_RATIO = 0.90
# Float32 bytes of distinct weights a decode measurement streams: more than any last-level
# cache, so that bfloat16 is not flattered by fitting where float32 does not.
_DECODE_BYTES = 128 << 20
_REPS = 7


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


class _Contender:
    """One dtype's linears of one shape, packed as the model would run them."""

    def __init__(self, dtype: torch.dtype, rows: int, in_f: int, out_f: int, cpu_isa: str, copies: int):
        gen = torch.Generator().manual_seed(0)
        self.linears = make_linears("auto", torch.device("cpu"), dtype, cpu_isa)
        w = (torch.randn(out_f, in_f, generator=gen) * 0.02).to(dtype)
        self.weights = [self.linears.pack(w) for _ in range(copies)]  # same values, distinct memory
        self.x = torch.randn(rows, in_f, generator=gen).to(self.linears.act_dtype)
        self.run()  # warm

    def run(self) -> float:
        t0 = time.perf_counter()
        for w in self.weights:
            self.linears(self.x, w)
        return time.perf_counter() - t0


def _ratio(rows: int, in_f: int, out_f: int, cpu_isa: str, copies: int) -> float:
    """float32 time / bfloat16 time: the median over interleaved pairs of runs, so that a
    noisy neighbour slows both sides of a pair alike."""
    f32 = _Contender(torch.float32, rows, in_f, out_f, cpu_isa, copies)
    bf16 = _Contender(torch.bfloat16, rows, in_f, out_f, cpu_isa, copies)
    ratios = sorted(f32.run() / max(bf16.run(), 1e-12) for _ in range(_REPS))
    return ratios[len(ratios) // 2]


def resolve_dtype(name: str, device: str = "cpu", cpu_isa: str = "auto") -> torch.dtype:
    """The serving dtype for ``--dtype name`` on this machine."""
    return choose_dtype(name, device, cpu_isa).dtype


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
    copies = max(1, _DECODE_BYTES // (4 * hidden * 2 * inter))
    decode = _ratio(4, hidden, 2 * inter, cpu_isa, copies)
    prefill = _ratio(512, hidden, 2 * inter, cpu_isa, 1)
    how = "native bfloat16 dot products" if native else "bfloat16 weights, float32 compute"
    measured = (f"{how}; gate/up [{hidden} -> {2 * inter}], bfloat16 vs float32: {decode:.2f}x at 4 rows "
                f"from memory, {prefill:.2f}x at 512 rows")
    return decide(decode, prefill, measured)


def decide(decode: float, prefill: float, measured: str) -> DtypeChoice:
    """The rule on measured float32/bfloat16 time ratios (``decode`` at a decode row count,
    ``prefill`` at a prefill one); the reason names the bar that decided."""
    if decode < _MIN_DECODE_SPEEDUP:
        return DtypeChoice(torch.float32, f"float32: bfloat16 not clearly faster at decode "
                                          f"(< {_MIN_DECODE_SPEEDUP}x; {measured})")
    if prefill < _MIN_PREFILL_RATIO:
        return DtypeChoice(torch.float32, f"float32: bfloat16 faster at decode but slower at prefill "
                                          f"(< {_MIN_PREFILL_RATIO}x; {measured})")
    return DtypeChoice(torch.bfloat16, f"bfloat16: faster at decode, not slower at prefill ({measured})")
