// Linear layers on GGUF blocks computed on their integer codes (``--weight-dtype gguf-codes``),
// and the definition they are exact to.
//
// Why: expanding a block to the dense model's bfloat16 weights (gemm_quant.cpp) multiplies
// every code by its scale and rounds the product to bfloat16, several vector instructions per
// 32 weights, which leaves a one-thread decode compute-bound. A block's weights share one
// scale, so the scale can wait: the activations' dot product with the block's codes first
// (the codes are small integers, exact in bfloat16: Q4_0 -8..7, Q4_1 0..15, Q8_0 -128..127,
// and every product of one with a bfloat16 activation is exact in float32), then one multiply
// by the scale per block and output element. A 4-bit code becomes its bfloat16 operand with a
// table lookup, no multiply and no rounding. The activations stay bfloat16, as in the dense
// model (gguf-q8 quantizes them to 8 bits), so the error is the dense model's order.
//
// The definition (tests/test_gemm_codes.py transcribes it in numpy). Every value below with a
// magnitude under FLT_MIN is flushed to a zero of its sign, inputs and results (vdpbf16ps's
// rule; the vector paths run under FTZ/DAZ, the portable one flushes by hand):
//
// 1. Row x rounded to bfloat16 (to nearest even); weight column n, block b (k = 32 b .. 32 b +
//    31): signed codes c_k (Q8_0: the stored int8; Q4_0: q - 8; Q4_1: q) and scale d (fp16
//    widened to float32; Q4_1 also its offset m).
// 2. B = 0; for j = 0 .. 15: B = fma(x[2j+1], c[2j+1], B); B = fma(x[2j], c[2j], B), the
//    block's pairs in order, odd k first: vdpbf16ps's chain over one block, as gemm_dot.cpp.
// 3. Q4_1: S = 0; for j = 0 .. 15: S = S + x[2j+1]; S = S + x[2j] (the block's activation sum,
//    per row, shared by every column).
// 4. acc = 0; for b = 0, 1, ... in order: acc = acc + (d * B) (the product rounded to float32
//    first); Q4_1 then acc = acc + (m * S).
// 5. y = acc (+ bias[n], a float32 add), stored as float32 or rounded to bfloat16.
//
// Each element is that one chain, whatever the path (the portable loop; AVX2 with two fmas per
// pair on the codes as float32; AVX-512 the same, or vdpbf16ps on the codes as bfloat16 where
// AVX512-BF16 is built), the row count, the tile a row falls in or the thread that runs it:
// a row gives the same bits alone, in a decode batch and inside a prefill of any length.
//
// Layout (a blob of version kBlobCodes): the panels and groups of quant.h's expansion layout
// (fp16 scales, then the codes; value v = 2 c + e of pair j is column c's k = 2 j + e), the
// same bytes, with the 4-bit codes of pairs 2t and 2t+1 sharing 32 bytes: byte 32 t + v holds
// value v of pair 2t in its low nibble and of pair 2t+1 in its high one. So one 32-byte load
// widened to 16-bit words gives two pairs' operands, a mask-free table lookup (vpermw) each.
// Q8_0 keeps the expansion layout's byte per value. A call of any row count runs tiles of a
// few rows over a chunk of panels that stays in L2, then the next rows over the same chunk
// (natively, a Q8_0 call of many rows expands the chunk once into scratch first: c5::run_scratch).
#include "common.h"
#include "gemm_dot.h"
#include "quant.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#if RS_AVX2 && defined(__F16C__)
#define RS_CODES_AVX2 1
#else
#define RS_CODES_AVX2 0
#endif
#if RS_CODES_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define RS_CODES_AVX512 1
#else
#define RS_CODES_AVX512 0
#endif
#if RS_CODES_AVX512 && defined(__AVX512BF16__)
#define RS_CODES_NATIVE 1
#else
#define RS_CODES_NATIVE 0
#endif

