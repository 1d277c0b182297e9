"""Fused paged decode attention for CPU: reads K/V straight from the pool by slot index.

The eager decode path gathers every sequence's K/V into a dense buffer (``index_select``),
converts it to float32 (bfloat16 pools), then runs two ``bmm``: the K/V bytes cross memory
three or four times per layer. The kernels here read each K/V row of the pool once, where
it lies, through the ``[B, Lmax]`` slot index, converting bfloat16 to float32 in registers:

* ``qk``: ``scores[b, h, l] = q[b, h] · K[idx[b, l], h // group]`` (float32 accumulation),
  ``-inf`` for ``l >= lens[b]`` — so padding costs no memory traffic and needs no mask.
  Sixteen keys are reduced at once by a shuffle tree instead of one horizontal sum per key.
* softmax in torch (float32, vectorised), between the two kernels;
* ``pv``: ``out[b, h] = sum_l probs[b, h, l] * V[idx[b, l], h // group]`` for ``l < lens[b]``.

Query heads of a KV head share its rows (GQA without repeating K/V). The work is split over
``torch.get_num_threads()`` OpenMP threads (the same libgomp torch uses).

The C source below is compiled once per machine with the system C compiler (``$CC``, else
``cc`` / ``gcc``; about a second) into a cache folder (``$RADIXSERVE_KERNEL_DIR``, else
``~/.cache/radixserve/kernels``) and loaded with ctypes: no torch headers, no build step at
install time. If there is no compiler or the build fails, :func:`load_kernel` logs one
warning and returns ``None``, and the attention backend keeps its eager path.
``RADIXSERVE_FUSED_DECODE=0`` disables the kernel.

Results equal the eager path to float32 rounding (summation order differs), not bitwise.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

#ifndef PF
#define PF 4  /* rows prefetched ahead (random slots defeat the hardware prefetcher) */
#endif
#ifndef PVROWS
#define PVROWS 1  /* P.V per sequence over whole V rows (all KV heads: one read per slot) */
#endif
#ifndef QPF
#define QPF 16  /* keys prefetched ahead by the scores kernel */
#endif
#define INL static inline __attribute__((always_inline))

INL float ld_f32(const float* p, int64_t i) { return p[i]; }
INL float ld_bf16(const uint16_t* p, int64_t i) {
    uint32_t u = ((uint32_t)p[i]) << 16; float f; memcpy(&f, &u, 4); return f;
}
INL void pf_bytes(const void* p, int64_t n) {
    const char* c = (const char*)p;
    for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(c + i);
}

typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
INL v16f ldv_f32(const float* p) { v16f x; memcpy(&x, p, 64); return x; }
#if defined(__AVX512F__)
#include <immintrin.h>
INL v16f ldv_bf16(const uint16_t* p) {
    __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
#else
INL v16f ldv_bf16(const uint16_t* p) {
    v16h x; memcpy(&x, p, 32);
    v16u u = __builtin_convertvector(x, v16u) << 16; v16f f; memcpy(&f, &u, 64); return f;
}
#endif
/* Returns r with r[j] = sum of the 16 lanes of a[j]: a shuffle tree, ~3 ops per sum. */
INL v16f hsum16(const v16f a[16]) {
    const v16i m1l = {0,1,2,3,4,5,6,7,16,17,18,19,20,21,22,23};
    const v16i m2l = {0,1,2,3,8,9,10,11,16,17,18,19,24,25,26,27};
    const v16i m3l = {0,1,4,5,8,9,12,13,16,17,20,21,24,25,28,29};
    const v16i m4l = {0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30};
    const v16i m1h = m1l + 8, m2h = m2l + 4, m3h = m3l + 2, m4h = m4l + 1;
    v16f x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = __builtin_shuffle(a[2*i], a[2*i+1], m1l) + __builtin_shuffle(a[2*i], a[2*i+1], m1h);
    for (int i = 0; i < 4; i++)
        y[i] = __builtin_shuffle(x[2*i], x[2*i+1], m2l) + __builtin_shuffle(x[2*i], x[2*i+1], m2h);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shuffle(y[2*i], y[2*i+1], m3l) + __builtin_shuffle(y[2*i], y[2*i+1], m3h);
    return __builtin_shuffle(z[0], z[1], m4l) + __builtin_shuffle(z[0], z[1], m4h);
}

#define DEFINE(NAME, T, LD)                                                                  \
/* Scores of keys l0..l1-1 of one sequence, 16 keys at a time (D % 16 == 0). */              \
INL void qk_blk_##NAME(const float* qb, const T* k, int64_t ss, const int64_t* ib,           \
                       int64_t l0, int64_t l1, int64_t len, float* sb, int64_t lds,          \
                       int64_t KV, int64_t G, const int64_t D) {                             \
    for (int64_t lb = l0; lb < l1; lb += 16) {                                               \
        const int64_t n = l1 - lb < 16 ? l1 - lb : 16;                                       \
        if (lb >= len) {                                                                     \
            for (int64_t h = 0; h < KV * G; h++)                                             \
                for (int64_t j = 0; j < n; j++) sb[h * lds + lb + j] = -INFINITY;            \
            continue;                                                                        \
        }                                                                                    \
        const T* rows[16];                                                                   \
        for (int64_t j = 0; j < 16; j++) rows[j] = k + ib[lb + (j < n ? j : 0)] * ss;        \
        for (int64_t j = 0; j < 16 && lb + QPF + j < len; j++)                               \
            pf_bytes(k + ib[lb + QPF + j] * ss, KV * D * (int64_t)sizeof(T));                \
        for (int64_t kh = 0; kh < KV; kh++) {                                                \
            for (int64_t g = 0; g < G; g++) {                                                \
                const int64_t h = kh * G + g;                                                \
                const float* qh = qb + h * D;                                                \
                v16f acc[16];                                                                \
                for (int j = 0; j < 16; j++) acc[j] = (v16f){0};                             \
                for (int64_t c = 0; c < D; c += 16) {                                        \
                    const v16f qv = ldv_f32(qh + c);                                         \
                    for (int j = 0; j < 16; j++) acc[j] += qv * ldv_##NAME(rows[j] + kh * D + c); \
                }                                                                            \
                const v16f r = hsum16(acc);                                                  \
                float* dst = sb + h * lds + lb;                                              \
                if (n == 16 && lb + 16 <= len) memcpy(dst, &r, 64);                          \
                else for (int64_t j = 0; j < n; j++) dst[j] = lb + j < len ? r[j] : -INFINITY; \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
/* Any D: one dot product per key. */                                                        \
INL void qk_rows_##NAME(const float* qb, const T* k, int64_t ss, const int64_t* ib,          \
                        int64_t l0, int64_t l1, int64_t len, float* sb, int64_t lds,         \
                        int64_t KV, int64_t G, const int64_t D) {                            \
    for (int64_t l = l0; l < l1; l++) {                                                      \
        if (l >= len) {                                                                      \
            for (int64_t h = 0; h < KV * G; h++) sb[h * lds + l] = -INFINITY;                \
            continue;                                                                        \
        }                                                                                    \
        if (l + PF < len) pf_bytes(k + ib[l + PF] * ss, KV * D * (int64_t)sizeof(T));        \
        const T* row = k + ib[l] * ss;                                                       \
        for (int64_t kh = 0; kh < KV; kh++) {                                                \
            const T* r = row + kh * D;                                                       \
            for (int64_t g = 0; g < G; g++) {                                                \
                const int64_t h = kh * G + g;                                                \
                const float* qh = qb + h * D;                                                \
                float acc = 0.f;                                                             \
                _Pragma("omp simd reduction(+:acc)")                                         \
                for (int64_t d = 0; d < D; d++) acc += qh[d] * LD(r, d);                     \
                sb[h * lds + l] = acc;                                                       \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
void qk_##NAME(const float* q, const T* k, int64_t ss, const int64_t* idx, int64_t ldi,      \
               const int64_t* lens, float* s, int64_t lds, int64_t B, int64_t H, int64_t KV, \
               int64_t D, int64_t nthreads) {                                                \
    const int64_t G = H / KV, CH = 128, nch = (lds + CH - 1) / CH;                           \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) if(nthreads > 1)") \
    for (int64_t w = 0; w < B * nch; w++) {                                                  \
        const int64_t b = w / nch, l0 = (w % nch) * CH;                                      \
        const int64_t l1 = l0 + CH < lds ? l0 + CH : lds;                                    \
        const float* qb = q + b * H * D;                                                     \
        float* sb = s + b * H * lds;                                                         \
        const int64_t* ib = idx + b * ldi;                                                   \
        if (D == 64) qk_blk_##NAME(qb, k, ss, ib, l0, l1, lens[b], sb, lds, KV, G, 64);      \
        else if (D == 128) qk_blk_##NAME(qb, k, ss, ib, l0, l1, lens[b], sb, lds, KV, G, 128); \
        else if (D % 16 == 0) qk_blk_##NAME(qb, k, ss, ib, l0, l1, lens[b], sb, lds, KV, G, D); \
        else qk_rows_##NAME(qb, k, ss, ib, l0, l1, lens[b], sb, lds, KV, G, D);              \
    }                                                                                        \
}                                                                                            \
INL void pv_one_##NAME(const float* pb, int64_t ldp, const T* v, int64_t ss,                 \
                       const int64_t* ib, int64_t len, float* ob, int64_t G, const int64_t D) { \
    float acc[G * D];                                                                        \
    for (int64_t i = 0; i < G * D; i++) acc[i] = 0.f;                                        \
    for (int64_t l = 0; l < len; l++) {                                                      \
        if (l + PF < len) pf_bytes(v + ib[l + PF] * ss, D * (int64_t)sizeof(T));             \
        const T* r = v + ib[l] * ss;                                                         \
        for (int64_t g = 0; g < G; g++) {                                                    \
            const float pg = pb[g * ldp + l];                                                \
            float* a = acc + g * D;                                                          \
            _Pragma("omp simd")                                                              \
            for (int64_t d = 0; d < D; d++) a[d] += pg * LD(r, d);                           \
        }                                                                                    \
    }                                                                                        \
    for (int64_t i = 0; i < G * D; i++) ob[i] = acc[i];                                      \
}                                                                                            \
/* out[b] for all heads: each V row (all KV heads, contiguous) is read once, in one piece. */ \
INL void pv_row_##NAME(const float* pb, int64_t ldp, const T* v, int64_t ss,                 \
                       const int64_t* ib, int64_t len, float* ob, int64_t KV, int64_t G,     \
                       const int64_t D) {                                                    \
    const int64_t H = KV * G;                                                                \
    v16f acc[H * D / 16];                                                                    \
    for (int64_t i = 0; i < H * D / 16; i++) acc[i] = (v16f){0};                             \
    for (int64_t l = 0; l < len; l++) {                                                      \
        if (l + PF < len) pf_bytes(v + ib[l + PF] * ss, KV * D * (int64_t)sizeof(T));        \
        const T* r = v + ib[l] * ss;                                                         \
        for (int64_t kh = 0; kh < KV; kh++) {                                                \
            for (int64_t c = 0; c < D; c += 16) {                                            \
                const v16f x = ldv_##NAME(r + kh * D + c);                                   \
                for (int64_t g = 0; g < G; g++) {                                            \
                    const int64_t h = kh * G + g;                                            \
                    acc[(h * D + c) / 16] += pb[h * ldp + l] * x;                            \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    memcpy(ob, acc, H * D * sizeof(float));                                                  \
}                                                                                            \
void pv_##NAME(const float* p, int64_t ldp, const T* v, int64_t ss, const int64_t* idx,      \
               int64_t ldi, const int64_t* lens, float* out, int64_t B, int64_t H,           \
               int64_t KV, int64_t D, int64_t nthreads) {                                    \
    const int64_t G = H / KV;                                                                \
    if (PVROWS && D % 16 == 0 && B >= nthreads) {                                                             \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) if(nthreads > 1)") \
        for (int64_t b = 0; b < B; b++) {                                                    \
            const float* pb = p + b * H * ldp;                                               \
            float* ob = out + b * H * D;                                                     \
            if (D == 64) pv_row_##NAME(pb, ldp, v, ss, idx + b * ldi, lens[b], ob, KV, G, 64); \
            else pv_row_##NAME(pb, ldp, v, ss, idx + b * ldi, lens[b], ob, KV, G, D);        \
        }                                                                                    \
        return;                                                                              \
    }                                                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) if(nthreads > 1)") \
    for (int64_t w = 0; w < B * KV; w++) {                                                   \
        const int64_t b = w / KV, kh = w % KV;                                               \
        const float* pb = p + (b * H + kh * G) * ldp;                                        \
        float* ob = out + (b * H + kh * G) * D;                                              \
        const T* vk = v + kh * D;                                                            \
        const int64_t* ib = idx + b * ldi;                                                   \
        if (D == 64) pv_one_##NAME(pb, ldp, vk, ss, ib, lens[b], ob, G, 64);                 \
        else if (D == 128) pv_one_##NAME(pb, ldp, vk, ss, ib, lens[b], ob, G, 128);          \
        else pv_one_##NAME(pb, ldp, vk, ss, ib, lens[b], ob, G, D);                          \
    }                                                                                        \
}

DEFINE(f32, float, ld_f32)
DEFINE(bf16, uint16_t, ld_bf16)
"""

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_lock = threading.Lock()
_kernel: "PagedDecodeKernel | None" = None
_tried = False


