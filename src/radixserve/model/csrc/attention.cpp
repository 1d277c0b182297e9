// Paged causal attention for CPU: every query row (prefill, prefill over a cached prefix,
// decode, any mix of them in one batch) attends over its sequence's K/V read in place from
// the pool through the slot table — nothing is gathered into a dense copy.
//
// The arithmetic of one query row is fixed by its q and by the K/V at positions 0..pos:
// keys are visited in blocks of kBlockK at absolute positions (0..31, 32..63, ...), with an
// online softmax across blocks. How the sequence was split (cached prefix + new tokens,
// chunks, a decode step) and how rows are grouped into work items only decide which rows
// share a pass over a block, never the operations applied to a row. So a row computed in a
// decode step equals, bit for bit, the same row computed inside a long prefill; that is
// what keeps greedy output with the prefix cache on equal to output with it off.
//
// Per block and row:
//   s_j  = dot(q, k_j) * scale     dot: fused multiply-adds over d in order (float32 mode),
//                                  or bf16 pair dot products over d pairs (bf16 mode)
//   s_j  = -inf past the row's position
//   m'   = max(m, max_j s_j);  a = exp(m - m');  p_j = exp(s_j - m')
//   l    = l * a + halving_sum(p)  (p_i + p_i+16, then + 8, + 4, + 2, + 1)
//   acc  = acc * a;  acc = fma(p_j, v_j, acc) for j in order (float32 mode), or bf16 pair
//          dot products of (p_2i, p_2i+1) and (v_2i, v_2i+1) (bf16 mode)
// Output acc / l. exp is exp_f32 of common.h.
//
// Modes: float32 (float32 or bfloat16 pool; everything in float32) and bf16 (bfloat16 pool,
// AVX512-BF16 CPU: q and p rounded to bfloat16 and multiplied with vdpbf16ps, accumulation
// in float32; twice the float32 rate). The mode depends on the pool dtype and the CPU only.
//
// Work items are (sequence, KV head, a run of query positions); their rows are positions x
// the query heads of that KV head, so GQA shares every K/V read. Two AVX-512 layouts compute
// the same per-row operations:
//   * many rows (prefill): rows in vector lanes for q.k — each key element is broadcast
//     straight from its pool row, so K is never repacked;
//   * few rows (decode): keys in lanes — 16 K rows are transposed in registers, each q
//     element is broadcast.
// p.v always has the head dimension in lanes. A portable C++ version of the float32 mode
// runs wherever AVX-512 (or a supported head size) is missing.
#include "common.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define RS_AVX512 1
#include <immintrin.h>
#else
#define RS_AVX512 0
#endif
#if RS_AVX512 && defined(__AVX512BF16__)
#define RS_AVX512_BF16 1
#else
#define RS_AVX512_BF16 0
#endif

