"""What this CPU can do, and the cap on what the kernels may use of it (no torch here).

The C++ kernels are built for the host CPU (``-march=native``) and hold one code path per
instruction-set level the host has: portable C++ (``generic``), AVX2 + FMA (``avx2``),
AVX-512 (``avx512``, with its bf16 dot products where the CPU has AVX512-BF16). A cap —
``EngineConfig.cpu_isa`` or, when that is ``auto``, the environment variable
``RADIXSERVE_CPU_ISA`` — limits the level they use, so an AVX-512 machine also runs (and its
tests cover) the paths an AVX2-only or a non-x86 CPU runs. A path the CPU lacks is never
run: the cap only lowers the level.

The same cap decides the float32-versus-bfloat16 default (``--dtype auto``): bfloat16 only
where the CPU computes it natively (AVX512-BF16 or AMX-BF16) under the cap.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

ISA_ENV = "RADIXSERVE_CPU_ISA"
# Instruction-set levels, lowest first.
ISAS = ("generic", "avx2", "avx512")

# /proc/cpuinfo flags each level needs (what the kernels' compile-time checks test).
_LEVEL_FLAGS = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
}
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """Feature flags of this CPU as Linux reports them (empty where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (what benchmark tables print beside their figures)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_isa() -> str:
    """The highest level this CPU has."""
    flags = cpu_flags()
    best = "generic"
    for level in ISAS[1:]:
        if platform.machine() in ("x86_64", "AMD64") and all(f in flags for f in _LEVEL_FLAGS[level]):
            best = level
    return best


def check_isa_name(value: str, where: str) -> str:
    """``value`` lower-cased if it names a level (or ``auto``), else ValueError naming ``where``."""
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in ("auto", *ISAS):
        raise ValueError(f"{where} must be one of {('auto', *ISAS)}, got {value!r}")
    return v


def isa_cap(value: str = "auto") -> str:
    """The cap in force: ``value`` unless it is ``auto``, then ``$RADIXSERVE_CPU_ISA``, then
    no cap (the highest level). ValueError naming the setting for an unknown level."""
    v = check_isa_name(value, "cpu_isa")
    if v == "auto":
        v = check_isa_name(os.environ.get(ISA_ENV, "") or "auto", ISA_ENV)
    return ISAS[-1] if v == "auto" else v


def effective_isa(value: str = "auto") -> str:
    """The level the kernels run at: the lower of the cap and what the CPU has."""
    cap, host = isa_cap(value), host_isa()
    return cap if ISAS.index(cap) < ISAS.index(host) else host


def isa_allows(cap: str, isa: str) -> bool:
    """Whether code for level ``isa`` may run under ``cap``."""
    return ISAS.index(isa) <= ISAS.index(isa_cap(cap))


def native_bf16(value: str = "auto") -> bool:
    """Whether the CPU computes bfloat16 products natively under the cap (AVX512-BF16 or
    AMX-BF16, both AVX-512-level features)."""
    return effective_isa(value) == "avx512" and any(f in cpu_flags() for f in _NATIVE_BF16_FLAGS)


def describe() -> str:
    """One line for logs and benchmark tables: model, the flags that decide the paths."""
    flags = cpu_flags()
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                         "avx512_vnni", "amx_bf16", "amx_tile", "avx_ne_convert") if f in flags]
    return f"{cpu_model()} ({os.cpu_count()} CPUs; {' '.join(shown) or 'no x86 SIMD flags'})"