namespace radixserve {

using namespace quant;

namespace {

constexpr int64_t kChunkBytes = 192 * 1024;  // the panels a thread's row tiles share, in L2
constexpr int64_t kScratchMinRows = 8;       // Q8_0 calls of more rows expand each panel once (native)

inline float flush(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }

// The signed code a stored (raw) code stands for.
template <int32_t F>
inline int code_of(uint32_t q) {
  if constexpr (F == kQ8_0) return static_cast<int8_t>(static_cast<uint8_t>(q));
  else if constexpr (F == kQ4_0) return static_cast<int>(q) - 8;
  else return static_cast<int>(q);
}

// Raw code of value v of pair j of a group.
template <int32_t F>
inline uint32_t code_at(const uint8_t* grp, int64_t j, int v) {
  const uint8_t* low = grp + scale_bytes(F);
  if constexpr (F == kQ8_0) return low[32 * j + v];
  else return (low[32 * (j >> 1) + v] >> (4 * (j & 1))) & 15u;
}

// A call as the tiles read it.
struct CCall {
  const DotRows* rows;   // bf16 pairs (xh, native) or chain-order float32 (xf)
  const float* sums;     // Q4_1: [M, G] the rows' block sums S (step 3), else nullptr
  int64_t M, K, G, K2;
  const uint8_t* seg;    // the segment's panels
  int64_t panel_bytes;
  const float* bias;     // [n] of the segment, or nullptr
  void* out;             // column 0 of the segment
  int64_t ldo;
  bool out_bf16;
  int64_t N;             // the segment's columns
};

inline void store16(const CCall& c, int64_t m, int64_t p, const float* acc) {
  const int64_t n0 = p * kNR, cols = std::min<int64_t>(kNR, c.N - n0);
  for (int64_t i = 0; i < cols; ++i) {
    if (c.out_bf16)
      static_cast<uint16_t*>(c.out)[m * c.ldo + n0 + i] = f32_to_bf16(acc[i]);
    else
      static_cast<float*>(c.out)[m * c.ldo + n0 + i] = acc[i];
  }
}

// x[m, k] of the call as float32 (bf16 values): from the pairs or the chain-order rows.
inline float x_at(const DotRows& r, bool pairs, int64_t m, int64_t k) {
  if (pairs) return bf16_to_f32(r.xh[m * 2 * r.K2 + k]);
  return r.xf[m * 2 * r.K2 + (k ^ 1)];
}

#if RS_CODES_AVX512
// A zero of its sign for every lane under FLT_MIN (flush, 16 lanes).
inline __m512 flush16(__m512 v) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ);
  return _mm512_mask_and_ps(v, tiny, v, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN)));
}

// Step 3 for 16 blocks of one row at once, from the bf16 pairs (`xr`: the row): lane i is block
// g0 + i, each lane the definition's chain. A pair is one dword: gathered 16 blocks apart.
inline void block_sums16(const uint16_t* xr, int64_t g0, int64_t n, float* s) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(kGroupPairs));
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
  const int32_t* base = reinterpret_cast<const int32_t*>(xr) + g0 * kGroupPairs;
  __m512 a = _mm512_setzero_ps();
  for (int64_t j = 0; j < kGroupPairs; ++j) {
    const __m512i pair = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at, base + j, 4);
    const __m512 xo = _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32(0xffff), pair));
    const __m512 xe = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
    a = flush16(_mm512_add_ps(a, flush16(xo)));
    a = flush16(_mm512_add_ps(a, flush16(xe)));
  }
  _mm512_mask_storeu_ps(s, live, a);
}
#endif

// Step 3 for every row and block, flushed by hand (every path reads these).
void block_sums(const DotRows& r, bool pairs, int64_t M, int64_t G, float* s) {
#if RS_CODES_AVX512
  if (pairs) {  // the native path: AVX-512 is there
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; g += 16)
        block_sums16(r.xh + m * 2 * r.K2, g, std::min<int64_t>(16, G - g), s + m * G + g);
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float a = 0.f;
      for (int64_t j = 0; j < kGroupPairs; ++j) {
        const int64_t k = g * kGroupK + 2 * j;
        a = flush(a + flush(x_at(r, pairs, m, k + 1)));
        a = flush(a + flush(x_at(r, pairs, m, k)));
      }
      s[m * G + g] = a;
    }
}

// ---------------------------------------------------------------- portable path
template <int32_t F>
void portable_tile(const CCall& c, int64_t m, int64_t p) {
  const uint8_t* pan = c.seg + p * c.panel_bytes;
  const float* x = c.rows->xf + m * 2 * c.K2;
  float acc[kNR] = {};
  for (int64_t g = 0; g < c.G; ++g) {
    const uint8_t* grp = pan + g * group_bytes(F);
    float blk[kNR] = {};
    for (int64_t j = 0; j < kGroupPairs; ++j) {
      const int64_t jj = g * kGroupPairs + j;
      const float xo = flush(x[2 * jj]), xe = flush(x[2 * jj + 1]);
      for (int col = 0; col < kNR; ++col) {
        blk[col] = flush(std::fma(xo, static_cast<float>(code_of<F>(code_at<F>(grp, j, 2 * col + 1))), blk[col]));
        blk[col] = flush(std::fma(xe, static_cast<float>(code_of<F>(code_at<F>(grp, j, 2 * col))), blk[col]));
      }
    }
    for (int col = 0; col < kNR; ++col) {
      const float d = f16_to_f32(load_u16(grp + 2 * col));
      acc[col] = flush(acc[col] + flush(d * blk[col]));
      if constexpr (F == kQ4_1) {
        const float mn = f16_to_f32(load_u16(grp + 2 * kNR + 2 * col));
        acc[col] = flush(acc[col] + flush(mn * c.sums[m * c.G + g]));
      }
    }
  }
  if (c.bias != nullptr) {
    const int64_t n0 = p * kNR, cols = std::min<int64_t>(kNR, c.N - n0);
    for (int64_t i = 0; i < cols; ++i) acc[i] = flush(acc[i] + flush(c.bias[n0 + i]));
  }
  store16(c, m, p, acc);
}

