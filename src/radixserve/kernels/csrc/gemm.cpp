// The model's linear layers: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), float32
// accumulation, with the weights packed once at load time, in float32 or bfloat16.
//
// Why our own: on CPUs without native bfloat16 arithmetic (AVX2, and AVX-512 without BF16)
// a decode step is bound by reading the weights, and bfloat16 weights computed in float32
// halve those bytes, which no torch CPU path offers (oneDNN refuses bf16 there, torch's
// fallback rounds every product to bf16). And the result of a row must not depend on the
// other rows of the call: every output element is one chain of fused multiply-adds over
// k = 0..K-1, in order, whatever the row count, the tile a row falls in, the thread count
// or the instruction set — so a prefix computed in a long prefill equals, bit for bit, the
// same tokens computed in a decode step (what keeps cache-on == cache-off exact).
//
// Packed layout: panels of 16 output columns, k-major: w_packed[p][k][0..15] = w[16 p + c][k]
// (columns past N are zero). The AVX2 micro-kernel holds 6 rows x 16 columns of sums in 12
// registers, loads one panel row (two vectors) per k and broadcasts the 6 x values; the
// AVX-512 one holds up to 12 rows x 16 columns (one vector per row, so twice the products
// per instruction). Groups of panels that fit L2 meet every row of the call, so each weight
// is read from memory once.
#include "common.h"
#include "gemm_dot.h"
#include "simd_avx2.h"

