// Linear layers on GGUF blocks with integer dot products (``--weight-dtype gguf-q8``), and the
// definition they are exact to.
//
// Why: expanding 4-bit blocks to bfloat16 costs several vector instructions per 32 weights and
// leaves a one-thread decode compute-bound far below the bytes' bound. Quantizing the
// activation rows to 8 bits per 32-block, as llama.cpp does, turns a block's products into one
// integer dot product (64 multiply-adds per vpdpbusd), which is exact, so a fixed float chain
// over the blocks keeps every output element one definition whatever the path or the batch.
//
// The definition (kernels/quant_weights.py states it too; tests/test_gemm_q8dot.py computes it in numpy):
//
// 1. Each row x of the call, per 32-k block b: amax = max |x_k|. If amax < 2^-60 (zero
//    included), the block's codes are 0 and dx = 0. Else dx = amax / 127 and, with
//    inv = 127 / amax (both float32 divisions), xq_k = clamp(rint(x_k * inv), -127, 127),
//    rint rounding half to even; sx = sum of the block's xq_k. (Rows must be finite.)
// 2. Weight column n, block b: its codes as signed integers c_k (Q8_0: the stored int8; Q4_0:
//    q - 8; Q4_1: q, with the block's offset m) and its scale d, fp16 widened to float32.
// 3. I = sum_k c_k * xq_k, exact (|I| <= 32 * 128 * 127 < 2^24, so float(I) is exact too).
// 4. acc = 0; for b = 0, 1, ... in order: acc = fma(d * dx, float(I), acc), the product
//    d * dx rounded to float32 first; Q4_1 then also acc = fma(m * dx, float(sx), acc).
// 5. y = acc, + bias[n] (a float32 add) when there is one, stored as float32 or rounded to
//    bfloat16 (to nearest even).
//
// The integer sums are exact and the float chain is fixed per element, so a row gives the
// same bits alone, in a decode batch and inside a prefill of any length, on every path: the
// portable loop, AVX2 (vpmaddubsw + vpmaddwd) and AVX512-VNNI (vpdpbusd). No step can produce a
// denormal (d >= 2^-24 unless 0, dx >= 2^-67), and the kernels run under IEEE defaults
// (round to nearest even, no flush to zero) whatever the caller's MXCSR.
//
// How the integer sums are taken: the panels (quant.h) hold unsigned codes u = c + offset,
// four k of a column per 32-bit word. vpdpbusd multiplies the unsigned u by the signed xq and
// sums four products into int32 lanes: I = sum u xq - offset * sx. vpmaddubsw sums two
// products into saturating int16: for 4-bit codes a pair is at most 2 * 15 * 127 = 3810, so
// eight of them (all 32 k) add in int16 without saturating (30480 < 32767) before vpmaddwd
// widens; for Q8_0 it takes llama.cpp's sign trick, |c| against xq with c's sign: a pair is at
// most 2 * 128 * 127 = 32512 (c = -128 included, since xq >= -127), widened at once.
#include "common.h"
#include "quant.h"
#include "simd_avx2.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_Q8_X86 1
#else
#define RS_Q8_X86 0
#endif

namespace radixserve {

using namespace quant;

namespace {

constexpr float kTinyAmax = 0x1p-60f;  // a block whose amax is below quantizes to zeros
constexpr int64_t kChunkBytes = 192 * 1024;  // panels a thread runs every row tile over: in L2

// IEEE defaults on this thread while alive: round to nearest even, no flush to zero, no
// denormals read as zero (the definition's arithmetic; see the header).
class IeeeDefaults {
 public:
#if RS_Q8_X86
  IeeeDefaults() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0xe040u); }
  ~IeeeDefaults() { _mm_setcsr(saved_); }
#else
  IeeeDefaults() = default;
#endif
  IeeeDefaults(const IeeeDefaults&) = delete;
  IeeeDefaults& operator=(const IeeeDefaults&) = delete;

 private:
#if RS_Q8_X86
  unsigned saved_;
#endif
};

// The quantized rows of a call: row m's codes at q + m * K, its blocks' dx and sx at m * G.
struct XRows {
  const int8_t* q;
  const float* d;
  const int32_t* s;
  int64_t K, G;
};

