// The model's linear layers in bfloat16 dot-product arithmetic, the same bits on every CPU:
// out[m, n] = sum over k pairs of bf16(x[m, 2j+1]) * w[n, 2j+1] and bf16(x[m, 2j]) * w[n, 2j]
// (+ bias[n]), accumulated in float32.
//
// Why: a CPU with native bfloat16 arithmetic (AVX512-BF16's vdpbf16ps) multiplies bf16 pairs
// at twice the float32 FMA rate, which is what oneDNN's bf16 GEMM uses; but oneDNN picks its
// blocking, and with it the order a row's sums are taken in, by the row count, so a token's
// result depends on the batch it ran in. Here every output element is one chain in a fixed
// order, whatever the row count, the tile a row falls in or the thread that runs it:
//
//   acc = 0; for j = 0 .. K2-1:  acc += x[2j+1] w[2j+1];  acc += x[2j] w[2j]
//
// each += one rounding of an exact product (a bf16 product fits float32), with denormal
// inputs read as zero and denormal results flushed to zero. That is vdpbf16ps's definition
// (Intel SDM; checked bit for bit against the hardware on every path by the tests), so a
// CPU without the instruction computes the same bits with two fused multiply-adds per pair
// under MXCSR's FTZ and DAZ (AVX-512F, AVX2), and the portable code flushes by hand. A prefix
// computed in a long prefill on one machine equals, bit for bit, the same tokens decoded one
// at a time, there or on a machine of another instruction-set level.
//
// x arrives in float32 and is rounded to bfloat16 (to nearest even) here, row by row, so the
// rest of the model keeps its float32 residual stream and no caller rounds differently.
//
// Packed layout (pack_linear_dot): panels of 16 output columns, k-pair-major, the pair
// interleaved: w_packed[p][j][c][0..1] = w[16 p + c][2j .. 2j+1] (zero past N and past K):
// one 64-byte line per panel per k pair, the operand vdpbf16ps takes.
#include "common.h"
#include "gemm_dot.h"
#include "simd_avx2.h"
#include "tiles.h"

#if RS_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define RS_DOT_AVX512 1
#else
#define RS_DOT_AVX512 0
#endif
#if RS_DOT_AVX512 && defined(__AVX512BF16__)
#define RS_DOT_NATIVE 1
#else
#define RS_DOT_NATIVE 0
#endif

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#endif

#include <algorithm>
#include <cfloat>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace radixserve {

bool dot_native_built() { return RS_DOT_NATIVE; }

namespace {

constexpr int64_t kNR = 16;             // output columns per panel
constexpr int64_t kPairRow = 2 * kNR;   // bf16 values per panel per k pair
constexpr int64_t kL2Bytes = 512 * 1024;

struct DotGemm {
  const uint16_t* xh;  // [M, 2 K2] the rows in bf16 (a pair j is x[2j], x[2j+1])
  const float* xf;     // [M, 2 K2] the same values as float32, in chain order (x[2j+1], x[2j])
  int64_t K2;
  const uint16_t* w;   // packed panels, w[0] the first value of panel wp0
  int64_t wp0 = 0;
  const float* bias;   // [N] or nullptr
  void* out;           // [M, N], stride ldo, float32 or bfloat16
  int64_t ldo;
  bool out_bf16;
  int64_t M, N;
  // Where element (m, n) is stored: out[(m - out_r0) * ldo + n - out_c0] (a gated call's tiles
  // write a scratch block of rows from out_r0 and columns from out_c0).
  int64_t out_r0 = 0, out_c0 = 0;
  int64_t panel() const { return K2 * kPairRow; }
  const uint16_t* panel_ptr(int64_t p) const { return w + (p - wp0) * panel(); }
  int64_t out_index(int64_t m, int64_t n) const { return (m - out_r0) * ldo + n - out_c0; }
};

// Two adjacent bf16 values as the 32-bit lane vdpbf16ps multiplies pairwise.
inline int32_t load_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float flush(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }

// The epilogue of one output row segment: the bias added (one rounding; under FTZ/DAZ on the
// vector paths, by hand on the portable one) and the store in the output dtype.
inline void store_row(const DotGemm& g, int64_t m, int64_t n0, const float* v, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    float y = v[c];
    if (g.bias != nullptr) y = flush(y + flush(g.bias[n0 + c]));
    if (g.out_bf16)
      static_cast<uint16_t*>(g.out)[g.out_index(m, n0 + c)] = f32_to_bf16(y);
    else
      static_cast<float*>(g.out)[g.out_index(m, n0 + c)] = y;
  }
}

// ---------------------------------------------------------------- portable path
// Rows [m0, m1) against panels [p0, p1).
void panels_generic(const DotGemm& g, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* w = g.panel_ptr(p);
    const int64_t n0 = p * kNR, cols = std::min(kNR, g.N - n0);
    for (int64_t m = m0; m < m1; ++m) {
      const float* x = g.xf + m * 2 * g.K2;
      float acc[kNR] = {};
      for (int64_t j = 0; j < g.K2; ++j) {
        const float xo = flush(x[2 * j]), xe = flush(x[2 * j + 1]);
        for (int64_t c = 0; c < kNR; ++c) {
          const float we = flush(bf16_to_f32(w[j * kPairRow + 2 * c]));
          const float wo = flush(bf16_to_f32(w[j * kPairRow + 2 * c + 1]));
          acc[c] = flush(std::fma(xo, wo, acc[c]));
          acc[c] = flush(std::fma(xe, we, acc[c]));
        }
      }
      store_row(g, m, n0, acc, cols);
    }
  }
}

