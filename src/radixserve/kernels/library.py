"""The CPU kernels of ``kernels/csrc/`` (C++), built with torch's extension machinery.

What they are for: the attention over the paged KV pool (prefill, prefill over a cached
prefix, decode, and mixes of these in one batch, all reading K/V in place by slot) and the
row-wise ops between a layer's matmuls (RMSNorm with the residual add, RoPE, SiLU·mul, the
K/V store). See the header comments of the ``.cpp`` files for the arithmetic.

How they are built: ``torch.utils.cpp_extension.load`` (torch's compiler flags, headers and
OpenMP runtime; ``ninja`` drives the compiler), once per machine, into a private cache
folder (created with mode 0700, refused if another user owns it or others can write to it)
named by a hash of everything the binary depends on: the sources, the compiler and its
version, the flags, the torch version and the CPU's instruction set (the code is built for
the CPU it runs on). A second process, or a later run, loads the cached binary.

Concurrent and interrupted builds: torch guards a build folder with a ``lock`` file that it
creates and deletes, and waits forever while one exists, so a build killed halfway (Ctrl-C,
the OOM killer, a CI timeout) would hang every later start on that machine. :class:`BuildLock`
holds an ``flock`` on the folder for the whole build instead (the kernel drops it when its
process dies); holding it, any torch ``lock`` left in the folder is a dead builder's and is
removed before torch looks.

``python -m radixserve.kernels.library`` builds them ahead of time (images, CI).

Failure is loud, never silent: :func:`load_kernels` raises :class:`KernelBuildError` with the
compiler's output. :func:`try_load_kernels` is what the attention backend uses: on failure it
logs that output once as a warning and returns ``None`` (the backend then runs its eager
torch path); ``kernels_expected()`` tells a test whether a failure is acceptable (no
compiler here) or a bug.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from radixserve.kernels.isa import ISAS, effective_isa, host_isa, isa_allows, isa_cap, process_capped

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "attention.cpp", "attention_avx2.cpp", "attention_avx512.cpp", "layer_ops.cpp",
           "gemm.cpp", "gemm_dot.cpp", "gemm_quant.cpp", "gemm_q8dot.cpp")
HEADERS = ("common.h", "attention.h", "simd_avx2.h", "gemm_dot.h", "quant.h")
# -ffp-contract=off: a * b + c stays two roundings unless the code asks for a fused
# multiply-add, so the vectorised and portable paths (and the eager RoPE) agree bit for bit.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
# The instruction set a process capped by $RADIXSERVE_CPU_ISA builds for, in place of the
# host's: what an AVX2-only (x86-64-v3: AVX2, FMA, F16C, BMI) or a pre-AVX2 x86 CPU compiles,
# so a capped process runs the binary such a machine builds — the AVX-512 paths are not in it
# at all, and the compiler's own vectorisation of the portable loops stays at that level too.
CAPPED_MARCH = {"avx2": "-march=x86-64-v3", "generic": "-march=x86-64"}


def kernel_cflags() -> tuple[str, ...]:
    """The compiler flags of this process's build: ``-march=native``, unless
    ``$RADIXSERVE_CPU_ISA`` caps the process below an x86 CPU's level
    (:func:`radixserve.kernels.isa.host_isa`); then the flags of a CPU at that level (``CAPPED_MARCH``).

    ``EngineConfig.cpu_isa`` does not change the build (one library per process): it picks
    among the paths the build has, at run time."""
    if process_capped() and platform.machine() in ("x86_64", "AMD64"):
        return tuple(CAPPED_MARCH[host_isa()] if f == "-march=native" else f for f in CFLAGS)
    return CFLAGS


# Attention implementations (the ``impl`` argument of the paged_attention op).
IMPL_AUTO, IMPL_GENERIC, IMPL_F32, IMPL_BF16, IMPL_AVX2 = 0, 1, 2, 3, 4
IMPL_NAMES = {IMPL_GENERIC: "portable float32", IMPL_AVX2: "AVX2 float32",
              IMPL_F32: "AVX-512 float32", IMPL_BF16: "AVX-512 bf16 dot products"}

# The instruction-set level each implementation needs (radixserve.kernels.isa names the levels; the
# cap there decides which ones run), and their preference order, fastest first.
#: The ``kv_kind`` argument of the kernels per quantized KV kind (float pools: 0).
KV_KINDS = {"int8": 1, "fp8_e4m3": 2}
#: The ``arith`` argument of the packed-linear operators (csrc/common.h).
ARITH_F32, ARITH_DOT, ARITH_DOT_EMULATED = 0, 1, 2
IMPL_ISA = {IMPL_GENERIC: "generic", IMPL_AVX2: "avx2", IMPL_F32: "avx512", IMPL_BF16: "avx512"}
_IMPL_ORDER = (IMPL_BF16, IMPL_F32, IMPL_AVX2, IMPL_GENERIC)


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded; the message carries the compiler output."""


