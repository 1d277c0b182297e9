// The AVX2 + FMA implementation of the paged attention kernel, float32 mode over float32 or
// bfloat16 pools (see attention.cpp for the arithmetic). Every operation applied to a row is
// the portable path's, in the same order and with the same roundings (exp256 is exp_f32 of
// common.h operation for operation), so its results equal the portable path's bit for bit.
//
// Two layouts, as in the AVX-512 file, 8 lanes wide:
//   * many rows (prefill, extend): rows in lanes. q is transposed once per item to
//     [D][rows]; for each key, each element is broadcast and multiplied into 8 rows at once.
//     p.v has the head dimension in lanes.
//   * few rows (decode, at most kFewRows): keys in lanes. 8 K rows are transposed in
//     registers (8x8 blocks), each q element is broadcast; 32 scores of a row sit in four
//     vectors, so the block max, exp and halving sum run on whole vectors.
// A bfloat16 pool's K/V rows of a block are converted to float32 once (exact), a quantized
// pool's dequantized once (dequant_row of common.h), then read like a float32 pool.
// Decode rows of sequences that read the same prefix slots (a radix-tree prefix they all
// extend) are grouped: each shared block is staged and its K transposed once, and every
// sequence of the group runs its rows over it (attend_group_avx2), so the shuffles of the
// transpose are paid once per group instead of once per sequence.
#include "attention.h"

#include <cstring>
#include <type_traits>
#include <utility>

#include "simd_avx2.h"