// ---------------------------------------------------------------- AVX2
#if RS_CODES_AVX2
namespace c2 {

// Columns in the order the even/odd split leaves them (0 1 4 5 2 3 6 7); its own inverse.
inline __m256 swap_mid(__m256 v) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xd8)); }
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The bytes of pair couple t (pairs 2t, 2t+1; Q8_0: pair t alone) widened to 32-bit lanes:
// b[i] holds values 8i .. 8i+7.
template <int32_t F>
inline void couple_bytes(const uint8_t* grp, int64_t t, __m256i b[4]) {
  const uint8_t* at = grp + scale_bytes(F) + 32 * t;
  for (int i = 0; i < 4; ++i) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 8 * i));
    b[i] = F == kQ8_0 ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
  }
}

// Signed codes as float32 from couple_bytes (`high`: the couple's second pair), split: even/odd
// k of columns 0..7 (e0, o0) and 8..15 (e1, o1), columns in swap_mid's order.
template <int32_t F>
inline void codes(const __m256i b[4], bool high, __m256& e0, __m256& o0, __m256& e1, __m256& o1) {
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    if constexpr (F == kQ8_0) {
      q[i] = b[i];
    } else {
      q[i] = high ? _mm256_srli_epi32(b[i], 4) : _mm256_and_si256(b[i], _mm256_set1_epi32(15));
      if constexpr (F == kQ4_0) q[i] = _mm256_sub_epi32(q[i], _mm256_set1_epi32(8));
    }
  }
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtepi32_ps(q[i]);
  e0 = _mm256_shuffle_ps(v[0], v[1], 0x88);
  o0 = _mm256_shuffle_ps(v[0], v[1], 0xdd);
  e1 = _mm256_shuffle_ps(v[2], v[3], 0x88);
  o1 = _mm256_shuffle_ps(v[2], v[3], 0xdd);
}