#if RS_AVX2
// One row's 16 columns at n0: the epilogue of store_row (under FTZ/DAZ the vector add flushes
// as store_row's does by hand), vectorised for a whole float32 panel.
inline void store_avx2(const DotGemm& g, int64_t m, int64_t n0, __m256 lo, __m256 hi) {
  if (!g.out_bf16 && n0 + kNR <= g.N) {
    if (g.bias != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(g.bias + n0));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(g.bias + n0 + 8));
    }
    float* o = static_cast<float*>(g.out) + g.out_index(m, n0);
    _mm256_storeu_ps(o, lo);
    _mm256_storeu_ps(o + 8, hi);
    return;
  }
  alignas(32) float buf[kNR];
  _mm256_store_ps(buf, lo);
  _mm256_store_ps(buf + 8, hi);
  store_row(g, m, n0, buf, std::min(kNR, g.N - n0));
}

// ---------------------------------------------------------------- AVX2 (emulated dot products)
// R rows x NP panels; a panel's pair line is two 8-column halves, each split into its even
// (x[2j]) and odd (x[2j+1]) weights.
template <int R, int NP>
void tile_avx2(const DotGemm& g, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 4, "at most 8 accumulators");
  const int64_t K2 = g.K2, panel = g.panel();
  const uint16_t* w = g.panel_ptr(p);
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 c[R][NP][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) c[r][i][0] = c[r][i][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    __m256 we[NP][2], wo[NP][2];
#pragma GCC unroll 4
    for (int i = 0; i < NP; ++i) {
      const uint16_t* wl = w + i * panel + j * kPairRow;
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wl + h * kNR));
        we[i][h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        wo[i][h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* x = g.xf + (m0 + r) * 2 * K2 + 2 * j;
      const __m256 xo = _mm256_broadcast_ss(x), xe = _mm256_broadcast_ss(x + 1);
#pragma GCC unroll 4
      for (int i = 0; i < NP; ++i)
        for (int h = 0; h < 2; ++h) {
          c[r][i][h] = _mm256_fmadd_ps(xo, wo[i][h], c[r][i][h]);
          c[r][i][h] = _mm256_fmadd_ps(xe, we[i][h], c[r][i][h]);
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) store_avx2(g, m0 + r, (p + i) * kNR, c[r][i][0], c[r][i][1]);
}
#endif  // RS_AVX2

#if RS_DOT_AVX512
// ---------------------------------------------------------------- AVX-512 (emulated, or native)
inline void store_avx512(const DotGemm& g, int64_t m, int64_t n0, __m512 y) {
  const int64_t cols = std::min(kNR, g.N - n0);
  if (!g.out_bf16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
    if (g.bias != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, g.bias + n0));
    _mm512_mask_storeu_ps(static_cast<float*>(g.out) + g.out_index(m, n0), mask, y);
    return;
  }
  alignas(64) float buf[kNR];
  _mm512_store_ps(buf, y);
  store_row(g, m, n0, buf, cols);
}