namespace radixserve {
namespace attn {

bool avx2_built() { return RS_AVX2; }

bool avx2_head_dim(int64_t D) { return D > 0 && D % 8 == 0 && D <= 512; }

#if RS_AVX2
namespace {

struct Work {
  int64_t M, Mp, nv, D;  // rows, rows padded to 8, row vectors, head size
  float* qt;             // rows in lanes: [D][Mp] q transposed; keys in lanes: [M][D] q rows
  float* st;             // rows in lanes: [kBlockK][Mp] scores then p; keys in lanes: [M][kBlockK]
  float* acc;            // [Mp][D]
  float* m;              // [Mp]
  float* l;              // [Mp]
  float* alpha;          // [Mp]
  int32_t* pos;          // [Mp]
  int32_t* lo;           // [Mp] first key each row sees (its window's start; 0 without one)
  float* kbuf;           // [kBlockK][D]: a bf16 pool's K rows of the block in float32
  float* vbuf;           // [kBlockK][D]: the same for V
  int64_t pj, pr;        // stride of p in st between keys and between rows
  const float* krow[kBlockK];  // float32 K rows of the block (pool rows or kbuf)
  const float* vrow[kBlockK];  // float32 V rows of the block
  const float* kt = nullptr;   // this head's K of the block transposed, [D][kBlockK], or null
};

// The micro-kernels below keep their accumulators in named variables: GCC keeps an array
// of vectors in memory and stores it back on every iteration, which halves the FMA rate.
#define RS_FMA(a, b, c) c = _mm256_fmadd_ps(a, b, c)
#define RS_ZERO(x) __m256 x = _mm256_setzero_ps()

// Rows in lanes: scores of 4 keys (k[0..3]) against 3 row vectors at qt (row stride 8,
// element stride Mp), dot products over d in order, then * scale, into st (key stride Mp).
inline void qk_k4_v3(const float* const* k, const float* qt, int64_t Mp, int64_t D, float scale, float* st) {
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
  RS_ZERO(a00); RS_ZERO(a01); RS_ZERO(a02); RS_ZERO(a10); RS_ZERO(a11); RS_ZERO(a12);
  RS_ZERO(a20); RS_ZERO(a21); RS_ZERO(a22); RS_ZERO(a30); RS_ZERO(a31); RS_ZERO(a32);
  for (int64_t d = 0; d < D; ++d) {
    const float* q = qt + d * Mp;
    const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8), q2 = _mm256_loadu_ps(q + 16);
    __m256 kb = _mm256_broadcast_ss(k0 + d);
    RS_FMA(kb, q0, a00); RS_FMA(kb, q1, a01); RS_FMA(kb, q2, a02);
    kb = _mm256_broadcast_ss(k1 + d);
    RS_FMA(kb, q0, a10); RS_FMA(kb, q1, a11); RS_FMA(kb, q2, a12);
    kb = _mm256_broadcast_ss(k2 + d);
    RS_FMA(kb, q0, a20); RS_FMA(kb, q1, a21); RS_FMA(kb, q2, a22);
    kb = _mm256_broadcast_ss(k3 + d);
    RS_FMA(kb, q0, a30); RS_FMA(kb, q1, a31); RS_FMA(kb, q2, a32);
  }
  const __m256 sc = _mm256_set1_ps(scale);
  auto put = [&](int64_t i, int64_t v, __m256 x) { _mm256_storeu_ps(st + i * Mp + v * 8, _mm256_mul_ps(x, sc)); };
  put(0, 0, a00); put(0, 1, a01); put(0, 2, a02); put(1, 0, a10); put(1, 1, a11); put(1, 2, a12);
  put(2, 0, a20); put(2, 1, a21); put(2, 2, a22); put(3, 0, a30); put(3, 1, a31); put(3, 2, a32);
}

// The same for 4 keys x 2 row vectors.
inline void qk_k4_v2(const float* const* k, const float* qt, int64_t Mp, int64_t D, float scale, float* st) {
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
  RS_ZERO(a00); RS_ZERO(a01); RS_ZERO(a10); RS_ZERO(a11); RS_ZERO(a20); RS_ZERO(a21); RS_ZERO(a30); RS_ZERO(a31);
  for (int64_t d = 0; d < D; ++d) {
    const float* q = qt + d * Mp;
    const __m256 q0 = _mm256_loadu_ps(q), q1 = _mm256_loadu_ps(q + 8);
    __m256 kb = _mm256_broadcast_ss(k0 + d);
    RS_FMA(kb, q0, a00); RS_FMA(kb, q1, a01);
    kb = _mm256_broadcast_ss(k1 + d);
    RS_FMA(kb, q0, a10); RS_FMA(kb, q1, a11);
    kb = _mm256_broadcast_ss(k2 + d);
    RS_FMA(kb, q0, a20); RS_FMA(kb, q1, a21);
    kb = _mm256_broadcast_ss(k3 + d);
    RS_FMA(kb, q0, a30); RS_FMA(kb, q1, a31);
  }
  const __m256 sc = _mm256_set1_ps(scale);
  auto put = [&](int64_t i, int64_t v, __m256 x) { _mm256_storeu_ps(st + i * Mp + v * 8, _mm256_mul_ps(x, sc)); };
  put(0, 0, a00); put(0, 1, a01); put(1, 0, a10); put(1, 1, a11);
  put(2, 0, a20); put(2, 1, a21); put(3, 0, a30); put(3, 1, a31);
}

// The same for 8 keys x 1 row vector.
inline void qk_k8_v1(const float* const* k, const float* qt, int64_t Mp, int64_t D, float scale, float* st) {
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3], *k4 = k[4], *k5 = k[5], *k6 = k[6], *k7 = k[7];
  RS_ZERO(a0); RS_ZERO(a1); RS_ZERO(a2); RS_ZERO(a3); RS_ZERO(a4); RS_ZERO(a5); RS_ZERO(a6); RS_ZERO(a7);
  for (int64_t d = 0; d < D; ++d) {
    const __m256 q0 = _mm256_loadu_ps(qt + d * Mp);
    RS_FMA(_mm256_broadcast_ss(k0 + d), q0, a0); RS_FMA(_mm256_broadcast_ss(k1 + d), q0, a1);
    RS_FMA(_mm256_broadcast_ss(k2 + d), q0, a2); RS_FMA(_mm256_broadcast_ss(k3 + d), q0, a3);
    RS_FMA(_mm256_broadcast_ss(k4 + d), q0, a4); RS_FMA(_mm256_broadcast_ss(k5 + d), q0, a5);
    RS_FMA(_mm256_broadcast_ss(k6 + d), q0, a6); RS_FMA(_mm256_broadcast_ss(k7 + d), q0, a7);
  }
  const __m256 sc = _mm256_set1_ps(scale);
  auto put = [&](int64_t i, __m256 x) { _mm256_storeu_ps(st + i * Mp, _mm256_mul_ps(x, sc)); };
  put(0, a0); put(1, a1); put(2, a2); put(3, a3); put(4, a4); put(5, a5); put(6, a6); put(7, a7);
}

void qk_rows_in_lanes(Work& w, float scale) {
  const int64_t Mp = w.Mp, D = w.D;
  int64_t v0 = 0;
  for (; v0 + 3 <= w.nv; v0 += 3)
    for (int64_t j = 0; j < kBlockK; j += 4) qk_k4_v3(w.krow + j, w.qt + v0 * 8, Mp, D, scale, w.st + j * Mp + v0 * 8);
  if (w.nv - v0 == 2) {
    for (int64_t j = 0; j < kBlockK; j += 4) qk_k4_v2(w.krow + j, w.qt + v0 * 8, Mp, D, scale, w.st + j * Mp + v0 * 8);
  } else if (w.nv - v0 == 1) {
    for (int64_t j = 0; j < kBlockK; j += 8) qk_k8_v1(w.krow + j, w.qt + v0 * 8, Mp, D, scale, w.st + j * Mp + v0 * 8);
  }
}

// p.v with the head dimension in lanes: acc[r][d0..d0+32) = acc * alpha + sum over the
// block's n keys of p(j, r) * v_j, for R (1 or 2) rows; p(j, r) = p[j * pj + r * pr].
// Two rows x 32 elements is what 16 registers hold without a spill (8 sums, 4 of V, p).
template <int R>
inline void pv_c4(float* acc, int64_t D, const float* alpha, const float* const* vrow, int64_t d0,
                  const float* p, int64_t pj, int64_t pr, int64_t n) {
  static_assert(R == 1 || R == 2, "1 or 2 rows");
  float* a0p = acc + d0;
  float* a1p = acc + (R > 1 ? D : 0) + d0;
  const __m256 al0 = _mm256_set1_ps(alpha[0]);
  const __m256 al1 = _mm256_set1_ps(alpha[R > 1 ? 1 : 0]);
  __m256 a00 = _mm256_mul_ps(_mm256_loadu_ps(a0p), al0), a01 = _mm256_mul_ps(_mm256_loadu_ps(a0p + 8), al0);
  __m256 a02 = _mm256_mul_ps(_mm256_loadu_ps(a0p + 16), al0), a03 = _mm256_mul_ps(_mm256_loadu_ps(a0p + 24), al0);
  __m256 a10, a11, a12, a13;
  if constexpr (R > 1) {
    a10 = _mm256_mul_ps(_mm256_loadu_ps(a1p), al1); a11 = _mm256_mul_ps(_mm256_loadu_ps(a1p + 8), al1);
    a12 = _mm256_mul_ps(_mm256_loadu_ps(a1p + 16), al1); a13 = _mm256_mul_ps(_mm256_loadu_ps(a1p + 24), al1);
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* v = vrow[j] + d0;
    const float* pp = p + j * pj;
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                 v3 = _mm256_loadu_ps(v + 24);
    __m256 pb = _mm256_broadcast_ss(pp);
    RS_FMA(pb, v0, a00); RS_FMA(pb, v1, a01); RS_FMA(pb, v2, a02); RS_FMA(pb, v3, a03);
    if constexpr (R > 1) {
      pb = _mm256_broadcast_ss(pp + pr);
      RS_FMA(pb, v0, a10); RS_FMA(pb, v1, a11); RS_FMA(pb, v2, a12); RS_FMA(pb, v3, a13);
    }
  }
  _mm256_storeu_ps(a0p, a00); _mm256_storeu_ps(a0p + 8, a01); _mm256_storeu_ps(a0p + 16, a02); _mm256_storeu_ps(a0p + 24, a03);
  if constexpr (R > 1) {
    _mm256_storeu_ps(a1p, a10); _mm256_storeu_ps(a1p + 8, a11); _mm256_storeu_ps(a1p + 16, a12); _mm256_storeu_ps(a1p + 24, a13);
  }
}

// One row, 8 elements of d at a time (head sizes that are not a multiple of 32).
inline void pv_c1(float* acc, float alpha, const float* const* vrow, int64_t d0, const float* p, int64_t pj,
                  int64_t n) {
  __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d0), _mm256_set1_ps(alpha));
  for (int64_t j = 0; j < n; ++j) RS_FMA(_mm256_broadcast_ss(p + j * pj), _mm256_loadu_ps(vrow[j] + d0), a);
  _mm256_storeu_ps(acc + d0, a);
}