namespace radixserve {
namespace {

constexpr int64_t kBlockK = 32;    // keys per online-softmax step (part of the arithmetic)
constexpr int64_t kMaxRows = 48;   // rows per work item: 3 vectors of q.k accumulators
constexpr int64_t kFewRows = 8;    // items with at most this many rows use keys-in-lanes
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

enum Impl : int64_t { kAuto = 0, kGeneric = 1, kF32 = 2, kBf16 = 3 };

struct SeqInfo {
  int64_t q_start, q_len, kv_start, kv_len;
};

struct Problem {
  const void* q;
  int64_t q_rs;  // q[t * q_rs + h * D + d]
  const void* k;
  const void* v;
  int64_t kv_ss;  // k[slot * kv_ss + kh * D + d]
  const int64_t* slots;
  const SeqInfo* seqs;
  void* out;
  int64_t o_rs;  // out[t * o_rs + h * D + d]
  int64_t H, KV, G, D;
  float scale;
  bool q_bf16, out_bf16;
};

// Query positions [p0, p1) (indices into the sequence's new tokens) x heads [g0, g1) of
// KV head kh. Row r of the item is position p0 + r / (g1 - g0), head g0 + r % (g1 - g0).
struct Item {
  int64_t seq, kh, g0, g1, p0, p1, cost;
};

std::vector<Item> make_items(const Problem& P, int64_t nseq) {
  std::vector<Item> items;
  const int64_t gsz = std::min<int64_t>(P.G, kMaxRows);
  const int64_t bq = std::max<int64_t>(1, kMaxRows / gsz);
  for (int64_t b = 0; b < nseq; ++b) {
    const SeqInfo& s = P.seqs[b];
    const int64_t base = s.kv_len - s.q_len;
    for (int64_t p0 = 0; p0 < s.q_len; p0 += bq) {
      const int64_t p1 = std::min(p0 + bq, s.q_len);
      const int64_t blocks = (base + p1 - 1) / kBlockK + 1;
      for (int64_t kh = 0; kh < P.KV; ++kh)
        for (int64_t g0 = 0; g0 < P.G; g0 += gsz) {
          const int64_t g1 = std::min(g0 + gsz, P.G);
          items.push_back({b, kh, g0, g1, p0, p1, blocks * ((p1 - p0) * (g1 - g0) + 16)});
        }
    }
  }
  // Longest first, then handed out dynamically: the causal triangle makes costs uneven.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// 64-byte aligned per-thread scratch, grown on demand and kept for later calls.
float* thread_scratch(size_t n) {
  static thread_local std::vector<float> buf;
  if (buf.size() < n + 16) buf.resize(n + 16);
  auto p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

// Below this much work (Item::cost units) one thread is done before a parallel region
// would have started and joined its workers (decode of one short sequence, say).
constexpr int64_t kInlineCost = 2000;

template <typename F>
void run_items(const std::vector<Item>& items, F&& fn) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  int64_t total = 0;
  for (const Item& it : items) total += it.cost;
  if (nt <= 1 || total < kInlineCost || at::in_parallel_region()) {
    for (const Item& it : items) fn(it);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(items[i]);
  });
}

// max as vmaxps computes it: a > b ? a : b.
inline float max_ps(float a, float b) { return a > b ? a : b; }

inline float halving_sum32(const float* p, int64_t stride) {
  float a[16];
  for (int i = 0; i < 16; ++i) a[i] = p[i * stride] + p[(i + 16) * stride];
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
  return a[0];
}

inline float load_q(const Problem& P, int64_t off) {
  return P.q_bf16 ? load_f32(static_cast<const uint16_t*>(P.q), off)
                  : load_f32(static_cast<const float*>(P.q), off);
}

inline void store_out(const Problem& P, int64_t off, float x) {
  if (P.out_bf16)
    store_f32(static_cast<uint16_t*>(P.out), off, x);
  else
    store_f32(static_cast<float*>(P.out), off, x);
}

// ------------------------------------------------------------------ portable path
template <typename KT>
void attend_generic(const Problem& P, const Item& it) {
  static_assert(kBlockK == 32, "halving_sum32 assumes 32-key blocks");
  const int64_t D = P.D;
  const SeqInfo& sq = P.seqs[it.seq];
  const int64_t ng = it.g1 - it.g0, M = (it.p1 - it.p0) * ng;
  const int64_t base = sq.kv_len - sq.q_len;
  float* s = thread_scratch(static_cast<size_t>(M * D * 2 + M * (kBlockK + 8)));
  float* q = s;             // [M][D]
  float* acc = q + M * D;   // [M][D]
  float* st = acc + M * D;  // [kBlockK][M]
  float* m = st + kBlockK * M;
  float* l = m + M;
  float* alpha = l + M;
  int64_t* pos = reinterpret_cast<int64_t*>(alpha + M);
  const KT* kp = static_cast<const KT*>(P.k);
  const KT* vp = static_cast<const KT*>(P.v);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
    for (int64_t d = 0; d < D; ++d) q[r * D + d] = load_q(P, t * P.q_rs + h * D + d);
    pos[r] = base + it.p0 + r / ng;
    m[r] = kNegInf;
    l[r] = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[r * D + d] = 0.f;
  }
  const int64_t nkb = (base + it.p1 - 1) / kBlockK + 1;
  const int64_t* slots = P.slots + sq.kv_start;
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * kBlockK, kn = std::min(kBlockK, sq.kv_len - k0);
    for (int64_t j = 0; j < kBlockK; ++j) {
      const KT* krow = j < kn ? kp + slots[k0 + j] * P.kv_ss + it.kh * D : nullptr;
      for (int64_t r = 0; r < M; ++r) {
        float x = kNegInf;
        if (krow != nullptr && k0 + j <= pos[r]) {
          float a = 0.f;
          for (int64_t d = 0; d < D; ++d) a = std::fma(load_f32(krow, d), q[r * D + d], a);
          x = a * P.scale;
        }
        st[j * M + r] = x;
      }
    }
    for (int64_t r = 0; r < M; ++r) {
      float mb = st[r];
      for (int64_t j = 1; j < kBlockK; ++j) mb = max_ps(mb, st[j * M + r]);
      const float mn = max_ps(m[r], mb);
      alpha[r] = exp_f32(m[r] - mn);
      for (int64_t j = 0; j < kBlockK; ++j) st[j * M + r] = exp_f32(st[j * M + r] - mn);
      l[r] = l[r] * alpha[r] + halving_sum32(st + r, M);
      m[r] = mn;
    }
    for (int64_t r = 0; r < M; ++r) {
      float* a = acc + r * D;
      for (int64_t d = 0; d < D; ++d) a[d] = a[d] * alpha[r];
      for (int64_t j = 0; j < kn; ++j) {
        const KT* vrow = vp + slots[k0 + j] * P.kv_ss + it.kh * D;
        const float pj = st[j * M + r];
        for (int64_t d = 0; d < D; ++d) a[d] = std::fma(pj, load_f32(vrow, d), a[d]);
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
    for (int64_t d = 0; d < D; ++d) store_out(P, t * P.o_rs + h * D + d, acc[r * D + d] / l[r]);
  }
}

#if RS_AVX512
// ------------------------------------------------------------------ AVX-512 path
inline __m512 exp512(__m512 x) {  // exp_f32 of common.h, operation for operation
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLo), _CMP_NGE_UQ);
  __m512 xc = _mm512_min_ps(x, _mm512_set1_ps(kExpHi));
  xc = _mm512_max_ps(xc, _mm512_set1_ps(kExpLo));
  const __m512 magic = _mm512_set1_ps(kRoundMagic);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)), magic), magic);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kExpP0), r, _mm512_set1_ps(kExpP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP5));
  p = _mm512_fmadd_ps(p, r2, r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, sc);
}

