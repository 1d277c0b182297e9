"""Which CPU code paths a test may run here: every path is a parameter of the tests that
cover it, and a path this CPU lacks (or that ``RADIXSERVE_CPU_ISA`` caps away) is skipped with
the reason — never failed, never silently dropped.

Paths are attention implementations (``kernels.IMPL_*``) and instruction-set levels
(``radixserve.kernels.isa.ISAS``): an AVX-512 machine runs all of them, an AVX2 machine the AVX2 and
portable ones, and ``RADIXSERVE_CPU_ISA=generic`` makes any machine run only the portable ones.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.isa import ISAS, host_isa, isa_allows, isa_cap, silicon_isa
from radixserve.kernels import builder
from radixserve.kernels import library as kernels

# Every attention implementation, and the ones that compute the float32 mode (bitwise equal
# to the portable path).
ALL_IMPLS = (kernels.IMPL_GENERIC, kernels.IMPL_AVX2, kernels.IMPL_F32, kernels.IMPL_BF16)
FLOAT32_MODE_IMPLS = (kernels.IMPL_GENERIC, kernels.IMPL_AVX2, kernels.IMPL_F32)


def impl_id(impl: int) -> str:
    return kernels.IMPL_ISA[impl] + ("-bf16" if impl == kernels.IMPL_BF16 else "")


def require_kernels() -> kernels.Kernels:
    if not builder.kernels_expected():
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    return kernels.load_kernels()


def require_impl(impl: int, kv_dtype: torch.dtype, head_dim: int) -> None:
    """Skip unless implementation ``impl`` exists here for this pool dtype and head size
    and the instruction-set cap allows it."""
    k = require_kernels()
    isa = kernels.IMPL_ISA[impl]
    if not isa_allows("auto", isa):
        pytest.skip(f"{kernels.IMPL_NAMES[impl]}: capped by RADIXSERVE_CPU_ISA={isa_cap()}")
    if ISAS.index(isa) > ISAS.index(host_isa()):
        pytest.skip(f"{kernels.IMPL_NAMES[impl]}: this CPU lacks {isa} (it has {host_isa()})")
    if not k.impl_available(impl, kv_dtype, head_dim):
        pytest.skip(f"{kernels.IMPL_NAMES[impl]} has no path for a {kv_dtype} pool with "
                    f"head_dim {head_dim} (this CPU has {isa})")


def dot_paths(k: kernels.Kernels) -> dict[str, kernels.Kernels]:
    """Every way this machine can run the bfloat16 dot products: each instruction-set level it
    has (emulated), and where the build has the native instruction: it, the AMX tile kernels on
    their software model, and on an AMX CPU whose tiles passed the probe, the tiles."""
    top = ISAS.index(host_isa())
    out = {f"{isa}-emulated": k.without_native_dot().capped(isa) for isa in ISAS[: min(top, ISAS.index("avx512")) + 1]}
    if k.native_dot and top >= ISAS.index("avx512"):
        out["avx512-native"] = k.capped("avx512")
        out["avx512-tile-model"] = k.with_tile_model().capped("avx512")
        if top >= ISAS.index("amx") and "amx" in k.available_isas():
            out["amx-tiles"] = k.capped("amx")
    return out


def require_isa(isa: str) -> None:
    """Skip unless this CPU has instruction-set level ``isa`` and the cap allows it."""
    if ISAS.index(isa) > ISAS.index(silicon_isa()):
        pytest.skip(f"this CPU lacks {isa} (it has {silicon_isa()})")
    if ISAS.index(isa) > ISAS.index(host_isa()):
        pytest.skip(f"{isa}: this process is capped at {host_isa()} by RADIXSERVE_CPU_ISA")
    if not isa_allows("auto", isa):
        pytest.skip(f"{isa}: capped by RADIXSERVE_CPU_ISA={isa_cap()}")