void pv_rows(Work& w, int64_t n) {
  const int64_t D = w.D, D32 = D / 32 * 32;
  for (int64_t r0 = 0; r0 < w.M; r0 += 2) {
    const int64_t R = std::min<int64_t>(2, w.M - r0);
    float* acc = w.acc + r0 * D;
    const float* p = w.st + r0 * w.pr;
    for (int64_t d0 = 0; d0 < D32; d0 += 32) {
      if (R == 2) pv_c4<2>(acc, D, w.alpha + r0, w.vrow, d0, p, w.pj, w.pr, n);
      else pv_c4<1>(acc, D, w.alpha + r0, w.vrow, d0, p, w.pj, w.pr, n);
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t d0 = D32; d0 < D; d0 += 8) pv_c1(acc + r * D, w.alpha[r0 + r], w.vrow, d0, p + r * w.pr, w.pj, n);
  }
}

// Rows in lanes: mask, block max, exp, halving sum for row vector v (8 rows).
void softmax_rows_in_lanes(Work& w, int64_t v, int64_t k0, int64_t kn, bool masked) {
  float* sv = w.st + v * 8;
  const int64_t Mp = w.Mp;
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  if (masked) {
    const __m256i pv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.pos + v * 8));
    const __m256i lv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.lo + v * 8));
    for (int64_t j = 0; j < kBlockK; ++j) {
      const __m256i kj = _mm256_set1_epi32(static_cast<int>(k0 + j));
      __m256i mk = _mm256_or_si256(_mm256_cmpgt_epi32(kj, pv), _mm256_cmpgt_epi32(lv, kj));
      if (j >= kn) mk = _mm256_set1_epi32(-1);
      _mm256_storeu_ps(sv + j * Mp, _mm256_blendv_ps(_mm256_loadu_ps(sv + j * Mp), ninf, _mm256_castsi256_ps(mk)));
    }
  }
  __m256 mb = _mm256_loadu_ps(sv);
  for (int64_t j = 1; j < kBlockK; ++j) mb = _mm256_max_ps(mb, _mm256_loadu_ps(sv + j * Mp));
  const __m256 mo = _mm256_loadu_ps(w.m + v * 8);
  const __m256 mn = _mm256_max_ps(mo, mb);
  const __m256 a = exp256(_mm256_sub_ps(mo, mn));
  // halving_sum32: p_i + p_i+16, then + 8, + 4, + 2, + 1
  __m256 h[16];
  for (int64_t i = 0; i < 16; ++i) {
    const __m256 p0 = exp256(_mm256_sub_ps(_mm256_loadu_ps(sv + i * Mp), mn));
    const __m256 p1 = exp256(_mm256_sub_ps(_mm256_loadu_ps(sv + (i + 16) * Mp), mn));
    _mm256_storeu_ps(sv + i * Mp, p0);
    _mm256_storeu_ps(sv + (i + 16) * Mp, p1);
    h[i] = _mm256_add_ps(p0, p1);
  }
  for (int64_t wd = 8; wd >= 1; wd /= 2)
    for (int64_t i = 0; i < wd; ++i) h[i] = _mm256_add_ps(h[i], h[i + wd]);
  const __m256 lo = _mm256_loadu_ps(w.l + v * 8);
  _mm256_storeu_ps(w.l + v * 8, _mm256_add_ps(_mm256_mul_ps(lo, a), h[0]));
  _mm256_storeu_ps(w.m + v * 8, mn);
  _mm256_storeu_ps(w.alpha + v * 8, a);
}

