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
// A bfloat16 pool's K/V rows of a block are converted to float32 once (exact), then read
// like a float32 pool.
#include "attention.h"

#include <cstring>
#include <type_traits>

#include "simd_avx2.h"

namespace radixserve {
namespace attn {

bool avx2_built() { return RS_AVX2; }

bool avx2_head_dim(int64_t D) { return D > 0 && D % 8 == 0 && D <= 512; }

#if RS_AVX2
namespace {

// 8x8 transpose of 32-bit elements: afterwards r[k] holds column k.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

struct Work {
  int64_t M, Mp, nv, D;  // rows, rows padded to 8, row vectors, head size
  float* qt;             // rows in lanes: [D][Mp] q transposed; keys in lanes: [M][D] q rows
  float* st;             // rows in lanes: [kBlockK][Mp] scores then p; keys in lanes: [M][kBlockK]
  float* acc;            // [Mp][D]
  float* m;              // [Mp]
  float* l;              // [Mp]
  float* alpha;          // [Mp]
  int32_t* pos;          // [Mp]
  float* kbuf;           // [kBlockK][D]: a bf16 pool's K rows of the block in float32
  float* vbuf;           // [kBlockK][D]: the same for V
  int64_t pj, pr;        // stride of p in st between keys and between rows
  const float* krow[kBlockK];  // float32 K rows of the block (pool rows or kbuf)
  const float* vrow[kBlockK];  // float32 V rows of the block
};

// Rows in lanes: scores of KT keys (krow[j0..j0+KT)) against NV row vectors starting at
// row vector v0, dot products over d in order, then * scale; into st[j][rows].
template <int NV, int KT>
inline void qk_tile(Work& w, int64_t j0, int64_t v0, float scale) {
  __m256 acc[KT][NV];
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  const float* const* kr = w.krow + j0;
  const float* qt = w.qt + v0 * 8;
  for (int64_t d = 0; d < w.D; ++d) {
    __m256 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm256_loadu_ps(qt + d * w.Mp + v * 8);
    for (int i = 0; i < KT; ++i) {
      const __m256 kb = _mm256_broadcast_ss(kr[i] + d);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(kb, qv[v], acc[i][v]);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v)
      _mm256_storeu_ps(w.st + (j0 + i) * w.Mp + (v0 + v) * 8, _mm256_mul_ps(acc[i][v], sc));
}

void qk_rows_in_lanes(Work& w, float scale) {
  int64_t v0 = 0;
  for (; v0 + 3 <= w.nv; v0 += 3)
    for (int64_t j = 0; j < kBlockK; j += 4) qk_tile<3, 4>(w, j, v0, scale);
  if (w.nv - v0 == 2) {
    static_assert(kBlockK == 32, "tiles of 6 keys: 5 x 6 + 2");
    for (int64_t j = 0; j < 30; j += 6) qk_tile<2, 6>(w, j, v0, scale);
    qk_tile<2, 2>(w, 30, v0, scale);
  } else if (w.nv - v0 == 1) {
    for (int64_t j = 0; j < kBlockK; j += 8) qk_tile<1, 8>(w, j, v0, scale);
  }
}

// acc[r0..r0+R)[d0..d0+8C) = acc * alpha + p.v over the block's n keys.
template <int R, int C>
inline void pv_tile(Work& w, int64_t r0, int64_t d0, int64_t n) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_set1_ps(w.alpha[r0 + r]);
    for (int c = 0; c < C; ++c)
      acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(w.acc + (r0 + r) * w.D + d0 + 8 * c), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    __m256 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm256_loadu_ps(w.vrow[j] + d0 + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 pb = _mm256_broadcast_ss(w.st + j * w.pj + (r0 + r) * w.pr);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(pb, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(w.acc + (r0 + r) * w.D + d0 + 8 * c, acc[r][c]);
}

template <int R>
inline void pv_rows_chunks(Work& w, int64_t r0, int64_t n) {
  int64_t d0 = 0;
  for (; d0 + 32 <= w.D; d0 += 32) pv_tile<R, 4>(w, r0, d0, n);
  switch ((w.D - d0) / 8) {
    case 3: pv_tile<R, 3>(w, r0, d0, n); break;
    case 2: pv_tile<R, 2>(w, r0, d0, n); break;
    case 1: pv_tile<R, 1>(w, r0, d0, n); break;
    default: break;
  }
}

void pv_rows(Work& w, int64_t n) {
  int64_t r0 = 0;
  for (; r0 + 2 <= w.M; r0 += 2) pv_rows_chunks<2>(w, r0, n);
  if (r0 < w.M) pv_rows_chunks<1>(w, r0, n);
}

// Rows in lanes: mask, block max, exp, halving sum for row vector v (8 rows).
void softmax_rows_in_lanes(Work& w, int64_t v, int64_t k0, int64_t kn, bool masked) {
  float* sv = w.st + v * 8;
  const int64_t Mp = w.Mp;
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  if (masked) {
    const __m256i pv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.pos + v * 8));
    for (int64_t j = 0; j < kBlockK; ++j) {
      __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k0 + j)), pv);
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

// Keys in lanes, rows [r0, r0 + R): scores of the block's 32 keys into acc[r][4].
template <int R>
inline void qk_few(Work& w, int64_t r0, __m256 (*acc)[4]) {
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int g = 0; g < 4; ++g) {
    const float* const* kr = w.krow + 8 * g;
    for (int64_t d0 = 0; d0 < w.D; d0 += 8) {
      __m256 kt[8];
      for (int i = 0; i < 8; ++i) kt[i] = _mm256_loadu_ps(kr[i] + d0);
      transpose8(kt);  // kt[e] = element d0 + e of the 8 keys
      for (int e = 0; e < 8; ++e)
        for (int r = 0; r < R; ++r)
          acc[r][g] = _mm256_fmadd_ps(kt[e], _mm256_broadcast_ss(w.qt + (r0 + r) * w.D + d0 + e), acc[r][g]);
    }
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
        const __m256i mk = _mm256_or_si256(_mm256_cmpgt_epi32(kpos, pr),
                                           _mm256_cmpgt_epi32(kpos, _mm256_sub_epi32(klim, _mm256_set1_epi32(1))));
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

template <typename KT>
void attend_avx2(const Problem& P, const Item& it) {
  constexpr bool kKvBf16 = std::is_same_v<KT, uint16_t>;
  const int64_t D = P.D;
  const SeqInfo& sq = P.seqs[it.seq];
  const int64_t ng = it.g1 - it.g0;
  Work w;
  w.D = D;
  w.M = (it.p1 - it.p0) * ng;
  w.nv = (w.M + 7) / 8;
  w.Mp = w.nv * 8;
  const bool few = w.M <= kFewRows;
  const int64_t Mp = w.Mp;
  const size_t need = static_cast<size_t>(D * Mp + kBlockK * Mp + Mp * D + 4 * Mp + 2 * kBlockK * D + 64);
  w.qt = thread_scratch(need);
  w.st = w.qt + D * Mp;
  w.acc = w.st + kBlockK * Mp;
  w.m = w.acc + Mp * D;
  w.l = w.m + Mp;
  w.alpha = w.l + Mp;
  w.pos = reinterpret_cast<int32_t*>(w.alpha + Mp);
  w.kbuf = reinterpret_cast<float*>(w.pos + Mp);
  w.vbuf = w.kbuf + kBlockK * D;
  w.pj = few ? 1 : Mp;
  w.pr = few ? kBlockK : 1;

  const int64_t base = sq.kv_len - sq.q_len;
  for (int64_t r = 0; r < w.M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
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
    w.m[r] = kNegInf;
    w.l[r] = 0.f;
  }
  std::memset(w.acc, 0, sizeof(float) * Mp * D);

  const KT* kp = static_cast<const KT*>(P.k);
  const KT* vp = static_cast<const KT*>(P.v);
  const int64_t* slots = P.slots + sq.kv_start;
  const int64_t hoff = it.kh * D;
  const int64_t min_pos = base + it.p0;
  const int64_t nkb = last / kBlockK + 1;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * kBlockK, kn = std::min(kBlockK, sq.kv_len - k0);
    // The block's K/V rows (keys past the sequence repeat its last row: they are masked,
    // and reading a real row keeps every load in bounds).
    for (int64_t j = 0; j < kBlockK; ++j) {
      const int64_t off = slots[k0 + std::min(j, kn - 1)] * P.kv_ss + hoff;
      if constexpr (kKvBf16) {
        float* kd = w.kbuf + j * D;
        float* vd = w.vbuf + j * D;
        if (j < kn) {
          for (int64_t d = 0; d < D; d += 8) {
            _mm256_storeu_ps(kd + d, bf16x8_to_f32(kp + off + d));
            _mm256_storeu_ps(vd + d, bf16x8_to_f32(vp + off + d));
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
    const bool masked = k0 + kBlockK - 1 > min_pos || kn < kBlockK;
    if (!few) {
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
  for (int64_t r = 0; r < w.M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
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

}  // namespace

bool run_avx2(const Problem& P, const std::vector<Item>& items, bool kv_bf16) {
  if (!avx2_head_dim(P.D)) return false;
  if (kv_bf16)
    run_items(items, [&](const Item& it) { attend_avx2<uint16_t>(P, it); });
  else
    run_items(items, [&](const Item& it) { attend_avx2<float>(P, it); });
  return true;
}
#else
bool run_avx2(const Problem&, const std::vector<Item>&, bool) { return false; }
#endif  // RS_AVX2

}  // namespace attn
}  // namespace radixserve