#if RS_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define RS_GEMM_AVX512 1
#else
#define RS_GEMM_AVX512 0
#endif

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace radixserve {
namespace {

constexpr int64_t kNR = 16;   // output columns per panel
constexpr int64_t kMR = 6;    // rows per micro-kernel call
constexpr int64_t kL2Floats = 512 * 1024 / 4;  // a typical per-core L2 (512 KB), in floats

struct Gemm {
  const float* x;     // [M, K] float32 rows, stride ldx
  int64_t ldx;
  const void* w;      // packed panels (float32 or bfloat16 bits), w[0] the first of panel wp0
  int64_t wp0 = 0;
  bool w_bf16;
  const float* bias;  // [N] or nullptr
  void* out;          // [M, N], stride ldo, float32 or bfloat16
  int64_t ldo;
  bool out_bf16;
  int64_t M, N, K;
  template <typename WT>
  const WT* panel_ptr(int64_t p) const { return static_cast<const WT*>(w) + (p - wp0) * K * 16; }
};

inline void store_row(const Gemm& g, int64_t m, int64_t n0, const float* v, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    float y = v[c];
    if (g.bias != nullptr) y = y + g.bias[n0 + c];
    if (g.out_bf16)
      static_cast<uint16_t*>(g.out)[m * g.ldo + n0 + c] = f32_to_bf16(y);
    else
      static_cast<float*>(g.out)[m * g.ldo + n0 + c] = y;
  }
}

// ---------------------------------------------------------------- portable path
// Rows [m0, m0 + rows) x panel p: per output element one fma chain over k, in order.
template <typename WT>
void tile_generic(const Gemm& g, int64_t m0, int64_t rows, int64_t p) {
  const WT* w = g.template panel_ptr<WT>(p);
  const int64_t n0 = p * kNR, cols = std::min(kNR, g.N - n0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = g.x + (m0 + r) * g.ldx;
    float acc[kNR] = {};
    for (int64_t k = 0; k < g.K; ++k) {
      const float xv = x[k];
      for (int64_t c = 0; c < kNR; ++c) acc[c] = std::fma(xv, load_f32(w, k * kNR + c), acc[c]);
    }
    store_row(g, m0 + r, n0, acc, cols);
  }
}

#if RS_AVX2
// ---------------------------------------------------------------- AVX2 path
template <typename WT>
inline void load_panel_row(const WT* w, __m256& lo, __m256& hi) {
  if constexpr (std::is_same_v<WT, uint16_t>) {
    lo = bf16x8_to_f32(w);
    hi = bf16x8_to_f32(w + 8);
  } else {
    lo = _mm256_loadu_ps(w);
    hi = _mm256_loadu_ps(w + 8);
  }
}

// R rows (1..6) x 16 columns; named accumulators (GCC keeps arrays of vectors in memory).
template <int R, typename WT>
void tile_avx2(const Gemm& g, int64_t m0, const WT* w, int64_t n0) {
  static_assert(R >= 1 && R <= 6, "1 to 6 rows");
  const int64_t K = g.K, ldx = g.ldx;
  const float* x0 = g.x + m0 * ldx;
  const float* x1 = x0 + (R > 1 ? ldx : 0);
  const float* x2 = x0 + (R > 2 ? 2 * ldx : 0);
  const float* x3 = x0 + (R > 3 ? 3 * ldx : 0);
  const float* x4 = x0 + (R > 4 ? 4 * ldx : 0);
  const float* x5 = x0 + (R > 5 ? 5 * ldx : 0);
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    constexpr int64_t kLineRows = 64 / (kNR * static_cast<int64_t>(sizeof(WT)));  // see tile_avx512
    if (k % kLineRows == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (k + 128) * kNR), _MM_HINT_T0);
    __m256 w0, w1;
    load_panel_row(w + k * kNR, w0, w1);
    __m256 xb = _mm256_broadcast_ss(x0 + k);
    c00 = _mm256_fmadd_ps(xb, w0, c00);
    c01 = _mm256_fmadd_ps(xb, w1, c01);
    if constexpr (R > 1) {
      xb = _mm256_broadcast_ss(x1 + k);
      c10 = _mm256_fmadd_ps(xb, w0, c10);
      c11 = _mm256_fmadd_ps(xb, w1, c11);
    }
    if constexpr (R > 2) {
      xb = _mm256_broadcast_ss(x2 + k);
      c20 = _mm256_fmadd_ps(xb, w0, c20);
      c21 = _mm256_fmadd_ps(xb, w1, c21);
    }
    if constexpr (R > 3) {
      xb = _mm256_broadcast_ss(x3 + k);
      c30 = _mm256_fmadd_ps(xb, w0, c30);
      c31 = _mm256_fmadd_ps(xb, w1, c31);
    }
    if constexpr (R > 4) {
      xb = _mm256_broadcast_ss(x4 + k);
      c40 = _mm256_fmadd_ps(xb, w0, c40);
      c41 = _mm256_fmadd_ps(xb, w1, c41);
    }
    if constexpr (R > 5) {
      xb = _mm256_broadcast_ss(x5 + k);
      c50 = _mm256_fmadd_ps(xb, w0, c50);
      c51 = _mm256_fmadd_ps(xb, w1, c51);
    }
  }
  const int64_t cols = std::min(kNR, g.N - n0);
  alignas(32) float buf[kNR];
  const __m256 b0 = g.bias != nullptr && cols == kNR ? _mm256_loadu_ps(g.bias + n0) : _mm256_setzero_ps();
  const __m256 b1 = g.bias != nullptr && cols == kNR ? _mm256_loadu_ps(g.bias + n0 + 8) : _mm256_setzero_ps();
  auto put = [&](int64_t r, __m256 lo, __m256 hi) {
    const int64_t m = m0 + r;
    if (cols == kNR) {
      if (g.bias != nullptr) {
        lo = _mm256_add_ps(lo, b0);
        hi = _mm256_add_ps(hi, b1);
      }
      if (g.out_bf16) {
        uint16_t* o = static_cast<uint16_t*>(g.out) + m * g.ldo + n0;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), f32_to_bf16x8(lo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8), f32_to_bf16x8(hi));
      } else {
        float* o = static_cast<float*>(g.out) + m * g.ldo + n0;
        _mm256_storeu_ps(o, lo);
        _mm256_storeu_ps(o + 8, hi);
      }
    } else {  // the last, partial panel
      _mm256_store_ps(buf, lo);
      _mm256_store_ps(buf + 8, hi);
      store_row(g, m, n0, buf, cols);
    }
  };
  put(0, c00, c01);
  if constexpr (R > 1) put(1, c10, c11);
  if constexpr (R > 2) put(2, c20, c21);
  if constexpr (R > 3) put(3, c30, c31);
  if constexpr (R > 4) put(4, c40, c41);
  if constexpr (R > 5) put(5, c50, c51);
}