def _cpu_signature() -> str:
    """What ``-march=native`` depends on, so a shared cache never serves a foreign binary."""
    sig = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features", "CPU part")):
                    sig += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return sig


def _cache_dir() -> Path:
    env = os.environ.get("RADIXSERVE_KERNEL_DIR")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "radixserve" / "kernels"


def _compile(cc: str, flags: list[str], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "paged_decode.c"
        src.write_text(_SOURCE)
        so = Path(tmp) / out.name
        proc = subprocess.run([cc, *flags, "-o", str(so), str(src)], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{proc.stderr[-2000:]}")
        os.replace(so, out)  # atomic: concurrent builders never see a half-written file


def _build() -> "PagedDecodeKernel":
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set $CC)")
    key = hashlib.sha256(
        "\0".join([_SOURCE, " ".join(_FLAGS), cc, _cpu_signature(), torch.__version__]).encode()
    ).hexdigest()[:20]
    path = _cache_dir() / f"paged_decode_{key}.so"
    if not path.exists():
        try:
            _compile(cc, _FLAGS, path)
        except OSError:  # cache folder not writable: build in a private temp folder
            path = Path(tempfile.mkdtemp(prefix="radixserve-kernels-")) / path.name
            _compile(cc, _FLAGS, path)
    return PagedDecodeKernel(ctypes.CDLL(str(path)), path)


def load_kernel() -> "PagedDecodeKernel | None":
    """The compiled kernel, built on first use; ``None`` (warned once) if unavailable."""
    global _kernel, _tried
    if _tried:
        return _kernel
    with _lock:
        if not _tried:
            if os.environ.get("RADIXSERVE_FUSED_DECODE", "1") == "0":
                log.info("fused paged decode disabled by RADIXSERVE_FUSED_DECODE=0")
            else:
                try:
                    _kernel = _build()
                except Exception as e:  # noqa: BLE001 - any failure means: use the eager path
                    log.warning("fused paged decode kernel unavailable, using the eager "
                                "gather path: %s", e)
                    _kernel = None
            _tried = True
    return _kernel


class PagedDecodeKernel:
    """ctypes handle on the compiled ``qk_*`` / ``pv_*`` functions."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._qk = {}
        self._pv = {}
        for suffix in _DTYPES.values():
            qk = getattr(lib, f"qk_{suffix}")
            qk.argtypes = [ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64]
            qk.restype = None
            pv = getattr(lib, f"pv_{suffix}")
            pv.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64]
            pv.restype = None
            self._qk[suffix], self._pv[suffix] = qk, pv

    @staticmethod
    def supports(kv: torch.Tensor) -> bool:
        """Whether K/V of this dtype / device / layout can be read by the kernel."""
        return (kv.device.type == "cpu" and kv.dtype in _DTYPES and kv.dim() == 3
                and kv.stride(2) == 1 and kv.stride(1) == kv.shape[2])

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        index: torch.Tensor,
        lens: torch.Tensor,
        scores: torch.Tensor,
        probs: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Single-query attention of B sequences over K/V rows picked by slot index.

        ``q`` ``[B, H, D]`` float32, already scaled by ``D ** -0.5``; ``k``/``v``
        ``[slots, kv_heads, D]`` (float32 or bfloat16, rows of D contiguous, any slot
        stride); ``index`` ``[B, Lmax]`` int64 slots (entries past ``lens[b]`` are never
        read); ``lens`` ``[B]`` int64, each in ``1..Lmax``. ``scores`` / ``probs``
        ``[B, H, Lmax]`` float32 and ``out`` ``[B, H, D]`` float32 are work / output
        buffers. Slots are not bounds-checked here: the caller validates them.
        """
        b, h, d = q.shape
        slots, kv_heads, d_k = k.shape
        lmax = index.shape[1]
        if not (q.dtype == torch.float32 and q.is_contiguous() and d_k == d and h % kv_heads == 0
                and v.shape == k.shape and v.stride() == k.stride() and v.dtype == k.dtype
                and self.supports(k) and index.dtype == torch.int64 and index.is_contiguous()
                and index.shape[0] == b and lens.dtype == torch.int64 and lens.is_contiguous()
                and scores.shape == (b, h, lmax) and scores.is_contiguous()
                and probs.shape == (b, h, lmax) and probs.is_contiguous()
                and out.shape == (b, h, d) and out.is_contiguous()):
            raise ValueError("paged decode kernel: unexpected shapes, dtypes or layouts")
        suffix = _DTYPES[k.dtype]
        nt = torch.get_num_threads()
        ss = k.stride(0)
        self._qk[suffix](q.data_ptr(), k.data_ptr(), ss, index.data_ptr(), lmax, lens.data_ptr(),
                         scores.data_ptr(), lmax, b, h, kv_heads, d, nt)
        torch.ops.aten._softmax.out(scores, -1, False, out=probs)
        self._pv[suffix](probs.data_ptr(), lmax, v.data_ptr(), ss, index.data_ptr(), lmax,
                         lens.data_ptr(), out.data_ptr(), b, h, kv_heads, d, nt)
        return out