// Step 1 of the definition for one 32-block. One portable loop for every level: each operation
// is a correctly rounded IEEE one (the max is exact), so the compiler's vectorisation of it
// cannot change a bit, and its cost is K per row against the linear's K * N.
inline void quantize_block(const float* x, int8_t* q, float& d, int32_t& s) {
  float amax = 0.f;
  for (int k = 0; k < kGroupK; ++k) amax = std::max(amax, std::fabs(x[k]));
  if (!(amax >= kTinyAmax)) {
    std::memset(q, 0, kGroupK);
    d = 0.f;
    s = 0;
    return;
  }
  d = amax / 127.f;
  const float inv = 127.f / amax;
  int32_t sum = 0;
  for (int k = 0; k < kGroupK; ++k) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[k] * inv)));
    q[k] = static_cast<int8_t>(v);
    sum += q[k];
  }
  s = sum;
}

void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* q, float* d, int32_t* s) {
  const int64_t G = K / kGroupK;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    IeeeDefaults ieee;
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g)
        quantize_block(x + m * ldx + g * kGroupK, q + m * K + g * kGroupK, d[m * G + g], s[m * G + g]);
  });
}

// A call's segment as the tiles read it.
struct QC {
  XRows x;
  const uint8_t* seg;  // the segment's panels
  int64_t panel_bytes;
  const float* bias;  // [n] of the segment, or nullptr
  void* out;          // column 0 of the segment
  int64_t ldo;
  bool out_bf16;
  int64_t N;  // the segment's columns
};

// Step 5: row m's 16 finished columns of panel p.
inline void store16(const QC& c, int64_t m, int64_t p, const float* acc) {
  const int64_t n0 = p * kNR, cols = std::min<int64_t>(kNR, c.N - n0);
  for (int64_t i = 0; i < cols; ++i) {
    const float y = c.bias != nullptr ? acc[i] + c.bias[n0 + i] : acc[i];
    if (c.out_bf16)
      static_cast<uint16_t*>(c.out)[m * c.ldo + n0 + i] = f32_to_bf16(y);
    else
      static_cast<float*>(c.out)[m * c.ldo + n0 + i] = y;
  }
}

template <int32_t F>
constexpr int kOffset = F == kQ8_0 ? 128 : F == kQ4_0 ? 8 : 0;

// ---------------------------------------------------------------- portable
template <int32_t F>
void tile_portable(const QC& c, int64_t m0, int64_t rows, int64_t p) {
  const uint8_t* pan = c.seg + p * c.panel_bytes;
  const int64_t G = c.x.G;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    float acc[kNR] = {};
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* grp = pan + g * idot_group_bytes(F);
      const uint8_t* codes = grp + idot_scale_bytes(F);
      const int8_t* xq = c.x.q + m * c.x.K + g * kGroupK;
      const float dx = c.x.d[m * G + g];
      const int32_t sx = c.x.s[m * G + g];
      for (int col = 0; col < kNR; ++col) {
        int32_t I = 0;
        for (int k = 0; k < kGroupK; ++k)
          I += (static_cast<int32_t>(idot_code(F, codes, col, k)) - kOffset<F>) * xq[k];
        const float d = f16_to_f32(load_u16(grp + 2 * col));
        acc[col] = std::fma(d * dx, static_cast<float>(I), acc[col]);
        if constexpr (F == kQ4_1) {
          const float mn = f16_to_f32(load_u16(grp + 2 * kNR + 2 * col));
          acc[col] = std::fma(mn * dx, static_cast<float>(sx), acc[col]);
        }
      }
    }
    store16(c, m, p, acc);
  }
}

#if RS_AVX2 && defined(__F16C__)
#define RS_Q8_AVX2 1
// ---------------------------------------------------------------- AVX2: vpmaddubsw + vpmaddwd
template <int32_t F, int R>
void tile_avx2(const QC& c, int64_t m0, int64_t p) {
  static_assert(R >= 1 && R <= 2, "two rows: 4 accumulators, 8 code registers");
  const uint8_t* pan = c.seg + p * c.panel_bytes;
  const int64_t G = c.x.G;
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* grp = pan + g * idot_group_bytes(F);
    const uint8_t* codes = grp + idot_scale_bytes(F);
    _mm_prefetch(reinterpret_cast<const char*>(grp + 4 * idot_group_bytes(F)), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h + 7: bytes 32h .. 32h + 31 of each line
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 16 * h)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (F == kQ4_1)
        mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 2 * kNR + 16 * h)));
      __m256i w[8];  // w[t]: k = 4t .. 4t + 3 of the 8 columns
      if constexpr (F == kQ8_0) {
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t)  // the signed codes c = u - 128
          w[t] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * t + 32 * h)), flip);
      } else {
#pragma GCC unroll 8
        for (int t = 0; t < 4; ++t) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * t + 32 * h));
          w[t] = _mm256_and_si256(v, low4);
          w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int8_t* xq = c.x.q + m * c.x.K + g * kGroupK;
        const float dx = c.x.d[m * G + g];
        const int32_t sx = c.x.s[m * G + g];
        __m256i I;
        if constexpr (F == kQ8_0) {
          I = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int t = 0; t < 8; ++t) {
            int32_t x4;
            std::memcpy(&x4, xq + 4 * t, 4);
            const __m256i xb = _mm256_set1_epi32(x4);
            const __m256i pr = _mm256_maddubs_epi16(_mm256_abs_epi8(w[t]), _mm256_sign_epi8(xb, w[t]));
            I = _mm256_add_epi32(I, _mm256_madd_epi16(pr, ones));
          }
        } else {
          __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int t = 0; t < 8; ++t) {
            int32_t x4;
            std::memcpy(&x4, xq + 4 * t, 4);
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(x4)));
          }
          I = _mm256_madd_epi16(s16, ones);
          if constexpr (kOffset<F> != 0) I = _mm256_sub_epi32(I, _mm256_set1_epi32(kOffset<F> * sx));
        }
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(I), acc[r][h]);
        if constexpr (F == kQ4_1)
          acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(mw, _mm256_set1_ps(dx)), _mm256_set1_ps(static_cast<float>(sx)),
                                      acc[r][h]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(32) float buf[kNR];
    _mm256_store_ps(buf, acc[r][0]);
    _mm256_store_ps(buf + 8, acc[r][1]);
    store16(c, m0 + r, p, buf);
  }
}
#else
#define RS_Q8_AVX2 0
#endif