// 8x8 transpose of 32-bit elements in named registers: afterwards r_k holds column k.
#define RS_TRANSPOSE8(r0, r1, r2, r3, r4, r5, r6, r7)                                            \
  do {                                                                                            \
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);                \
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);                \
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);                \
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);                \
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);      \
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);      \
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);      \
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);      \
    r0 = _mm256_permute2f128_ps(u0, u4, 0x20);                                                    \
    r1 = _mm256_permute2f128_ps(u1, u5, 0x20);                                                    \
    r2 = _mm256_permute2f128_ps(u2, u6, 0x20);                                                    \
    r3 = _mm256_permute2f128_ps(u3, u7, 0x20);                                                    \
    r4 = _mm256_permute2f128_ps(u0, u4, 0x31);                                                    \
    r5 = _mm256_permute2f128_ps(u1, u5, 0x31);                                                    \
    r6 = _mm256_permute2f128_ps(u2, u6, 0x31);                                                    \
    r7 = _mm256_permute2f128_ps(u3, u7, 0x31);                                                    \
  } while (0)

// Keys in lanes: scores of 8 keys (rows k[0..7]) for R (1..4) query rows q + r * D, dot
// products over d in order (8 K rows transposed per 8 elements of d); into out[r].
template <int R>
inline void qk_few_group(const float* const* k, const float* q, int64_t D, __m256* out) {
  static_assert(R >= 1 && R <= 4, "1 to 4 rows");
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3], *k4 = k[4], *k5 = k[5], *k6 = k[6], *k7 = k[7];
  const float* q0 = q;
  const float* q1 = q + (R > 1 ? D : 0);
  const float* q2 = q + (R > 2 ? 2 * D : 0);
  const float* q3 = q + (R > 3 ? 3 * D : 0);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d0 = 0; d0 < D; d0 += 8) {
    __m256 c0 = _mm256_loadu_ps(k0 + d0), c1 = _mm256_loadu_ps(k1 + d0), c2 = _mm256_loadu_ps(k2 + d0),
           c3 = _mm256_loadu_ps(k3 + d0), c4 = _mm256_loadu_ps(k4 + d0), c5 = _mm256_loadu_ps(k5 + d0),
           c6 = _mm256_loadu_ps(k6 + d0), c7 = _mm256_loadu_ps(k7 + d0);
    RS_TRANSPOSE8(c0, c1, c2, c3, c4, c5, c6, c7);  // c_e = element d0 + e of the 8 keys
#define RS_STEP(e, c)                                                        \
  a0 = _mm256_fmadd_ps(c, _mm256_broadcast_ss(q0 + d0 + e), a0);             \
  if constexpr (R > 1) a1 = _mm256_fmadd_ps(c, _mm256_broadcast_ss(q1 + d0 + e), a1); \
  if constexpr (R > 2) a2 = _mm256_fmadd_ps(c, _mm256_broadcast_ss(q2 + d0 + e), a2); \
  if constexpr (R > 3) a3 = _mm256_fmadd_ps(c, _mm256_broadcast_ss(q3 + d0 + e), a3);
    RS_STEP(0, c0) RS_STEP(1, c1) RS_STEP(2, c2) RS_STEP(3, c3)
    RS_STEP(4, c4) RS_STEP(5, c5) RS_STEP(6, c6) RS_STEP(7, c7)
#undef RS_STEP
  }
  out[0] = a0;
  if constexpr (R > 1) out[1] = a1;
  if constexpr (R > 2) out[2] = a2;
  if constexpr (R > 3) out[3] = a3;
}

// Keys in lanes from a block already transposed (kt[d * kBlockK + j] = key j, element d),
// as a block shared by several sequences is: 16 keys x R rows per pass, the same in-order
// fma chain over d per score as qk_few_group, without the shuffles.
template <int R>
inline void qk_few_t(const float* kt, const float* q, int64_t D, __m256 (*acc)[4]) {
  static_assert(R >= 1 && R <= 4, "1 to 4 rows");
  const float* q0 = q;
  const float* q1 = q + (R > 1 ? D : 0);
  const float* q2 = q + (R > 2 ? 2 * D : 0);
  const float* q3 = q + (R > 3 ? 3 * D : 0);
  for (int half = 0; half < 2; ++half) {
    const float* k = kt + 16 * half;
    RS_ZERO(a00); RS_ZERO(a01); RS_ZERO(a10); RS_ZERO(a11); RS_ZERO(a20); RS_ZERO(a21); RS_ZERO(a30); RS_ZERO(a31);
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(k + d * kBlockK), k1 = _mm256_loadu_ps(k + d * kBlockK + 8);
      __m256 qb = _mm256_broadcast_ss(q0 + d);
      a00 = _mm256_fmadd_ps(k0, qb, a00); a01 = _mm256_fmadd_ps(k1, qb, a01);
      if constexpr (R > 1) { qb = _mm256_broadcast_ss(q1 + d); a10 = _mm256_fmadd_ps(k0, qb, a10); a11 = _mm256_fmadd_ps(k1, qb, a11); }
      if constexpr (R > 2) { qb = _mm256_broadcast_ss(q2 + d); a20 = _mm256_fmadd_ps(k0, qb, a20); a21 = _mm256_fmadd_ps(k1, qb, a21); }
      if constexpr (R > 3) { qb = _mm256_broadcast_ss(q3 + d); a30 = _mm256_fmadd_ps(k0, qb, a30); a31 = _mm256_fmadd_ps(k1, qb, a31); }
    }
    acc[0][2 * half] = a00; acc[0][2 * half + 1] = a01;
    if constexpr (R > 1) { acc[1][2 * half] = a10; acc[1][2 * half + 1] = a11; }
    if constexpr (R > 2) { acc[2][2 * half] = a20; acc[2][2 * half + 1] = a21; }
    if constexpr (R > 3) { acc[3][2 * half] = a30; acc[3][2 * half + 1] = a31; }
  }
}

