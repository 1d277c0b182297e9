// The AVX-512 implementation of the paged attention kernel (see attention.cpp for the
// arithmetic, which this code repeats operation for operation): float32 mode over float32 or
// bfloat16 pools, and, on AVX512-BF16 CPUs, the bf16 mode (q and p rounded to bfloat16,
// vdpbf16ps pair dot products, float32 accumulation).
//
// Two layouts compute the same per-row operations:
//   * many rows (prefill): rows in vector lanes for q.k — each key element is broadcast
//     straight from its pool row, so K is never repacked;
//   * few rows (decode): keys in lanes — 16 K rows are transposed in registers, each q
//     element is broadcast.
// p.v always has the head dimension in lanes. A quantized pool's K and V rows of a block are
// dequantized into the work buffer (dequant_row of common.h) and read as float32 rows.
#include "attention.h"

#include <cstdlib>
#include <cstring>
#include <array>
#include <new>
#include <type_traits>

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
namespace attn {

bool avx512_built(bool bf16_mode) { return bf16_mode ? RS_AVX512_BF16 : RS_AVX512; }

bool avx512_head_dim(int64_t D) { return D == 16 || D == 32 || D == 64 || D == 128 || D == 256; }

bool tile_head_dim(int64_t D) { return avx512_head_dim(D) && D % 32 == 0; }

#if RS_AVX512
namespace {

constexpr int64_t kMaxGroupHeads = 8;  // KV heads run together (attend_avx512)
constexpr int64_t kMaxBundle = 16;     // sequences sharing blocks run together (attend_shared)
constexpr int64_t kTouchBytes = 256;   // rows at least this long are loaded a block ahead
std::atomic<uint64_t> touch_sink{0};

// RADIXSERVE_ATTENTION_GROUPS=0 runs every item alone, with no loads ahead and no shared
// blocks, as this file did before groups: for benchmarks/bench_decode_attention.py to compare
// the two (same bits). Read at every call, so one process can alternate.
bool grouping_on() {
  const char* e = std::getenv("RADIXSERVE_ATTENTION_GROUPS");
  return e == nullptr || std::strcmp(e, "0") != 0;
}

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
  int32_t* lo;    // [Mp] first key each row sees (its window's start; 0 without one)
  float* kv;      // [kBlockK][D]: float32 rows of K or V of the block, or V as bf16 pairs
  int64_t pj, pr; // stride of p / pp between keys (pairs) and between rows
};

// acc[r0..r0+R) = acc * alpha + p.v over the block's n keys (head dimension in lanes), for
// the NU vectors of columns from vector u0 (a wide head is done in column chunks that fit the
// registers; every output element is still one in-order chain over the keys).
template <bool BF16, int R, int NU>
inline void pv_tile(Work& w, int64_t r0, int64_t n, int64_t D, int u0) {
  __m512 acc[R][NU];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(w.alpha[r0 + r]);
    for (int u = 0; u < NU; ++u) acc[r][u] = _mm512_mul_ps(_mm512_load_ps(w.acc + (r0 + r) * D + (u0 + u) * 16), a);
  }
  if constexpr (BF16) {
    const uint32_t* vp = reinterpret_cast<const uint32_t*>(w.kv);
    for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
      __m512 vv[NU];
      for (int u = 0; u < NU; ++u)
        vv[u] = _mm512_load_ps(reinterpret_cast<const float*>(vp + jp * D + (u0 + u) * 16));
      for (int r = 0; r < R; ++r) {
        const __m512 pb = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(w.pp[jp * w.pj + (r0 + r) * w.pr])));
        for (int u = 0; u < NU; ++u) acc[r][u] = dot_step(acc[r][u], pb, vv[u], std::true_type{});
      }
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[NU];
      for (int u = 0; u < NU; ++u) vv[u] = _mm512_load_ps(w.kv + j * D + (u0 + u) * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 pb = _mm512_set1_ps(w.st[j * w.pj + (r0 + r) * w.pr]);
        for (int u = 0; u < NU; ++u) acc[r][u] = _mm512_fmadd_ps(pb, vv[u], acc[r][u]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NU; ++u) _mm512_store_ps(w.acc + (r0 + r) * D + (u0 + u) * 16, acc[r][u]);
}