template <int32_t F, int R, int NP>
void tile(const CCall& c, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 4, "at most 8 block accumulators");
  __m256 tot[R][NP][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) tot[r][i][0] = tot[r][i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < c.G; ++g) {
    const uint8_t* grp[NP];
    for (int i = 0; i < NP; ++i) grp[i] = c.seg + (p + i) * c.panel_bytes + g * group_bytes(F);
    __m256 blk[R][NP][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NP; ++i) blk[r][i][0] = blk[r][i][1] = _mm256_setzero_ps();
    constexpr int kPer = F == kQ8_0 ? 1 : 2;  // pairs a couple_bytes load holds
    for (int64_t t = 0; t < kGroupPairs / kPer; ++t)
      for (int i = 0; i < NP; ++i) {
        __m256i bytes[4];
        couple_bytes<F>(grp[i], t, bytes);
        for (int h = 0; h < kPer; ++h) {
        const int64_t jj = g * kGroupPairs + kPer * t + h;
        __m256 e0, o0, e1, o1;
        codes<F>(bytes, h == 1, e0, o0, e1, o1);
        for (int r = 0; r < R; ++r) {  // chain order: the odd product, then the even one
          const float* x = c.rows->xf + (m0 + r) * 2 * c.K2 + 2 * jj;
          const __m256 xo = _mm256_broadcast_ss(x), xe = _mm256_broadcast_ss(x + 1);
          blk[r][i][0] = _mm256_fmadd_ps(xo, o0, blk[r][i][0]);
          blk[r][i][1] = _mm256_fmadd_ps(xo, o1, blk[r][i][1]);
          blk[r][i][0] = _mm256_fmadd_ps(xe, e0, blk[r][i][0]);
          blk[r][i][1] = _mm256_fmadd_ps(xe, e1, blk[r][i][1]);
        }
        }
      }
    for (int i = 0; i < NP; ++i) {
      const __m256 d0 = swap_mid(f16x8(grp[i])), d1 = swap_mid(f16x8(grp[i] + 16));
      for (int r = 0; r < R; ++r) {
        tot[r][i][0] = _mm256_add_ps(tot[r][i][0], _mm256_mul_ps(d0, blk[r][i][0]));
        tot[r][i][1] = _mm256_add_ps(tot[r][i][1], _mm256_mul_ps(d1, blk[r][i][1]));
      }
      if constexpr (F == kQ4_1) {
        const __m256 n0 = swap_mid(f16x8(grp[i] + 32)), n1 = swap_mid(f16x8(grp[i] + 48));
        for (int r = 0; r < R; ++r) {
          const __m256 s = _mm256_broadcast_ss(c.sums + (m0 + r) * c.G + g);
          tot[r][i][0] = _mm256_add_ps(tot[r][i][0], _mm256_mul_ps(n0, s));
          tot[r][i][1] = _mm256_add_ps(tot[r][i][1], _mm256_mul_ps(n1, s));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) {
      alignas(32) float buf[kNR] = {};
      __m256 lo = swap_mid(tot[r][i][0]), hi = swap_mid(tot[r][i][1]);
      if (c.bias != nullptr) {  // (no add of +0 without one: -0 + +0 is +0)
        std::memcpy(buf, c.bias + (p + i) * kNR, sizeof(float) * std::min<int64_t>(kNR, c.N - (p + i) * kNR));
        lo = _mm256_add_ps(lo, _mm256_load_ps(buf));
        hi = _mm256_add_ps(hi, _mm256_load_ps(buf + 8));
      }
      _mm256_store_ps(buf, lo);
      _mm256_store_ps(buf + 8, hi);
      store16(c, m0 + r, p + i, buf);
    }
}

}  // namespace c2
#endif

// ---------------------------------------------------------------- AVX-512
#if RS_CODES_AVX512
namespace c5 {

// Pair j's signed codes as float32: even (we) and odd (wo) k of columns 0..15.
template <int32_t F>
inline void codes_f32(const uint8_t* grp, int64_t j, const __m512& table, __m512& we, __m512& wo) {
  const uint8_t* low = grp + scale_bytes(F);
  __m512 lo, hi;  // values 0..15 and 16..31
  if constexpr (F == kQ8_0) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 32 * j))));
    hi = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 32 * j + 16))));
  } else {  // vpermps reads an index's low 4 bits: the low nibble without a mask
    const uint8_t* at = low + 32 * (j >> 1);
    __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16)));
    if (j & 1) {
      b0 = _mm512_srli_epi32(b0, 4);
      b1 = _mm512_srli_epi32(b1, 4);
    }
    lo = _mm512_permutexvar_ps(b0, table);
    hi = _mm512_permutexvar_ps(b1, table);
  }
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  we = _mm512_permutex2var_ps(lo, ie, hi);
  wo = _mm512_permutex2var_ps(lo, io, hi);
}

template <int32_t F>
inline __m512 code_table_f32() {
  const float b = F == kQ4_0 ? -8.f : 0.f;
  return _mm512_setr_ps(b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6, b + 7, b + 8, b + 9, b + 10, b + 11, b + 12,
                        b + 13, b + 14, b + 15);
}

#if RS_CODES_NATIVE
// The bf16 words of every 4-bit code (minus the format's offset), twice: vpermw reads an
// index's low 5 bits, so a whole byte (low nibble + one bit of the high one) indexes it.
template <int32_t F>
inline __m512i code_table_bf16() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = static_cast<uint16_t>(f32_to_bits(static_cast<float>(code_of<F>(i & 15))) >> 16);
  return _mm512_load_si512(t);
}

// Pair couple t's codes as vdpbf16ps's operands (value v in bf16 word v): w[0] for pair 2t,
// w[1] for pair 2t+1 (Q8_0: w[0] for pair t alone).
template <int32_t F>
inline void codes_bf16(const uint8_t* grp, int64_t t, const __m512i& table, __m512bh w[2]) {
  const uint8_t* at = grp + scale_bytes(F) + 32 * t;
  if constexpr (F == kQ8_0) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16))));
    w[0] = _mm512_cvtne2ps_pbh(hi, lo);  // exact: every code is a bf16 value
  } else {  // word v = byte v: its low 5 bits index the table (low nibble), then its high nibble
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    w[0] = (__m512bh)_mm512_permutexvar_epi16(b, table);
    w[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
  }
}
#endif

// Row m's 16 columns of panel p: + bias (one rounding; FTZ/DAZ flush as store16's caller does
// by hand), stored with one vector store where the output is float32.
inline void store16v(const CCall& c, int64_t m, int64_t p, __m512 y) {
  const int64_t n0 = p * kNR;
  const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(kNR, c.N - n0)) - 1u);
  if (c.bias != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(live, c.bias + n0));
  if (!c.out_bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(c.out) + m * c.ldo + n0, live, y);
    return;
  }
  alignas(64) float buf[kNR];
  _mm512_store_ps(buf, y);
  store16(c, m, p, buf);
}