inline __m512 bf16x16_to_f32(const uint16_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

// f32_to_bf16 of common.h (no NaN here), the result in the low 16 bits of each lane.
inline __m512i f32_to_bf16_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
}

// Word e (4 bytes: a float32, or a pair of bf16) of a row, broadcast to all lanes.
inline __m512 bcast_word(const void* row, int64_t e) {
  float f;
  std::memcpy(&f, static_cast<const char*>(row) + 4 * e, 4);
  return _mm512_set1_ps(f);
}

inline __m512 dot_step(__m512 acc, __m512 a, __m512 b, std::false_type) { return _mm512_fmadd_ps(a, b, acc); }
#if RS_AVX512_BF16
inline __m512 dot_step(__m512 acc, __m512 a, __m512 b, std::true_type) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b));
}
#endif

// 16x16 transpose of 32-bit elements: afterwards r[k] holds column k.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512i ab0 = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    const __m512i ab1 = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    const __m512i cd0 = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    const __m512i cd1 = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    t[i] = _mm512_shuffle_i32x4(ab0, cd0, 0x88);
    t[i + 8] = _mm512_shuffle_i32x4(ab0, cd0, 0xdd);
    t[i + 4] = _mm512_shuffle_i32x4(ab1, cd1, 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(ab1, cd1, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 16 words (float32, or bf16 pairs) of one row of q or K, starting at word w0, `nw` valid.
// Float32 mode over bfloat16 storage converts; bf16 mode over float32 q rounds.
template <bool BF16>
inline __m512i load_words(const void* row, bool row_bf16, int64_t w0, int64_t nw) {
  const __mmask16 wm = static_cast<__mmask16>((1u << nw) - 1u);
  if constexpr (BF16) {
    if (row_bf16) return _mm512_maskz_loadu_epi32(wm, static_cast<const uint16_t*>(row) + 2 * w0);
    const float* f = static_cast<const float*>(row) + 2 * w0;
    const __mmask16 lo = static_cast<__mmask16>(nw >= 8 ? 0xffff : (1u << (2 * nw)) - 1u);
    const __mmask16 hi = static_cast<__mmask16>(nw <= 8 ? 0 : (1u << (2 * (nw - 8))) - 1u);
    const __m512i a = f32_to_bf16_lanes(_mm512_maskz_loadu_ps(lo, f));
    const __m512i b = f32_to_bf16_lanes(_mm512_maskz_loadu_ps(hi, f + 16));
    // Words = (even element) | (odd element) << 16 over the 32 elements a ++ b.
    const __m512i ev = _mm512_permutex2var_epi32(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
    const __m512i od = _mm512_permutex2var_epi32(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
    return _mm512_or_si512(ev, _mm512_slli_epi32(od, 16));
  } else {
    if (row_bf16) {
      const __m256i h = _mm256_maskz_loadu_epi16(wm, static_cast<const uint16_t*>(row) + w0);
      return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    }
    return _mm512_maskz_loadu_epi32(wm, static_cast<const float*>(row) + w0);
  }
}

struct Work {
  int64_t M, Mp, nv, words;  // rows, rows padded to 16, row vectors, dot words per row
  int64_t qs;                // keys in lanes: q row stride (words rounded up to 16)
  float* qt;      // rows in lanes: [words][Mp] q transposed; keys in lanes: [M][words] q rows
  float* st;      // rows in lanes: [kBlockK][Mp] scores then p; keys in lanes: [M][kBlockK]
  uint32_t* pp;   // bf16 pairs of p: [kBlockK/2][Mp] (rows in lanes) or [M][kBlockK] (first half used)
  float* acc;     // [Mp][D]
  float* m;       // [Mp]
  float* l;       // [Mp]
  float* alpha;   // [Mp]
  int32_t* pos;   // [Mp]
  float* kv;      // [kBlockK][D]: float32 rows of K or V of the block, or V as bf16 pairs
  int64_t pj, pr; // stride of p / pp between keys (pairs) and between rows
};

// acc[r0..r0+R) = acc * alpha + p.v over the block's n keys (head dimension in lanes).
template <bool BF16, int R, int NVD>
inline void pv_tile(Work& w, int64_t r0, int64_t n, int64_t D) {
  __m512 acc[R][NVD];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(w.alpha[r0 + r]);
    for (int u = 0; u < NVD; ++u) acc[r][u] = _mm512_mul_ps(_mm512_load_ps(w.acc + (r0 + r) * D + u * 16), a);
  }
  if constexpr (BF16) {
    const uint32_t* vp = reinterpret_cast<const uint32_t*>(w.kv);
    for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
      __m512 vv[NVD];
      for (int u = 0; u < NVD; ++u) vv[u] = _mm512_load_ps(reinterpret_cast<const float*>(vp + jp * D + u * 16));
      for (int r = 0; r < R; ++r) {
        const __m512 pb = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(w.pp[jp * w.pj + (r0 + r) * w.pr])));
        for (int u = 0; u < NVD; ++u) acc[r][u] = dot_step(acc[r][u], pb, vv[u], std::true_type{});
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[NVD];
      for (int u = 0; u < NVD; ++u) vv[u] = _mm512_load_ps(w.kv + j * D + u * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 pb = _mm512_set1_ps(w.st[j * w.pj + (r0 + r) * w.pr]);
        for (int u = 0; u < NVD; ++u) acc[r][u] = _mm512_fmadd_ps(pb, vv[u], acc[r][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NVD; ++u) _mm512_store_ps(w.acc + (r0 + r) * D + u * 16, acc[r][u]);
}

template <bool BF16, int NVD>
void pv_rows(Work& w, int64_t n, int64_t D) {
  constexpr int R = NVD >= 8 ? 3 : NVD >= 4 ? 6 : NVD >= 2 ? 10 : 12;
  int64_t r0 = 0;
  for (; r0 + R <= w.M; r0 += R) pv_tile<BF16, R, NVD>(w, r0, n, D);
  switch (w.M - r0) {  // a tail tile of exactly the remaining rows
#define RS_TAIL(k) \
  case k:          \
    if constexpr (k < R) pv_tile<BF16, k, NVD>(w, r0, n, D); break;
    RS_TAIL(1) RS_TAIL(2) RS_TAIL(3) RS_TAIL(4) RS_TAIL(5) RS_TAIL(6)
    RS_TAIL(7) RS_TAIL(8) RS_TAIL(9) RS_TAIL(10) RS_TAIL(11)
#undef RS_TAIL
    default:
      break;
  }
}

// Rows in lanes: scores of 8 keys (row pointers krow) against NV row vectors.
template <bool BF16, int NV>
inline void qk_rows_in_lanes(const Work& w, const void* const* krow, float scale, float* st) {
  constexpr int KT = 8;
  __m512 acc[KT][NV];
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t e = 0; e < w.words; ++e) {
    __m512 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(w.qt + e * w.Mp + v * 16);
    for (int i = 0; i < KT; ++i) {
      const __m512 kb = bcast_word(krow[i], e);
      for (int v = 0; v < NV; ++v) acc[i][v] = dot_step(acc[i][v], kb, qv[v], std::bool_constant<BF16>{});
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < KT; ++i)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(st + i * w.Mp + v * 16, _mm512_mul_ps(acc[i][v], sc));
}

// V of the block in w.kv: float32 rows, or bf16 pairs (v_2i[d], v_2i+1[d]) of each element
// in d order (one two-source permute per 16 pairs). off[j]: element offset of key j's row.
template <typename KT, bool BF16, int NVD>
inline void load_v(const Problem& P, Work& w, const int64_t* off, int64_t kn) {
  const KT* vp = static_cast<const KT*>(P.v);
  constexpr int64_t D = NVD * 16;
  if constexpr (BF16) {
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                         0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                         0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    constexpr __mmask32 kRow = NVD == 1 ? 0xffffu : 0xffffffffu;  // elements per 32-wide chunk
    uint32_t* dst = reinterpret_cast<uint32_t*>(w.kv);
    for (int64_t jp = 0; jp < (kn + 1) / 2; ++jp) {
      const uint16_t* a = vp + off[2 * jp];
      const bool has_b = 2 * jp + 1 < kn;
      const uint16_t* b = vp + off[has_b ? 2 * jp + 1 : 2 * jp];
      for (int c = 0; c < (NVD + 1) / 2; ++c) {
        const __m512i ea = _mm512_maskz_loadu_epi16(kRow, a + 32 * c);
        const __m512i eb = has_b ? _mm512_maskz_loadu_epi16(kRow, b + 32 * c) : _mm512_setzero_si512();
        _mm512_store_si512(reinterpret_cast<__m512i*>(dst + jp * D + 32 * c), _mm512_permutex2var_epi16(ea, lo, eb));
        if (2 * c + 1 < NVD)
          _mm512_store_si512(reinterpret_cast<__m512i*>(dst + jp * D + 32 * c + 16), _mm512_permutex2var_epi16(ea, hi, eb));
      }
    }
  } else {
    for (int64_t j = 0; j < kn; ++j) {
      const KT* src = vp + off[j];
      for (int u = 0; u < NVD; ++u) {
        __m512 x;
        if constexpr (std::is_same_v<KT, float>)
          x = _mm512_loadu_ps(src + u * 16);
        else
          x = bf16x16_to_f32(src + u * 16);
        _mm512_store_ps(w.kv + j * D + u * 16, x);
      }
    }
  }
}

// Keys in lanes, R rows: scores of 16 keys (the transposed words kt[0..nw) of a 16-word
// chunk) accumulated into acc[r] (sequentially over the words, as every layout does).
template <bool BF16, int R>
inline void qk_few_tile(const __m512i* kt, int64_t nw, const float* const* qrow, int64_t wc, __m512* acc) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = acc[r];
  for (int64_t e = 0; e < nw; ++e) {
    const __m512 kv = _mm512_castsi512_ps(kt[e]);
    for (int r = 0; r < R; ++r) a[r] = dot_step(a[r], bcast_word(qrow[r], wc + e), kv, std::bool_constant<BF16>{});
  }
  for (int r = 0; r < R; ++r) acc[r] = a[r];
}

template <typename KT, bool BF16, int NVD>
void attend_avx512(const Problem& P, const Item& it) {
  constexpr int64_t D = NVD * 16;
  constexpr bool kKvBf16 = std::is_same_v<KT, uint16_t>;
  const SeqInfo& sq = P.seqs[it.seq];
  const int64_t ng = it.g1 - it.g0;
  Work w;
  w.M = (it.p1 - it.p0) * ng;
  w.nv = (w.M + 15) / 16;
  w.Mp = w.nv * 16;
  w.words = BF16 ? D / 2 : D;
  w.qs = (w.words + 15) / 16 * 16;
  const bool few = w.M <= kFewRows;
  const int64_t Mp = w.Mp;
  const size_t need = static_cast<size_t>(w.words * Mp + kBlockK * Mp + kBlockK / 2 * Mp + Mp * D +
                                          4 * Mp + kBlockK * D + 64);
  w.qt = thread_scratch(need);
  w.st = w.qt + w.words * Mp;
  w.pp = reinterpret_cast<uint32_t*>(w.st + kBlockK * Mp);
  w.acc = reinterpret_cast<float*>(w.pp + kBlockK / 2 * Mp);
  w.m = w.acc + Mp * D;
  w.l = w.m + Mp;
  w.alpha = w.l + Mp;
  w.pos = reinterpret_cast<int32_t*>(w.alpha + Mp);
  w.kv = reinterpret_cast<float*>(w.pos + Mp);
  w.pj = few ? 1 : Mp;
  w.pr = few ? kBlockK : 1;

  // ---- q: transposed (rows in lanes) or as rows of words (keys in lanes)
  const int64_t base = sq.kv_len - sq.q_len;
  auto q_row = [&](int64_t r) -> const void* {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
    const int64_t off = t * P.q_rs + h * D;
    return P.q_bf16 ? static_cast<const void*>(static_cast<const uint16_t*>(P.q) + off)
                    : static_cast<const void*>(static_cast<const float*>(P.q) + off);
  };
  for (int64_t rv = 0; rv < w.nv; ++rv) {
    for (int64_t wc = 0; wc < w.words; wc += 16) {
      const int64_t nw = std::min<int64_t>(16, w.words - wc);
      __m512i rows[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = rv * 16 + i;
        rows[i] = r < w.M ? load_words<BF16>(q_row(r), P.q_bf16, wc, nw) : _mm512_setzero_si512();
        if (few && r < w.M) _mm512_store_si512(reinterpret_cast<__m512i*>(w.qt + r * w.qs + wc), rows[i]);
      }
      if (!few) {
        transpose16(rows);
        for (int64_t e = 0; e < nw; ++e)
          _mm512_store_si512(reinterpret_cast<__m512i*>(w.qt + (wc + e) * Mp + rv * 16), rows[e]);
      }
    }
  }
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
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  const __m512 scale = _mm512_set1_ps(P.scale);
  // Element offsets of the block's K/V rows (keys past the sequence repeat its last row:
  // they are masked, and reading a real row keeps every load in bounds).
  int64_t offs[2][kBlockK];
  auto fill_offsets = [&](int64_t k0, int64_t* off) {
    const int64_t kn = std::min(kBlockK, sq.kv_len - k0);
    for (int64_t j = 0; j < kBlockK; ++j) off[j] = slots[k0 + std::min(j, kn - 1)] * P.kv_ss + hoff;
  };
  fill_offsets(0, offs[0]);

  for (int64_t kb = 0; kb < nkb; ++kb) {
    const int64_t k0 = kb * kBlockK, kn = std::min(kBlockK, sq.kv_len - k0);
    const int64_t* off = offs[kb & 1];
    if (kb + 1 < nkb) {
      // The next block's rows, unless they are one ascending run of slots (the allocator
      // hands slots out in runs): the hardware prefetcher streams those by itself.
      int64_t* next = offs[(kb + 1) & 1];
      fill_offsets(k0 + kBlockK, next);
      const int64_t n1 = std::min(kBlockK, sq.kv_len - k0 - kBlockK);
      const bool run = next[n1 - 1] - next[0] == (n1 - 1) * P.kv_ss;
      for (int64_t j = 0; j < (run ? 0 : n1); ++j)
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KT)); b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kp + next[j]) + b, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vp + next[j]) + b, _MM_HINT_T0);
        }
    }
    const bool masked = k0 + kBlockK - 1 > min_pos || kn < kBlockK;
    if (!few) {
      // ---- rows in lanes: q.k with each K word broadcast from its row
      const void* krows[kBlockK];
      for (int64_t j = 0; j < kBlockK; ++j) {
        const KT* src = kp + off[j];
        if constexpr (kKvBf16 && !BF16) {  // float32 mode over a bf16 pool: convert first
          for (int u = 0; u < NVD; ++u) _mm512_store_ps(w.kv + j * D + u * 16, bf16x16_to_f32(src + u * 16));
          krows[j] = w.kv + j * D;
        } else {
          krows[j] = src;
        }
      }
      for (int64_t j = 0; j < kBlockK; j += 8) {
        switch (w.nv) {
          case 1: qk_rows_in_lanes<BF16, 1>(w, krows + j, P.scale, w.st + j * Mp); break;
          case 2: qk_rows_in_lanes<BF16, 2>(w, krows + j, P.scale, w.st + j * Mp); break;
          default: qk_rows_in_lanes<BF16, 3>(w, krows + j, P.scale, w.st + j * Mp); break;
        }
      }
      for (int64_t v = 0; v < w.nv; ++v) {
        float* sv = w.st + v * 16;
        if (masked) {  // a select: no arithmetic
          const __m512i pv = _mm512_load_si512(w.pos + v * 16);
          for (int64_t j = 0; j < kBlockK; ++j) {
            __mmask16 mk = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int>(k0 + j)), pv);
            if (j >= kn) mk = 0xffff;
            _mm512_store_ps(sv + j * Mp, _mm512_mask_mov_ps(_mm512_load_ps(sv + j * Mp), mk, ninf));
          }
        }
        __m512 mb = _mm512_load_ps(sv);
        for (int64_t j = 1; j < kBlockK; ++j) mb = _mm512_max_ps(mb, _mm512_load_ps(sv + j * Mp));
        const __m512 mo = _mm512_load_ps(w.m + v * 16);
        const __m512 mn = _mm512_max_ps(mo, mb);
        const __m512 a = exp512(_mm512_sub_ps(mo, mn));
        __m512 p[kBlockK];
        for (int64_t j = 0; j < kBlockK; ++j) {
          p[j] = exp512(_mm512_sub_ps(_mm512_load_ps(sv + j * Mp), mn));
          if constexpr (!BF16) _mm512_store_ps(sv + j * Mp, p[j]);
        }
        if constexpr (BF16) {
          for (int64_t jp = 0; jp < kBlockK / 2; ++jp)
            _mm512_store_si512(reinterpret_cast<__m512i*>(w.pp + jp * Mp + v * 16),
                               _mm512_or_si512(f32_to_bf16_lanes(p[2 * jp]),
                                               _mm512_slli_epi32(f32_to_bf16_lanes(p[2 * jp + 1]), 16)));
        }
        for (int64_t i = 0; i < 16; ++i) p[i] = _mm512_add_ps(p[i], p[i + 16]);  // halving_sum32
        for (int64_t wd = 8; wd >= 1; wd /= 2)
          for (int64_t i = 0; i < wd; ++i) p[i] = _mm512_add_ps(p[i], p[i + wd]);
        const __m512 lo = _mm512_load_ps(w.l + v * 16);
        _mm512_store_ps(w.l + v * 16, _mm512_add_ps(_mm512_mul_ps(lo, a), p[0]));
        _mm512_store_ps(w.m + v * 16, mn);
        _mm512_store_ps(w.alpha + v * 16, a);
      }
    } else {
      // ---- keys in lanes: 16 K rows transposed in registers, q words broadcast
      const float* qrow[kFewRows];
      for (int64_t r = 0; r < w.M; ++r) qrow[r] = w.qt + r * w.qs;
      for (int64_t half = 0; half < 2; ++half) {
        __m512 acc[kFewRows];
        for (int64_t r = 0; r < w.M; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t wc = 0; wc < w.words; wc += 16) {
          const int64_t nw = std::min<int64_t>(16, w.words - wc);
          __m512i rows[16];
          for (int64_t i = 0; i < 16; ++i) rows[i] = load_words<BF16>(kp + off[half * 16 + i], kKvBf16, wc, nw);
          transpose16(rows);
          for (int64_t r0 = 0; r0 < w.M; r0 += 4) {
            switch (std::min<int64_t>(4, w.M - r0)) {
              case 1: qk_few_tile<BF16, 1>(rows, nw, qrow + r0, wc, acc + r0); break;
              case 2: qk_few_tile<BF16, 2>(rows, nw, qrow + r0, wc, acc + r0); break;
              case 3: qk_few_tile<BF16, 3>(rows, nw, qrow + r0, wc, acc + r0); break;
              default: qk_few_tile<BF16, 4>(rows, nw, qrow + r0, wc, acc + r0); break;
            }
          }
        }
        for (int64_t r = 0; r < w.M; ++r) _mm512_store_ps(w.st + r * kBlockK + half * 16, acc[r]);
      }
      const __m512i kpos0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      const __m512i kpos1 = _mm512_add_epi32(kpos0, _mm512_set1_epi32(16));
      const __m512i klim = _mm512_set1_epi32(static_cast<int>(k0 + kn));
      for (int64_t r = 0; r < w.M; ++r) {
        __m512 s0 = _mm512_mul_ps(_mm512_load_ps(w.st + r * kBlockK), scale);
        __m512 s1 = _mm512_mul_ps(_mm512_load_ps(w.st + r * kBlockK + 16), scale);
        if (masked) {
          const __m512i pr = _mm512_set1_epi32(w.pos[r]);
          const __mmask16 m0 = _mm512_cmpgt_epi32_mask(kpos0, pr) | _mm512_cmpge_epi32_mask(kpos0, klim);
          const __mmask16 m1 = _mm512_cmpgt_epi32_mask(kpos1, pr) | _mm512_cmpge_epi32_mask(kpos1, klim);
          s0 = _mm512_mask_mov_ps(s0, m0, ninf);
          s1 = _mm512_mask_mov_ps(s1, m1, ninf);
        }
        const float mb = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
        const float mo = w.m[r];
        const float mn = max_ps(mo, mb);
        const float a = exp_f32(mo - mn);
        const __m512 mnv = _mm512_set1_ps(mn);
        const __m512 p0 = exp512(_mm512_sub_ps(s0, mnv));
        const __m512 p1 = exp512(_mm512_sub_ps(s1, mnv));
        if constexpr (BF16) {  // pairs of adjacent keys: 16-bit lanes 2i, 2i+1 of one word
          _mm256_store_si256(reinterpret_cast<__m256i*>(w.pp + r * kBlockK), _mm512_cvtepi32_epi16(f32_to_bf16_lanes(p0)));
          _mm256_store_si256(reinterpret_cast<__m256i*>(w.pp + r * kBlockK + 8), _mm512_cvtepi32_epi16(f32_to_bf16_lanes(p1)));
        } else {
          _mm512_store_ps(w.st + r * kBlockK, p0);
          _mm512_store_ps(w.st + r * kBlockK + 16, p1);
        }
        const __m512 h16 = _mm512_add_ps(p0, p1);  // halving_sum32
        const __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(h16), _mm512_extractf32x8_ps(h16, 1));
        const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
        const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
        const __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
        w.l[r] = w.l[r] * a + _mm_cvtss_f32(h1);
        w.m[r] = mn;
        w.alpha[r] = a;
      }
    }
    // ---- p.v, head dimension in lanes
    load_v<KT, BF16, NVD>(P, w, off, kn);
    pv_rows<BF16, NVD>(w, kn, D);
  }
  // ---- out = acc / l
  for (int64_t r = 0; r < w.M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
    const __m512 lv = _mm512_set1_ps(w.l[r]);
    const int64_t off = t * P.o_rs + h * D;
    for (int u = 0; u < NVD; ++u) {
      const __m512 o = _mm512_div_ps(_mm512_load_ps(w.acc + r * D + u * 16), lv);
      if (P.out_bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(P.out) + off + u * 16),
                            _mm512_cvtepi32_epi16(f32_to_bf16_lanes(o)));
      else
        _mm512_storeu_ps(static_cast<float*>(P.out) + off + u * 16, o);
    }
  }
}
#endif  // RS_AVX512