template <bool BF16, int NVD>
void pv_rows(Work& w, int64_t n, int64_t D) {
  constexpr int NU = NVD > 8 ? 8 : NVD;  // vectors of columns per pass
  constexpr int R = NU >= 8 ? 3 : NU >= 4 ? 6 : NU >= 2 ? 10 : 12;
  for (int u0 = 0; u0 < NVD; u0 += NU) {
    int64_t r0 = 0;
    for (; r0 + R <= w.M; r0 += R) pv_tile<BF16, R, NU>(w, r0, n, D, u0);
    switch (w.M - r0) {  // a tail tile of exactly the remaining rows
#define RS_TAIL(k) \
  case k:          \
    if constexpr (k < R) pv_tile<BF16, k, NU>(w, r0, n, D, u0); break;
      RS_TAIL(1) RS_TAIL(2) RS_TAIL(3) RS_TAIL(4) RS_TAIL(5) RS_TAIL(6)
      RS_TAIL(7) RS_TAIL(8) RS_TAIL(9) RS_TAIL(10) RS_TAIL(11)
#undef RS_TAIL
      default:
        break;
    }
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
inline void load_v(const Problem& P, float* kv, const int64_t* off, int64_t kn) {
  const KT* vp = static_cast<const KT*>(P.v);
  constexpr int64_t D = NVD * 16;
  if constexpr (BF16) {
    const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                         0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                         0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    constexpr __mmask32 kRow = NVD == 1 ? 0xffffu : 0xffffffffu;  // elements per 32-wide chunk
    uint32_t* dst = reinterpret_cast<uint32_t*>(kv);
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
      if constexpr (std::is_same_v<KT, uint8_t>) {
        dequant_row(src, D, P.kv_kind, P.fp8, kv + j * D);
      } else {
        for (int u = 0; u < NVD; ++u) {
          __m512 x;
          if constexpr (std::is_same_v<KT, float>)
            x = _mm512_loadu_ps(src + u * 16);
          else
            x = bf16x16_to_f32(src + u * 16);
          _mm512_store_ps(kv + j * D + u * 16, x);
        }
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

// One work item's attention, key block by key block. A decode step runs the items of a
// sequence's KV heads together (attend_avx512), interleaved block by block: a pool row holds
// every KV head of a slot, so one head alone reads a third (or less) of each row it touches,
// at a stride the hardware prefetcher follows poorly; the heads together read the block's
// rows whole. Each item's arithmetic is the same whichever way they are run.
template <typename KT, bool BF16, int NVD>
struct Attend {
  static constexpr int64_t D = NVD * 16;
  static constexpr bool kKvBf16 = std::is_same_v<KT, uint16_t>;
  static constexpr bool kQuant = std::is_same_v<KT, uint8_t>;  // dequantized into w.kv, then float32

  const Problem& P;
  const Item& it;
  const SeqInfo& sq;
  int64_t ng;
  Work w;
  bool few;
  int tiles;      // kTiles*: the unit this item's blocks run on
  uint32_t* qs;   // tiles: q rows [Mp][words], each bf16 pair swapped (tiles.h: the unit adds the
                  // even product first), zero past M
  uint32_t* vs;   // tiles: the block's V pairs as load_v lays them out, each pair swapped
  int64_t Mp, base, last, hoff, min_pos, nkb, klo, klo_last, kb0;
  const KT* kp;
  const KT* vp;
  const int64_t* slots;
  __m512 ninf, scale;
  // Element offsets of the block's K/V rows (keys past the sequence repeat its last row,
  // keys before klo repeat klo's: they are masked, and reading a real row keeps every load
  // in bounds); klo: keys before it are never read; klo_last: the last row's window start.
  int64_t offs[2][kBlockK];

  static Work shape(const Item& it) {
    Work w;
    w.M = (it.p1 - it.p0) * (it.g1 - it.g0);
    w.nv = (w.M + 15) / 16;
    w.Mp = w.nv * 16;
    w.words = BF16 ? D / 2 : D;
    w.qs = (w.words + 15) / 16 * 16;
    return w;
  }
  // Floats of scratch an item takes, a multiple of 16 (the next item's scratch stays aligned).
  static size_t scratch_floats(const Item& it) {
    const Work w = shape(it);
    const int64_t n = w.words * w.Mp + kBlockK * w.Mp + kBlockK / 2 * w.Mp + w.Mp * D + 5 * w.Mp + kBlockK * D +
                      (kTileable ? w.words * w.Mp + kBlockK / 2 * D : 0) + 64;
    return static_cast<size_t>((n + 15) / 16 * 16);
  }

  // The bf16 mode's prefill items run their blocks on a tile unit where the Problem names one
  // (kAmx, kAmxModel); decode items (keys in lanes) never do.
  static constexpr bool kTileable = BF16 && kKvBf16 && D % 32 == 0;
  static int tile_unit_of(const Problem& P, const Item& it) {
    return kTileable && shape(it).M > kFewRows ? P.tiles : kTilesNone;
  }

  Attend(const Problem& P_, const Item& it_, float* scratch)
      : P(P_), it(it_), sq(P_.seqs[it_.seq]), ng(it_.g1 - it_.g0), w(shape(it_)) {
    few = w.M <= kFewRows;
    tiles = tile_unit_of(P, it);
    Mp = w.Mp;
    w.qt = scratch;
    w.st = w.qt + w.words * Mp;
    w.pp = reinterpret_cast<uint32_t*>(w.st + kBlockK * Mp);
    w.acc = reinterpret_cast<float*>(w.pp + kBlockK / 2 * Mp);
    w.m = w.acc + Mp * D;
    w.l = w.m + Mp;
    w.alpha = w.l + Mp;
    w.pos = reinterpret_cast<int32_t*>(w.alpha + Mp);
    w.lo = w.pos + Mp;
    w.kv = reinterpret_cast<float*>(w.lo + Mp);
    qs = reinterpret_cast<uint32_t*>(w.kv + kBlockK * D);
    vs = qs + w.words * Mp;
    w.pj = few ? 1 : Mp;
    w.pr = few ? kBlockK : 1;

    // ---- q: transposed (rows in lanes) or as rows of words (keys in lanes)
    base = sq.kv_len - sq.q_len;
    for (int64_t rv = 0; rv < w.nv; ++rv) {
      for (int64_t wc = 0; wc < w.words; wc += 16) {
        const int64_t nw = std::min<int64_t>(16, w.words - wc);
        __m512i rows[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t r = rv * 16 + i;
          rows[i] = r < w.M ? load_words<BF16>(q_row(r), P.q_bf16, wc, nw) : _mm512_setzero_si512();
          if (few && r < w.M) _mm512_store_si512(reinterpret_cast<__m512i*>(w.qt + r * w.qs + wc), rows[i]);
          if (tiles != kTilesNone)
            _mm512_store_si512(reinterpret_cast<__m512i*>(qs + r * w.words + wc), _mm512_rol_epi32(rows[i], 16));
        }
        if (!few) {
          transpose16(rows);
          for (int64_t e = 0; e < nw; ++e)
            _mm512_store_si512(reinterpret_cast<__m512i*>(w.qt + (wc + e) * Mp + rv * 16), rows[e]);
        }
      }
    }
    last = base + it.p1 - 1;
    for (int64_t r = 0; r < Mp; ++r) {
      // Padding rows take the last position: always attended, never NaN.
      w.pos[r] = static_cast<int32_t>(r < w.M ? base + it.p0 + r / ng : last);
      w.lo[r] = static_cast<int32_t>(first_key(P, w.pos[r]));
      w.m[r] = kNegInf;
      w.l[r] = 0.f;
    }
    std::memset(w.acc, 0, sizeof(float) * Mp * D);

    kp = static_cast<const KT*>(P.k);
    vp = static_cast<const KT*>(P.v);
    slots = P.slots + sq.kv_start;
    hoff = it.kh * P.hs;
    min_pos = base + it.p0;
    nkb = last / kBlockK + 1;
    klo = first_key(P, min_pos);
    klo_last = first_key(P, last);
    ninf = _mm512_set1_ps(kNegInf);
    scale = _mm512_set1_ps(P.scale);
    kb0 = klo / kBlockK;
    fill_offsets(kb0 * kBlockK, offs[kb0 & 1]);

  }

  // Words of a K row in 16-word chunks; a block's K transposed takes 2 * kChunks * 16 vectors.
  static constexpr int64_t kChunks = ((BF16 ? D / 2 : D) + 15) / 16;

  // The block's 32 K rows (element offsets off) transposed for the keys-in-lanes layout:
  // kt[(half * kChunks + c) * 16 + e] = word 16c + e of keys 16 half .. 16 half + 15.
  void transpose_k(const int64_t* off, __m512i* kt) {
    if constexpr (kQuant)
      for (int64_t j = 0; j < kBlockK; ++j) dequant_row(kp + off[j], D, P.kv_kind, P.fp8, w.kv + j * D);
    for (int64_t half = 0; half < 2; ++half)
      for (int64_t wc = 0; wc < w.words; wc += 16) {
        const int64_t nw = std::min<int64_t>(16, w.words - wc);
        __m512i* rows = kt + (half * kChunks + wc / 16) * 16;
        for (int64_t i = 0; i < 16; ++i) {
          if constexpr (kQuant)
            rows[i] = load_words<BF16>(w.kv + (half * 16 + i) * D, false, wc, nw);
          else
            rows[i] = load_words<BF16>(kp + off[half * 16 + i], kKvBf16, wc, nw);
        }
        transpose16(rows);
      }
  }

  // Block kb's K transposed and V as pv_rows reads it, into kt and v (see block()).
  void prepare(int64_t kb, __m512i* kt, float* v) {
    int64_t off[kBlockK];
    fill_offsets(kb * kBlockK, off);
    transpose_k(off, kt);
    load_v<KT, BF16, NVD>(P, v, off, std::min(kBlockK, sq.kv_len - kb * kBlockK));
  }

  // Starts the walk at block kb (offsets of its rows) instead of kb0.
  void start_at(int64_t kb) { fill_offsets(kb * kBlockK, offs[kb & 1]); }

  const void* q_row(int64_t r) const {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
    const int64_t off = t * P.q_rs + h * D;
    return P.q_bf16 ? static_cast<const void*>(static_cast<const uint16_t*>(P.q) + off)
                    : static_cast<const void*>(static_cast<const float*>(P.q) + off);
  }

  void fill_offsets(int64_t k0, int64_t* off) const {
    const int64_t kn = std::min(kBlockK, sq.kv_len - k0);
    for (int64_t j = 0; j < kBlockK; ++j) off[j] = slots[std::max(k0 + std::min(j, kn - 1), klo)] * P.kv_ss + hoff;
  }

  // Scores of the block's keys (rows off) for every row, scaled, into w.st ([kBlockK][Mp]):
  // each K word broadcast from its pool row against the rows' q words in lanes.
  void qk_rows(const int64_t* off) {
    const void* krows[kBlockK];
    for (int64_t j = 0; j < kBlockK; ++j) {
      const KT* src = kp + off[j];
      if constexpr (kKvBf16 && !BF16) {  // float32 mode over a bf16 pool: convert first
        for (int u = 0; u < NVD; ++u) _mm512_store_ps(w.kv + j * D + u * 16, bf16x16_to_f32(src + u * 16));
        krows[j] = w.kv + j * D;
      } else if constexpr (kQuant) {
        dequant_row(src, D, P.kv_kind, P.fp8, w.kv + j * D);
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
  }

  // on_tiles(tag) for the unit `kind` names (tag: a null pointer of its type), or otherwise():
  // only the tileable instantiations have tile code at all.
  template <typename OnTiles, typename Otherwise>
  void run_tiles_or(int kind, OnTiles on_tiles, Otherwise otherwise) {
#if RS_TILES
    if constexpr (kTileable) {
      if (kind == kTilesHardware) return on_tiles(static_cast<HardwareTiles*>(nullptr));
      if (kind == kTilesModel) return on_tiles(static_cast<ModelTiles*>(nullptr));
    }
#endif
    (void)kind;
    (void)on_tiles;
    otherwise();
  }

#if RS_TILES
  // ---- tile blocks: q.k and p.v of a prefill item on the tile unit, kBf16's bits.
  // kBf16 computes every score as one chain over the q.k words (pairs) in order, and every
  // output element as acc * alpha and then one chain over the block's key pairs, each step a
  // vdpbf16ps (odd product first). A C tile's element is the same chain when both operands
  // reach the unit with each pair swapped (tdpbf16ps adds the even product first), the q.k
  // words are whole tile rows (tile_head_dim) and a block's 16 key pairs are all real keys:
  // p.v runs on the tiles only for a full block (kBf16's chain over a part block is shorter).

  // Scores of the block's 32 keys for every row (16-row tiles; padding rows too, which
  // nothing reads), scaled, into w.st as qk_rows writes them.
  template <class Unit>
  void qk_tiles(const int64_t* off) {
    alignas(64) __m512i kt[2 * kChunks * 16];  // B tiles: words x 16 keys per half and chunk
    transpose_k(off, kt);
    for (int64_t i = 0; i < 2 * kChunks * 16; ++i) kt[i] = _mm512_rol_epi32(kt[i], 16);
    Unit& u = tile_unit<Unit>();
    u.configure();
    const __m512 sc = _mm512_set1_ps(P.scale);
    for (int64_t rt = 0; rt < w.nv; ++rt) {
      u.template zero<0>();
      u.template zero<1>();
      for (int64_t c = 0; c < kChunks; ++c) {
        u.template load<4>(qs + rt * 16 * w.words + 16 * c, 4 * w.words);
        u.template load<6>(kt + c * 16, kTileBytes);
        u.template load<7>(kt + (kChunks + c) * 16, kTileBytes);
        u.template dot<0, 4, 6>();
        u.template dot<1, 4, 7>();
      }
      alignas(64) __m512i s[2][16];  // [half][row]: a row's 16 keys
      u.template store<0>(s[0], kTileBytes);
      u.template store<1>(s[1], kTileBytes);
      for (int64_t h = 0; h < 2; ++h) {
        transpose16(s[h]);  // [key][rows in lanes], as st holds them
        for (int64_t j = 0; j < 16; ++j)
          _mm512_store_ps(w.st + (16 * h + j) * Mp + 16 * rt, _mm512_mul_ps(_mm512_castsi512_ps(s[h][j]), sc));
      }
    }
    u.release();
  }

  // acc = acc * alpha + p.v over a full block for every row, p's pairs in w.pp and V's in
  // w.kv (load_v).
  template <class Unit>
  void pv_tiles() {
    const uint32_t* kv = reinterpret_cast<const uint32_t*>(w.kv);
    for (int64_t i = 0; i < kBlockK / 2 * D; i += 16)
      _mm512_store_si512(reinterpret_cast<__m512i*>(vs + i),
                         _mm512_rol_epi32(_mm512_load_si512(reinterpret_cast<const __m512i*>(kv + i)), 16));
    Unit& u = tile_unit<Unit>();
    u.configure();
    for (int64_t rt = 0; rt < w.nv; ++rt) {
      const int64_t r0 = 16 * rt;
      for (int64_t r = r0; r < r0 + 16; ++r) {  // pv_tile's first step, row by row
        const __m512 a = _mm512_set1_ps(w.alpha[r]);
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(w.acc + r * D + d, _mm512_mul_ps(_mm512_load_ps(w.acc + r * D + d), a));
      }
      alignas(64) __m512i p[16];  // the rows' 16 p pairs: [pair][rows in lanes] -> [row][pair]
      for (int64_t jp = 0; jp < 16; ++jp) p[jp] = _mm512_load_si512(reinterpret_cast<const __m512i*>(w.pp + jp * Mp + r0));
      transpose16(p);
      for (int64_t r = 0; r < 16; ++r) p[r] = _mm512_rol_epi32(p[r], 16);
      u.template load<4>(p, kTileBytes);
      for (int64_t d = 0; d < D; d += 16) {
        u.template load<0>(w.acc + r0 * D + d, 4 * D);
        u.template load<6>(vs + d, 4 * D);
        u.template dot<0, 4, 6>();
        u.template store<0>(w.acc + r0 * D + d, 4 * D);
      }
    }
    u.release();
  }
#endif

  // Block kb's keys; shared / shared_v: its K transposed (transpose_k) and V (load_v)
  // prepared once for every sequence whose slots hold the same block (attend_shared).
  void block(int64_t kb, const __m512i* shared = nullptr, float* shared_v = nullptr) {
    const int64_t k0 = kb * kBlockK, kn = std::min(kBlockK, sq.kv_len - k0);
    const int64_t* off = offs[kb & 1];
    if (kb + 1 < nkb) {
      fill_offsets(k0 + kBlockK, offs[(kb + 1) & 1]);  // (attend_avx512 prefetches its rows)
    }
    const bool masked = k0 + kBlockK - 1 > min_pos || kn < kBlockK || k0 < klo_last;
    if (!few) {
      // ---- rows in lanes: q.k with each K word broadcast from its row (or on the tiles)
      run_tiles_or(
          tiles, [&](auto tag) { qk_tiles<std::remove_pointer_t<decltype(tag)>>(off); }, [&] { qk_rows(off); });
      for (int64_t v = 0; v < w.nv; ++v) {
        float* sv = w.st + v * 16;
        if (masked) {  // a select: no arithmetic
          const __m512i pv = _mm512_load_si512(w.pos + v * 16);
          const __m512i lv = _mm512_load_si512(w.lo + v * 16);
          for (int64_t j = 0; j < kBlockK; ++j) {
            const __m512i kj = _mm512_set1_epi32(static_cast<int>(k0 + j));
            __mmask16 mk = _mm512_cmpgt_epi32_mask(kj, pv) | _mm512_cmpgt_epi32_mask(lv, kj);
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
      // ---- keys in lanes: 16 K rows transposed (here, or once for every sequence sharing
      // the block: attend_shared), q words broadcast
      const float* qrow[kFewRows];
      for (int64_t r = 0; r < w.M; ++r) qrow[r] = w.qt + r * w.qs;
      alignas(64) __m512i own[2 * kChunks * 16];
      const __m512i* kt = shared;
      if (kt == nullptr) {
        transpose_k(off, own);
        kt = own;
      }
      for (int64_t half = 0; half < 2; ++half) {
        __m512 acc[kFewRows];
        for (int64_t r = 0; r < w.M; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t wc = 0; wc < w.words; wc += 16) {
          const int64_t nw = std::min<int64_t>(16, w.words - wc);
          const __m512i* rows = kt + (half * kChunks + wc / 16) * 16;
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
          const __m512i lr = _mm512_set1_epi32(w.lo[r]);
          const __mmask16 m0 = _mm512_cmpgt_epi32_mask(kpos0, pr) | _mm512_cmpge_epi32_mask(kpos0, klim) |
                               _mm512_cmpgt_epi32_mask(lr, kpos0);
          const __mmask16 m1 = _mm512_cmpgt_epi32_mask(kpos1, pr) | _mm512_cmpge_epi32_mask(kpos1, klim) |
                               _mm512_cmpgt_epi32_mask(lr, kpos1);
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
    if (shared_v != nullptr) {
      float* own_kv = w.kv;
      w.kv = shared_v;
      pv_rows<BF16, NVD>(w, kn, D);
      w.kv = own_kv;
    } else {
      load_v<KT, BF16, NVD>(P, w.kv, off, kn);
      run_tiles_or(
          kn == kBlockK ? tiles : kTilesNone, [&](auto tag) { pv_tiles<std::remove_pointer_t<decltype(tag)>>(); },
          [&] { pv_rows<BF16, NVD>(w, kn, D); });
    }
  }

  // ---- out = acc / l
  void finish() const {
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
};

// Consecutive items of one sequence's rows that differ only in their KV head, for
// attend_avx512 to run together (make_items puts them side by side), as long as there are at
// least as many groups as threads: one short sequence's heads still spread over the threads.
struct Group {
  int64_t first, n, cost;
};

// One word of every cache line of block kb's slot rows (the heads a group reads), K and V,
// loaded before the block before it computes: without it a decode step waits on memory for
// most of its attention time. Real loads, not prefetch hints: on the Zen 4 measured,
// PREFETCHT0 did nothing and PREFETCHT1 gave less. Rows of under 256 bytes (one head of 64
// bf16) stream well enough by the hardware prefetcher alone, and the loads only cost there.
// (benchmarks/bench_decode_attention.py measures both ways.)
template <typename KT>
struct RowToucher {
  const Problem& P;
  const char* kbase;
  const char* vbase;
  int64_t span, el;
  bool on;
  uint64_t sink = 0;

  RowToucher(const Problem& P_, int64_t kh0, int64_t kh1)
      : P(P_), el(static_cast<int64_t>(sizeof(KT))) {
    kbase = static_cast<const char*>(P.k) + kh0 * P.hs * el;
    vbase = static_cast<const char*>(P.v) + kh0 * P.hs * el;
    span = ((kh1 - kh0 - 1) * P.hs + P.hs) * el;
    on = span >= kTouchBytes && grouping_on();
  }
  // Keys [kf, kf + kBlockK) of a sequence (slots: its first), those from `lo` on.
  void touch(const int64_t* slots, int64_t kf, int64_t kv_len, int64_t lo) {
    const int64_t nf = on ? std::min(kBlockK, kv_len - kf) : 0;
    for (int64_t j = std::max<int64_t>(0, lo - kf); j < nf; ++j) {
      const int64_t o = slots[kf + j] * P.kv_ss * el;
      for (int64_t b = 0; b < span; b += 64) {
        uint64_t x, y;
        std::memcpy(&x, kbase + o + b, 8);
        std::memcpy(&y, vbase + o + b, 8);
        sink += x ^ y;
      }
    }
  }
  ~RowToucher() { touch_sink.fetch_add(sink & 1, std::memory_order_relaxed); }  // keeps the loads
};

// The items of a group (one, or one sequence's KV heads) set up in caller-provided storage.
template <typename A>
A* make_group(const Problem& P, const Item* its, int64_t n, unsigned char (*mem)[sizeof(A)], float*& scratch) {
  A* a = reinterpret_cast<A*>(mem);
  for (int64_t i = 0; i < n; ++i) {
    new (a + i) A(P, its[i], scratch);
    scratch += A::scratch_floats(its[i]);
  }
  return a;
}

// Blocks [from, end) of a group's items a[0 .. n), block by block, the next one's rows loaded ahead.
template <typename KT, typename A>
void walk(const Problem& P, A* a, int64_t n, int64_t from) {
  RowToucher<KT> rows(P, a[0].it.kh, a[n - 1].it.kh + 1);
  const A& f = a[0];
  for (int64_t i = 0; i < n; ++i) a[i].start_at(from);
  for (int64_t kb = from; kb < f.nkb; ++kb) {
    rows.touch(f.slots, (kb + 1) * kBlockK, f.sq.kv_len, f.klo);
    for (int64_t i = 0; i < n; ++i) a[i].block(kb);
  }
}

template <typename A>
void finish_group(A* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    a[i].finish();
    a[i].~A();
  }
}

// Items its[0 .. n): one, or the KV heads of one sequence's rows (same positions, so the same
// key blocks), run block by block together.
template <typename KT, bool BF16, int NVD>
void attend_avx512(const Problem& P, const Item* its, int64_t n) {
  using A = Attend<KT, BF16, NVD>;
  size_t need = 0;
  for (int64_t i = 0; i < n; ++i) need += A::scratch_floats(its[i]);
  float* scratch = thread_scratch(need);
  alignas(A) unsigned char mem[kMaxGroupHeads][sizeof(A)];
  A* a = make_group<A>(P, its, n, mem, scratch);
  walk<KT>(P, a, n, a[0].kb0);
  finish_group(a, n);
}


// Sequences whose groups (all KV heads, few rows, no window) start with the same slot: each
// block they share has its K transposed and its V laid out once per head, and every sequence
// holding it runs its rows over that; then each walks its own blocks as attend_avx512 does.
// A row sees the same blocks in the same order with the same arithmetic (block() runs the
// same code on a shared or its own transposition), so its bits do not depend on the bundle.
template <typename KT, bool BF16, int NVD>
void attend_shared(const Problem& P, const std::vector<Item>& items, const Group* gs, int64_t ns) {
  using A = Attend<KT, BF16, NVD>;
  const int64_t KV = gs[0].n;
  const SeqInfo& s0 = P.seqs[items[gs[0].first].seq];
  size_t need = 0;
  int64_t shared[kMaxBundle], maxb = 0;
  for (int64_t m = 0; m < ns; ++m) {
    for (int64_t h = 0; h < KV; ++h) need += A::scratch_floats(items[gs[m].first + h]);
    shared[m] = shared_blocks(P, s0, P.seqs[items[gs[m].first].seq]);
    maxb = std::max(maxb, shared[m]);
  }
  const size_t kt_floats = static_cast<size_t>(2 * A::kChunks * 16 * 16), v_floats = static_cast<size_t>(kBlockK * A::D);
  float* scratch = thread_scratch(need + KV * (kt_floats + v_floats));
  float* prep = scratch + need;
  std::vector<std::array<unsigned char, sizeof(A)>> store(static_cast<size_t>(ns * KV) + 1);
  auto* base = reinterpret_cast<unsigned char(*)[sizeof(A)]>(
      (reinterpret_cast<uintptr_t>(store.data()) + alignof(A) - 1) & ~(uintptr_t(alignof(A)) - 1));
  A* a[kMaxBundle];
  for (int64_t m = 0; m < ns; ++m) a[m] = make_group<A>(P, items.data() + gs[m].first, KV, base + m * KV, scratch);
  RowToucher<KT> rows(P, 0, KV);
  for (int64_t kb = a[0][0].kb0; kb < maxb; ++kb) {
    rows.touch(P.slots + s0.kv_start, (kb + 1) * kBlockK, s0.kv_len, 0);
    for (int64_t h = 0; h < KV; ++h) {
      __m512i* kt = reinterpret_cast<__m512i*>(prep + h * (kt_floats + v_floats));
      float* v = prep + h * (kt_floats + v_floats) + kt_floats;
      a[0][h].prepare(kb, kt, v);
      for (int64_t m = 0; m < ns; ++m)
        if (shared[m] > kb) a[m][h].block(kb, kt, v);
    }
  }
  for (int64_t m = 0; m < ns; ++m) {
    walk<KT>(P, a[m], KV, shared[m]);
    finish_group(a[m], KV);
  }
}

std::vector<Group> group_items(const std::vector<Item>& items) {
  std::vector<Group> groups;
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    const Item& it = items[i];
    if (!groups.empty()) {
      Group& g = groups.back();
      const Item& f = items[g.first];
      if (g.n < kMaxGroupHeads && it.seq == f.seq &&
          it.p0 == f.p0 && it.p1 == f.p1 && it.g0 == f.g0 && it.g1 == f.g1) {
        ++g.n;
        g.cost += it.cost;
        continue;
      }
    }
    groups.push_back({i, 1, it.cost});
  }
  if (!grouping_on() || (static_cast<int64_t>(groups.size()) < at::get_num_threads() &&
                         static_cast<int64_t>(groups.size()) < n)) {
    groups.clear();
    for (int64_t i = 0; i < n; ++i) groups.push_back({i, 1, items[i].cost});
  }
  return groups;
}

// Bundles of groups whose sequences start with the same slot (see attend_shared): only whole
// decode-like groups (every KV head, few rows, the whole query, no window, an unquantized
// pool, at least two full blocks before the query). Tasks index the reordered groups.
std::vector<Task> bundle_groups(const Problem& P, const std::vector<Item>& items, std::vector<Group>& groups,
                                bool quant) {
  std::vector<std::pair<int64_t, int64_t>> keyed;  // (first slot, group)
  for (int64_t i = 0; i < static_cast<int64_t>(groups.size()); ++i) {
    const Group& g = groups[i];
    const Item& it = items[g.first];
    const SeqInfo& sq = P.seqs[it.seq];
    if (!quant && P.window == 0 && g.n == P.KV && (it.p1 - it.p0) * (it.g1 - it.g0) <= kFewRows && it.p0 == 0 &&
        it.p1 == sq.q_len && it.g0 == 0 && it.g1 == P.G && sq.kv_len - sq.q_len + 1 >= 2 * kBlockK)
      keyed.emplace_back(P.slots[sq.kv_start], i);
  }
  return bundle_by_first_slot(groups, std::move(keyed), kMaxBundle);
}

template <typename KT, bool B>
void go(const Problem& P, const std::vector<Item>& items) {
  std::vector<Group> groups = group_items(items);
  const std::vector<Task> tasks = bundle_groups(P, items, groups, std::is_same_v<KT, uint8_t> || !grouping_on());
  auto run = [&](auto nvd) {
    constexpr int V = decltype(nvd)::value;
    run_items(tasks, [&](const Task& t) {
      if (t.n > 1)
        attend_shared<KT, B, V>(P, items, groups.data() + t.first, t.n);
      else
        attend_avx512<KT, B, V>(P, items.data() + groups[t.first].first, groups[t.first].n);
    });
  };
  switch (P.D) {
    case 16: run(std::integral_constant<int, 1>{}); break;
    case 32: run(std::integral_constant<int, 2>{}); break;
    case 64: run(std::integral_constant<int, 4>{}); break;
    case 128: run(std::integral_constant<int, 8>{}); break;
    default: run(std::integral_constant<int, 16>{}); break;
  }
}

}  // namespace

bool run_avx512(const Problem& P, const std::vector<Item>& items, Store store, bool bf16_mode) {
  if (!avx512_head_dim(P.D)) return false;
  if (bf16_mode) {
#if RS_AVX512_BF16
    if (store != Store::kBf16) return false;
    go<uint16_t, true>(P, items);
    return true;
#else
    return false;
#endif
  }
  switch (store) {
    case Store::kBf16: go<uint16_t, false>(P, items); break;
    case Store::kQuant: go<uint8_t, false>(P, items); break;
    default: go<float, false>(P, items); break;
  }
  return true;
}
#else
bool run_avx512(const Problem&, const std::vector<Item>&, Store, bool) { return false; }
#endif  // RS_AVX512

}  // namespace attn
}  // namespace radixserve