template <int32_t F, int R, int NP, bool NATIVE>
void tile(const CCall& c, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 12, "at most 12 block accumulators");
  __m512 tot[R][NP];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) tot[r][i] = _mm512_setzero_ps();
  const __m512 tf = code_table_f32<F>();
#if RS_CODES_NATIVE
  const __m512i tb = code_table_bf16<F>();
#endif
  for (int64_t g = 0; g < c.G; ++g) {
    const uint8_t* grp[NP];
    for (int i = 0; i < NP; ++i) {
      grp[i] = c.seg + (p + i) * c.panel_bytes + g * group_bytes(F);
      _mm_prefetch(reinterpret_cast<const char*>(grp[i] + 4 * group_bytes(F)), _MM_HINT_T0);
    }
    __m512 blk[R][NP];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NP; ++i) blk[r][i] = _mm512_setzero_ps();
    if constexpr (NATIVE) {
#if RS_CODES_NATIVE
      constexpr int kPer = F == kQ8_0 ? 1 : 2;  // pairs one codes_bf16 gives
      for (int64_t t = 0; t < kGroupPairs / kPer; ++t)
        for (int i = 0; i < NP; ++i) {
          __m512bh w[2];
          codes_bf16<F>(grp[i], t, tb, w);
          for (int h = 0; h < kPer; ++h) {
            const int64_t jj = g * kGroupPairs + kPer * t + h;
            for (int r = 0; r < R; ++r) {  // the products commute: x in the broadcast operand
              int32_t pair;
              std::memcpy(&pair, c.rows->xh + (m0 + r) * 2 * c.K2 + 2 * jj, 4);
              blk[r][i] = _mm512_dpbf16_ps(blk[r][i], w[h], (__m512bh)_mm512_set1_epi32(pair));
            }
          }
        }
#endif
    } else {
      for (int64_t j = 0; j < kGroupPairs; ++j) {
        const int64_t jj = g * kGroupPairs + j;
        for (int i = 0; i < NP; ++i) {
          __m512 we, wo;
          codes_f32<F>(grp[i], j, tf, we, wo);
          for (int r = 0; r < R; ++r) {  // chain order: the odd product, then the even one
            const float* x = c.rows->xf + (m0 + r) * 2 * c.K2 + 2 * jj;
            blk[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[0]), wo, blk[r][i]);
            blk[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[1]), we, blk[r][i]);
          }
        }
      }
    }
    for (int i = 0; i < NP; ++i) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp[i])));
      for (int r = 0; r < R; ++r) tot[r][i] = _mm512_add_ps(tot[r][i], _mm512_mul_ps(d, blk[r][i]));
      if constexpr (F == kQ4_1) {
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp[i] + 32)));
        for (int r = 0; r < R; ++r)
          tot[r][i] = _mm512_add_ps(tot[r][i], _mm512_mul_ps(mn, _mm512_set1_ps(c.sums[(m0 + r) * c.G + g])));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) {
      store16v(c, m0 + r, p + i, tot[r][i]);
    }
}

// ---- many rows of Q8_0 (prefill): the codes expanded once per call into scratch
// A tile above expands a panel's codes for every few rows. A 4-bit pair couple is one table
// lookup a pair, cheap beside the dot products it feeds; a Q8_0 pair is two widenings, two
// conversions and a rounding, which a prefill of hundreds of rows would repeat hundreds of
// times. So for Q8_0 a chunk of panels is expanded once per call into the thread's scratch
// (pair j of panel q at words [q][j][32], vdpbf16ps's operand as above) and wider tiles run
// over it (measured faster so for Q8_0 on a Zen 4 core, and not for the 4-bit formats). The
// products, their order and the per-block chain are the tile's: only where the operand comes
// from changes, not the bits.
#if RS_CODES_NATIVE
template <int32_t F>
void expand_codes(const uint8_t* pan, int64_t G, const __m512i& table, uint16_t* dst) {
  constexpr int kPer = F == kQ8_0 ? 1 : 2;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* grp = pan + g * group_bytes(F);
    for (int64_t t = 0; t < kGroupPairs / kPer; ++t) {
      __m512bh w[2];
      codes_bf16<F>(grp, t, table, w);
      for (int h = 0; h < kPer; ++h)
        _mm512_storeu_si512(dst + (g * kGroupPairs + kPer * t + h) * 32, (__m512i)w[h]);
    }
  }
}

// A zeroed accumulator by the xor idiom, which the core resolves at rename; left to itself
// the compiler copies one zero register into each, a vector move per block and accumulator.
inline void zero_idiom(__m512& v) { asm volatile("vpxord %0, %0, %0" : "=v"(v)); }