bool avx512_head_dim(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 128; }

int64_t pick_impl(bool kv_bf16, int64_t D) {
#if RS_AVX512
  if (avx512_head_dim(D)) {
#if RS_AVX512_BF16
    if (kv_bf16) return kBf16;
#endif
    return kF32;
  }
#endif
  (void)kv_bf16;
  (void)D;
  return kGeneric;
}

bool impl_available(int64_t impl, bool kv_bf16, int64_t D) {
  switch (impl) {
    case kGeneric: return true;
    case kF32: return RS_AVX512 && avx512_head_dim(D);
    case kBf16: return RS_AVX512_BF16 && avx512_head_dim(D) && kv_bf16;
    default: return false;
  }
}

template <typename KT>
void dispatch(const Problem& P, const std::vector<Item>& items, int64_t impl) {
  if (impl == kGeneric) {
    run_items(items, [&](const Item& it) { attend_generic<KT>(P, it); });
    return;
  }
#if RS_AVX512
  auto go = [&](auto bf16) {
    constexpr bool B = decltype(bf16)::value;
    switch (P.D) {
      case 16: run_items(items, [&](const Item& it) { attend_avx512<KT, B, 1>(P, it); }); break;
      case 32: run_items(items, [&](const Item& it) { attend_avx512<KT, B, 2>(P, it); }); break;
      case 64: run_items(items, [&](const Item& it) { attend_avx512<KT, B, 4>(P, it); }); break;
      default: run_items(items, [&](const Item& it) { attend_avx512<KT, B, 8>(P, it); }); break;
    }
  };
  if (impl == kF32) {
    go(std::false_type{});
    return;
  }
#if RS_AVX512_BF16
  if constexpr (std::is_same_v<KT, uint16_t>) {
    go(std::true_type{});
    return;
  }
#endif
#endif
}

}  // namespace

