// The row-wise operations between the GEMMs of a decoder layer, each one pass over memory
// instead of the chain of torch ops (and temporaries) the eager path runs:
//
//   rms_norm      x -> rms_norm(x) * w, cast for the next matmul
//   add_rms_norm  h += delta (residual add), then rms_norm(h) * w
//   rope_         rotate-half RoPE in place on the q and k heads of the fused qkv output
//   silu_mul      silu(gate) * up from the fused gate_up output
//   gelu_tanh_mul gelu_tanh(gate) * up (GeGLU, Gemma)
//   qk_norm_rope  per-head RMSNorm of the q and k heads, then RoPE, v copied (Gemma 3): the
//                 fused qkv output in, float32 q/k/v rows out, one pass
//   store_kv      K and V of the new tokens into their pool slots
//
// All math is float32 with one rounding to the output dtype at the end. Every row is
// computed by one thread with the same code whatever the batch, so a row's result never
// depends on which other rows share the batch. Plain loops: the compiler vectorises them,
// except the exp of silu_mul and gelu_tanh_mul, which has an explicit AVX2 version (same
// operations, same bits) used when the instruction-set level allows it (the `isa` argument).
#include "common.h"
#include "simd_avx2.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

namespace radixserve {
namespace {

// Rows per parallel chunk: each chunk touches at least 2^18 elements, so small batches (a
// decode step) run on the calling thread — a parallel region would cost more than the work,
// and on a busy machine far more (its workers must all be scheduled before it ends).
int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, row_elems)); }

inline float sum_squares(const float* x, int64_t n) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) part[j] = std::fma(x[i + j], x[i + j], part[j]);
  for (int j = 0; i < n; ++i, ++j) part[j] = std::fma(x[i], x[i], part[j]);
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) part[j] = part[2 * j] + part[2 * j + 1];
  return part[0];
}

template <typename OT>
inline void norm_row(const float* x, const float* w, int64_t n, float eps, OT* out) {
  const float mean = sum_squares(x, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) store_f32(out, i, (x[i] * r) * w[i]);
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace

void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = ptr<float>(x);
  const float* wp = ptr<float>(weight);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (bf16)
        norm_row(xp + t * xs, wp, n, static_cast<float>(eps), ptr<uint16_t>(out) + t * os);
      else
        norm_row(xp + t * xs, wp, n, static_cast<float>(eps), ptr<float>(out) + t * os);
    }
  });
}

void add_rms_norm_kernel(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight,
                         double eps, at::Tensor& out) {
  const int64_t rows = hidden.size(0), n = hidden.size(1);
  float* hp = ptr<float>(hidden);
  const float* wp = ptr<float>(weight);
  const int64_t hs = hidden.stride(0), ds = delta.stride(0), os = out.stride(0);
  const bool dbf16 = delta.scalar_type() == at::kBFloat16;
  const bool obf16 = out.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* h = hp + t * hs;
      if (dbf16) {
        const uint16_t* d = ptr<uint16_t>(delta) + t * ds;
        for (int64_t i = 0; i < n; ++i) h[i] = h[i] + bf16_to_f32(d[i]);
      } else {
        const float* d = ptr<float>(delta) + t * ds;
        for (int64_t i = 0; i < n; ++i) h[i] = h[i] + d[i];
      }
      if (obf16)
        norm_row(h, wp, n, static_cast<float>(eps), ptr<uint16_t>(out) + t * os);
      else
        norm_row(h, wp, n, static_cast<float>(eps), ptr<float>(out) + t * os);
    }
  });
}

namespace {
template <typename T>
void rope_rows(T* x, int64_t rs, const int64_t* positions, const float* cos, const float* sin,
               int64_t rows, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, row_grain(heads * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = x + t * rs + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load_f32(p, i), x2 = load_f32(p, half + i);
          // Same roundings as the eager path: two products, then the sum.
          const float o1 = x1 * c[i] - x2 * s[i];
          const float o2 = x2 * c[i] + x1 * s[i];
          store_f32(p, i, o1);
          store_f32(p, half + i, o2);
        }
      }
    }
  });
}

// silu(g) * u of one row, elements [i0, n): the portable operation sequence.
template <typename IT, typename OT>
inline void silu_mul_tail(const IT* g, const IT* u, OT* o, int64_t i0, int64_t n) {
  for (int64_t i = i0; i < n; ++i) {
    const float gv = load_f32(g, i);
    const float silu = gv / (1.0f + exp_f32(-gv));
    store_f32(o, i, silu * load_f32(u, i));
  }
}

#if RS_AVX2
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, uint16_t>) return bf16x8_to_f32(p);
  else return _mm256_loadu_ps(p);
}

template <typename T>
inline void store8(T* p, __m256 x) {
  if constexpr (std::is_same_v<T, uint16_t>) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f32_to_bf16x8(x));
  else _mm256_storeu_ps(p, x);
}

