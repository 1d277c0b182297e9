"""The CPU kernels of ``kernels/csrc/`` (C++): their Python face, :class:`Kernels`.

What they are for: the attention over the paged KV pool (prefill, prefill over a cached
prefix, decode, and mixes of these in one batch, all reading K/V in place by slot), the
row-wise ops between a layer's matmuls (RMSNorm with the residual add, RoPE, SiLU·mul, the
K/V store), the packed GEMMs and whole decoder layers in one call. See the header comments
of the ``.cpp`` files for the arithmetic, :mod:`~radixserve.kernels.builder` for the build
and :mod:`~radixserve.kernels.operands` for the typed operands.
``python -m radixserve.kernels.library`` builds them ahead of time (images, CI).

Failure is loud, never silent: :func:`load_kernels` raises :class:`KernelBuildError` with the
compiler's output. :func:`try_load_kernels` is what the attention backend uses: on failure it
logs that output once as a warning and returns ``None`` (the backend then runs its eager
torch path).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from pathlib import Path

import torch

from radixserve.kernels import builder
from radixserve.kernels.builder import CSRC, HEADERS, SOURCES, KernelBuildError, build
from radixserve.kernels.isa import ISAS, effective_isa, isa_allows, isa_cap
from radixserve.kernels.operands import (Gemma3LayerBuffers, Gemma3LayerWeights, LayerBuffers, LayerGeometry,
                                         LayerPlaces, LlamaLayerWeights, PackedWeight, PoolPlaces)

log = logging.getLogger(__name__)


# Attention implementations (the ``impl`` argument of the paged_attention op).
# IMPL_AMX: the bf16 dot products with prefill blocks on the AMX tiles; IMPL_AMX_MODEL: the same
# on the tiles' software model (csrc/tiles.h), for tests on CPUs without AMX. Both give
# IMPL_BF16's bits.
IMPL_AUTO, IMPL_GENERIC, IMPL_F32, IMPL_BF16, IMPL_AVX2, IMPL_AMX, IMPL_AMX_MODEL = 0, 1, 2, 3, 4, 5, 6
IMPL_NAMES = {IMPL_GENERIC: "portable float32", IMPL_AVX2: "AVX2 float32",
              IMPL_F32: "AVX-512 float32", IMPL_BF16: "AVX-512 bf16 dot products",
              IMPL_AMX: "AMX bf16 tiles (decode: AVX-512 bf16 dot products)",
              IMPL_AMX_MODEL: "AMX bf16 tiles' software model"}

#: The ``kv_kind`` argument of the kernels per quantized KV kind (float pools: 0).
KV_KINDS = {"int8": 1, "fp8_e4m3": 2}
#: The ``arith`` argument of the packed-linear operators (csrc/common.h).
ARITH_F32, ARITH_DOT, ARITH_DOT_EMULATED, ARITH_DOT_TILE_MODEL = 0, 1, 2, 3
#: Why the AMX tiles may not run (``amx_status``; csrc/tiles.h), by code; 0: they may.
AMX_READY, AMX_NOT_BUILT, AMX_NO_CPU, AMX_NO_OS, AMX_PROBE_DIFFERS, AMX_PROBE_FAILED = 0, 1, 2, 3, 4, 5
AMX_STATUS = {AMX_READY: "ready", AMX_NOT_BUILT: "not in this build (needs AVX512-BF16)",
              AMX_NO_CPU: "the CPU has no AMX-BF16", AMX_NO_OS: "Linux did not grant the tile state (arch_prctl)",
              AMX_PROBE_DIFFERS: "the tiles' bits differ from the model's (startup probe)",
              AMX_PROBE_FAILED: "the startup probe's process could not run or died (a fault on the tiles)"}
#: The ``kind`` argument of the gated linear (csrc/common.h).
GATES = {"silu": 0, "gelu_tanh": 1}
# The instruction-set level each implementation needs (radixserve.kernels.isa names the levels; the
# cap there decides which ones run), and their preference order, fastest first.
IMPL_ISA = {IMPL_GENERIC: "generic", IMPL_AVX2: "avx2", IMPL_F32: "avx512", IMPL_BF16: "avx512",
            IMPL_AMX: "amx", IMPL_AMX_MODEL: "avx512"}
_IMPL_ORDER = (IMPL_AMX, IMPL_BF16, IMPL_F32, IMPL_AVX2, IMPL_GENERIC)


class Kernels:
    """Python face of the loaded operators (``torch.ops.radixserve.*``). Methods take and return
    torch tensors; shapes are those of the model's forward pass (``T`` new tokens). Outputs are
    allocated here unless an ``out`` is passed."""

    def __init__(self, path: Path, build_seconds: float | None):
        self.path = path
        self.build_seconds = build_seconds  # None when the library came from the cache
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
        self._gated_linear = ops.gated_linear.default
        self.pack_quant_panels = ops.pack_quant.default
        self.pack_int8_panels = ops.pack_quant_int8.default
        self._quant_rows = ops.quant_rows.default
        self.quant_panel_bytes = ops.quant_panel_bytes
        self.pack_q8dot_panels = ops.pack_q8dot.default
        self.pack_codes_panels = ops.pack_codes.default
        self.q8dot_panel_bytes = ops.q8dot_panel_bytes
        self._q8dot_quantize = ops.q8dot_quantize.default
        # Whether the bfloat16 dot products may run the CPU's own instruction (AVX512-BF16)
        # where this build has it; False runs their emulation (the same bits), for tests.
        self.native_dot = bool(ops.dot_native_built())
        # Whether calls that would take the AMX tiles run on their software model instead
        # (csrc/tiles.h; the same bits), for tests on CPUs without AMX.
        self.tile_model = False
        self.amx_status = int(ops.amx_status())
        self._llama_layers = ops.llama_layers.default
        self._gemma3_layers = ops.gemma3_layers.default
        # Instruction-set level (a name of radixserve.kernels.isa.ISAS) of the row-wise ops: the
        # highest the CPU has; capped() gives a view with a lower one.
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
        out = torch.empty(x.shape, dtype=dtype) if out is None else out
        self._rms_norm(x, weight, eps, out)
        return out

    def add_rms_norm(self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden += delta`` in place (float32 residual stream), then its RMSNorm in ``dtype``."""
        out = torch.empty(hidden.shape, dtype=dtype) if out is None else out
        self._add_rms_norm(hidden, delta, weight, eps, out)
        return out

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, n_rot_heads: int, head_dim: int) -> None:
        """Rotate-half RoPE in place on the first ``n_rot_heads`` heads of each row of ``qkv``
        (the q and k heads of the fused projection), in float32, rounded back to its dtype."""
        self._rope(qkv, positions, cos, sin, n_rot_heads, head_dim)

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gu[:, :I]) * gu[:, I:]`` in float32, one rounding to ``gu``'s dtype."""
        out = torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=gu.dtype) if out is None else out
        self._silu_mul(gu, out, ISAS.index(self.isa))
        return out

    def gelu_tanh_mul(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``gelu_tanh(gu[:, :I]) * gu[:, I:]`` (GeGLU) in float32, one rounding to ``gu``'s
        dtype; the tanh form's sigmoid from the same exp as :meth:`silu_mul`."""
        out = torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=gu.dtype) if out is None else out
        self._gelu_tanh_mul(gu, out, ISAS.index(self.isa))
        return out

    def qk_norm_rope(self, qkv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, n_qk_heads: int, head_dim: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 ``[T, heads * head_dim]`` from the fused projection ``qkv``: its first
        ``n_qk_heads`` heads RMS-normalised with their row of ``weight [n_qk_heads, head_dim]``
        and rotated (rotate-half RoPE at ``positions``), the remaining (v) heads copied."""
        out = torch.empty(qkv.shape, dtype=torch.float32) if out is None else out
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

    def with_tile_model(self) -> "Kernels":
        """A view whose calls that would take the AMX tiles run on their software model
        (csrc/tiles.h) at any level with native bf16 dot products: the GEMM's calls of 16 rows
        or more, and attention's prefill blocks (``IMPL_AMX_MODEL`` picked before
        ``IMPL_BF16``). The same bits, so a CPU without AMX checks the tile kernels' code."""
        view = copy.copy(self)
        view.tile_model = True
        return view

    def arith(self, w: PackedWeight | LlamaLayerWeights) -> int:
        """The ``arith`` argument of the packed-linear operators for weights packed like ``w``."""
        if not w.dot:
            return ARITH_F32
        if not self.native_dot:
            return ARITH_DOT_EMULATED
        return ARITH_DOT_TILE_MODEL if self.tile_model else ARITH_DOT

    @staticmethod
    def packed_numel(n: int, k: int, dot: bool = False) -> int:
        """Elements the packed form of an ``[n, k]`` weight takes (whole 16-column panels;
        ``dot``: k padded to whole pairs)."""
        return (n + 15) // 16 * 16 * (2 * ((k + 1) // 2) if dot else k)

    def pack_linear(self, w: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None,
                    dot: bool = False) -> PackedWeight:
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

    def packed_linear(self, x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K] (float32) @ w.T (+ bias)`` accumulated in float32, written in
        ``out_dtype``. Each output element is one chain in a fixed order (float32 fmas over
        K, or bfloat16 pair products for ``w.dot``), so a row's result does not depend on the
        rest of the batch (see csrc/gemm.cpp, csrc/gemm_dot.cpp)."""
        out = torch.empty((x.shape[0], w.n), dtype=out_dtype) if out is None else out
        self._packed_linear(x, w.data, w.n, bias, out, ISAS.index(self.isa), self.arith(w))
        return out

    def gated_linear(self, x: torch.Tensor, w: PackedWeight, gate: str, out: torch.Tensor | None = None,
                     fuse: bool = True, gu: torch.Tensor | None = None) -> torch.Tensor:
        """``act(x Wg) * (x Wu)`` in float32 rows ``[M, I]`` for the fused gate_up weight
        ``w [2 I, K]`` (``gate``: "silu" or "gelu_tanh"): what :meth:`packed_linear` and then
        :meth:`silu_mul` / :meth:`gelu_tanh_mul` give, bit for bit. Dense weights packed for the
        dot products, and GGUF blocks that expand to them, run it in one pass (csrc/gemm_dot.cpp,
        "gated calls"): the ``[M, 2 I]`` rows of the two-pass form never reach memory. ``fuse=False`` runs the two passes (``gu``:
        their ``[M, 2 I]`` float32 buffer, allocated here when not given)."""
        inter = w.n // 2
        out = torch.empty((x.shape[0], inter), dtype=torch.float32) if out is None else out
        if gu is None:  # touched only by the two passes
            gu = torch.empty((x.shape[0], w.n), dtype=torch.float32)
        self._gated_linear(x, w.data, GATES[gate], gu, out, ISAS.index(self.isa), self.arith(w), fuse)
        return out

    def quant_rows(self, w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
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

    def llama_layers(self, hidden: torch.Tensor, buffers: LayerBuffers, weights: LlamaLayerWeights,
                     places: PoolPlaces, positions: torch.Tensor, geometry: LayerGeometry,
                     tail: torch.Tensor | None = None, fused_gate: bool = True) -> None:
        """Every decoder layer of a Llama-family model in one call, updating the float32
        residual ``hidden`` in place: the calls of ``LlamaForCausalLM._layers_fused``, made
        from C++ (the same kernels in the same order, so the same bits) to spare a decode
        step the Python overhead of ~10 kernel calls per layer. With ``tail`` (increasing
        row indices, :class:`~radixserve.model.arch.logits.LogitRows`) the last layer runs
        past its attention on those rows only, which end in ``hidden[:len(tail)]``. ``fused_gate``:
        the gate_up projection and its gate as :meth:`gated_linear` runs them (False: two passes)."""
        b, w, pl, g = buffers, weights, places, geometry
        self._llama_layers(hidden, b.x, b.qkv, b.attn, b.d, b.delta, b.gu, b.act, w.norm_in, w.qkv, w.qkv_bias,
                           w.o, w.norm_post, w.gate_up, w.down, pl.k_caches, pl.v_caches, positions, pl.cos,
                           pl.sin, pl.out_slots, pl.slots, pl.seq_info, g.num_heads, g.num_kv_heads,
                           g.head_dim, g.eps, g.scale, pl.impl, KV_KINDS.get(pl.kv_dtype, 0),
                           ISAS.index(self.isa), self.arith(w), tail, fused_gate)

    def gemma3_layers(self, hidden: torch.Tensor, buffers: Gemma3LayerBuffers, weights: Gemma3LayerWeights,
                      places: LayerPlaces, positions: torch.Tensor, geometry: LayerGeometry,
                      tail: torch.Tensor | None = None, fused_gate: bool = True) -> None:
        """Every decoder layer of Gemma 3 in one call (see :meth:`llama_layers`, ``tail`` and
        ``fused_gate`` too): the kernel calls of ``Gemma3ForCausalLM._run_layers``, made from C++, the same bits."""
        b, w, pl, g = buffers, weights, places, geometry
        self._gemma3_layers(hidden, b.x, b.qkv, b.qk, b.attn, b.d, b.dn, b.gu, b.act, w.norm_in, w.qkv,
                            w.qkv_bias, w.qk_norm, w.o, w.norm_post, w.norm_pre_ff, w.gate_up, w.down,
                            w.norm_post_ff, pl.k_caches, pl.v_caches, pl.out_slots, pl.slots, pl.seq_info,
                            pl.windows, pl.cos, pl.sin, pl.impl, [KV_KINDS.get(k, 0) for k in pl.kv_dtype],
                            positions, g.num_heads, g.num_kv_heads, g.head_dim, g.eps, g.scale,
                            ISAS.index(self.isa), self.arith(w), tail, fused_gate)

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
        order = _IMPL_ORDER
        if self.tile_model:  # the model where the tiles would run: in their place, before kBf16
            order = (IMPL_AMX_MODEL, *order)
        return [i for i in order
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
            if self.amx_status == AMX_READY:
                have.append("amx")
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
    """Build (first time on this machine) and load the kernels; the same object afterwards. One
    build per process: torch allows one registration of the ``radixserve`` operator namespace, so a
    later call with another ``cache_dir`` returns the loaded kernels. Raises KernelBuildError (the
    compiler output in its message) if they cannot be built; the failure is remembered, so a broken
    toolchain costs one attempt per process."""
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
        _kernels = Kernels(path, builder.last_build_seconds)
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
    """``python -m radixserve.kernels.library``: build (or find) the kernels and say where. For
    images and CI: run it once at install time, and the first server start or test does not pay the
    compile."""
    t0 = time.perf_counter()
    k = load_kernels()
    took = time.perf_counter() - t0
    cap = isa_cap()
    names = {dt: IMPL_NAMES[k.pick_attention_impl(dt, 64, cap)] for dt in (torch.float32, torch.bfloat16)}
    print(f"{k.path}\n{'built' if k.build_seconds is not None else 'cached'} in {took:.1f} s; "
          f"CPU paths: {', '.join(k.available_isas())} (cap {cap}); attention (head_dim 64): "
          f"float32 pool {names[torch.float32]}, bfloat16 pool {names[torch.bfloat16]}; "
          f"AMX tiles: {AMX_STATUS[k.amx_status]}")


if __name__ == "__main__":
    main()