// Rows [m0, m0 + R) x panels [p, p + NP) from scratch `w` (panel p's words; panels `pw` words
// apart). The block sums (R x NP) stay in registers; the chains over the blocks wait in `tot`
// (L1), one load, multiply, add and store per block and output vector.
template <int32_t F, int R, int NP>
void scratch_tile(const CCall& c, const uint16_t* w, int64_t pw, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 24, "at most 24 block accumulators");
  static_assert(F == kQ8_0, "only Q8_0 expands into scratch (a 4-bit format has no offset term here)");
  alignas(64) float tot[R][NP][kNR];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) _mm512_store_ps(tot[r][i], _mm512_setzero_ps());
  const uint16_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = c.rows->xh + (m0 + r) * 2 * c.K2;
  for (int64_t g = 0; g < c.G; ++g) {
    __m512 blk[R][NP];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NP; ++i) zero_idiom(blk[r][i]);
    for (int64_t j = 0; j < kGroupPairs; ++j) {
      const int64_t jj = g * kGroupPairs + j;
      __m512bh wv[NP];
      for (int i = 0; i < NP; ++i)
        wv[i] = (__m512bh)_mm512_loadu_si512(w + i * pw + jj * 32);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xr[r] + 2 * jj, 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int i = 0; i < NP; ++i) blk[r][i] = _mm512_dpbf16_ps(blk[r][i], wv[i], xb);
      }
    }
    for (int i = 0; i < NP; ++i) {
      const uint8_t* grp = c.seg + (p + i) * c.panel_bytes + g * group_bytes(F);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp)));
      for (int r = 0; r < R; ++r)
        _mm512_store_ps(tot[r][i], _mm512_add_ps(_mm512_load_ps(tot[r][i]), _mm512_mul_ps(d, blk[r][i])));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) {
      store16v(c, m0 + r, p + i, _mm512_load_ps(tot[r][i]));
    }
}

using STile = void (*)(const CCall&, const uint16_t*, int64_t, int64_t, int64_t);

template <int32_t F, int NP>
STile scratch_tile_rows(int r) {
  switch (r) {
    case 1: return &scratch_tile<F, 1, NP>;
    case 2: return &scratch_tile<F, 2, NP>;
    case 3: return &scratch_tile<F, 3, NP>;
    case 4: return &scratch_tile<F, 4, NP>;
    case 5: return &scratch_tile<F, 5, NP>;
    default: return &scratch_tile<F, 6, NP>;
  }
}

template <int32_t F>
STile scratch_tile_for(int r, int np) {
  switch (np) {
    case 1: return scratch_tile_rows<F, 1>(r);
    case 2: return scratch_tile_rows<F, 2>(r);
    case 3: return scratch_tile_rows<F, 3>(r);
    default: return scratch_tile_rows<F, 4>(r);
  }
}

constexpr int kScratchRows = 6;    // rows of a scratch tile at most
constexpr int kScratchPanels = 4;  // its panels
constexpr int64_t kScratchBytes = 512 * 1024;  // expanded codes a thread holds: half of L2

uint16_t* code_scratch(int64_t words) {
  static thread_local std::vector<uint16_t> buf;
  if (static_cast<int64_t>(buf.size()) < words) buf.resize(words);
  return buf.data();
}

// Panels [p0, p1) of a many-row call: chunk by chunk, each expanded once, then the rows split
// as evenly as tiles of kScratchRows allow, every row tile over the chunk's panels.
template <int32_t F>
void run_scratch(const CCall& c, int64_t p0, int64_t p1) {
  const int64_t pw = c.K2 * 32;
  const int64_t chunk = std::max<int64_t>(kScratchPanels, kScratchBytes / (2 * pw));
  const __m512i tb = code_table_bf16<F>();
  const int64_t tiles = (c.M + kScratchRows - 1) / kScratchRows;
  for (int64_t q0 = p0; q0 < p1; q0 += chunk) {
    const int64_t q1 = std::min(p1, q0 + chunk);
    uint16_t* w = code_scratch((q1 - q0) * pw);
    for (int64_t q = q0; q < q1; ++q) expand_codes<F>(c.seg + q * c.panel_bytes, c.G, tb, w + (q - q0) * pw);
    for (int64_t p = q0; p < q1; p += kScratchPanels) {
      const int np = static_cast<int>(std::min<int64_t>(kScratchPanels, q1 - p));
      int64_t m0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int r = static_cast<int>((c.M - m0) / (tiles - t) + ((c.M - m0) % (tiles - t) != 0));
        scratch_tile_for<F>(r, np)(c, w + (p - q0) * pw, pw, m0, p);
        m0 += r;
      }
    }
  }
}