// The same operations on 8 lanes (exp256 is exp_f32's sequence): the portable bits.
template <typename IT, typename OT>
inline int64_t silu_mul_avx2(const IT* g, const IT* u, OT* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = load8(g + i);
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_xor_ps(gv, sign))));
    store8(o + i, _mm256_mul_ps(silu, load8(u + i)));
  }
  return i;
}
#endif

// gelu_tanh(g) * u of one row, elements [i0, n). 0.5 g (1 + tanh(y)) with
// y = c (g + 0.044715 g^3) is g * sigmoid(2y) = g / (1 + exp(-2y)): no cancellation where
// tanh is near -1 (exp_f32 saturates, so large |y| gives g or a signed 0).
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

template <typename IT, typename OT>
inline void gelu_mul_tail(const IT* g, const IT* u, OT* o, int64_t i0, int64_t n) {
  for (int64_t i = i0; i < n; ++i) {
    const float x = load_f32(g, i);
    const float y = kGeluC * (x + kGeluA * (x * (x * x)));
    store_f32(o, i, (x / (1.0f + exp_f32(-(y + y)))) * load_f32(u, i));
  }
}

#if RS_AVX2
template <typename IT, typename OT>
inline int64_t gelu_mul_avx2(const IT* g, const IT* u, OT* o, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const __m256 c = _mm256_set1_ps(kGeluC), a = _mm256_set1_ps(kGeluA);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(g + i);
    const __m256 y = _mm256_mul_ps(c, _mm256_add_ps(x, _mm256_mul_ps(a, _mm256_mul_ps(x, _mm256_mul_ps(x, x)))));
    const __m256 e = exp256(_mm256_xor_ps(_mm256_add_ps(y, y), sign));
    store8(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), load8(u + i)));
  }
  return i;
}
#endif

enum class Gate { kSilu, kGeluTanh };

// act(gate) * up of one row's n elements: the vector path where the level allows it, the
// portable loop for the tail (and everything on a generic build). Both compute every element
// with the same operations, so where a row is cut into segments does not change its bits.
template <Gate A, typename IT, typename OT>
inline void gated_row(const IT* g, const IT* u, OT* o, int64_t n, int64_t isa) {
  int64_t done = 0;
#if RS_AVX2
  if (isa >= kIsaAvx2) done = A == Gate::kSilu ? silu_mul_avx2(g, u, o, n) : gelu_mul_avx2(g, u, o, n);
#endif
  if constexpr (A == Gate::kSilu)
    silu_mul_tail(g, u, o, done, n);
  else
    gelu_mul_tail(g, u, o, done, n);
  (void)isa;
}

// act(gate) * up for every row of the fused gate_up output.
template <Gate A, typename IT, typename OT>
void gated_rows(const IT* gu, int64_t gs, OT* out, int64_t os, int64_t rows, int64_t inter, int64_t isa) {
  at::parallel_for(0, rows, row_grain(3 * inter), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const IT* g = gu + t * gs;
      gated_row<A>(g, g + inter, out + t * os, inter, isa);
    }
  });
}

template <Gate A>
void gated_kernel(const at::Tensor& gu, at::Tensor& out, int64_t isa) {
  const int64_t rows = gu.size(0), inter = out.size(1);
  const bool ib = gu.scalar_type() == at::kBFloat16, ob = out.scalar_type() == at::kBFloat16;
  const int64_t gs = gu.stride(0), os = out.stride(0);
  if (ib && ob) gated_rows<A>(ptr<uint16_t>(gu), gs, ptr<uint16_t>(out), os, rows, inter, isa);
  else if (ib) gated_rows<A>(ptr<uint16_t>(gu), gs, ptr<float>(out), os, rows, inter, isa);
  else if (ob) gated_rows<A>(ptr<float>(gu), gs, ptr<uint16_t>(out), os, rows, inter, isa);
  else gated_rows<A>(ptr<float>(gu), gs, ptr<float>(out), os, rows, inter, isa);
}

// Per-head RMSNorm (weight row h for head h) and rotate-half RoPE of the first nqk heads of
// each row, the remaining nv heads copied: float32 rows out. The norm is norm_row's sequence,
// the rotation rope_rows'.
template <typename IT>
void qk_norm_rope_rows(const IT* in, int64_t is, float* out, int64_t os, const float* w, float eps,
                       const int64_t* positions, const float* cos, const float* sin, int64_t rows,
                       int64_t nqk, int64_t nv, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, row_grain((nqk + nv) * D), [&](int64_t b, int64_t e) {
    float buf[kMaxHeadDim];
    for (int64_t t = b; t < e; ++t) {
      const IT* x = in + t * is;
      float* y = out + t * os;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < nqk; ++h) {
        for (int64_t i = 0; i < D; ++i) buf[i] = load_f32(x + h * D, i);
        norm_row(buf, w + h * D, D, eps, buf);
        float* p = y + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = buf[i], x2 = buf[half + i];
          p[i] = x1 * c[i] - x2 * s[i];
          p[half + i] = x2 * c[i] + x1 * s[i];
        }
      }
      for (int64_t i = nqk * D; i < (nqk + nv) * D; ++i) y[i] = load_f32(x, i);
    }
  });
}