// Keys in lanes, rows [r0, r0 + R): scores of the block's 32 keys into acc[r][4].
template <int R>
inline void qk_few(Work& w, int64_t r0, __m256 (*acc)[4]) {
  if (w.kt != nullptr) {
    qk_few_t<R>(w.kt, w.qt + r0 * w.D, w.D, acc);
    return;
  }
  for (int g = 0; g < 4; ++g) {
    __m256 out[4];
    qk_few_group<R>(w.krow + 8 * g, w.qt + r0 * w.D, w.D, out);
    for (int r = 0; r < R; ++r) acc[r][g] = out[r];
  }
}

inline float hmax8(__m256 x) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

template <int R>
void softmax_few(Work& w, int64_t r0, int64_t k0, int64_t kn, bool masked, float scale) {
  __m256 s[R][4];
  qk_few<R>(w, r0, s);
  const __m256 sc = _mm256_set1_ps(scale);
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i klim = _mm256_set1_epi32(static_cast<int>(k0 + kn));
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < 4; ++g) {
      s[r][g] = _mm256_mul_ps(s[r][g], sc);
      if (masked) {
        const __m256i kpos = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(k0 + 8 * g)), lane);
        const __m256i pr = _mm256_set1_epi32(w.pos[r0 + r]);
        const __m256i lr = _mm256_set1_epi32(w.lo[r0 + r]);
        __m256i mk = _mm256_or_si256(_mm256_cmpgt_epi32(kpos, pr),
                                     _mm256_cmpgt_epi32(kpos, _mm256_sub_epi32(klim, _mm256_set1_epi32(1))));
        mk = _mm256_or_si256(mk, _mm256_cmpgt_epi32(lr, kpos));
        s[r][g] = _mm256_blendv_ps(s[r][g], ninf, _mm256_castsi256_ps(mk));
      }
    }
    const float mb = hmax8(_mm256_max_ps(_mm256_max_ps(s[r][0], s[r][1]), _mm256_max_ps(s[r][2], s[r][3])));
    const int64_t row = r0 + r;
    const float mo = w.m[row];
    const float mn = max_ps(mo, mb);
    const float a = exp_f32(mo - mn);
    const __m256 mnv = _mm256_set1_ps(mn);
    __m256 p[4];
    for (int g = 0; g < 4; ++g) {
      p[g] = exp256(_mm256_sub_ps(s[r][g], mnv));
      _mm256_storeu_ps(w.st + row * kBlockK + 8 * g, p[g]);
    }
    // halving_sum32 over keys 0..31 = p[0] ++ p[1] ++ p[2] ++ p[3]
    const __m256 h8 = _mm256_add_ps(_mm256_add_ps(p[0], p[2]), _mm256_add_ps(p[1], p[3]));
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    const __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
    w.l[row] = w.l[row] * a + _mm_cvtss_f32(h1);
    w.m[row] = mn;
    w.alpha[row] = a;
  }
}

// Scratch floats one Work needs for M rows (see the layout in init_work).
inline int64_t work_floats(int64_t M, int64_t D) {
  const int64_t Mp = (M + 7) / 8 * 8;
  return D * Mp + kBlockK * Mp + Mp * D + 5 * Mp + 2 * kBlockK * D + 64;
}

// Work of item `it` for KV head kh in scratch `s`: q gathered (and transposed for rows in
// lanes), running max / sum / output zeroed.
void init_work(Work& w, const Problem& P, const Item& it, int64_t kh, float* s) {
  const int64_t D = P.D;
  const SeqInfo& sq = P.seqs[it.seq];
  const int64_t ng = it.g1 - it.g0;
  w.D = D;
  w.M = (it.p1 - it.p0) * ng;
  w.nv = (w.M + 7) / 8;
  w.Mp = w.nv * 8;
  const bool few = w.M <= kFewRows;
  const int64_t Mp = w.Mp;
  w.qt = s;
  w.st = w.qt + D * Mp;
  w.acc = w.st + kBlockK * Mp;
  w.m = w.acc + Mp * D;
  w.l = w.m + Mp;
  w.alpha = w.l + Mp;
  w.pos = reinterpret_cast<int32_t*>(w.alpha + Mp);
  w.lo = w.pos + Mp;
  w.kbuf = reinterpret_cast<float*>(w.lo + Mp);
  w.vbuf = w.kbuf + kBlockK * D;
  w.pj = few ? 1 : Mp;
  w.pr = few ? kBlockK : 1;
  const int64_t base = sq.kv_len - sq.q_len;
  for (int64_t r = 0; r < w.M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = kh * P.G + it.g0 + r % ng;
    const int64_t off = t * P.q_rs + h * D;
    for (int64_t d = 0; d < D; ++d) {
      const float x = load_q(P, off + d);
      if (few)
        w.qt[r * D + d] = x;
      else
        w.qt[d * Mp + r] = x;
    }
  }
  if (!few)
    for (int64_t r = w.M; r < Mp; ++r)
      for (int64_t d = 0; d < D; ++d) w.qt[d * Mp + r] = 0.f;
  const int64_t last = base + it.p1 - 1;
  for (int64_t r = 0; r < Mp; ++r) {
    // Padding rows take the last position: always attended, never NaN.
    w.pos[r] = static_cast<int32_t>(r < w.M ? base + it.p0 + r / ng : last);
    w.lo[r] = static_cast<int32_t>(first_key(P, w.pos[r]));
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
  }
  std::memset(w.acc, 0, sizeof(float) * Mp * D);
}