#endif

}  // namespace c5
#endif

// ---------------------------------------------------------------- tiling
using CTile = void (*)(const CCall&, int64_t, int64_t);

// The tiles of one path: rows a tile takes at most, panels it takes by its rows, the tile.
struct CPlan {
  int max_rows;
  const int* panels;
  CTile (*tile)(int32_t f, int r, int np);
  int many_rows = 0;                 // calls of more than max_rows rows: tiles of this many rows
  const int* many_panels = nullptr;  // ... taking these panels by their rows
};

template <template <int32_t, int, int> class T, int R, int NP>
CTile tile_for(int32_t f) {
  switch (f) {
    case kQ8_0: return &T<kQ8_0, R, NP>::run;
    case kQ4_0: return &T<kQ4_0, R, NP>::run;
    default: return &T<kQ4_1, R, NP>::run;
  }
}

struct Portable {
  template <int32_t F, int R, int NP>
  struct T {
    static void run(const CCall& c, int64_t m0, int64_t p) { portable_tile<F>(c, m0, p); }
  };
  static constexpr int kPanels[1] = {1};
  static CTile pick(int32_t f, int, int) { return tile_for<T, 1, 1>(f); }
};

#if RS_CODES_AVX2
struct P2 {
  template <int32_t F, int R, int NP>
  struct T {
    static void run(const CCall& c, int64_t m0, int64_t p) { c2::tile<F, R, NP>(c, m0, p); }
  };
  static constexpr int kPanels[4] = {2, 2, 1, 1};
  static CTile pick(int32_t f, int r, int np) {
    if (np > 1) return r == 1 ? tile_for<T, 1, 2>(f) : tile_for<T, 2, 2>(f);
    switch (r) {
      case 1: return tile_for<T, 1, 1>(f);
      case 2: return tile_for<T, 2, 1>(f);
      case 3: return tile_for<T, 3, 1>(f);
      default: return tile_for<T, 4, 1>(f);
    }
  }
};
#endif

#if RS_CODES_AVX512
template <bool NATIVE>
struct P5 {
  template <int32_t F, int R, int NP>
  struct T {
    static void run(const CCall& c, int64_t m0, int64_t p) { c5::tile<F, R, NP, NATIVE>(c, m0, p); }
  };
  // Eight independent chains a tile: a chain's latency (two dot products a pair couple) is
  // hidden behind the others' for a decode's one row too.
  static constexpr int kPanels[8] = {8, 4, 2, 2, 1, 1, 1, 1};
  // Many rows (native): tiles of up to 6 rows on 2 panels, 12 chains; each pair couple's
  // expansion then serves twice the dot products of an 8-row, 1-panel tile.
  static constexpr int kManyPanels[6] = {8, 4, 2, 2, 2, 2};
  static CTile pick(int32_t f, int r, int np) {
    if (np > 1) {
      switch (r) {
        case 1: return tile_for<T, 1, 8>(f);
        case 2: return tile_for<T, 2, 4>(f);
        case 3: return tile_for<T, 3, 2>(f);
        case 4: return tile_for<T, 4, 2>(f);
        case 5: return tile_for<T, 5, 2>(f);
        default: return tile_for<T, 6, 2>(f);
      }
    }
    switch (r) {
      case 1: return tile_for<T, 1, 1>(f);
      case 2: return tile_for<T, 2, 1>(f);
      case 3: return tile_for<T, 3, 1>(f);
      case 4: return tile_for<T, 4, 1>(f);
      case 5: return tile_for<T, 5, 1>(f);
      case 6: return tile_for<T, 6, 1>(f);
      case 7: return tile_for<T, 7, 1>(f);
      default: return tile_for<T, 8, 1>(f);
    }
  }
};
#endif

// The plan at level `isa`; `native`: vdpbf16ps on the pairs (the rows were converted so).
CPlan plan_for(int64_t isa, bool native) {
#if RS_CODES_AVX512
  if (isa >= kIsaAvx512) {
#if RS_CODES_NATIVE
    if (native) return {8, P5<true>::kPanels, &P5<true>::pick, 6, P5<true>::kManyPanels};
#endif
    return {8, P5<false>::kPanels, &P5<false>::pick};
  }
#endif
#if RS_CODES_AVX2
  if (isa >= kIsaAvx2) return {4, P2::kPanels, &P2::pick};
#endif
  (void)isa;
  (void)native;
  return {1, Portable::kPanels, &Portable::pick};
}