template <int R, int NP>
void tile_avx512(const DotGemm& g, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 16, "at most 16 accumulators");
  const int64_t K2 = g.K2, panel = g.panel();
  const uint16_t* w = g.panel_ptr(p);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 c[R][NP];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) c[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    __m512 we[NP], wo[NP];
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) {
      const uint16_t* wl = w + i * panel + j * kPairRow;
      const __m512i v = _mm512_loadu_si512(wl);
      we[i] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[i] = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* x = g.xf + (m0 + r) * 2 * K2 + 2 * j;
      const __m512 xo = _mm512_set1_ps(x[0]), xe = _mm512_set1_ps(x[1]);
#pragma GCC unroll 8
      for (int i = 0; i < NP; ++i) {
        c[r][i] = _mm512_fmadd_ps(xo, wo[i], c[r][i]);
        c[r][i] = _mm512_fmadd_ps(xe, we[i], c[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) store_avx512(g, m0 + r, (p + i) * kNR, c[r][i]);
}
#endif  // RS_DOT_AVX512

#if RS_DOT_NATIVE
// Lines of each of the next row tile's rows that a prefill tile prefetches before its loop.
constexpr int kNextRowLines = 4;

// What a prefill tile (its panels waiting in L2) asks of memory before its k loop, so that
// neither waits on it later: its output lines, to be written (prefetchw: the line arrives
// owned, and the stores after the loop do not stall on its read-for-ownership), and the first
// lines of the next row tile's rows (each tile starts new row streams; the hardware prefetcher
// follows a stream only once it has seen it miss). Hints only: no value changes. As volatile
// asm, because GCC 12 deletes some loops of nothing but __builtin_prefetch as if empty.
inline void prefetch_owned(const void* p) { asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_read(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }

template <int R, int NP>
inline void prefetch_tile(const DotGemm& g, int64_t m0, int64_t p, const uint16_t* x) {
  const int64_t esize = g.out_bf16 ? 2 : 4;
  const char* out = static_cast<const char*>(g.out) + g.out_index(m0, p * kNR) * esize;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) prefetch_owned(out + (r * g.ldo + i * kNR) * esize);
  const int64_t next = std::min<int64_t>(R, g.M - m0 - R);  // rows of the next tile
  for (int64_t r = 0; r < next; ++r)
    for (int l = 0; l < kNextRowLines; ++l) prefetch_read(x + (R + r) * 2 * g.K2 + 32 * l);
}

template <int R, int NP>
void tile_native(const DotGemm& g, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP + NP + 1 <= 32, "accumulators, panels and the row in 32 registers");
  const int64_t K2 = g.K2, panel = g.panel();
  const uint16_t* w = g.panel_ptr(p);
  const uint16_t* x = g.xh + m0 * 2 * K2;
  prefetch_tile<R, NP>(g, m0, p, x);
  __m512 c[R][NP];
#pragma GCC unroll 25
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) c[r][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K2; ++j) {
    __m512bh wv[NP];
#pragma GCC unroll 8
    for (int i = 0; i < NP; ++i) {
      const uint16_t* wl = w + i * panel + j * kPairRow;
      wv[i] = (__m512bh)_mm512_loadu_si512(wl);
    }
#pragma GCC unroll 24
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(load_pair(x + r * 2 * K2 + 2 * j));
#pragma GCC unroll 8
      for (int i = 0; i < NP; ++i) c[r][i] = _mm512_dpbf16_ps(c[r][i], xb, wv[i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) store_avx512(g, m0 + r, (p + i) * kNR, c[r][i]);
}
#endif  // RS_DOT_NATIVE

// ---------------------------------------------------------------- tiling (any path)
// A path's tiles as a table: fn[r - 1][np - 1] runs r rows x np panels. Every tile computes
// each of its elements with the same chain, so how a call is cut into tiles (by its row
// count, by its thread's share of panels) changes the speed, never the bits.
using TileFn = void (*)(const DotGemm&, int64_t, int64_t);

template <int MR, int NPR>
struct TileTable {
  TileFn fn[MR][NPR] = {};
};

// Fill::ok<R, NP> says whether the path has that tile (its registers hold it); the table
// leaves the others empty, and run_plan never asks for them.
template <typename Fill, int MR, int NPR, int R = 1, int NP = 1>
constexpr void fill_table(TileTable<MR, NPR>& t) {
  if constexpr (R <= MR) {
    if constexpr (NP <= NPR) {
      if constexpr (Fill::template ok<R, NP>) t.fn[R - 1][NP - 1] = &Fill::template at<R, NP>;
      fill_table<Fill, MR, NPR, R, NP + 1>(t);
    } else {
      fill_table<Fill, MR, NPR, R + 1, 1>(t);
    }
  }
}

#if RS_AVX2
struct Avx2Fill {
  template <int R, int NP>
  static constexpr bool ok = R * NP <= 4;
  template <int R, int NP>
  static void at(const DotGemm& g, int64_t m0, int64_t p) { tile_avx2<R, NP>(g, m0, p); }
};
#endif
#if RS_DOT_AVX512
struct Avx512Fill {
  template <int R, int NP>
  static constexpr bool ok = R * NP <= 16;
  template <int R, int NP>
  static void at(const DotGemm& g, int64_t m0, int64_t p) { tile_avx512<R, NP>(g, m0, p); }
};
#endif
#if RS_DOT_NATIVE
struct NativeFill {
  // A tile holds its accumulators, a register per panel of weights and the broadcast row
  // pair in the 32 vector registers, without spilling.
  template <int R, int NP>
  static constexpr bool ok = R * NP + NP + 1 <= 32;
  // Fewer rows than a full tile (a decode batch of up to 5, the rows past the last full
  // tile) take more panels, so that the tile still has enough independent accumulators.
  static int64_t panels_for(int64_t r) { return std::min<int64_t>(8, 31 / (r + 1)); }
  template <int R, int NP>
  static void at(const DotGemm& g, int64_t m0, int64_t p) { tile_native<R, NP>(g, m0, p); }
};
#endif

// How one path cuts a call: its rows, few (decode) or many (prefill), meet groups of panels
// that stay in L2, a row tile at a time. Decode rows take the same plan: streaming each
// group once with the hardware prefetcher measured faster than tiles that prefetch their
// panels from memory themselves, at every level (benchmarks/README.md, "Decode tiles").
struct Plan {
  int64_t tile_rows;                 // rows a tile takes
  int64_t tile_panels;               // panels a tile takes
  TileFn (*tile)(int64_t r, int64_t np);
  int64_t pair_bytes;                // bytes of a row's k pair as the tiles read it
  int64_t (*panels_for)(int64_t r);  // panels of a tile of r < tile_rows rows (a decode batch's
                                     // rows, a call's last tile)
};

template <int NP>
int64_t same_panels(int64_t) { return NP; }

template <typename Fill, int MR, int NPR>
TileFn table_fn(int64_t r, int64_t np) {
  static const TileTable<MR, NPR> table = [] {
    TileTable<MR, NPR> t;
    fill_table<Fill, MR, NPR>(t);
    return t;
  }();
  return table.fn[r - 1][np - 1];
}

// Whether rows run in blocks (below); RADIXSERVE_GEMM_ROW_BLOCKS=0 runs all of a call's rows
// past each group of panels, for benchmarks to compare. Read once per process.
bool row_blocks() {
  static const bool on = [] {
    const char* v = std::getenv("RADIXSERVE_GEMM_ROW_BLOCKS");
    return v == nullptr || v[0] != '0';
  }();
  return on;
}

// Rows come in blocks that stay in L2 beside a group of panels: every group of the thread's
// panels meets a block before the next block is read. Without blocks, a long prefill's rows
// (megabytes) streamed past each group from L3 or memory once per group; with them, the
// panels (a layer's weights, which L3 holds) stream once per block instead. The order in
// which tiles run changes, not any element's chain: the same bits.
// The rows [b0, b1) against panels [q0, q1), in as few row tiles as hold them, of sizes as
// even as can be (9 rows: 5 + 4, not 6 + 3): a tile of few rows has few accumulators to keep
// the unit busy.
void run_tiles(const DotGemm& g, int64_t b0, int64_t b1, int64_t q0, int64_t q1, const Plan& plan) {
  const int64_t tiles = (b1 - b0 + plan.tile_rows - 1) / plan.tile_rows;
  const int64_t base = (b1 - b0) / tiles, longer = (b1 - b0) % tiles;
  for (int64_t t = 0, m = b0; t < tiles; ++t) {
    const int64_t r = base + (t < longer ? 1 : 0);
    const int64_t np = r == plan.tile_rows ? plan.tile_panels : plan.panels_for(r);
    int64_t p = q0;
    for (; p + np <= q1; p += np) plan.tile(r, np)(g, m, p);
    if (p < q1) plan.tile(r, q1 - p)(g, m, p);
    m += r;
  }
}

// How a call's rows and panels are cut: `group` panels (half of kL2Bytes) stay in L2 while a
// `block` of rows meets them (see run_plan); `panels`: the thread's.
struct Blocking {
  int64_t group, block;
};

Blocking blocking(const DotGemm& g, int64_t panels, const Plan& plan) {
  const int64_t panel_bytes = g.panel() * 2;
  int64_t group = std::max<int64_t>(plan.tile_panels, (kL2Bytes / 2) / panel_bytes);
  group -= group % plan.tile_panels;
  // One row tile (a decode batch) reads each panel once whatever the grouping: its tiles may
  // then take as many panels as they hold.
  if (g.M <= plan.tile_rows) group = std::max<int64_t>(group, panels);
  int64_t block = std::max<int64_t>(plan.tile_rows, (kL2Bytes / 2) / (g.K2 * plan.pair_bytes));
  block -= block % plan.tile_rows;
  if (!row_blocks()) block = std::max<int64_t>(g.M, 1);
  return {group, block};
}

// Rows come in blocks that stay in L2 beside a group of panels: every group of the thread's
// panels meets a block before the next block is read. Without blocks, a long prefill's rows
// (megabytes) streamed past each group from L3 or memory once per group; with them, the
// panels (a layer's weights, which L3 holds) stream once per block instead. The order in
// which tiles run changes, not any element's chain: the same bits.
void run_plan(const DotGemm& g, int64_t p0, int64_t p1, const Plan& plan) {
  const Blocking cut = blocking(g, p1 - p0, plan);
  for (int64_t b0 = 0; b0 < g.M; b0 += cut.block) {
    const int64_t b1 = std::min(g.M, b0 + cut.block);
    for (int64_t q0 = p0; q0 < p1; q0 += cut.group) run_tiles(g, b0, b1, q0, std::min(p1, q0 + cut.group), plan);
  }
}

#if RS_AVX2
const Plan kAvx2Plan{4, 1, &table_fn<Avx2Fill, 4, 2>, 8, &same_panels<1>};
#endif
#if RS_DOT_AVX512
const Plan kAvx512Plan{4, 4, &table_fn<Avx512Fill, 4, 8>, 8, &same_panels<4>};
#endif
#if RS_DOT_NATIVE
const Plan kNativePlan{6, 4, &table_fn<NativeFill, 6, 8>, 4, &NativeFill::panels_for};
#endif

#if RS_DOT_NATIVE && RS_TILES
// ---------------------------------------------------------------- tile calls (AMX)
// A call's rows through the tile unit (tiles.h) give the bits of the vdpbf16ps chain: a C
// tile's element is one chain over the k pairs in order, as a native tile's accumulator is,
// and three things line up the rest:
// - tdpbf16ps adds a pair's even product first, vdpbf16ps its odd one: both operands reach
//   the unit with each pair swapped (the rows in DotRows::xs, the panels swapped into scratch
//   here), so the product it adds first is x[2j+1] w[2j+1], as in the chain;
// - a tile row holds 16 pairs: the k pairs are padded to whole tile rows with zero pairs in
//   FRONT of the chain, where the accumulator is +0 and +0 + 0 * 0 stays +0 (zero pairs at
//   the end would turn an accumulator of -0 into +0);
// - rows come in whole 16-row tiles, zero past M, and only the call's rows are stored.
// Decode batches (fewer than kTileMinRows rows, gemm_dot.h) keep the native tiles: their
// bits are the same, and a tile call would pad one row to sixteen.

// One thread's tile calls over `rows`, on one unit: C tiles 0-3 (2 row tiles x 2 panels),
// row tiles 4-5, panel tiles 6-7. Constructed per call and thread: it configures the unit.
template <class Unit>
class TileGemm {
 public:
  explicit TileGemm(const DotRows& rows) : rows_(rows), unit_(tile_unit<Unit>()) { unit_.configure(); }
  ~TileGemm() { unit_.release(); }
  TileGemm(const TileGemm&) = delete;
  TileGemm& operator=(const TileGemm&) = delete;

  // Rows [b0, b1) (b0 a multiple of 16) of g against panels [q0, q1): the panels swapped into
  // scratch once, then every row tile of the block meets them.
  void run(const DotGemm& g, int64_t b0, int64_t b1, int64_t q0, int64_t q1) {
    swap_panels(g, q0, q1);
    for (int64_t m = b0; m < b1; m += 2 * kTileRows) {
      const bool two = b1 - m > kTileRows;
      int64_t p = q0;
      for (; p + 2 <= q1; p += 2) two ? tile<2, 2>(g, m, b1, q0, p) : tile<1, 2>(g, m, b1, q0, p);
      if (p < q1) two ? tile<2, 1>(g, m, b1, q0, p) : tile<1, 1>(g, m, b1, q0, p);
    }
  }

 private:
  int64_t lead() const { return rows_.K2p - rows_.K2; }

  // Panels [q0, q1) of g's weights, each pair swapped, lead() zero lines first.
  void swap_panels(const DotGemm& g, int64_t q0, int64_t q1) {
    const int64_t K2p = rows_.K2p, line = kPairRow;
    panels_.resize(static_cast<size_t>((q1 - q0) * K2p * line));
    for (int64_t p = q0; p < q1; ++p) {
      uint16_t* dst = panels_.data() + (p - q0) * K2p * line;
      std::memset(dst, 0, static_cast<size_t>(lead() * line * 2));
      dst += lead() * line;
      const uint16_t* src = g.panel_ptr(p);
      for (int64_t j = 0; j < g.K2; ++j) {
        const __m512i v = _mm512_loadu_si512(src + j * line);
        _mm512_storeu_si512(dst + j * line, _mm512_rol_epi32(v, 16));
      }
    }
  }

  // Rows [m, m + 16 RT) (those below b1 stored) against panels p .. p + PT - 1.
  template <int RT, int PT>
  void tile(const DotGemm& g, int64_t m, int64_t b1, int64_t q0, int64_t p) {
    const int64_t K2p = rows_.K2p, row_bytes = 4 * K2p, panel = K2p * kPairRow;
    const uint16_t* a = rows_.xs + m * 2 * K2p;
    const uint16_t* b = panels_.data() + (p - q0) * panel;
    unit_.template zero<0>();
    if constexpr (PT > 1) unit_.template zero<1>();
    if constexpr (RT > 1) unit_.template zero<2>();
    if constexpr (RT > 1 && PT > 1) unit_.template zero<3>();
    for (int64_t kb = 0; kb < K2p; kb += kTilePairs) {
      unit_.template load<4>(a + 2 * kb, row_bytes);
      if constexpr (RT > 1) unit_.template load<5>(a + kTileRows * 2 * K2p + 2 * kb, row_bytes);
      unit_.template load<6>(b + kb * kPairRow, kTileBytes);
      if constexpr (PT > 1) unit_.template load<7>(b + panel + kb * kPairRow, kTileBytes);
      unit_.template dot<0, 4, 6>();
      if constexpr (PT > 1) unit_.template dot<1, 4, 7>();
      if constexpr (RT > 1) unit_.template dot<2, 5, 6>();
      if constexpr (RT > 1 && PT > 1) unit_.template dot<3, 5, 7>();
    }
    store<0>(g, m, b1, p);
    if constexpr (PT > 1) store<1>(g, m, b1, p + 1);
    if constexpr (RT > 1) store<2>(g, m + kTileRows, b1, p);
    if constexpr (RT > 1 && PT > 1) store<3>(g, m + kTileRows, b1, p + 1);
  }

  // C tile T (rows from m, panel p) through store_avx512, the epilogue of every dot path.
  template <int T>
  void store(const DotGemm& g, int64_t m, int64_t b1, int64_t p) {
    alignas(64) float c[kTileRows * kNR];
    unit_.template store<T>(c, kTileBytes);
    const int64_t rows = std::min(kTileRows, b1 - m);
    for (int64_t r = 0; r < rows; ++r) store_avx512(g, m + r, p * kNR, _mm512_load_ps(c + r * kNR));
  }

  const DotRows& rows_;
  Unit& unit_;
  static thread_local std::vector<uint16_t> panels_;
};

template <class Unit>
thread_local std::vector<uint16_t> TileGemm<Unit>::panels_;

// How tile calls cut a call: a group of panels (their swapped copy in half of L2) meets a
// block of rows (whole pairs of row tiles, their swapped rows in the other half).
Blocking tile_blocking(const DotRows& rows) {
  int64_t group = std::max<int64_t>(2, (kL2Bytes / 2) / (rows.K2p * kPairRow * 2));
  group -= group % 2;
  int64_t block = std::max<int64_t>(2 * kTileRows, (kL2Bytes / 2) / (rows.K2p * 4));
  block -= block % (2 * kTileRows);
  return {group, block};
}

template <class Unit>
void tile_panels(const DotGemm& g, const DotRows& rows, int64_t p0, int64_t p1) {
  TileGemm<Unit> t(rows);
  const Blocking cut = tile_blocking(rows);
  for (int64_t b0 = 0; b0 < g.M; b0 += cut.block)
    for (int64_t q0 = p0; q0 < p1; q0 += cut.group)
      t.run(g, b0, std::min(g.M, b0 + cut.block), q0, std::min(p1, q0 + cut.group));
}
#endif  // RS_DOT_NATIVE && RS_TILES

// ---------------------------------------------------------------- gated calls
// act = gate(x Wg) * (x Wu) from one packed gate_up weight (gate panels [0, Pg), up panels
// [Pg, 2 Pg)): the thread's gate panels [p0, p1) and their up panels run, a block of rows and
// a group of panels at a time, into a scratch block that stays in L1/L2, and the gate reads it
// there. Without it the GEMM wrote the float32 gate_up rows (twice act's width) to memory for
// a second pass to read back. Every element's chain is the GEMM's, and the gate is
// gated_segment, silu_mul's code under the caller's MXCSR: the bits of the two passes.
// up_off: how many panels past a gate panel its up panel lies in g's weights.
template <typename RunTiles>
void run_gated(const DotGemm& g, const GatedAct& out, int64_t up_off, int64_t p0, int64_t p1, Blocking cut,
               unsigned mxcsr, RunTiles run) {
  static thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(std::min(cut.block, g.M) * 2 * cut.group * kNR));
  for (int64_t b0 = 0; b0 < g.M; b0 += cut.block) {
    const int64_t b1 = std::min(g.M, b0 + cut.block);
    for (int64_t q0 = p0; q0 < p1; q0 += cut.group) {
      const int64_t q1 = std::min(p1, q0 + cut.group), width = (q1 - q0) * kNR;
      DotGemm s = g;
      s.out = scratch.data();
      s.ldo = 2 * width;
      s.out_bf16 = false;
      s.bias = nullptr;
      s.out_r0 = b0;
      s.out_c0 = q0 * kNR;  // gate columns first,
      run(s, b0, b1, q0, q1);
      s.out_c0 = (up_off + q0) * kNR - width;  // then their up columns
      run(s, b0, b1, up_off + q0, up_off + q1);
#if RS_AVX2
      const unsigned inner = _mm_getcsr();
      _mm_setcsr(mxcsr);
#endif
      for (int64_t m = b0; m < b1; ++m) {
        const float* row = scratch.data() + (m - b0) * s.ldo;
        gated_segment(out.kind, row, row + width, out.act + m * out.ld + q0 * kNR, width, out.isa);
      }
#if RS_AVX2
      _mm_setcsr(inner);
#endif
    }
  }
  (void)mxcsr;
}

// The rows in the forms the paths read: bf16 pairs (native) or their float32 values in chain
// order (emulation, portable), and for tile calls the pairs swapped and padded (DotRows::xs).
// Each row's conversion is its own: no row sees another. Plain loops over contiguous rows,
// which the compiler vectorises (f32_to_bf16 is branch-free integer arithmetic: the same bits
// vectorised or not).
// A row of bf16 pairs h (K2 pairs) as the tile calls read it, into t (K2p pairs): K2p - K2
// zero pairs first, then each pair swapped.
void tile_row(const uint16_t* h, int64_t K2, int64_t K2p, uint16_t* t) {
  std::fill(t, t + 2 * (K2p - K2), uint16_t{0});
  t += 2 * (K2p - K2);
  for (int64_t j = 0; j < K2; ++j) {
    t[2 * j] = h[2 * j + 1];
    t[2 * j + 1] = h[2 * j];
  }
}

struct RowBuffers {
  std::vector<uint16_t> xh, xs;
  std::vector<float> xf;
};

void convert_rows(const at::Tensor& x, int64_t K2, bool pairs, int64_t K2p, int64_t Mp, RowBuffers& buf) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  const float* src = x.data_ptr<float>();
  buf.xh.resize(M * 2 * K2);
  if (!pairs) buf.xf.resize(M * 2 * K2);
  if (K2p > 0) {
    buf.xs.resize(Mp * 2 * K2p);
    std::fill(buf.xs.begin() + M * 2 * K2p, buf.xs.end(), uint16_t{0});  // rows past M
  }
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* row = src + m * ld;
      uint16_t* h = buf.xh.data() + m * 2 * K2;
      for (int64_t k = 0; k < K; ++k) h[k] = f32_to_bf16(row[k]);
      if (K & 1) h[K] = 0;
      if (K2p > 0) tile_row(h, K2, K2p, buf.xs.data() + m * 2 * K2p);
      if (pairs) continue;
      float* f = buf.xf.data() + m * 2 * K2;
      for (int64_t j = 0; j < K2; ++j) {  // the chain takes the odd product first
        f[2 * j] = bf16_to_f32(h[2 * j + 1]);
        f[2 * j + 1] = bf16_to_f32(h[2 * j]);
      }
    }
  });
}

}  // namespace