// One key block of KV head kh for Work w: its K/V rows, scores, softmax step, p.v.
template <typename KT>
void attend_block(Work& w, const Problem& P, const Item& it, int64_t kh, int64_t kb,
                  const float* stage = nullptr, const float* kt = nullptr) {
  constexpr bool kKvBf16 = std::is_same_v<KT, uint16_t>;
  constexpr bool kQuant = std::is_same_v<KT, uint8_t>;
  const int64_t D = P.D;
  const SeqInfo& sq = P.seqs[it.seq];
  const KT* kp = static_cast<const KT*>(P.k);
  const KT* vp = static_cast<const KT*>(P.v);
  const int64_t* slots = P.slots + sq.kv_start;
  const int64_t hoff = kh * P.hs;
  const int64_t k0 = kb * kBlockK, kn = std::min(kBlockK, sq.kv_len - k0);
  const int64_t base = sq.kv_len - sq.q_len;
  const int64_t jlo = std::max<int64_t>(0, first_key(P, base + it.p0) - k0);
  // The block's K/V rows (keys past the sequence repeat its last row, keys before the first
  // one the item reads repeat that one: they are masked, and reading a real row keeps every
  // load in bounds).
  if (stage != nullptr) {  // staged by the caller: [K | V][key][all heads' D] in float32
    const int64_t row = P.KV * D;
    for (int64_t j = 0; j < kBlockK; ++j) {
      const int64_t jj = std::max(std::min(j, kn - 1), jlo);
      w.krow[j] = stage + jj * row + kh * D;
      w.vrow[j] = stage + (kBlockK + jj) * row + kh * D;
    }
  }
  for (int64_t j = 0; stage == nullptr && j < kBlockK; ++j) {
    const int64_t off = slots[k0 + std::max(std::min(j, kn - 1), jlo)] * P.kv_ss + hoff;
    if constexpr (kKvBf16 || kQuant) {
      float* kd = w.kbuf + j * D;
      float* vd = w.vbuf + j * D;
      if (j < kn) {
        if constexpr (kQuant) {
          dequant_row(kp + off, D, P.kv_kind, P.fp8, kd);
          dequant_row(vp + off, D, P.kv_kind, P.fp8, vd);
        } else {
          for (int64_t d = 0; d < D; d += 8) {
            _mm256_storeu_ps(kd + d, bf16x8_to_f32(kp + off + d));
            _mm256_storeu_ps(vd + d, bf16x8_to_f32(vp + off + d));
          }
        }
      } else {
        std::memcpy(kd, w.kbuf + (kn - 1) * D, sizeof(float) * D);
      }
      w.krow[j] = kd;
      w.vrow[j] = vd;
    } else {
      w.krow[j] = kp + off;
      w.vrow[j] = vp + off;
    }
  }
  w.kt = kt;
  const int64_t min_pos = base + it.p0;
  // (The last row's window starts last: blocks before it need the window mask too.)
  const bool masked = k0 + kBlockK - 1 > min_pos || kn < kBlockK || k0 < first_key(P, base + it.p1 - 1);
  if (w.M > kFewRows) {
    qk_rows_in_lanes(w, P.scale);
    for (int64_t v = 0; v < w.nv; ++v) softmax_rows_in_lanes(w, v, k0, kn, masked);
  } else {
    int64_t r0 = 0;
    for (; r0 + 4 <= w.M; r0 += 4) softmax_few<4>(w, r0, k0, kn, masked, P.scale);
    switch (w.M - r0) {
      case 3: softmax_few<3>(w, r0, k0, kn, masked, P.scale); break;
      case 2: softmax_few<2>(w, r0, k0, kn, masked, P.scale); break;
      case 1: softmax_few<1>(w, r0, k0, kn, masked, P.scale); break;
      default: break;
    }
  }
  pv_rows(w, kn);
}

// Software prefetch of block kb's K/V rows of heads [kh0, kh1), unless they are one
// ascending run of slots (the allocator hands slots out in runs): the hardware prefetcher
// streams those by itself, but scattered rows would each cost a trip to memory.
template <typename KT>
void prefetch_block(const Problem& P, const SeqInfo& sq, int64_t kb, int64_t klo, int64_t kh0, int64_t kh1,
                    bool runs_too = false) {
  const int64_t k0 = std::max(kb * kBlockK, klo);  // (the slots before klo are never read)
  if (k0 >= sq.kv_len) return;
  const int64_t* ns = P.slots + sq.kv_start + k0;
  const int64_t n = std::min((kb + 1) * kBlockK, sq.kv_len) - k0;
  if (!runs_too && ns[n - 1] - ns[0] == n - 1) return;
  const int64_t bytes = (kh1 - kh0) * P.hs * static_cast<int64_t>(sizeof(KT));
  for (int64_t j = 0; j < n; ++j) {
    const char* kr = reinterpret_cast<const char*>(static_cast<const KT*>(P.k) + ns[j] * P.kv_ss + kh0 * P.hs);
    const char* vr = reinterpret_cast<const char*>(static_cast<const KT*>(P.v) + ns[j] * P.kv_ss + kh0 * P.hs);
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(kr + b, _MM_HINT_T0);
      _mm_prefetch(vr + b, _MM_HINT_T0);
    }
  }
}