// Panels [p0, p1): chunk by chunk (what stays in L2), every row tile over a chunk.
void run_panels(const CCall& c, const CPlan& plan, int32_t f, int64_t p0, int64_t p1) {
  const int64_t chunk = std::max<int64_t>(4, kChunkBytes / c.panel_bytes);
  const bool many = plan.many_rows > 0 && c.M > plan.max_rows;
  const int max_rows = many ? plan.many_rows : plan.max_rows;
  for (int64_t q0 = p0; q0 < p1; q0 += chunk) {
    const int64_t q1 = std::min(p1, q0 + chunk);
    for (int64_t m0 = 0; m0 < c.M; m0 += max_rows) {
      const int r = static_cast<int>(std::min<int64_t>(max_rows, c.M - m0));
      const int np = many ? plan.many_panels[r - 1] : plan.panels[r - 1];
      const CTile wide = plan.tile(f, r, np), one = plan.tile(f, r, 1);
      int64_t p = q0;
      for (; p + np <= q1; p += np) wide(c, m0, p);
      for (; p < q1; ++p) one(c, m0, p);
    }
  }
}

}  // namespace

namespace quant {

void codes_linear(const at::Tensor& x, const Blob& blob, const c10::optional<at::Tensor>& bias, at::Tensor& out,
                  int64_t isa, bool allow_native) {
  const int64_t M = x.size(0), K = blob.K, G = K / kGroupK;
  TORCH_CHECK(K % kGroupK == 0, "a block-codes weight needs K a multiple of 32, got ", K);
  // Its own tiles read the pairs: never the tile calls (no swapped rows to build).
  const DotPath path = dot_path(std::min(isa, kIsaAvx512), allow_native ? kArithDot : kArithDotEmulated);
  const DotRows rows = dot_rows(x, path);
  const bool vector = isa >= kIsaAvx2 && RS_CODES_AVX2;
  const CPlan plan = plan_for(isa, path.native);
  static thread_local std::vector<float> sbuf;
  const bool any_q41 = std::any_of(blob.segs.begin(), blob.segs.end(), [](const Segment& s) { return s.fmt == kQ4_1; });
  if (any_q41) {
    if (static_cast<int64_t>(sbuf.size()) < M * G) sbuf.resize(M * G);
    block_sums(rows, path.pairs, M, G, sbuf.data());
  }
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  char* o = static_cast<char*>(out.data_ptr());
  for (const Segment& s : blob.segs) {
    const CCall c{&rows, any_q41 ? sbuf.data() : nullptr, M, K, G, rows.K2, blob.base + s.offset,
                  blob.panel_bytes_of(s), b != nullptr ? b + s.n0 : nullptr, o + s.n0 * (out_bf16 ? 2 : 4),
                  out.stride(0), out_bf16, s.n};
    const int64_t P = s.panels();
    const int64_t grain = s.n * K < (int64_t{1} << 15) ? P : 1;
    at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
#if RS_AVX2
      if (vector) {
        FlushDenormals ftz;
#if RS_CODES_NATIVE
        if (path.native && M > kScratchMinRows && s.fmt == kQ8_0) {  // many rows: expand once
          c5::run_scratch<kQ8_0>(c, p0, p1);
          return;
        }
#endif
        run_panels(c, plan, s.fmt, p0, p1);
        return;
      }
#endif
      run_panels(c, plan, s.fmt, p0, p1);
    });
  }
  (void)vector;
}

}  // namespace quant

void pack_codes_kernel(const at::Tensor& rows, int64_t fmt, int64_t K, at::Tensor& out) {
  const int32_t f = static_cast<int32_t>(fmt);
  TORCH_CHECK(int_dot_format(f), "format ", f, " has no block-codes layout");
  pack_quant_kernel(rows, fmt, K, out);  // the expansion layout, then its 4-bit planes regrouped
  if (f == kQ8_0) return;
  const int64_t P = (rows.size(0) + kNR - 1) / kNR, pb = panel_bytes(f, K), G = groups(K);
  uint8_t* base = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t b0, int64_t e0) {
    uint8_t plane[32 * kGroupPairs / 2];
    for (int64_t p = b0; p < e0; ++p)
      for (int64_t g = 0; g < G; ++g) {
        uint8_t* low = base + p * pb + header_bytes(f) + g * group_bytes(f) + scale_bytes(f);
        auto nib = [&](int64_t j, int v) { return (low[16 * j + (v & 15)] >> (4 * (v >> 4))) & 15u; };
        for (int64_t t = 0; t < kGroupPairs / 2; ++t)
          for (int v = 0; v < 32; ++v)
            plane[32 * t + v] = static_cast<uint8_t>(nib(2 * t, v) | (nib(2 * t + 1, v) << 4));
        std::memcpy(low, plane, sizeof plane);
      }
  });
}

}  // namespace radixserve