// Fewer rows than the FMA units need chains: R (1 or 2) rows x NP panels at once, so one k
// step issues 2 * R * NP independent FMAs (each output still one in-order chain over k; the
// same bits as tile_avx2). Panel i starts at w + i * panel; its columns at n0 + 16 i.
template <int R, int NP, typename WT>
void tile_avx2_wide(const Gemm& g, int64_t m0, const WT* w, int64_t panel, int64_t n0) {
  static_assert((R == 1 || R == 2) && NP >= 1 && NP <= 4 && R * NP <= 4, "at most 8 accumulators");
  const int64_t K = g.K;
  const float* x0 = g.x + m0 * g.ldx;
  const float* x1 = x0 + (R > 1 ? g.ldx : 0);
  __m256 c0[NP][2], c1[NP][2];
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i) {
    c0[i][0] = c0[i][1] = _mm256_setzero_ps();
    c1[i][0] = c1[i][1] = _mm256_setzero_ps();
  }
  constexpr int64_t kLineRows = 64 / (kNR * static_cast<int64_t>(sizeof(WT)));
  for (int64_t k = 0; k < K; ++k) {
    const __m256 xb0 = _mm256_broadcast_ss(x0 + k);
    const __m256 xb1 = R > 1 ? _mm256_broadcast_ss(x1 + k) : xb0;
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      const WT* wi = w + i * panel + k * kNR;
      if (k % kLineRows == 0) _mm_prefetch(reinterpret_cast<const char*>(wi + 128 * kNR), _MM_HINT_T0);
      __m256 w0, w1;
      load_panel_row(wi, w0, w1);
      c0[i][0] = _mm256_fmadd_ps(xb0, w0, c0[i][0]);
      c0[i][1] = _mm256_fmadd_ps(xb0, w1, c0[i][1]);
      if constexpr (R > 1) {
        c1[i][0] = _mm256_fmadd_ps(xb1, w0, c1[i][0]);
        c1[i][1] = _mm256_fmadd_ps(xb1, w1, c1[i][1]);
      }
    }
  }
  alignas(32) float buf[kNR];
#pragma GCC unroll 4
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(buf, r == 0 ? c0[i][0] : c1[i][0]);
      _mm256_store_ps(buf + 8, r == 0 ? c0[i][1] : c1[i][1]);
      store_row(g, m0 + r, n0 + i * kNR, buf, std::min(kNR, g.N - n0 - i * kNR));
    }
}

// Decode's one or two rows over panels [p, p1), several panels a call; returns the first
// panel it left (the tail, fewer than a call's panels, goes to rows_avx2).
template <typename WT>
int64_t wide_avx2(const Gemm& g, int64_t p, int64_t p1) {
  if (g.M > 2) return p;
  const int64_t panel = g.K * kNR, np = 4 / g.M;
  for (; p + np <= p1; p += np) {
    const WT* wp = g.template panel_ptr<WT>(p);
    if (g.M == 1) tile_avx2_wide<1, 4>(g, 0, wp, panel, p * kNR);
    else tile_avx2_wide<2, 2>(g, 0, wp, panel, p * kNR);
  }
  return p;
}

template <typename WT>
void rows_avx2(const Gemm& g, int64_t m0, int64_t m1, const WT* w, int64_t n0) {
  int64_t m = m0;
  for (; m + kMR <= m1; m += kMR) tile_avx2<6>(g, m, w, n0);
  switch (m1 - m) {
    case 5: tile_avx2<5>(g, m, w, n0); break;
    case 4: tile_avx2<4>(g, m, w, n0); break;
    case 3: tile_avx2<3>(g, m, w, n0); break;
    case 2: tile_avx2<2>(g, m, w, n0); break;
    case 1: tile_avx2<1>(g, m, w, n0); break;
    default: break;
  }
}

// A bfloat16 panel used by many rows is widened to float32 once (exact), in L1/L2 scratch.
float* panel_scratch(int64_t n) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}
#endif  // RS_AVX2

#if RS_GEMM_AVX512
// ---------------------------------------------------------------- AVX-512 path
template <typename WT>
inline __m512 load_panel_row512(const WT* w) {
  if constexpr (std::is_same_v<WT, uint16_t>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // exact
  } else {
    return _mm512_loadu_ps(w);
  }
}

// R rows (1..12) x one panel: per output element the same in-order fma chain over k.
template <int R, typename WT>
void tile_avx512(const Gemm& g, int64_t m0, const WT* w, int64_t n0) {
  static_assert(R >= 1 && R <= 12, "1 to 12 rows");
  const int64_t K = g.K, ldx = g.ldx;
  const float* x = g.x + m0 * ldx;
  __m512 c[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    // A few rows of compute per weight byte: without a prefetch the loads of a panel wait
    // for memory instead of overlapping the FMAs of the rows before (decode's lm_head).
    constexpr int64_t kLineRows = 64 / (kNR * static_cast<int64_t>(sizeof(WT)));  // panel rows per line
    if (k % kLineRows == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (k + 128) * kNR), _MM_HINT_T0);
    const __m512 wv = load_panel_row512(w + k * kNR);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, c[r]);
  }
  const int64_t cols = std::min(kNR, g.N - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = g.bias != nullptr ? _mm512_maskz_loadu_ps(mask, g.bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    const __m512 y = g.bias != nullptr ? _mm512_add_ps(c[r], b) : c[r];
    const int64_t m = m0 + r;
    if (g.out_bf16) {
      alignas(64) float buf[kNR];
      _mm512_store_ps(buf, y);
      for (int64_t i = 0; i < cols; ++i) static_cast<uint16_t*>(g.out)[m * g.ldo + n0 + i] = f32_to_bf16(buf[i]);
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(g.out) + m * g.ldo + n0, mask, y);
    }
  }
}