void write_out(const Work& w, const Problem& P, const Item& it, int64_t kh) {
  const SeqInfo& sq = P.seqs[it.seq];
  const int64_t D = P.D, ng = it.g1 - it.g0;
  for (int64_t r = 0; r < w.M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = kh * P.G + it.g0 + r % ng;
    const __m256 lv = _mm256_set1_ps(w.l[r]);
    const int64_t off = t * P.o_rs + h * D;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 o = _mm256_div_ps(_mm256_loadu_ps(w.acc + r * D + d), lv);
      if (P.out_bf16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(P.out) + off + d), f32_to_bf16x8(o));
      else
        _mm256_storeu_ps(static_cast<float*>(P.out) + off + d, o);
    }
  }
}

// Most KV heads one item walks together (decode items; see run_avx2).
constexpr int64_t kMaxItemHeads = 8;
// Most sequences one shared-block group holds (see run_avx2).
constexpr int64_t kMaxGroup = 16;

// Block kb's K and V slot rows (every head) of sequence sq copied front to back into float32
// stage ([K | V][key][all heads' D]): the pool is read as two plain streams, which the
// hardware prefetcher keeps up with, rather than head by head at a stride (measured ~3x
// faster from memory). Keys before klo are never read.
template <typename KT>
void stage_block(const Problem& P, const SeqInfo& sq, int64_t kb, int64_t klo, float* stage) {
  const int64_t row = P.KV * P.D;
  const int64_t* slots = P.slots + sq.kv_start;
  const int64_t k0 = kb * kBlockK, kn = std::min(kBlockK, sq.kv_len - k0);
  for (int half = 0; half < 2; ++half) {
    const KT* src = static_cast<const KT*>(half ? P.v : P.k);
    float* dst = stage + half * kBlockK * row;
    for (int64_t j = std::max<int64_t>(0, klo - k0); j < kn; ++j) {
      const KT* r = src + slots[k0 + j] * P.kv_ss;
      float* o = dst + j * row;
      if constexpr (std::is_same_v<KT, uint8_t>) {
        for (int64_t h = 0; h < P.KV; ++h) dequant_row(r + h * P.hs, P.D, P.kv_kind, P.fp8, o + h * P.D);
      } else if constexpr (std::is_same_v<KT, uint16_t>) {
        for (int64_t d = 0; d < row; d += 8) _mm256_storeu_ps(o + d, bf16x8_to_f32(r + d));
      } else {
        std::memcpy(o, r, sizeof(float) * row);
      }
    }
  }
}

// Blocks [kb0, end) of item `it` over KV heads [it.kh, it.kh + heads), works ws initialised:
// block by block, every head's rows of a block are read while that block's slot rows (all
// heads, contiguous) are in cache (staged when stage is not null).
template <typename KT>
void walk_blocks(const Problem& P, const Item& it, int64_t heads, Work* ws, float* stage, int64_t kb0) {
  const SeqInfo& sq = P.seqs[it.seq];
  const int64_t nkb = (sq.kv_len - sq.q_len + it.p1 - 1) / kBlockK + 1;
  const int64_t klo = first_key(P, sq.kv_len - sq.q_len + it.p0);  // keys before it are never read
  for (int64_t kb = std::max(kb0, klo / kBlockK); kb < nkb; ++kb) {
    if (kb + 1 < nkb) prefetch_block<KT>(P, sq, kb + 1, klo, it.kh, it.kh + heads, stage != nullptr);
    if (stage != nullptr) stage_block<KT>(P, sq, kb, klo, stage);
    for (int64_t h = 0; h < heads; ++h) attend_block<KT>(ws[h], P, it, it.kh + h, kb, stage);
  }
}

// Item `it` over KV heads [it.kh, it.kh + heads). The operations applied to each row are
// those of a one-head item.
template <typename KT>
void attend_avx2(const Problem& P, const Item& it, int64_t heads) {
  const int64_t per = work_floats((it.p1 - it.p0) * (it.g1 - it.g0), P.D);
  const int64_t row = P.KV * P.D;
  const bool staged = heads == P.KV && heads > 1;
  float* s = thread_scratch(static_cast<size_t>(per * heads + (staged ? 2 * kBlockK * row : 0)));
  Work ws[kMaxItemHeads];
  for (int64_t h = 0; h < heads; ++h) init_work(ws[h], P, it, it.kh + h, s + h * per);
  walk_blocks<KT>(P, it, heads, ws, staged ? s + per * heads : nullptr, 0);
  for (int64_t h = 0; h < heads; ++h) write_out(ws[h], P, it, it.kh + h);
}