void pack_linear_dot_kernel(const at::Tensor& w, at::Tensor& packed) {
  const int64_t N = w.size(0), K = w.size(1), K2 = (K + 1) / 2, P = (N + kNR - 1) / kNR, ld = w.stride(0);
  const bool src_bf16 = w.scalar_type() == at::kBFloat16;
  const float* wf = src_bf16 ? nullptr : w.data_ptr<float>();
  const uint16_t* wb = src_bf16 ? reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()) : nullptr;
  uint16_t* out = static_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t c = 0; c < kNR; ++c) {
        const int64_t n = p * kNR + c;
        uint16_t* dst = out + p * K2 * kPairRow + 2 * c;
        for (int64_t k = 0; k < 2 * K2; ++k) {
          uint16_t v = 0;
          if (n < N && k < K) v = src_bf16 ? wb[n * ld + k] : f32_to_bf16(wf[n * ld + k]);
          dst[(k / 2) * kPairRow + (k & 1)] = v;
        }
      }
  });
}

DotPath dot_path(int64_t isa, int64_t arith) {
  DotPath path;
  const bool allow_native = dot_allows_native(arith);
#if RS_DOT_NATIVE
  if (path.plan == nullptr && isa >= kIsaAvx512 && allow_native) {
    path.plan = &kNativePlan;
    path.pairs = path.native = true;
#if RS_TILES
    if (arith == kArithDotTileModel)
      path.tiles = kTilesModel;
    else if (isa >= kIsaAmx && amx_status() == kAmxReady)
      path.tiles = kTilesHardware;
#endif
  }
#endif
#if RS_DOT_AVX512
  if (path.plan == nullptr && isa >= kIsaAvx512) path.plan = &kAvx512Plan;
#endif
#if RS_AVX2
  if (path.plan == nullptr && isa >= kIsaAvx2) path.plan = &kAvx2Plan;
#endif
  (void)isa;
  (void)allow_native;
  return path;
}