// Few rows (1..4) x NP panels at once: R * NP independent FMA chains per k step instead of
// R (each output still one in-order chain over k; the same bits as tile_avx512).
template <int R, int NP, typename WT>
void tile_avx512_wide(const Gemm& g, int64_t m0, const WT* w, int64_t panel, int64_t n0) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 8, "at most 8 accumulators");
  const int64_t K = g.K, ldx = g.ldx;
  const float* x = g.x + m0 * ldx;
  __m512 c[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) c[r][i] = _mm512_setzero_ps();
  constexpr int64_t kLineRows = 64 / (kNR * static_cast<int64_t>(sizeof(WT)));
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) {
      const WT* wi = w + i * panel + k * kNR;
      if (k % kLineRows == 0) _mm_prefetch(reinterpret_cast<const char*>(wi + 128 * kNR), _MM_HINT_T0);
      const __m512 wv = load_panel_row512(wi);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) c[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, c[r][i]);
    }
  }
  alignas(64) float buf[kNR];
#pragma GCC unroll 8
  for (int i = 0; i < NP; ++i)
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(buf, c[r][i]);
      store_row(g, m0 + r, n0 + i * kNR, buf, std::min(kNR, g.N - n0 - i * kNR));
    }
}

// Decode's one to four rows over panels [p, p1), several panels a call (see wide_avx2).
template <typename WT>
int64_t wide_avx512(const Gemm& g, int64_t p, int64_t p1) {
  if (g.M > 4) return p;
  const int64_t panel = g.K * kNR, np = g.M == 1 ? 8 : g.M == 2 ? 4 : 2;
  for (; p + np <= p1; p += np) {
    const WT* wp = g.template panel_ptr<WT>(p);
    switch (g.M) {
      case 1: tile_avx512_wide<1, 8>(g, 0, wp, panel, p * kNR); break;
      case 2: tile_avx512_wide<2, 4>(g, 0, wp, panel, p * kNR); break;
      case 3: tile_avx512_wide<3, 2>(g, 0, wp, panel, p * kNR); break;
      default: tile_avx512_wide<4, 2>(g, 0, wp, panel, p * kNR); break;
    }
  }
  return p;
}

template <typename WT>
void rows_avx512(const Gemm& g, int64_t m0, int64_t m1, const WT* w, int64_t n0) {
  int64_t m = m0;
  for (; m + 12 <= m1; m += 12) tile_avx512<12>(g, m, w, n0);
  switch (m1 - m) {
#define RS_ROWS(k) \
  case k:          \
    tile_avx512<k>(g, m, w, n0); break;
    RS_ROWS(1) RS_ROWS(2) RS_ROWS(3) RS_ROWS(4) RS_ROWS(5) RS_ROWS(6)
    RS_ROWS(7) RS_ROWS(8) RS_ROWS(9) RS_ROWS(10) RS_ROWS(11)
#undef RS_ROWS
    default: break;
  }
}
#endif  // RS_GEMM_AVX512

#if RS_AVX2
// Panels [p0, p1) against every row with a vector kernel: `rows(g, m0, m1, w, n0)` runs rows
// [m0, m1) of one panel, `tile` rows at a time. Few rows (decode): each panel straight from
// memory, read once; `wide(g, p, p1)` first runs as many panels as it can several at a time
// (returning where it stopped), `rows_w` the rest. Many rows: groups of panels that fit L2 run against every row of the
// call, a row tile (in L1) against each panel of the group in turn, so each weight is read
// from memory once per call; bf16 groups are widened once (exact) into scratch first.
template <typename WT, int64_t kTile, typename Wide, typename RowsW, typename RowsF>
void panels_vector(const Gemm& g, int64_t p0, int64_t p1, Wide wide, RowsW rows_w, RowsF rows_f) {
  const int64_t panel = g.K * kNR;
  if (g.M <= 12) {
    int64_t p = wide(g, p0, p1);
    for (; p < p1; ++p) rows_w(g, 0, g.M, g.template panel_ptr<WT>(p), p * kNR);
    return;
  }
  const int64_t group = std::max<int64_t>(1, (kL2Floats / 2) / panel);
  for (int64_t q0 = p0; q0 < p1; q0 += group) {
    const int64_t q1 = std::min(p1, q0 + group);
    const float* f = nullptr;
    if constexpr (std::is_same_v<WT, uint16_t>) {
      float* s = panel_scratch((q1 - q0) * panel);
      const WT* w = g.template panel_ptr<WT>(q0);
      for (int64_t i = 0; i < (q1 - q0) * panel; i += 8) _mm256_storeu_ps(s + i, bf16x8_to_f32(w + i));
      f = s;
    } else {
      f = g.template panel_ptr<WT>(q0);
    }
    for (int64_t m = 0; m < g.M; m += kTile) {
      const int64_t m1 = std::min(g.M, m + kTile);
      for (int64_t p = q0; p < q1; ++p) rows_f(g, m, m1, f + (p - q0) * panel, p * kNR);
    }
  }
}
#endif