// Decode items (all KV heads each, whole query, no window) of sequences whose first slots
// are the same: each shared block is staged and its K transposed once for the group, then
// every sequence that shares it runs its rows over it; each sequence's own blocks follow as
// in attend_avx2. A row sees the same blocks in the same order with the same arithmetic
// (qk_few_t is qk_few_group's fma chain), so its bits do not depend on the grouping.
template <typename KT>
void attend_group_avx2(const Problem& P, const Item* its, int64_t n) {
  const int64_t D = P.D, KV = P.KV, row = KV * D;
  int64_t per = 0, shared[kMaxGroup], maxb = 0;
  const SeqInfo& s0 = P.seqs[its[0].seq];
  for (int64_t m = 0; m < n; ++m) {
    per = std::max(per, work_floats((its[m].p1 - its[m].p0) * (its[m].g1 - its[m].g0), D));
    shared[m] = shared_blocks(P, s0, P.seqs[its[m].seq]);
    maxb = std::max(maxb, shared[m]);
  }
  float* s = thread_scratch(static_cast<size_t>(per * KV * n + 2 * kBlockK * row + kBlockK * row));
  float* stage = s + per * KV * n;
  float* kt = stage + 2 * kBlockK * row;  // [head][D][kBlockK]
  Work ws[kMaxGroup][kMaxItemHeads];
  for (int64_t m = 0; m < n; ++m)
    for (int64_t h = 0; h < KV; ++h) init_work(ws[m][h], P, its[m], h, s + (m * KV + h) * per);
  for (int64_t kb = 0; kb < maxb; ++kb) {
    if (kb + 1 < maxb) prefetch_block<KT>(P, s0, kb + 1, 0, 0, KV, true);
    stage_block<KT>(P, s0, kb, 0, stage);
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t g = 0; g < kBlockK; g += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
          const float* src = stage + g * row + h * D + d0;
          __m256 c0 = _mm256_loadu_ps(src), c1 = _mm256_loadu_ps(src + row), c2 = _mm256_loadu_ps(src + 2 * row),
                 c3 = _mm256_loadu_ps(src + 3 * row), c4 = _mm256_loadu_ps(src + 4 * row),
                 c5 = _mm256_loadu_ps(src + 5 * row), c6 = _mm256_loadu_ps(src + 6 * row),
                 c7 = _mm256_loadu_ps(src + 7 * row);
          RS_TRANSPOSE8(c0, c1, c2, c3, c4, c5, c6, c7);
          float* dst = kt + h * D * kBlockK + d0 * kBlockK + g;
          _mm256_storeu_ps(dst, c0); _mm256_storeu_ps(dst + kBlockK, c1);
          _mm256_storeu_ps(dst + 2 * kBlockK, c2); _mm256_storeu_ps(dst + 3 * kBlockK, c3);
          _mm256_storeu_ps(dst + 4 * kBlockK, c4); _mm256_storeu_ps(dst + 5 * kBlockK, c5);
          _mm256_storeu_ps(dst + 6 * kBlockK, c6); _mm256_storeu_ps(dst + 7 * kBlockK, c7);
        }
    for (int64_t m = 0; m < n; ++m)
      if (shared[m] > kb)
        for (int64_t h = 0; h < KV; ++h) attend_block<KT>(ws[m][h], P, its[m], h, kb, stage, kt + h * D * kBlockK);
  }
  for (int64_t m = 0; m < n; ++m) {
    walk_blocks<KT>(P, its[m], KV, ws[m], stage, shared[m]);
    for (int64_t h = 0; h < KV; ++h) write_out(ws[m][h], P, its[m], h);
  }
}


}  // namespace

bool run_avx2(const Problem& P, const std::vector<Item>& items, Store store) {
  if (!avx2_head_dim(P.D)) return false;
  // Decode items (few rows) of one sequence walk all its KV heads together: a slot's K and V
  // rows are contiguous across heads, so that reads the pool front to back instead of
  // once per head at a stride.
  // (Only with at least a sequence per thread: merging must not leave a thread idle.)
  const int64_t nt = at::get_num_threads();
  int64_t few_items = 0;
  for (const Item& it : items) few_items += (it.p1 - it.p0) * (it.g1 - it.g0) <= kFewRows;
  const bool merge = P.KV > 1 && P.KV <= kMaxItemHeads && few_items >= P.KV * nt;
  std::vector<Item> work;
  work.reserve(items.size());
  for (const Item& it : items) {
    const bool few = (it.p1 - it.p0) * (it.g1 - it.g0) <= kFewRows;
    if (merge && few) {
      if (it.kh != 0) continue;  // covered by the kh == 0 item
      Item m = it;
      m.cost = it.cost * P.KV;
      work.push_back(m);
    } else {
      work.push_back(it);
    }
  }
  auto merged = [&](const Item& it) { return merge && (it.p1 - it.p0) * (it.g1 - it.g0) <= kFewRows; };
  // Merged items of a whole query (no window) whose sequences start with the same slot, in
  // groups of at most kMaxGroup, split so that every thread gets a group; the rest (and a
  // part of one item) run alone.
  std::vector<std::pair<int64_t, int64_t>> keyed;  // (first slot, index in work)
  if (merge && P.window == 0) {
    for (int64_t i = 0; i < static_cast<int64_t>(work.size()); ++i) {
      const Item& it = work[i];
      const SeqInfo& sq = P.seqs[it.seq];
      if (merged(it) && it.p0 == 0 && it.p1 == sq.q_len && it.g0 == 0 && it.g1 == P.G &&
          sq.kv_len - sq.q_len + 1 >= 2 * kBlockK)
        keyed.emplace_back(P.slots[sq.kv_start], i);
    }
  }
  const std::vector<Task> tasks = bundle_by_first_slot(work, std::move(keyed), kMaxGroup);
  const std::vector<Item>& order = work;
  auto run = [&](auto tag) {
    using KT = decltype(tag);
    run_items(tasks, [&](const Task& t) {
      const Item& it = order[t.first];
      if (t.n > 1)
        attend_group_avx2<KT>(P, &order[t.first], t.n);
      else
        attend_avx2<KT>(P, it, merged(it) ? P.KV : int64_t{1});
    });
  };
  switch (store) {
    case Store::kBf16: run(uint16_t{}); break;
    case Store::kQuant: run(uint8_t{}); break;
    default: run(float{}); break;
  }
  return true;
}
#else
bool run_avx2(const Problem&, const std::vector<Item>&, Store) { return false; }
#endif  // RS_AVX2

}  // namespace attn
}  // namespace radixserve