DotRows dot_rows(const at::Tensor& x, const DotPath& path) {
  static thread_local RowBuffers buf;
  DotRows rows;
  rows.K2 = (x.size(1) + 1) / 2;
  rows.M = x.size(0);
  if (path.tiles != kTilesNone && rows.M >= kTileMinRows) {
    rows.K2p = (rows.K2 + kTilePairs - 1) / kTilePairs * kTilePairs;
    rows.Mp = (rows.M + kTileRows - 1) / kTileRows * kTileRows;
  }
  convert_rows(x, rows.K2, path.pairs, rows.K2p, rows.Mp, buf);
  rows.xh = buf.xh.data();
  rows.xf = buf.xf.data();
  rows.xs = rows.K2p > 0 ? buf.xs.data() : nullptr;
  return rows;
}

namespace {
// A call over `rows` and the panels at w (panel wp0 first) into out [M, N].
DotGemm make_gemm(const DotRows& rows, const uint16_t* w, int64_t wp0, int64_t N, const float* bias, void* out,
                  int64_t ldo, bool out_bf16) {
  DotGemm g;
  g.xh = rows.xh;
  g.xf = rows.xf;
  g.K2 = rows.K2;
  g.w = w;
  g.wp0 = wp0;
  g.bias = bias;
  g.out = out;
  g.ldo = ldo;
  g.out_bf16 = out_bf16;
  g.M = rows.M;
  g.N = N;
  return g;
}
}  // namespace