#if RS_Q8_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RS_Q8_VNNI 1
// ---------------------------------------------------------------- AVX512-VNNI: vpdpbusd
// Rows [m0, m0 + R) x panel p: the panel's codes are unpacked once per group and serve every
// row. One panel a tile: a decode's rows stream the weight once, in address order.
template <int32_t F, int R>
void tile_vnni(const QC& c, int64_t m0, int64_t p) {
  static_assert(R >= 1 && R <= 8, "at most 8 accumulators");
  const int64_t G = c.x.G;
  const uint8_t* pan = c.seg + p * c.panel_bytes;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* grp = pan + g * idot_group_bytes(F);
    const uint8_t* codes = grp + idot_scale_bytes(F);
    _mm_prefetch(reinterpret_cast<const char*>(grp + 8 * idot_group_bytes(F)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(grp + 8 * idot_group_bytes(F) + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(grp + 8 * idot_group_bytes(F) + 256), _MM_HINT_T0);
    if constexpr (F == kQ8_0) _mm_prefetch(reinterpret_cast<const char*>(grp + 8 * idot_group_bytes(F) + 448), _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp)));
    __m512 mw = _mm512_setzero_ps();
    if constexpr (F == kQ4_1)
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 2 * kNR)));
    __m512i w[8];  // w[t]: k = 4t .. 4t + 3 of the 16 columns, unsigned
    if constexpr (F == kQ8_0) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(codes + 64 * t);
    } else {
#pragma GCC unroll 8
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(codes + 64 * t);
        w[t] = _mm512_and_si512(v, low4);
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xq = c.x.q + m * c.x.K + g * kGroupK;
      const float dx = c.x.d[m * G + g];
      const int32_t sx = c.x.s[m * G + g];
      __m512i I;
      if constexpr (R <= 2) {  // two chains: a lone row's dot products overlap their latency
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t += 2) {
          int32_t a, b;
          std::memcpy(&a, xq + 4 * t, 4);
          std::memcpy(&b, xq + 4 * t + 4, 4);
          s0 = _mm512_dpbusd_epi32(s0, w[t], _mm512_set1_epi32(a));
          s1 = _mm512_dpbusd_epi32(s1, w[t + 1], _mm512_set1_epi32(b));
        }
        I = _mm512_add_epi32(s0, s1);
      } else {  // the rows' chains overlap each other
        I = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          int32_t a;
          std::memcpy(&a, xq + 4 * t, 4);
          I = _mm512_dpbusd_epi32(I, w[t], _mm512_set1_epi32(a));
        }
      }
      if constexpr (kOffset<F> != 0) I = _mm512_sub_epi32(I, _mm512_set1_epi32(kOffset<F> * sx));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(I), acc[r]);
      if constexpr (F == kQ4_1)
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(mw, _mm512_set1_ps(dx)), _mm512_set1_ps(static_cast<float>(sx)),
                                 acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    alignas(64) float buf[kNR];
    _mm512_store_ps(buf, acc[r]);
    store16(c, m0 + r, p, buf);
  }
}
#else
#define RS_Q8_VNNI 0
#endif

