"""What this CPU can do, and the cap on what the kernels may use of it (no torch here).

The C++ kernels are built for the host CPU (``-march=native``) and hold one code path per
instruction-set level the host has: portable C++ (``generic``), AVX2 + FMA (``avx2``),
AVX-512 (``avx512``, with its bf16 dot products where the CPU has AVX512-BF16), and AMX
(``amx``: prefill rows through the AMX-BF16 tiles, where the CPU, Linux and a startup probe of
the tiles' bits allow; ``kernels.library.Kernels.amx_status``). A cap —
``EngineConfig.cpu_isa`` or, when that is ``auto``, the environment variable
``RADIXSERVE_CPU_ISA`` — limits the level they use, so an AVX-512 machine also runs (and its
tests cover) the paths an AVX2-only or a non-x86 CPU runs. A path the CPU lacks is never
run: the cap only lowers the level.

The environment variable caps the whole process, not only the paths our kernels pick: the
kernels are then built for a CPU of the capped level (``kernels.builder.kernel_cflags``), and
:func:`cap_libraries` (called by ``import radixserve``) caps the libraries torch computes
with — ATen's vectorised kernels, oneDNN, MKL — at the same level, so a capped process's
GEMMs (float32, and bfloat16 without native bf16 arithmetic) run the way they do on such a
CPU. Those libraries read their settings once, at their first use; a process that runs torch
ops before it imports radixserve keeps the host's level there. The same cap feeds the
``auto`` choices of ``--dtype`` and ``--weight-dtype`` (``dtype_choice``, ``weight_choice``).
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

from radixserve.config import CPU_ISAS, ISA_ENV, check_isa_name

# Instruction-set levels, lowest first.
ISAS = CPU_ISAS[1:]

# /proc/cpuinfo flags each level needs (what the kernels' compile-time checks test).
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_LEVEL_FLAGS = {"avx2": ("avx2", "fma"), "avx512": _AVX512_FLAGS,
                # the tiles take prefill rows; decode rows keep AVX512-BF16's dot products
                "amx": (*_AVX512_FLAGS, "avx512_bf16", "amx_tile", "amx_bf16")}
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of ``keys`` (None: no such
    line, or no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(keys)), None)
    except OSError:
        return None


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """Feature flags of this CPU as Linux reports them (empty where /proc/cpuinfo is absent)."""
    return frozenset((_cpuinfo("flags", "Features") or "").split())


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (what benchmark tables print beside their figures)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def silicon_isa() -> str:
    """The highest level this CPU has, by its flags, whatever the caps."""
    flags = cpu_flags()
    best = "generic"
    for level in ISAS[1:]:
        if _x86() and all(f in flags for f in _LEVEL_FLAGS[level]):
            best = level
    return best


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


@lru_cache(maxsize=1)
def host_isa() -> str:
    """The highest level this process runs at: the CPU's, lowered by ``$RADIXSERVE_CPU_ISA``
    as it was at the first call (``import radixserve`` makes it). That cap is the process's
    for good, because what it decided cannot change later: which binary the kernels were
    built as and the level torch's libraries took at their first use. Later changes of the
    variable, and ``EngineConfig.cpu_isa``, only lower the level further (:func:`isa_cap`).
    An invalid value caps nothing here; ``EngineConfig`` reports it, naming the variable."""
    best = silicon_isa()
    try:
        cap = check_isa_name(os.environ.get(ISA_ENV, "") or "auto", ISA_ENV)
    except ValueError:
        return best
    return cap if cap != "auto" and ISAS.index(cap) < ISAS.index(best) else best


def process_capped() -> bool:
    """Whether ``$RADIXSERVE_CPU_ISA`` made this process run below its CPU's level."""
    return ISAS.index(host_isa()) < ISAS.index(silicon_isa())


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


# The settings of torch's libraries that cap them at each level below the top one.
LIBRARY_CAPS = {
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def cap_libraries(environ: "os._Environ[str] | dict[str, str] | None" = None) -> dict[str, str]:
    """Cap torch's libraries at this process's level where ``$RADIXSERVE_CPU_ISA`` lowered it
    below an x86 CPU's (:func:`host_isa`): sets the ``LIBRARY_CAPS`` variables the user has
    not set, and returns those it set."""
    env = os.environ if environ is None else environ
    if not (_x86() and process_capped()):
        return {}
    applied = {k: v for k, v in LIBRARY_CAPS[host_isa()].items() if k not in env}
    env.update(applied)
    return applied


def native_bf16(value: str = "auto") -> bool:
    """Whether the CPU computes bfloat16 products natively under the cap (AVX512-BF16 or
    AMX-BF16, features of the ``avx512`` level and above)."""
    return (ISAS.index(effective_isa(value)) >= ISAS.index("avx512")
            and any(f in cpu_flags() for f in _NATIVE_BF16_FLAGS))


def describe() -> str:
    """One line for logs and benchmark tables: model, the flags that decide the paths."""
    flags = cpu_flags()
    shown = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                         "avx512_vnni", "amx_bf16", "amx_tile", "avx_ne_convert") if f in flags]
    line = f"{cpu_model()} ({os.cpu_count()} CPUs; {' '.join(shown) or 'no x86 SIMD flags'})"
    return line + (f", capped at {host_isa()} by {ISA_ENV}" if process_capped() else "")