void dot_panels(const DotRows& rows, const DotPath& path, const uint16_t* w, int64_t wp0, int64_t p0,
                int64_t p1, int64_t N, const float* bias, void* out, int64_t ldo, bool out_bf16) {
  const DotGemm g = make_gemm(rows, w, wp0, N, bias, out, ldo, out_bf16);
#if RS_DOT_NATIVE && RS_TILES
  if (rows.xs != nullptr) {  // tile calls (dot_rows built their rows)
    FlushDenormals ftz;
    path.tiles == kTilesHardware ? tile_panels<HardwareTiles>(g, rows, p0, p1) : tile_panels<ModelTiles>(g, rows, p0, p1);
    return;
  }
#endif
#if RS_AVX2
  if (path.plan != nullptr) {
    FlushDenormals ftz;
    run_plan(g, p0, p1, *static_cast<const Plan*>(path.plan));
    return;
  }
#endif
  panels_generic(g, 0, g.M, p0, p1);
}

void dot_gated_panels(const DotRows& rows, const DotPath& path, const uint16_t* w, int64_t wp0, int64_t up_off,
                      int64_t p0, int64_t p1, const GatedAct& out) {
  const DotGemm g = make_gemm(rows, w, wp0, 2 * out.inter, nullptr, nullptr, 0, false);  // run_gated sets out
#if RS_DOT_NATIVE && RS_TILES
  if (rows.xs != nullptr) {
    FlushDenormals ftz;
    const auto on = [&](auto& t) {
      run_gated(g, out, up_off, p0, p1, tile_blocking(rows), ftz.outer(),
                [&t](const DotGemm& s, int64_t b0, int64_t b1, int64_t q0, int64_t q1) { t.run(s, b0, b1, q0, q1); });
    };
    if (path.tiles == kTilesHardware) {
      TileGemm<HardwareTiles> t(rows);
      on(t);
    } else {
      TileGemm<ModelTiles> t(rows);
      on(t);
    }
    return;
  }
#endif
#if RS_AVX2
  if (path.plan != nullptr) {
    const Plan& plan = *static_cast<const Plan*>(path.plan);
    FlushDenormals ftz;
    // A group's gate panels and their up panels each take a plain group's share of L2: a
    // block of rows meets twice the weights (L2 holds both), in tiles as wide as a plain call's.
    run_gated(g, out, up_off, p0, p1, blocking(g, p1 - p0, plan), ftz.outer(),
              [&plan](const DotGemm& s, int64_t b0, int64_t b1, int64_t q0, int64_t q1) {
                run_tiles(s, b0, b1, q0, q1, plan);
              });
    return;
  }
  const unsigned mxcsr = _mm_getcsr();
#else
  const unsigned mxcsr = 0;
#endif
  run_gated(g, out, up_off, p0, p1, Blocking{p1 - p0, 64}, mxcsr,
            [](const DotGemm& s, int64_t b0, int64_t b1, int64_t q0, int64_t q1) { panels_generic(s, b0, b1, q0, q1); });
}