template <typename IT, typename CT>
void store_rows(const IT* k, const IT* v, int64_t ks, int64_t vs, CT* kc, CT* vc, int64_t cs,
                const int64_t* slots, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t s = slots[t];
      for (int64_t i = 0; i < n; ++i) store_f32(kc + s * cs, i, load_f32(k + t * ks, i));
      for (int64_t i = 0; i < n; ++i) store_f32(vc + s * cs, i, load_f32(v + t * vs, i));
    }
  });
}
}  // namespace

void rope_kernel(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, int64_t n_rot_heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  if (qkv.scalar_type() == at::kBFloat16)
    rope_rows(ptr<uint16_t>(qkv), qkv.stride(0), pos, ptr<float>(cos), ptr<float>(sin), rows,
              n_rot_heads, head_dim);
  else
    rope_rows(ptr<float>(qkv), qkv.stride(0), pos, ptr<float>(cos), ptr<float>(sin), rows,
              n_rot_heads, head_dim);
}

void silu_mul_kernel(const at::Tensor& gu, at::Tensor& out, int64_t isa) { gated_kernel<Gate::kSilu>(gu, out, isa); }

void gated_segment(int64_t kind, const float* g, const float* u, float* o, int64_t n, int64_t isa) {
  if (kind == kGateSilu)
    gated_row<Gate::kSilu>(g, u, o, n, isa);
  else
    gated_row<Gate::kGeluTanh>(g, u, o, n, isa);
}

void gelu_tanh_mul_kernel(const at::Tensor& gu, at::Tensor& out, int64_t isa) {
  gated_kernel<Gate::kGeluTanh>(gu, out, isa);
}

void qk_norm_rope_kernel(const at::Tensor& qkv, const at::Tensor& weight, double eps,
                         const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t n_qk_heads, int64_t head_dim, at::Tensor& out) {
  const int64_t rows = qkv.size(0);
  const int64_t nv = out.size(1) / head_dim - n_qk_heads;
  const int64_t* pos = positions.data_ptr<int64_t>();
  if (qkv.scalar_type() == at::kBFloat16)
    qk_norm_rope_rows(ptr<uint16_t>(qkv), qkv.stride(0), ptr<float>(out), out.stride(0), ptr<float>(weight),
                      static_cast<float>(eps), pos, ptr<float>(cos), ptr<float>(sin), rows, n_qk_heads, nv,
                      head_dim);
  else
    qk_norm_rope_rows(ptr<float>(qkv), qkv.stride(0), ptr<float>(out), out.stride(0), ptr<float>(weight),
                      static_cast<float>(eps), pos, ptr<float>(cos), ptr<float>(sin), rows, n_qk_heads, nv,
                      head_dim);
}

void store_kv_kernel(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t rows = k.size(0), n = k.size(1) * k.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool ib = k.scalar_type() == at::kBFloat16, cb = k_cache.scalar_type() == at::kBFloat16;
  const int64_t ks = k.stride(0), vs = v.stride(0), cs = k_cache.stride(0);
  if (ib && cb)
    store_rows(ptr<uint16_t>(k), ptr<uint16_t>(v), ks, vs, ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache), cs, sp, rows, n);
  else if (ib)
    store_rows(ptr<uint16_t>(k), ptr<uint16_t>(v), ks, vs, ptr<float>(k_cache), ptr<float>(v_cache), cs, sp, rows, n);
  else if (cb)
    store_rows(ptr<float>(k), ptr<float>(v), ks, vs, ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache), cs, sp, rows, n);
  else
    store_rows(ptr<float>(k), ptr<float>(v), ks, vs, ptr<float>(k_cache), ptr<float>(v_cache), cs, sp, rows, n);
}

void store_kv_quant_kernel(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slots, int64_t kind) {
  const int64_t rows = k.size(0), heads = k.size(1), D = k.size(2), R = k_cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t ks = k.stride(0), vs = v.stride(0), cs = k_cache.stride(0);
  uint8_t* kc = k_cache.data_ptr<uint8_t>();
  uint8_t* vc = v_cache.data_ptr<uint8_t>();
  auto go = [&](auto* kp, auto* vp) {
    at::parallel_for(0, rows, row_grain(2 * heads * D), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          quantize_row(kp + t * ks + h * D, D, kind, kc + sp[t] * cs + h * R);
          quantize_row(vp + t * vs + h * D, D, kind, vc + sp[t] * cs + h * R);
        }
    });
  };
  if (k.scalar_type() == at::kBFloat16)
    go(ptr<uint16_t>(k), ptr<uint16_t>(v));
  else
    go(ptr<float>(k), ptr<float>(v));
}

}  // namespace radixserve