template <typename WT>
void gemm_panels(const Gemm& g, int64_t p0, int64_t p1, int64_t isa) {
#if RS_GEMM_AVX512
  if (isa >= kIsaAvx512) {
    panels_vector<WT, 12>(g, p0, p1, wide_avx512<WT>, rows_avx512<WT>, rows_avx512<float>);
    return;
  }
#endif
#if RS_AVX2
  if (isa >= kIsaAvx2) {
    panels_vector<WT, kMR>(g, p0, p1, wide_avx2<WT>, rows_avx2<WT>, rows_avx2<float>);
    return;
  }
#endif
  (void)isa;
  for (int64_t p = p0; p < p1; ++p) tile_generic<WT>(g, 0, g.M, p);
}

}  // namespace

void pack_linear_kernel(const at::Tensor& w, at::Tensor& packed) {
  const int64_t N = w.size(0), K = w.size(1), P = (N + kNR - 1) / kNR, ld = w.stride(0);
  const bool src_bf16 = w.scalar_type() == at::kBFloat16;
  const bool dst_bf16 = packed.scalar_type() == at::kBFloat16;
  const float* wf = src_bf16 ? nullptr : w.data_ptr<float>();
  const uint16_t* wb = src_bf16 ? reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) : nullptr;
  float* pf = dst_bf16 ? nullptr : packed.data_ptr<float>();
  uint16_t* pb = dst_bf16 ? static_cast<uint16_t*>(packed.data_ptr()) : nullptr;
  // Row by row: each weight row is read contiguously; its K values land 16 apart inside
  // one panel (K * 16 values, small enough to stay in cache while its 16 rows arrive).
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t c = 0; c < kNR; ++c) {
        const int64_t n = p * kNR + c;
        const int64_t base = p * K * kNR + c;
        for (int64_t k = 0; k < K; ++k) {
          const float v = n < N ? (src_bf16 ? bf16_to_f32(wb[n * ld + k]) : wf[n * ld + k]) : 0.0f;
          if (dst_bf16)
            pb[base + k * kNR] = f32_to_bf16(v);
          else
            pf[base + k * kNR] = v;
        }
      }
  });
}

void packed_linear_kernel(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                          const c10::optional<at::Tensor>& bias, at::Tensor& out, int64_t isa) {
  Gemm g;
  g.x = x.data_ptr<float>();
  g.ldx = x.stride(0);
  g.w = packed.data_ptr();
  g.w_bf16 = packed.scalar_type() == at::kBFloat16;
  g.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  g.out = out.data_ptr();
  g.ldo = out.stride(0);
  g.out_bf16 = out.scalar_type() == at::kBFloat16;
  g.M = x.size(0);
  g.N = N;
  g.K = x.size(1);
  const int64_t P = (N + kNR - 1) / kNR;
  // Panels split over threads in contiguous runs; which thread computes a panel does not
  // change its arithmetic. Small problems stay on the calling thread.
  const int64_t grain = N * g.K < (int64_t{1} << 15) ? P : 1;
  at::parallel_for(0, P, grain, [&](int64_t b, int64_t e) {
    if (g.w_bf16)
      gemm_panels<uint16_t>(g, b, e, isa);
    else
      gemm_panels<float>(g, b, e, isa);
  });
}

void f32_panels_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t wp0,
                     int64_t p0, int64_t p1, int64_t N, const float* bias, void* out, int64_t ldo,
                     bool out_bf16, int64_t isa) {
  Gemm g;
  g.x = x;
  g.ldx = ldx;
  g.w = w;
  g.wp0 = wp0;
  g.w_bf16 = true;
  g.bias = bias;
  g.out = out;
  g.ldo = ldo;
  g.out_bf16 = out_bf16;
  g.M = M;
  g.N = N;
  g.K = K;
  gemm_panels<uint16_t>(g, p0, p1, isa);
}

}  // namespace radixserve