void packed_gated_dot_kernel(const at::Tensor& x, const at::Tensor& packed, int64_t kind, at::Tensor& act,
                             int64_t isa, int64_t arith) {
  const DotPath path = dot_path(isa, arith);
  const DotRows rows = dot_rows(x, path);
  const GatedAct out{act.data_ptr<float>(), act.stride(0), act.size(1), kind, isa};
  const uint16_t* w = static_cast<const uint16_t*>(packed.data_ptr());
  const int64_t Pg = out.inter / kNR;
  const int64_t grain = 2 * out.inter * x.size(1) < (int64_t{1} << 15) ? Pg : 1;
  at::parallel_for(0, Pg, grain, [&](int64_t b0, int64_t e0) { dot_gated_panels(rows, path, w, 0, Pg, b0, e0, out); });
}

void packed_linear_dot_kernel(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const c10::optional<at::Tensor>& bias, at::Tensor& out, int64_t isa,
                              int64_t arith) {
  const DotPath path = dot_path(isa, arith);
  const DotRows rows = dot_rows(x, path);
  const uint16_t* w = static_cast<const uint16_t*>(packed.data_ptr());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  void* o = out.data_ptr();
  const int64_t ldo = out.stride(0);
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  const int64_t P = (N + kNR - 1) / kNR;
  const int64_t grain = N * x.size(1) < (int64_t{1} << 15) ? P : 1;
  at::parallel_for(0, P, grain, [&](int64_t b0, int64_t e0) {
    dot_panels(rows, path, w, 0, b0, e0, N, b, o, ldo, out_bf16);
  });
}

}  // namespace radixserve