def compiler() -> str | None:
    """The C++ compiler torch's extension builder would call (``$CXX``, else ``c++``)."""
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx)


def kernels_expected() -> bool:
    """Whether this machine should be able to build the kernels (a CPU build of torch, a
    C++ compiler). Where it is True, a build failure is a bug, not a missing tool."""
    return compiler() is not None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixserve" / "kernels"


def _cpu_isa() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    sig = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part", "cpu family", "model\t")):
                    sig.append(line.strip())
                if not line.strip():
                    break
    except OSError:
        sig.append(platform.processor())
    return "\n".join(sig)


def _compiler_version(cxx: str) -> str:
    try:
        proc = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
    return proc.stdout + proc.stderr


def build_key(sources: list[Path], cxx: str, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """Hash of everything the built binary depends on (see the module docstring), and of
    where the sources are: torch's build.ninja records their absolute paths, so two checkouts
    of the same sources sharing one build folder would rebuild it for each other in turn."""
    h = hashlib.sha256()
    for folder in sorted({str(src.resolve().parent) for src in sources}):
        h.update(folder.encode())
        h.update(b"\0")
    for part in (cxx, _compiler_version(cxx), " ".join(cflags), " ".join(ldflags),
                 torch.__version__, _cpu_isa()):
        h.update(part.encode())
        h.update(b"\0")
    for src in sources:
        h.update(src.name.encode())
        h.update(b"\0")
        h.update(src.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:20]


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) with mode 0700, or check an existing one.

    An existing folder must belong to this user and not be writable by anyone else: a
    shared-writable cache would let another user plant the library this process loads."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelBuildError(f"kernel cache {path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelBuildError(f"kernel cache {path} is writable by group/others "
                               f"(mode {oct(st.st_mode & 0o777)}); chmod 700 it")
    if st.st_mode & 0o077:  # readable by others: tighten what we own
        os.chmod(path, 0o700)
    return path


class BuildLock:
    """Exclusive right to build into one cache folder, held by an ``flock`` that dies with
    its process. Entering it clears torch's own ``lock`` file if a killed builder left one
    (see the module docstring): no live radixserve builder can hold that file while this
    lock is held."""

    LOCK_NAME = ".radixserve-build.lock"
    TORCH_BATON = "lock"

    def __init__(self, build_dir: Path) -> None:
        self.build_dir = build_dir
        self._fd: int | None = None

    def __enter__(self) -> BuildLock:
        fd = os.open(self.build_dir / self.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                log.info("waiting for another process building the kernels in %s", self.build_dir)
                fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        baton = self.build_dir / self.TORCH_BATON
        if baton.exists():
            log.warning("removing %s left by a kernel build that did not finish", baton)
            baton.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def build(name: str, sources: list[Path], headers: tuple[Path, ...] = (),
          cache_dir: Path | None = None, cflags: tuple[str, ...] | None = None,
          ldflags: tuple[str, ...] = LDFLAGS) -> Path:
    """Compile ``sources`` into ``<cache>/<name>_<key>/`` unless already built there, load
    the library into this process (registering its operators) and return its path.

    Raises KernelBuildError (with the compiler's output) when anything fails."""
    cxx = compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found ($CXX or c++)")
    cflags = kernel_cflags() if cflags is None else cflags
    from torch.utils import cpp_extension

    key = build_key([*sources, *headers], cxx, cflags, ldflags)
    root = private_dir(cache_dir or default_cache_dir())
    full = f"{name}_{key}"
    build_dir = private_dir(root / full)
    lib = build_dir / f"{full}.so"
    fresh = not lib.exists()
    global last_build_seconds
    last_build_seconds = None
    t0 = time.perf_counter()
    try:
        with BuildLock(build_dir):
            cpp_extension.load(
                name=full,
                sources=[str(s) for s in sources],
                extra_cflags=list(cflags),
                extra_ldflags=list(ldflags),
                extra_include_paths=[str(s.parent) for s in sources[:1]],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building {full} failed (compiler {cxx}):\n{e}") from e
    if fresh:
        last_build_seconds = time.perf_counter() - t0
        log.info("built %s in %.1f s (%s)", full, last_build_seconds, build_dir)
    return lib


# Seconds the last build() spent compiling (None when it found the library in the cache).
last_build_seconds: float | None = None


class PackedWeight(NamedTuple):
    """A linear weight packed for :meth:`Kernels.packed_linear`: ``data`` holds ``[N, K]`` in
    the panel layout of csrc/gemm.cpp (float32 chains over float32 rows), or, with ``dot``,
    of csrc/gemm_dot.cpp (bfloat16 dot products: the rows rounded to bfloat16). A uint8
    ``data`` is a quantized weight (csrc/quant.h, :mod:`radixserve.kernels.quant_weights`): its
    blocks expand to the bfloat16 weights of the dense model, computed with the same
    arithmetic (``dot``: the dot products; else the float32 chains)."""

    data: torch.Tensor
    n: int
    k: int
    dot: bool = False

    @property
    def quantized(self) -> bool:
        return self.data.dtype == torch.uint8


def _float32_rows(rows: int, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """One uninitialised float32 ``[rows, width]`` buffer per width."""
    return [torch.empty((rows, n), dtype=torch.float32) for n in widths]


@dataclass(frozen=True)
class LlamaLayerWeights:
    """Per-layer weights of :meth:`Kernels.llama_layers`, one list entry per layer: norm
    weights (float32), the packed linears' ``data`` and the qkv bias (float32 or None).
    ``norm_post`` is HF's ``post_attention_layernorm`` (Llama: the MLP's input norm).
    ``dot``: every linear is packed for bfloat16 dot products (else for float32 chains)."""

    norm_in: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    o: list[torch.Tensor]
    norm_post: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    dot: bool


class LayerBuffers(NamedTuple):
    """The float32 rows :meth:`Kernels.llama_layers` works in, reused by every layer: x
    ``[T, hidden]``, qkv ``[T, (H + 2 KV) D]``, attn ``[T, H D]``, d and delta ``[T, hidden]``,
    gu ``[T, 2 I]``, act ``[T, I]``."""

    x: torch.Tensor
    qkv: torch.Tensor
    attn: torch.Tensor
    d: torch.Tensor
    delta: torch.Tensor
    gu: torch.Tensor
    act: torch.Tensor

    @classmethod
    def empty(cls, rows: int, hidden: int, qkv: int, attn: int, inter: int) -> "LayerBuffers":
        return cls(*_float32_rows(rows, (hidden, qkv, attn, hidden, hidden, 2 * inter, inter)))


@dataclass(frozen=True)
class Gemma3LayerWeights(LlamaLayerWeights):
    """Per-layer weights of :meth:`Kernels.gemma3_layers` (norms stored as ``1 + w``): the
    Llama ones, ``norm_post`` normalising the attention output, plus Gemma 3's own."""

    qk_norm: list[torch.Tensor]
    norm_pre_ff: list[torch.Tensor]
    norm_post_ff: list[torch.Tensor]


class Gemma3LayerBuffers(NamedTuple):
    """The float32 rows :meth:`Kernels.gemma3_layers` works in: x, d and dn ``[T, hidden]``,
    qkv and qk ``[T, (H + 2 KV) D]``, attn ``[T, H D]``, gu ``[T, 2 I]``, act ``[T, I]``."""

    x: torch.Tensor
    qkv: torch.Tensor
    qk: torch.Tensor
    attn: torch.Tensor
    d: torch.Tensor
    dn: torch.Tensor
    gu: torch.Tensor
    act: torch.Tensor

    @classmethod
    def empty(cls, rows: int, hidden: int, qkv: int, attn: int, inter: int) -> "Gemma3LayerBuffers":
        return cls(*_float32_rows(rows, (hidden, qkv, qkv, attn, hidden, hidden, 2 * inter, inter)))


class LayerPlaces(NamedTuple):
    """Where each layer's attention reads and writes, one entry per layer: its pool's K and
    V views and that pool's slot metadata, its window (0 = full), RoPE table, attention
    implementation and KV dtype name."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    out_slots: list[torch.Tensor]
    slots: list[torch.Tensor]
    seq_info: list[torch.Tensor]
    windows: list[int]
    cos: list[torch.Tensor]
    sin: list[torch.Tensor]
    impl: list[int]
    kv_dtype: list[str | None]


class Kernels:
    """Python face of the loaded operators (``torch.ops.radixserve.*``).

    Methods take and return torch tensors; shapes are those of the model's forward pass
    (``T`` new tokens). Outputs are allocated here unless an ``out`` is passed.
    """

    def __init__(self, path: Path, build_seconds: float | None):
        self.path = path
        self.build_seconds = build_seconds  # None when the library came from the cache
        # Instruction-set level (index into radixserve.kernels.isa.ISAS) of the row-wise ops: the
        # highest the CPU has; capped() gives a view with a lower one.
        self.isa = "generic"
        ops = torch.ops.radixserve
        self._rms_norm = ops.rms_norm.default
        self._add_rms_norm = ops.add_rms_norm.default
        self._rope = ops.rope_.default
        self._silu_mul = ops.silu_mul.default
        self._gelu_tanh_mul = ops.gelu_tanh_mul.default
        self._qk_norm_rope = ops.qk_norm_rope.default
        self._store_kv = ops.store_kv.default
        self._store_kv_quant = ops.store_kv_quant.default
        self._attention = ops.paged_attention.default
        self._attention_impl = ops.attention_impl.default
        self._impl_available = ops.attention_impl_available.default
        self._pack_linear = ops.pack_linear.default
        self._pack_linear_dot = ops.pack_linear_dot.default
        self._packed_linear = ops.packed_linear.default
        self.pack_quant_panels = ops.pack_quant.default
        self.pack_int8_panels = ops.pack_quant_int8.default
        self._quant_rows = ops.quant_rows.default
        self.quant_panel_bytes = ops.quant_panel_bytes
        self.pack_q8dot_panels = ops.pack_q8dot.default
        self.q8dot_panel_bytes = ops.q8dot_panel_bytes
        self._q8dot_quantize = ops.q8dot_quantize.default
        # Whether the bfloat16 dot products may run the CPU's own instruction (AVX512-BF16)
        # where this build has it; False runs their emulation (the same bits), for tests.
        self.native_dot = bool(ops.dot_native_built())
        self._llama_layers = ops.llama_layers.default
        self._gemma3_layers = ops.gemma3_layers.default
        self.isa = self.available_isas()[-1]

    def capped(self, cap: str = "auto") -> "Kernels":
        """A view of these kernels whose row-wise ops use at most instruction-set level
        ``cap`` (their results are the same at every level; the cap picks the code path)."""
        view = copy.copy(self)
        view.isa = effective_isa(cap) if ISAS.index(effective_isa(cap)) < ISAS.index(self.isa) else self.isa
        return view

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """``rms_norm(x) * weight`` of float32 rows ``x [T, hidden]``, in ``dtype`` (into
        ``out`` when given: a buffer reused across layers saves an allocation per call)."""
        if out is None:
            out = torch.empty(x.shape, dtype=dtype)
        self._rms_norm(x, weight, eps, out)
        return out

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden += delta`` in place (float32 residual stream), then its RMSNorm in ``dtype``."""
        if out is None:
            out = torch.empty(hidden.shape, dtype=dtype)
        self._add_rms_norm(hidden, delta, weight, eps, out)
        return out

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, n_rot_heads: int, head_dim: int) -> None:
        """Rotate-half RoPE in place on the first ``n_rot_heads`` heads of each row of ``qkv``
        (the q and k heads of the fused projection), in float32, rounded back to its dtype."""
        self._rope(qkv, positions, cos, sin, n_rot_heads, head_dim)

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gu[:, :I]) * gu[:, I:]`` in float32, one rounding to ``gu``'s dtype."""
        if out is None:
            out = torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=gu.dtype)
        self._silu_mul(gu, out, ISAS.index(self.isa))
        return out

    def gelu_tanh_mul(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``gelu_tanh(gu[:, :I]) * gu[:, I:]`` (GeGLU) in float32, one rounding to ``gu``'s
        dtype; the tanh form's sigmoid from the same exp as :meth:`silu_mul`."""
        if out is None:
            out = torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=gu.dtype)
        self._gelu_tanh_mul(gu, out, ISAS.index(self.isa))
        return out

    def qk_norm_rope(self, qkv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, n_qk_heads: int, head_dim: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 ``[T, heads * head_dim]`` from the fused projection ``qkv``: its first
        ``n_qk_heads`` heads RMS-normalised with their row of ``weight [n_qk_heads, head_dim]``
        and rotated (rotate-half RoPE at ``positions``), the remaining (v) heads copied."""
        if out is None:
            out = torch.empty(qkv.shape, dtype=torch.float32)
        self._qk_norm_rope(qkv, weight, eps, positions, cos, sin, n_qk_heads, head_dim, out)
        return out

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """``k_cache[slots] = k`` and ``v_cache[slots] = v`` (``[T, kv_heads, D]`` rows,
        converted to the cache dtype the way ``Tensor.to`` rounds)."""
        self._store_kv(k, v, k_cache, v_cache, slots)

    def store_kv_quant(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, kv_dtype: str) -> None:
        """The same into a quantized pool (uint8 ``[slots, kv_heads, D + 4]``): each row's
        codes and scale, bit for bit what :func:`radixserve.memory.quant.quantize` gives."""
        self._store_kv_quant(k, v, k_cache, v_cache, slots, KV_KINDS[kv_dtype])

    def without_native_dot(self) -> "Kernels":
        """A view whose bfloat16 dot products never run the native instruction (their
        emulation: the same bits), so a test can compare the two on one machine."""
        view = copy.copy(self)
        view.native_dot = False
        return view

    def arith(self, w: "PackedWeight") -> int:
        """The ``arith`` argument of the packed-linear operators for weights packed like ``w``."""
        return (ARITH_DOT if self.native_dot else ARITH_DOT_EMULATED) if w.dot else ARITH_F32

    @staticmethod
    def packed_numel(n: int, k: int, dot: bool = False) -> int:
        """Elements the packed form of an ``[n, k]`` weight takes (whole 16-column panels;
        ``dot``: k padded to whole pairs)."""
        return (n + 15) // 16 * 16 * (2 * ((k + 1) // 2) if dot else k)

    def pack_linear(self, w: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None,
                    dot: bool = False) -> "PackedWeight":
        """``w [N, K]`` (float32/bf16) packed for :meth:`packed_linear`, stored in ``dtype``;
        into ``out`` (1-D, :meth:`packed_numel` elements of ``dtype``) when given. ``dot``:
        for bfloat16 dot products (``dtype`` must be bfloat16)."""
        if dot and dtype != torch.bfloat16:
            raise ValueError(f"bfloat16 dot products need bfloat16 weights, got dtype {dtype}")
        n, k = w.shape
        numel = self.packed_numel(n, k, dot)
        if out is None:
            out = torch.empty((numel,), dtype=dtype)
        elif out.dim() != 1 or out.numel() != numel or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous 1-D {dtype} tensor of {numel} elements, "
                             f"got {tuple(out.shape)} {out.dtype}")
        (self._pack_linear_dot if dot else self._pack_linear)(w.contiguous() if w.stride(1) != 1 else w, out)
        return PackedWeight(out, n, k, dot)

    def packed_linear(self, x: torch.Tensor, w: "PackedWeight", bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K] (float32) @ w.T (+ bias)`` accumulated in float32, written in
        ``out_dtype``. Each output element is one chain in a fixed order (float32 fmas over
        K, or bfloat16 pair products for ``w.dot``), so a row's result does not depend on the
        rest of the batch (see csrc/gemm.cpp, csrc/gemm_dot.cpp)."""
        if out is None:
            out = torch.empty((x.shape[0], w.n), dtype=out_dtype)
        self._packed_linear(x, w.data, w.n, bias, out, ISAS.index(self.isa), self.arith(w))
        return out

    def quant_rows(self, w: "PackedWeight", ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the quantized weight ``w`` as the dense bfloat16 model holds them
        (``[len(ids), K]`` bfloat16): the embedding lookup of a quantized table."""
        out = torch.empty((ids.numel(), w.k), dtype=torch.bfloat16)
        self._quant_rows(w.data, ids.reshape(-1).to(torch.int64).contiguous(), out)
        return out

    def q8dot_quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 rows ``x [M, K]`` as the integer-dot linears quantize them (csrc/gemm_q8dot.cpp):
        (codes int8 ``[M, K]``, scales float32 ``[M, K / 32]``, code sums int32 ``[M, K / 32]``)."""
        m, k = x.shape
        q = torch.empty((m, k), dtype=torch.int8)
        d = torch.empty((m, k // 32), dtype=torch.float32)
        s = torch.empty((m, k // 32), dtype=torch.int32)
        self._q8dot_quantize(x, q, d, s)
        return q, d, s

    def _layers_arith(self, weights: "LlamaLayerWeights") -> int:
        return (ARITH_DOT if self.native_dot else ARITH_DOT_EMULATED) if weights.dot else ARITH_F32

    def llama_layers(self, hidden: torch.Tensor, buffers: "LayerBuffers", weights: "LlamaLayerWeights",
                     caches: tuple[list[torch.Tensor], list[torch.Tensor]], positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, out_slots: torch.Tensor, slots: torch.Tensor,
                     seq_info: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     eps: float, scale: float, impl: int, kv_dtype: str | None) -> None:
        """Every decoder layer of a Llama-family model in one call, updating the float32
        residual ``hidden`` in place: the calls of ``LlamaForCausalLM._layers_fused``, made
        from C++ (the same kernels in the same order, so the same bits) to spare a decode
        step the Python overhead of ~10 kernel calls per layer."""
        b = buffers
        self._llama_layers(hidden, b.x, b.qkv, b.attn, b.d, b.delta, b.gu, b.act, weights.norm_in,
                           weights.qkv, weights.qkv_bias, weights.o, weights.norm_post, weights.gate_up,
                           weights.down, caches[0], caches[1], positions, cos, sin, out_slots, slots,
                           seq_info, num_heads, num_kv_heads, head_dim, eps, scale, impl,
                           KV_KINDS[kv_dtype] if kv_dtype in KV_KINDS else 0, ISAS.index(self.isa),
                           self._layers_arith(weights))

    def gemma3_layers(self, hidden: torch.Tensor, buffers: "Gemma3LayerBuffers", weights: "Gemma3LayerWeights",
                      places: "LayerPlaces", positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, eps: float, scale: float) -> None:
        """Every decoder layer of Gemma 3 in one call (see :meth:`llama_layers`): the kernel
        calls of ``Gemma3ForCausalLM._run_layers``, made from C++, the same bits."""
        b, w, pl = buffers, weights, places
        self._gemma3_layers(hidden, b.x, b.qkv, b.qk, b.attn, b.d, b.dn, b.gu, b.act, w.norm_in, w.qkv,
                            w.qkv_bias, w.qk_norm, w.o, w.norm_post, w.norm_pre_ff, w.gate_up, w.down,
                            w.norm_post_ff, pl.k_caches, pl.v_caches, pl.out_slots, pl.slots, pl.seq_info,
                            pl.windows, pl.cos, pl.sin, pl.impl,
                            [KV_KINDS[k] if k in KV_KINDS else 0 for k in pl.kv_dtype], positions,
                            num_heads, num_kv_heads, head_dim, eps, scale, ISAS.index(self.isa),
                            self._layers_arith(weights))

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, seq_info: torch.Tensor, out: torch.Tensor,
                  scale: float, impl: int = IMPL_AUTO, window: int = 0,
                  kv_dtype: str | None = None) -> torch.Tensor:
        """Causal attention of ``q [T, H, D]`` over the pool ``k_cache/v_cache [slots, KV, D]``.

        ``slots``: every sequence's slots (prefix then new tokens), concatenated;
        ``seq_info [B, 4]`` int64: first q row, q rows, first entry in ``slots``, KV length.
        Sequence b's q rows are its last ``q rows`` positions. Writes ``out [T, H * D]``.
        ``window`` > 0: sliding-window attention, a row at position p sees keys
        ``p - window + 1 .. p`` only, and the slots of earlier keys are never read (nor
        checked: they may be stale). ``kv_dtype`` "int8" / "fp8_e4m3": the pool is quantized
        (uint8 rows of codes + scale, dequantized in the kernel)."""
        self._attention(q, k_cache, v_cache, slots, seq_info, out, scale, impl, window,
                        KV_KINDS[kv_dtype] if kv_dtype in KV_KINDS else 0)
        return out

    def attention_impl(self, q: torch.Tensor, k_cache: torch.Tensor) -> int:
        """The implementation ``impl=0`` picks for these dtypes and head size on this CPU
        (ignoring any cap: see :meth:`pick_attention_impl`)."""
        return int(self._attention_impl(q, k_cache))

    def impl_available(self, impl: int, kv_dtype: torch.dtype, head_dim: int) -> bool:
        """Whether attention implementation ``impl`` exists in this build (this CPU) for a
        pool of ``kv_dtype`` and this head size."""
        quant = kv_dtype == torch.uint8  # a quantized pool (every code kind is served alike)
        return bool(self._impl_available(impl, torch.empty((0, 1, head_dim), dtype=kv_dtype), head_dim,
                                          1 if quant else 0))

    def attention_impls(self, kv_dtype: torch.dtype, head_dim: int, cap: str | None = None) -> list[int]:
        """The implementations that can serve this pool dtype and head size under ``cap``
        (default: this view's level), fastest first (the portable one always last)."""
        cap = self.isa if cap is None else cap
        return [i for i in _IMPL_ORDER
                if isa_allows(cap, IMPL_ISA[i]) and self.impl_available(i, kv_dtype, head_dim)]

    def pick_attention_impl(self, kv_dtype: torch.dtype, head_dim: int, cap: str | None = None) -> int:
        """The fastest implementation for this pool dtype and head size under ``cap``
        (default: this view's level)."""
        return self.attention_impls(kv_dtype, head_dim, cap)[0]

    def available_isas(self) -> tuple[str, ...]:
        """The instruction-set levels whose kernel paths this CPU (this build) has,
        regardless of any cap."""
        have = ["generic"]
        if self.impl_available(IMPL_AVX2, torch.float32, 64):
            have.append("avx2")
        if self.impl_available(IMPL_F32, torch.float32, 64):
            have.append("avx512")
        return tuple(have)


_lock = threading.Lock()
_kernels: Kernels | None = None
_error: KernelBuildError | None = None


def _ops_registered() -> bool:
    try:
        return hasattr(torch.ops.radixserve, "paged_attention")
    except (AttributeError, RuntimeError):
        return False


def load_kernels(cache_dir: Path | None = None) -> Kernels:
    """Build (first time on this machine) and load the kernels; the same object afterwards.

    One build per process: torch allows one registration of the ``radixserve`` operator
    namespace, so a later call with another ``cache_dir`` returns the loaded kernels.
    Raises KernelBuildError (the compiler output in its message) if they cannot be built;
    the failure is remembered, so a broken toolchain costs one attempt per process."""
    global _kernels, _error
    with _lock:
        if _kernels is not None:
            return _kernels
        if _error is not None:
            raise _error
        if _ops_registered():
            raise KernelBuildError("torch.ops.radixserve is registered by another library copy")
        try:
            path = build("radixserve_kernels", [CSRC / s for s in SOURCES],
                         headers=tuple(CSRC / h for h in HEADERS), cache_dir=cache_dir)
        except KernelBuildError as e:
            _error = e
            raise
        _kernels = Kernels(path, last_build_seconds)
        return _kernels


def try_load_kernels(cache_dir: Path | None = None) -> Kernels | None:
    """:func:`load_kernels`, or ``None`` after logging why (once per process)."""
    first = _error is None
    try:
        return load_kernels(cache_dir)
    except KernelBuildError as e:
        if first:
            log.warning("radixserve CPU kernels unavailable, using the eager torch path: %s", e)
        return None


def main() -> None:
    """``python -m radixserve.kernels.library``: build (or find) the kernels and say where.

    For images and CI: run it once at install time, and the first server start or test
    does not pay the compile."""
    t0 = time.perf_counter()
    k = load_kernels()
    took = time.perf_counter() - t0
    cap = isa_cap()
    names = {dt: IMPL_NAMES[k.pick_attention_impl(dt, 64, cap)] for dt in (torch.float32, torch.bfloat16)}
    print(f"{k.path}\n{'built' if k.build_seconds is not None else 'cached'} in {took:.1f} s; "
          f"CPU paths: {', '.join(k.available_isas())} (cap {cap}); attention (head_dim 64): "
          f"float32 pool {names[torch.float32]}, bfloat16 pool {names[torch.bfloat16]}")


if __name__ == "__main__":
    main()