int64_t attention_impl(const at::Tensor& q, const at::Tensor& k_cache) {
  return pick_impl(k_cache.scalar_type() == at::kBFloat16, q.size(-1));
}

void paged_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& seq_info, at::Tensor& out, double scale,
                            int64_t impl) {
  Problem P;
  P.q = q.data_ptr();
  P.q_rs = q.stride(0);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.kv_ss = k_cache.stride(0);
  P.slots = slots.data_ptr<int64_t>();
  P.seqs = reinterpret_cast<const SeqInfo*>(seq_info.data_ptr<int64_t>());
  P.out = out.data_ptr();
  P.o_rs = out.stride(0);
  P.H = q.size(1);
  P.KV = k_cache.size(1);
  P.G = P.H / P.KV;
  P.D = q.size(2);
  P.scale = static_cast<float>(scale);
  P.q_bf16 = q.scalar_type() == at::kBFloat16;
  P.out_bf16 = out.scalar_type() == at::kBFloat16;
  const bool kv_bf16 = k_cache.scalar_type() == at::kBFloat16;
  if (impl == kAuto) impl = pick_impl(kv_bf16, P.D);
  TORCH_CHECK(impl_available(impl, kv_bf16, P.D), "paged_attention: impl ", impl,
              " is not available for this pool dtype / head size / CPU");
  const auto items = make_items(P, seq_info.size(0));
  if (kv_bf16)
    dispatch<uint16_t>(P, items, impl);
  else
    dispatch<float>(P, items, impl);
}

}  // namespace radixserve