// ---------------------------------------------------------------- may the tiles run
namespace radixserve {
namespace {

#if RS_DOT_NATIVE && RS_TILES
// Whether the CPU has AMX-TILE and AMX-BF16 (cpuid leaf 7: EDX bits 24 and 22).
bool cpu_has_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1u) && (d >> 22 & 1u);
}

// Linux hands a process the tiles' 8 KiB of state only on request; then XCR0 has XTILECFG and
// XTILEDATA (bits 17 and 18).
bool os_grants_tiles() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) != 0) return false;
  unsigned lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo >> 17 & 3u) == 3u;
}

// A bf16 bit pattern from a fixed generator: exponents over +-24 binades around 1 (sums of
// them lose bits at every step, so chains that differ in order or in rounding differ here),
// and among them zeros and denormals (read as zero) of either sign.
uint16_t probe_value(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  const uint32_t r = static_cast<uint32_t>(state >> 33);
  const uint32_t sign = (r & 1u) << 15, mant = (r >> 1) & 0x7fu, pick = (r >> 8) % 16;
  if (pick == 0) return static_cast<uint16_t>(sign);         // +-0
  if (pick == 1) return static_cast<uint16_t>(sign | mant | 1u);  // a denormal
  const uint32_t exp = 127 - 24 + (r >> 12) % 49;
  return static_cast<uint16_t>(sign | exp << 7 | mant);
}

// The probe: one call whose rows (40: a pair of row tiles and a single one, rows past M),
// k pairs (35: 13 zero pairs in front) and columns (40: a part panel) take every branch of the
// tile calls, on the hardware, on the model and through the native tiles; the tiles are
// admitted only if every bit agrees. Other values, shapes and the model's agreement with the
// vdpbf16ps chain are the tests' (tests/test_amx_tiles.py). It runs in a child process
// (fork_probe), so it touches neither torch nor the thread pool: the operands are laid out
// here, one thread runs every call.
bool probe_agrees(int unit) {
  constexpr int64_t M = 40, K2 = 35, N = 40, P = (N + kNR - 1) / kNR;
  constexpr int64_t K2p = (K2 + kTilePairs - 1) / kTilePairs * kTilePairs, Mp = 48;
  uint64_t state = 0x5eed;
  // Panels of any values (the columns past N are computed and not stored); rows as dot_rows
  // lays them out, rows past M zero.
  std::vector<uint16_t> xh(M * 2 * K2), xs(Mp * 2 * K2p, 0), w(P * K2 * kPairRow);
  for (uint16_t& v : xh) v = probe_value(state);
  for (uint16_t& v : w) v = probe_value(state);
  for (int64_t m = 0; m < M; ++m) tile_row(xh.data() + m * 2 * K2, K2, K2p, xs.data() + m * 2 * K2p);
  DotRows rows;
  rows.xh = xh.data();
  rows.xs = xs.data();
  rows.K2 = K2;
  rows.M = M;
  rows.K2p = K2p;
  rows.Mp = Mp;
  std::vector<float> hw(M * N), model(M * N), native(M * N);
  DotPath path = dot_path(kIsaAvx512, kArithDotTileModel);
  dot_panels(rows, path, w.data(), 0, 0, P, N, nullptr, model.data(), N, false);
  DotRows pairs = rows;  // the same rows through the native tiles (what decode batches run)
  pairs.xs = nullptr;
  dot_panels(pairs, path, w.data(), 0, 0, P, N, nullptr, native.data(), N, false);
  path.tiles = unit;
  dot_panels(rows, path, w.data(), 0, 0, P, N, nullptr, hw.data(), N, false);
  const size_t bytes = hw.size() * sizeof(float);
  return std::memcmp(hw.data(), model.data(), bytes) == 0 && std::memcmp(hw.data(), native.data(), bytes) == 0;
}

#endif

}  // namespace

// The tiles' first use in a child process: code that has not met this CPU before may fault
// (a tile configuration it rejects, an instruction it traps) or disagree, and neither must
// take the server down. The child asks for the tile state (ask_os) and runs the probe on the
// hardware or on the model; this process asks for the state only after the child agreed.
int64_t tile_probe(bool hardware, bool ask_os) {
#if RS_DOT_NATIVE && RS_TILES
  const pid_t pid = fork();
  if (pid < 0) return kAmxProbeFailed;
  if (pid == 0) {
    // A trap ends the child quietly: no handler of the parent's (Python's faulthandler would
    // print a fatal error and a traceback), no core file.
    for (int sig : {SIGILL, SIGSEGV, SIGBUS, SIGFPE}) std::signal(sig, SIG_DFL);
    const rlimit no_core{0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    _exit(ask_os && !os_grants_tiles() ? 2 : probe_agrees(hardware ? kTilesHardware : kTilesModel) ? 0 : 1);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return kAmxProbeFailed;
  if (!WIFEXITED(status)) return kAmxProbeFailed;  // killed by a signal
  switch (WEXITSTATUS(status)) {
    case 0: return !ask_os || os_grants_tiles() ? kAmxReady : kAmxNoOs;
    case 1: return kAmxProbeDiffers;
    case 2: return kAmxNoOs;
    default: return kAmxProbeFailed;
  }
#else
  (void)hardware;
  (void)ask_os;
  return kAmxNotBuilt;
#endif
}

int64_t amx_status() {
  static const int64_t status = [] {
#if RS_DOT_NATIVE && RS_TILES
    if (!cpu_has_amx()) return kAmxNoCpu;
    return tile_probe(true, true);
#else
    return kAmxNotBuilt;
#endif
  }();
  return status;
}

}  // namespace radixserve