// ---------------------------------------------------------------- tiling
// Rows [0, M) x panels [p0, p1) of one segment at level `isa`. Every tile computes each element
// with the definition's chain, so how the call is cut changes the speed, never the bits.
template <int32_t F>
void run_panels(const QC& c, int64_t M, int64_t p0, int64_t p1, int64_t isa) {
  // Prefill: every row tile runs over a chunk of panels that stays in L2. A decode's rows are
  // one tile (AVX-512), so the chunks only cut its one pass over the weight.
  const int64_t chunk = std::max<int64_t>(2, kChunkBytes / c.panel_bytes);
  for (int64_t q0 = p0; q0 < p1; q0 += chunk) {
    const int64_t q1 = std::min(p1, q0 + chunk);
#if RS_Q8_VNNI
    if (isa >= kIsaAvx512) {
      int64_t m0 = 0;
      for (; m0 + 8 <= M; m0 += 8)
        for (int64_t p = q0; p < q1; ++p) tile_vnni<F, 8>(c, m0, p);
      if (m0 < M) {
        using T = void (*)(const QC&, int64_t, int64_t);
        static constexpr T tiles[7] = {&tile_vnni<F, 1>, &tile_vnni<F, 2>, &tile_vnni<F, 3>, &tile_vnni<F, 4>,
                                       &tile_vnni<F, 5>, &tile_vnni<F, 6>, &tile_vnni<F, 7>};
        const T tile = tiles[M - m0 - 1];
        for (int64_t p = q0; p < q1; ++p) tile(c, m0, p);
      }
      continue;
    }
#endif
#if RS_Q8_AVX2
    if (isa >= kIsaAvx2) {
      int64_t m0 = 0;
      for (; m0 + 2 <= M; m0 += 2)
        for (int64_t p = q0; p < q1; ++p) tile_avx2<F, 2>(c, m0, p);
      for (; m0 < M; ++m0)
        for (int64_t p = q0; p < q1; ++p) tile_avx2<F, 1>(c, m0, p);
      continue;
    }
#endif
    (void)isa;
    for (int64_t m0 = 0; m0 < M; m0 += 4)
      for (int64_t p = q0; p < q1; ++p) tile_portable<F>(c, m0, std::min<int64_t>(4, M - m0), p);
  }
}

using RunFn = void (*)(const QC&, int64_t, int64_t, int64_t, int64_t);
RunFn run_fn(int32_t f) {
  switch (f) {
    case kQ8_0: return &run_panels<kQ8_0>;
    case kQ4_0: return &run_panels<kQ4_0>;
    default: return &run_panels<kQ4_1>;
  }
}

template <typename T>
T* scratch(std::vector<T>& buf, int64_t n) {
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

}  // namespace

int64_t q8dot_panel_bytes(int64_t fmt, int64_t K) {
  TORCH_CHECK(int_dot_format(static_cast<int32_t>(fmt)), "format ", fmt, " has no integer-dot layout");
  return idot_panel_bytes(static_cast<int32_t>(fmt), K);
}

void q8dot_quantize_kernel(const at::Tensor& x, at::Tensor& q, at::Tensor& d, at::Tensor& s) {
  quantize_rows(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), q.data_ptr<int8_t>(), d.data_ptr<float>(),
                s.data_ptr<int32_t>());
}

namespace quant {

void idot_linear(const at::Tensor& x, const Blob& blob, const c10::optional<at::Tensor>& bias, at::Tensor& out,
                 int64_t isa) {
  const int64_t M = x.size(0), K = blob.K, G = K / kGroupK;
  TORCH_CHECK(K % kGroupK == 0, "an integer-dot weight needs K a multiple of 32, got ", K);
  static thread_local std::vector<int8_t> qbuf;
  static thread_local std::vector<float> dbuf;
  static thread_local std::vector<int32_t> sbuf;
  int8_t* q = scratch(qbuf, M * K);
  float* d = scratch(dbuf, M * G);
  int32_t* s = scratch(sbuf, M * G);
  quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, q, d, s);
  const XRows xr{q, d, s, K, G};
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  char* o = static_cast<char*>(out.data_ptr());
  for (const Segment& sg : blob.segs) {
    const QC c{xr, blob.base + sg.offset, blob.panel_bytes_of(sg), b != nullptr ? b + sg.n0 : nullptr,
               o + sg.n0 * (out_bf16 ? 2 : 4), out.stride(0), out_bf16, sg.n};
    const RunFn run = run_fn(sg.fmt);
    const int64_t P = sg.panels();
    const int64_t grain = sg.n * K < (int64_t{1} << 15) ? P : 1;
    at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
      IeeeDefaults ieee;
      run(c, M, p0, p1, isa);
    });
  }
}

}  // namespace quant
}  // namespace radixserve
