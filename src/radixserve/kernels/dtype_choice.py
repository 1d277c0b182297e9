"""``--dtype auto``: the serving dtype for the CPU at hand, decided by its features alone.

The rule reads the CPU's flags and the instruction-set cap, never a timing: a measurement
taken at startup can land on either side of a bar when the machine is busy, and then two
servers started with the same command on the same machine would compute in different dtypes
and give different answers. What the rule encodes was measured once per kind of CPU
(``benchmarks/bench_dtype_choice.py`` repeats it and prints the ratios):

* native bfloat16 arithmetic (AVX512-BF16): bfloat16. Its dot products run at twice the
  float32 FMA rate and a decode step reads half the weight bytes.
* AVX2, or AVX-512 without BF16: bfloat16. The same dot products emulated with float32 FMAs
  (the same bits) cost what float32 costs at prefill, and decode, which streams the weights
  from memory, reads half the bytes.
* the portable level (no vector kernels), or no C++ compiler: float32, the more exact model,
  since nothing there makes bfloat16 faster.

The choice and its reason are logged at startup and reported in ``/server_info``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixserve.kernels.isa import describe, effective_isa, native_bf16
from radixserve.kernels.builder import kernels_expected

log = logging.getLogger("radixserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_dtype(name: str, device: str = "cpu", cpu_isa: str = "auto") -> torch.dtype:
    """The serving dtype for ``--dtype name`` on this machine."""
    return choose_dtype(name, device, cpu_isa).dtype


def choose_dtype(name: str, device: str = "cpu", cpu_isa: str = "auto") -> DtypeChoice:
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
    if isa == "generic" or not kernels_expected():
        return DtypeChoice(torch.float32, f"float32: no vector kernels at instruction-set level {isa} "
                                          f"(nothing makes bfloat16 faster) on {describe()}")
    if native_bf16(cpu_isa):
        return DtypeChoice(torch.bfloat16, "bfloat16: native bfloat16 dot products (twice the float32 FMA "
                                           f"rate, half the weight bytes; by CPU features) on {describe()}")
    return DtypeChoice(torch.bfloat16, "bfloat16: half the weight bytes a decode step reads; dot products "
                                       f"emulated with float32 FMAs at level {isa} (by CPU features) on "
                                       f"{describe()}")
