// Linear layers on quantized weights (quant.h: GGUF's blocks repacked into panels), exact to
// the dense bfloat16 model of the same GGUF.
//
// Why: a decode step reads every weight once, so its speed is the weights' bytes; GGUF's 4-bit
// blocks are a quarter of bfloat16's. The values each block stands for are what gguf-py's
// dequantization computes, rounded to bfloat16 (the dense model's weights): every path here
// expands a block to exactly those bfloat16 values and runs the dense model's arithmetic on
// them — the bfloat16 dot products of gemm_dot.cpp (one fixed chain per output element), or
// the float32 chains of gemm.cpp for an lm_head packed for them — so a quantized model gives
// the same bits as the dense one, and stays batch-invariant as it is.
//
// How a call runs: each thread takes a run of panels. A call of a few rows (decode, at most 8)
// streams each panel from memory once and expands it in registers, k pair by k pair, into the
// operand its arithmetic takes (vdpbf16ps's interleaved bf16 pair; the even- and odd-k
// weights as float32 for the emulation and the float32 chains), each output element
// accumulated in the dense tiles' order. A call of many rows (prefill) expands a chunk of
// panels into scratch of the thread in the dense packed layout (for the layers: pairs
// interleaved; for the lm_head: k-major), sized to stay in L2, and the dense tiles run over
// it: its many rows amortise the expansion. The portable level expands into scratch always.
//
// A weight is a "blob" (uint8): a 64-byte header (magic "RSQW", version, N, K, the number of
// segments), a 32-byte entry per segment (format, first output column, columns, byte offset
// of its panels) and the segments' panels. A fused weight whose parts came in different
// formats (Gemma 3's q/k in Q5_0 beside v in Q8_0) is one blob of several segments.
#include "common.h"
#include "gemm_dot.h"
#include "quant.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace radixserve {

using namespace quant;

namespace quant {

Blob parse_blob(const at::Tensor& blob) {
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.dim() == 1 && blob.is_contiguous() && blob.device().is_cpu(),
              "a quantized weight must be a contiguous 1-D uint8 CPU tensor");
  const int64_t bytes = blob.numel();
  const uint8_t* b = blob.data_ptr<uint8_t>();
  TORCH_CHECK(bytes >= kBlobHeader && load_u32(b) == kBlobMagic &&
                  (load_u32(b + 4) == kBlobExpand || load_u32(b + 4) == kBlobIntDot || load_u32(b + 4) == kBlobCodes),
              "not a quantized weight (bad header)");
  Blob q;
  q.base = b;
  q.version = load_u32(b + 4);
  std::memcpy(&q.N, b + 8, 8);
  std::memcpy(&q.K, b + 16, 8);
  int32_t nseg;
  std::memcpy(&nseg, b + 24, 4);
  TORCH_CHECK(q.N > 0 && q.K > 0 && nseg > 0 && kBlobHeader + nseg * kSegEntry <= bytes,
              "quantized weight header out of range");
  int64_t next = 0;
  for (int32_t i = 0; i < nseg; ++i) {
    const uint8_t* e = b + kBlobHeader + i * kSegEntry;
    Segment s;
    std::memcpy(&s.fmt, e, 4);
    std::memcpy(&s.n0, e + 8, 8);
    std::memcpy(&s.n, e + 16, 8);
    std::memcpy(&s.offset, e + 24, 8);
    TORCH_CHECK(q.version == kBlobExpand ? known(s.fmt) : int_dot_format(s.fmt),
                "quantized weight: unknown format ", s.fmt, " for layout ", q.version);
    TORCH_CHECK(s.n0 == next && s.n > 0 && s.offset >= kBlobHeader + nseg * kSegEntry &&
                    s.offset + s.panels() * q.panel_bytes_of(s) <= bytes,
                "quantized weight: segment ", i, " out of range");
    next = s.n0 + s.n;
    q.segs.push_back(s);
  }
  TORCH_CHECK(next == q.N, "quantized weight: segments do not cover its ", q.N, " columns");
  return q;
}

}  // namespace quant

namespace {

constexpr int64_t kScratchBytes = 256 * 1024;  // a chunk of expanded panels: half a typical L2
constexpr int64_t kMinChunkPanels = 8;         // at least the panels of the dense tiles' widest tile

// ---------------------------------------------------------------- expansion (portable)
// Pairs [j0, j1) of panel `pan` in the dot layout: dst[(j - j0) * 32 + v], v = 2 c + e.
template <int32_t F>
void expand_dot(const uint8_t* pan, int64_t /*K*/, int64_t j0, int64_t j1, uint16_t* dst) {
  const uint8_t* hdr = pan;
  const uint8_t* groups0 = pan + header_bytes(F);
  float s[2][32], m[32];
  for (int64_t g = j0 / kGroupPairs; g * kGroupPairs < j1; ++g) {
    const uint8_t* grp = groups0 + g * group_bytes(F);
    group_scales<F>(grp, hdr, s, m);
    const int64_t a = std::max(j0, g * kGroupPairs), e = std::min(j1, (g + 1) * kGroupPairs);
    for (int64_t jj = a; jj < e; ++jj) {
      const int64_t j = jj - g * kGroupPairs;
      uint8_t q[32];
      pair_codes<F>(grp, j, q);
      const float* sj = s[j >= kGroupPairs / 2 ? 1 : 0];
      uint16_t* d = dst + (jj - j0) * 32;
      for (int v = 0; v < 32; ++v) d[v] = f32_to_bf16(value<F>(q[v], sj[v], m[v]));
    }
  }
}

// The same pairs in gemm.cpp's k-major layout: dst[(k - 2 j0) * 16 + c].
template <int32_t F>
void expand_kmajor(const uint8_t* pan, int64_t K, int64_t j0, int64_t j1, uint16_t* dst) {
  uint16_t line[32 * kGroupPairs];
  for (int64_t a = j0; a < j1; a += kGroupPairs) {
    const int64_t e = std::min(j1, a + kGroupPairs);
    expand_dot<F>(pan, K, a, e, line);
    for (int64_t j = a; j < e; ++j) {
      const uint16_t* l = line + (j - a) * 32;
      uint16_t* d0 = dst + (2 * (j - j0)) * kNR;
      uint16_t* d1 = d0 + kNR;
      const bool odd_k = 2 * j + 1 < K;
      for (int c = 0; c < kNR; ++c) {
        d0[c] = l[2 * c];
        if (odd_k) d1[c] = l[2 * c + 1];
      }
    }
  }
}

// Column c of a panel (one row of the weight) expanded: out[k] for k < K, bf16.
template <int32_t F>
void expand_column(const uint8_t* pan, int64_t K, int c, uint16_t* out) {
  const uint8_t* groups0 = pan + header_bytes(F);
  float s[2][32], m[32];
  for (int64_t g = 0; g * kGroupK < K; ++g) {
    const uint8_t* grp = groups0 + g * group_bytes(F);
    group_scales<F>(grp, pan, s, m);
    const uint8_t* low = grp + scale_bytes(F);
    const uint8_t* high = low + low_plane_bytes(F);
    for (int64_t kk = 0; kk < kGroupK && g * kGroupK + kk < K; ++kk) {
      const int64_t j = kk / 2;
      const int v = 2 * c + static_cast<int>(kk & 1);
      uint32_t q;
      if constexpr (F == kQ8_0 || F == kI8C) {
        q = low[32 * j + v];
      } else {
        q = (low[16 * j + (v & 15)] >> (4 * (v >> 4))) & 15u;
        if constexpr (F == kQ5_0 || F == kQ5_1 || F == kQ5_K) q |= ((load_u32(high + 4 * j) >> v) & 1u) << 4;
        if constexpr (F == kQ6_K) q |= static_cast<uint32_t>((load_u64(high + 8 * j) >> (2 * v)) & 3u) << 4;
      }
      out[g * kGroupK + kk] = f32_to_bf16(value<F>(q, s[j >= kGroupPairs / 2 ? 1 : 0][v], m[v]));
    }
  }
}

using ColumnFn = void (*)(const uint8_t*, int64_t, int, uint16_t*);
ColumnFn column_fn(int32_t f) {
  switch (f) {
    case kQ8_0: return &expand_column<kQ8_0>;
    case kQ4_0: return &expand_column<kQ4_0>;
    case kQ4_1: return &expand_column<kQ4_1>;
    case kQ5_0: return &expand_column<kQ5_0>;
    case kQ5_1: return &expand_column<kQ5_1>;
    case kQ4_K: return &expand_column<kQ4_K>;
    case kQ5_K: return &expand_column<kQ5_K>;
    case kQ6_K: return &expand_column<kQ6_K>;
    default: return &expand_column<kI8C>;
  }
}

using ExpandFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, uint16_t*);

template <template <int32_t> class Pick>
ExpandFn by_format(int32_t f) {
  switch (f) {
    case kQ8_0: return Pick<kQ8_0>::fn;
    case kQ4_0: return Pick<kQ4_0>::fn;
    case kQ4_1: return Pick<kQ4_1>::fn;
    case kQ5_0: return Pick<kQ5_0>::fn;
    case kQ5_1: return Pick<kQ5_1>::fn;
    case kQ4_K: return Pick<kQ4_K>::fn;
    case kQ5_K: return Pick<kQ5_K>::fn;
    case kQ6_K: return Pick<kQ6_K>::fn;
    default: return Pick<kI8C>::fn;
  }
}
template <int32_t F>
struct PickDot {
  static constexpr ExpandFn fn = &expand_dot<F>;
};
template <int32_t F>
struct PickKmajor {
  static constexpr ExpandFn fn = &expand_kmajor<F>;
};

uint16_t* scratch(int64_t n) {
  static thread_local std::vector<uint16_t> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// Panels a chunk of expanded scratch holds (prefill, the portable level): what fits kScratchBytes.
int64_t chunk_panels(int64_t panel_values) {
  return std::max<int64_t>(kMinChunkPanels, kScratchBytes / (2 * panel_values));
}

inline void* column(void* out, bool bf16, int64_t n0) {
  return static_cast<char*>(out) + n0 * (bf16 ? 2 : 4);
}

// ---------------------------------------------------------------- repacking
// One GGUF block (of row n, starting at k = kb) decoded: its raw codes q[0..bk) and, per 32-k
// group, the two scale words to store (fp16 bits or float32, see scale_bytes).
struct Decoded {
  uint8_t q[256];
  uint32_t sa[8][2];  // per group: d (or S, or S0), m (or M, or S1)
};

inline void q4_k_scale_min(const uint8_t* sc12, int s, uint8_t& sc, uint8_t& mn) {
  if (s < 4) {
    sc = sc12[s] & 63u;
    mn = sc12[4 + s] & 63u;
  } else {
    sc = (sc12[8 + s - 4] & 15u) | ((sc12[s - 4] >> 2) & 0x30u);
    mn = (sc12[8 + s - 4] >> 4) | ((sc12[4 + s - 4] >> 2) & 0x30u);
  }
}

inline uint32_t f32_word(float v) { return f32_to_bits(v); }

int64_t block_k(int32_t f) { return f == kQ4_K || f == kQ5_K || f == kQ6_K ? 256 : 32; }
int64_t block_bytes(int32_t f) {
  switch (f) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

void decode_block(int32_t f, const uint8_t* b, Decoded& d) {
  auto nib = [](const uint8_t* qs, int k) -> uint8_t { return k < 16 ? (qs[k] & 15u) : (qs[k - 16] >> 4); };
  switch (f) {
    case kQ8_0:
      d.sa[0][0] = load_u16(b);
      for (int k = 0; k < 32; ++k) d.q[k] = b[2 + k];
      break;
    case kQ4_0:
      d.sa[0][0] = load_u16(b);
      for (int k = 0; k < 32; ++k) d.q[k] = nib(b + 2, k);
      break;
    case kQ4_1:
      d.sa[0][0] = load_u16(b);
      d.sa[0][1] = load_u16(b + 2);
      for (int k = 0; k < 32; ++k) d.q[k] = nib(b + 4, k);
      break;
    case kQ5_0: {
      d.sa[0][0] = load_u16(b);
      const uint32_t qh = load_u32(b + 2);
      for (int k = 0; k < 32; ++k) d.q[k] = nib(b + 6, k) | static_cast<uint8_t>(((qh >> k) & 1u) << 4);
      break;
    }
    case kQ5_1: {
      d.sa[0][0] = load_u16(b);
      d.sa[0][1] = load_u16(b + 2);
      const uint32_t qh = load_u32(b + 4);
      for (int k = 0; k < 32; ++k) d.q[k] = nib(b + 8, k) | static_cast<uint8_t>(((qh >> k) & 1u) << 4);
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float dd = f16_to_f32(load_u16(b)), dmin = f16_to_f32(load_u16(b + 2));
      const uint8_t* sc12 = b + 4;
      const uint8_t* qh = f == kQ5_K ? b + 16 : nullptr;
      const uint8_t* qs = b + (f == kQ5_K ? 48 : 16);
      for (int s = 0; s < 8; ++s) {
        uint8_t sc, mn;
        q4_k_scale_min(sc12, s, sc, mn);
        d.sa[s][0] = f32_word(dd * static_cast<float>(sc));
        d.sa[s][1] = f32_word(dmin * static_cast<float>(mn));
        for (int i = 0; i < 32; ++i) {
          uint8_t v = (qs[32 * (s / 2) + i] >> (4 * (s % 2))) & 15u;
          if (qh != nullptr) v |= static_cast<uint8_t>(((qh[i] >> s) & 1u) << 4);
          d.q[32 * s + i] = v;
        }
      }
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float dd = f16_to_f32(load_u16(b + 208));
      for (int t = 0; t < 256; ++t) {
        const int h = t / 128, s = (t % 128) / 64, i = t % 64, s2 = (t % 128) / 32, i2 = t % 32;
        const uint8_t lo = (ql[64 * h + i] >> (4 * s)) & 15u;
        const uint8_t hi = (qh[32 * h + i2] >> (2 * s2)) & 3u;
        d.q[t] = lo | static_cast<uint8_t>(hi << 4);
      }
      for (int g = 0; g < 8; ++g) {
        d.sa[g][0] = f32_word(dd * static_cast<float>(sc[2 * g]));
        d.sa[g][1] = f32_word(dd * static_cast<float>(sc[2 * g + 1]));
      }
      break;
    }
    default:
      TORCH_CHECK(false, "no GGUF block format ", f);
  }
}

// A weight with a NaN or infinite scale is refused: every expanded value is then finite, which
// the vector paths' rounding (no NaN case) and vcvtne2ps2bf16 (its own NaN payloads) rely on.
void check_scales(int32_t f, const Decoded& d, int64_t row, int64_t blk) {
  const int64_t groups_per_block = block_k(f) / kGroupK;
  const bool half = scale_bytes(f) != 8 * kNR;  // fp16 words
  const int words = (f == kQ4_1 || f == kQ5_1 || !half) ? 2 : 1;
  for (int64_t g = 0; g < groups_per_block; ++g)
    for (int w = 0; w < words; ++w) {
      const float v = half ? f16_to_f32(static_cast<uint16_t>(d.sa[g][w])) : bits_to_f32(d.sa[g][w]);
      TORCH_CHECK(std::isfinite(v), "quantized weight: row ", row, ", block ", blk, " has a non-finite scale");
    }
}

// Stores column c's raw code q at k (within group `grp`) and its group's scale words.
inline void put_code(int32_t f, uint8_t* grp, int c, int64_t kk, uint8_t q) {
  const int64_t j = kk / 2;
  const int v = 2 * c + static_cast<int>(kk & 1);
  uint8_t* low = grp + scale_bytes(f);
  if (code_bits(f) == 8) {
    low[32 * j + v] = q;
    return;
  }
  low[16 * j + (v & 15)] |= static_cast<uint8_t>((q & 15u) << (4 * (v >> 4)));
  uint8_t* high = low + low_plane_bytes(f);
  if (code_bits(f) == 5) {
    uint32_t h = load_u32(high + 4 * j);
    h |= static_cast<uint32_t>((q >> 4) & 1u) << v;
    std::memcpy(high + 4 * j, &h, 4);
  } else if (code_bits(f) == 6) {
    uint64_t h = load_u64(high + 8 * j);
    h |= static_cast<uint64_t>((q >> 4) & 3u) << (2 * v);
    std::memcpy(high + 8 * j, &h, 8);
  }
}

inline void put_scales(int32_t f, uint8_t* grp, int c, const uint32_t sa[2]) {
  if (scale_bytes(f) == 2 * kNR) {
    const uint16_t d = static_cast<uint16_t>(sa[0]);
    std::memcpy(grp + 2 * c, &d, 2);
  } else if (scale_bytes(f) == 4 * kNR) {
    const uint16_t d = static_cast<uint16_t>(sa[0]), m = static_cast<uint16_t>(sa[1]);
    std::memcpy(grp + 2 * c, &d, 2);
    std::memcpy(grp + 2 * kNR + 2 * c, &m, 2);
  } else {
    std::memcpy(grp + 4 * c, &sa[0], 4);
    std::memcpy(grp + 4 * kNR + 4 * c, &sa[1], 4);
  }
}

// ---------------------------------------------------------------- vector paths
// A call's rows and outputs as the vector tiles read them. `arith`: the dot products, native
// (xh pairs) or emulated (xf, chain order, under FTZ/DAZ), or the float32 chains (x as given).
struct QCall {
  const DotRows* rows;   // dot products
  const float* x;        // float32 chains: [M, K] rows, stride ldx
  int64_t ldx;
  int64_t M, K, K2;
  const uint8_t* seg;    // the segment's panels
  int64_t panel_bytes;
  const float* bias;     // [n] of the segment, or nullptr
  void* out;             // column 0 of the segment
  int64_t ldo;
  bool out_bf16;
  int64_t N;             // the segment's columns
};

// kF32Native: the float32 chains on a CPU with AVX512-BF16, whose conversion instruction
// rounds the expanded values (the same bits as the integer rounding of the other paths).
enum QArith : int { kNativeDot = 0, kEmulatedDot = 1, kF32Chain = 2, kF32Native = 3 };

// One row's 16 finished columns at panel p, stored in the output dtype. The tiles add the bias
// before, with a vector add: under the dot products' FTZ/DAZ it flushes as store_row of
// gemm_dot.cpp does by hand, and it is plain for the float32 chains, as in gemm.cpp.
inline void store16(const QCall& c, int64_t m, int64_t p, const float* acc) {
  const int64_t n0 = p * kNR, cols = std::min<int64_t>(kNR, c.N - n0);
  for (int64_t i = 0; i < cols; ++i) {
    const float y = acc[i];
    if (c.out_bf16)
      static_cast<uint16_t*>(c.out)[m * c.ldo + n0 + i] = f32_to_bf16(y);
    else
      static_cast<float*>(c.out)[m * c.ldo + n0 + i] = y;
  }
}

#if RS_AVX2 && defined(__F16C__)
#define RS_QUANT_AVX2 1
namespace v2 {

// Scales of one group as per-value vectors: quarter i covers values 8i .. 8i+7 (columns 4i ..
// 4i+3, each twice); s[1] is Q6_K's second 16-k half (equal to s[0] elsewhere), m the offsets.
struct Scales {
  __m256 s[2][4];
  __m256 m[4];
};

inline void quarters(__m256 d0, __m256 d1, __m256* out) {
  const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  out[0] = _mm256_permutevar8x32_ps(d0, lo);
  out[1] = _mm256_permutevar8x32_ps(d0, hi);
  out[2] = _mm256_permutevar8x32_ps(d1, lo);
  out[3] = _mm256_permutevar8x32_ps(d1, hi);
}
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 f32x8(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }

template <int32_t F>
inline void load_scales(const uint8_t* grp, const uint8_t* hdr, Scales& sc) {
  if constexpr (F == kI8C) {
    quarters(f32x8(hdr), f32x8(hdr + 32), sc.s[0]);
  } else if constexpr (F == kQ8_0 || F == kQ4_0 || F == kQ5_0) {
    quarters(f16x8(grp), f16x8(grp + 16), sc.s[0]);
  } else if constexpr (F == kQ4_1 || F == kQ5_1) {
    quarters(f16x8(grp), f16x8(grp + 16), sc.s[0]);
    quarters(f16x8(grp + 32), f16x8(grp + 48), sc.m);
  } else if constexpr (F == kQ6_K) {
    quarters(f32x8(grp), f32x8(grp + 32), sc.s[0]);
    quarters(f32x8(grp + 64), f32x8(grp + 96), sc.s[1]);
  } else {
    quarters(f32x8(grp), f32x8(grp + 32), sc.s[0]);
    quarters(f32x8(grp + 64), f32x8(grp + 96), sc.m);
  }
  if constexpr (F != kQ6_K)
    for (int i = 0; i < 4; ++i) sc.s[1][i] = sc.s[0][i];
}

// Pair j of a group expanded: v[i] = values 8i .. 8i+7, exact float32 (value<F> of quant.h).
template <int32_t F>
inline void expand(const uint8_t* grp, int64_t j, const Scales& sc, __m256 v[4]) {
  const uint8_t* low = grp + scale_bytes(F);
  __m256i q[4];
  if constexpr (F == kQ8_0 || F == kI8C) {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(low + 32 * j + 8 * i)));
  } else {
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(low + 16 * j)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(low + 16 * j + 8)));
    const __m256i m15 = _mm256_set1_epi32(15);
    q[0] = _mm256_and_si256(b0, m15);
    q[1] = _mm256_and_si256(b1, m15);
    q[2] = _mm256_srli_epi32(b0, 4);
    q[3] = _mm256_srli_epi32(b1, 4);
    const uint8_t* high = low + low_plane_bytes(F);
    if constexpr (F == kQ5_0 || F == kQ5_1 || F == kQ5_K) {
      const __m256i h = _mm256_set1_epi32(static_cast<int>(load_u32(high + 4 * j)));
      const __m256i one = _mm256_set1_epi32(1);
      for (int i = 0; i < 4; ++i) {
        const __m256i sh = _mm256_setr_epi32(8 * i, 8 * i + 1, 8 * i + 2, 8 * i + 3, 8 * i + 4, 8 * i + 5, 8 * i + 6,
                                             8 * i + 7);
        q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, sh), one), 4));
      }
    } else if constexpr (F == kQ6_K) {
      const uint64_t h64 = load_u64(high + 8 * j);
      const __m256i hl = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(h64)));
      const __m256i hh = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(h64 >> 32)));
      const __m256i s0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), s1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
      const __m256i three = _mm256_set1_epi32(3);
      const __m256i hs[4] = {_mm256_srlv_epi32(hl, s0), _mm256_srlv_epi32(hl, s1), _mm256_srlv_epi32(hh, s0),
                             _mm256_srlv_epi32(hh, s1)};
      for (int i = 0; i < 4; ++i) q[i] = _mm256_or_si256(q[i], _mm256_slli_epi32(_mm256_and_si256(hs[i], three), 4));
    }
  }
  const __m256* s = sc.s[(F == kQ6_K && j >= kGroupPairs / 2) ? 1 : 0];
  for (int i = 0; i < 4; ++i) {
    const __m256 qf = _mm256_cvtepi32_ps(q[i]);
    if constexpr (F == kQ8_0 || F == kI8C) {
      v[i] = _mm256_mul_ps(qf, s[i]);
    } else if constexpr (F == kQ4_0) {
      v[i] = _mm256_mul_ps(s[i], _mm256_sub_ps(qf, _mm256_set1_ps(8.f)));
    } else if constexpr (F == kQ5_0) {
      v[i] = _mm256_mul_ps(s[i], _mm256_sub_ps(qf, _mm256_set1_ps(16.f)));
    } else if constexpr (F == kQ6_K) {
      v[i] = _mm256_mul_ps(s[i], _mm256_sub_ps(qf, _mm256_set1_ps(32.f)));
    } else if constexpr (F == kQ4_1 || F == kQ5_1) {
      v[i] = _mm256_fmadd_ps(s[i], qf, sc.m[i]);  // the product is exact: one rounding, as d * q + m
    } else {
      v[i] = _mm256_fmsub_ps(s[i], qf, sc.m[i]);  // exact product: as (d sc) q - dmin m
    }
  }
}

// f32_to_bf16 of common.h on 8 finite lanes, kept as float32 (the low 16 bits cleared).
inline __m256 round_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The even-k and odd-k weights of 8 columns from two quarters (values of 4 columns each),
// columns in the order 0 1 4 5 2 3 6 7 (fixed by `unpermute`).
inline void split(__m256 a, __m256 b, __m256& even, __m256& odd) {
  even = _mm256_shuffle_ps(a, b, 0x88);
  odd = _mm256_shuffle_ps(a, b, 0xdd);
}
inline __m256 unpermute(__m256 v) {
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xd8));
}

// Rows [m0, m0 + R) x panels [p, p + NP) of one segment, expanded in registers pair by pair.
template <int32_t F, int R, int NP, int A>
void tile(const QCall& c, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 4, "at most 8 accumulators");
  __m256 acc[R][NP][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
  const int64_t G = groups(c.K);
  for (int64_t g = 0; g < G; ++g) {
    Scales sc[NP];
    const uint8_t* grp[NP];
    for (int i = 0; i < NP; ++i) {
      const uint8_t* pan = c.seg + (p + i) * c.panel_bytes;
      grp[i] = pan + header_bytes(F) + g * group_bytes(F);
      load_scales<F>(grp[i], pan, sc[i]);
    }
    const int64_t npairs = std::min<int64_t>(kGroupPairs, c.K2 - g * kGroupPairs);
    for (int64_t j = 0; j < npairs; ++j) {
      const int64_t jj = g * kGroupPairs + j;
      for (int i = 0; i < NP; ++i) {
        __m256 v[4];
        expand<F>(grp[i], j, sc[i], v);
        for (int t = 0; t < 4; ++t) v[t] = round_bf16(v[t]);
        __m256 we0, wo0, we1, wo1;
        split(v[0], v[1], we0, wo0);
        split(v[2], v[3], we1, wo1);
        for (int r = 0; r < R; ++r) {
          if constexpr (A == kF32Chain) {
            const float* x = c.x + (m0 + r) * c.ldx + 2 * jj;
            const __m256 xe = _mm256_broadcast_ss(x);
            acc[r][i][0] = _mm256_fmadd_ps(xe, we0, acc[r][i][0]);
            acc[r][i][1] = _mm256_fmadd_ps(xe, we1, acc[r][i][1]);
            if (2 * jj + 1 < c.K) {
              const __m256 xo = _mm256_broadcast_ss(x + 1);
              acc[r][i][0] = _mm256_fmadd_ps(xo, wo0, acc[r][i][0]);
              acc[r][i][1] = _mm256_fmadd_ps(xo, wo1, acc[r][i][1]);
            }
          } else {  // chain order: the odd product, then the even one
            const float* x = c.rows->xf + (m0 + r) * 2 * c.K2 + 2 * jj;
            const __m256 xo = _mm256_broadcast_ss(x), xe = _mm256_broadcast_ss(x + 1);
            acc[r][i][0] = _mm256_fmadd_ps(xo, wo0, acc[r][i][0]);
            acc[r][i][1] = _mm256_fmadd_ps(xo, wo1, acc[r][i][1]);
            acc[r][i][0] = _mm256_fmadd_ps(xe, we0, acc[r][i][0]);
            acc[r][i][1] = _mm256_fmadd_ps(xe, we1, acc[r][i][1]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) {
      __m256 lo = unpermute(acc[r][i][0]), hi = unpermute(acc[r][i][1]);
      const int64_t n0 = (p + i) * kNR;
      if (c.bias != nullptr && n0 + kNR <= c.N) {
        lo = _mm256_add_ps(lo, _mm256_loadu_ps(c.bias + n0));
        hi = _mm256_add_ps(hi, _mm256_loadu_ps(c.bias + n0 + 8));
      } else if (c.bias != nullptr) {
        alignas(32) float b[kNR] = {};
        std::memcpy(b, c.bias + n0, sizeof(float) * (c.N - n0));
        lo = _mm256_add_ps(lo, _mm256_load_ps(b));
        hi = _mm256_add_ps(hi, _mm256_load_ps(b + 8));
      }
      alignas(32) float buf[kNR];
      _mm256_store_ps(buf, lo);
      _mm256_store_ps(buf + 8, hi);
      store16(c, m0 + r, p + i, buf);
    }
}

// Expanded panel p of a segment into the dense layouts (see expand_dot / expand_kmajor).
template <int32_t F>
void expand_panel(const uint8_t* pan, int64_t K, bool kmajor, uint16_t* dst) {
  const int64_t K2 = (K + 1) / 2, G = groups(K);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* grp = pan + header_bytes(F) + g * group_bytes(F);
    Scales sc;
    load_scales<F>(grp, pan, sc);
    const int64_t npairs = std::min<int64_t>(kGroupPairs, K2 - g * kGroupPairs);
    for (int64_t j = 0; j < npairs; ++j) {
      const int64_t jj = g * kGroupPairs + j;
      __m256 v[4];
      expand<F>(grp, j, sc, v);
      __m256i h[4];
      if (kmajor) {
        __m256 a, b, e, o;
        split(v[0], v[1], a, b);
        split(v[2], v[3], e, o);
        v[0] = unpermute(a);
        v[1] = unpermute(e);
        v[2] = unpermute(b);
        v[3] = unpermute(o);
      }
      for (int t = 0; t < 4; ++t) h[t] = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v[t])), 16);
      const __m256i lo = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xd8);
      const __m256i hi = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[2], h[3]), 0xd8);
      if (kmajor) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * jj * kNR), lo);
        if (2 * jj + 1 < K) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (2 * jj + 1) * kNR), hi);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + jj * 32), lo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + jj * 32 + 16), hi);
      }
    }
  }
}

}  // namespace v2
#else
#define RS_QUANT_AVX2 0
#endif

#if RS_QUANT_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define RS_QUANT_AVX512 1
namespace v5 {

// Scales of one group as per-value vectors: lo covers values 0..15 (columns 0..7, each twice),
// hi values 16..31; s[1] is Q6_K's second 16-k half; m the offsets.
struct Scales {
  __m512 s[2][2];
  __m512 m[2];
};

inline void halves(__m512 d, __m512* out) {
  const __m512i lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i hi = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  out[0] = _mm512_permutexvar_ps(lo, d);
  out[1] = _mm512_permutexvar_ps(hi, d);
}
inline __m512 f16x16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 f32x16(const uint8_t* p) { return _mm512_loadu_ps(p); }

template <int32_t F>
inline void load_scales(const uint8_t* grp, const uint8_t* hdr, Scales& sc) {
  if constexpr (F == kI8C) {
    halves(f32x16(hdr), sc.s[0]);
  } else if constexpr (F == kQ8_0 || F == kQ4_0 || F == kQ5_0) {
    halves(f16x16(grp), sc.s[0]);
  } else if constexpr (F == kQ4_1 || F == kQ5_1) {
    halves(f16x16(grp), sc.s[0]);
    halves(f16x16(grp + 32), sc.m);
  } else if constexpr (F == kQ6_K) {
    halves(f32x16(grp), sc.s[0]);
    halves(f32x16(grp + 64), sc.s[1]);
  } else {
    halves(f32x16(grp), sc.s[0]);
    halves(f32x16(grp + 64), sc.m);
  }
  if constexpr (F != kQ6_K) sc.s[1][0] = sc.s[0][0], sc.s[1][1] = sc.s[0][1];
}

// The float32 value of every 4-bit code (minus the format's offset), by code: a 4-bit code
// becomes its float with one permute (vpermps reads an index's low 4 bits), no mask, no
// conversion; a 5-bit one with two (the high bit picks the second table).
template <int32_t F>
inline __m512 code_table(int half) {
  const float off = F == kQ4_0 ? 8.f : F == kQ5_0 ? 16.f : 0.f;
  const float b = static_cast<float>(16 * half) - off;
  return _mm512_setr_ps(b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6, b + 7, b + 8, b + 9, b + 10, b + 11, b + 12,
                        b + 13, b + 14, b + 15);
}

// Pair j of a group expanded: lo = values 0..15, hi = values 16..31, exact float32.
template <int32_t F>
inline void expand(const uint8_t* grp, int64_t j, const Scales& sc, __m512& lo, __m512& hi) {
  const uint8_t* low = grp + scale_bytes(F);
  __m512 f0, f1;  // the codes as floats, the format's offset subtracted (q - 8, q - 16, q - 32)
  if constexpr (F == kQ8_0 || F == kI8C) {
    f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 32 * j))));
    f1 = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 32 * j + 16))));
  } else if constexpr (F == kQ6_K) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 16 * j)));
    __m512i q0 = _mm512_and_si512(b, _mm512_set1_epi32(15)), q1 = _mm512_srli_epi32(b, 4);
    const uint64_t h = load_u64(low + low_plane_bytes(F) + 8 * j);
    const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i three = _mm512_set1_epi32(3);
    const __m512i h0 = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(h))), sh);
    const __m512i h1 = _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(h >> 32))), sh);
    q0 = _mm512_or_si512(q0, _mm512_slli_epi32(_mm512_and_si512(h0, three), 4));
    q1 = _mm512_or_si512(q1, _mm512_slli_epi32(_mm512_and_si512(h1, three), 4));
    const __m512 off = _mm512_set1_ps(32.f);
    f0 = _mm512_sub_ps(_mm512_cvtepi32_ps(q0), off);
    f1 = _mm512_sub_ps(_mm512_cvtepi32_ps(q1), off);
  } else {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 16 * j)));
    const __m512i b1 = _mm512_srli_epi32(b, 4);
    const __m512 t0 = code_table<F>(0);
    f0 = _mm512_permutexvar_ps(b, t0);
    f1 = _mm512_permutexvar_ps(b1, t0);
    if constexpr (F == kQ5_0 || F == kQ5_1 || F == kQ5_K) {
      const uint32_t h = load_u32(low + low_plane_bytes(F) + 4 * j);
      const __m512 t1 = code_table<F>(1);
      f0 = _mm512_mask_permutexvar_ps(f0, static_cast<__mmask16>(h), b, t1);
      f1 = _mm512_mask_permutexvar_ps(f1, static_cast<__mmask16>(h >> 16), b1, t1);
    }
  }
  const __m512* s = sc.s[(F == kQ6_K && j >= kGroupPairs / 2) ? 1 : 0];
  if constexpr (F == kQ8_0 || F == kI8C) {
    lo = _mm512_mul_ps(f0, s[0]);
    hi = _mm512_mul_ps(f1, s[1]);
  } else if constexpr (F == kQ4_0 || F == kQ5_0 || F == kQ6_K) {
    lo = _mm512_mul_ps(s[0], f0);
    hi = _mm512_mul_ps(s[1], f1);
  } else if constexpr (F == kQ4_1 || F == kQ5_1) {
    lo = _mm512_fmadd_ps(s[0], f0, sc.m[0]);  // exact product: as d * q + m
    hi = _mm512_fmadd_ps(s[1], f1, sc.m[1]);
  } else {
    lo = _mm512_fmsub_ps(s[0], f0, sc.m[0]);  // exact product: as (d sc) q - dmin m
    hi = _mm512_fmsub_ps(s[1], f1, sc.m[1]);
  }
}

inline __m512i round_bits(__m512 x) {  // f32_to_bf16 on 16 finite lanes, in the high halves
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
}
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_bits(x), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The even-k and odd-k weights of the 16 columns (bf16 values in float32) from lo and hi.
inline void split(__m512 lo, __m512 hi, __m512& even, __m512& odd) {
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 l = round_bf16(lo), h = round_bf16(hi);
  even = _mm512_permutex2var_ps(l, ie, h);
  odd = _mm512_permutex2var_ps(l, io, h);
}

#if defined(__AVX512BF16__)
#define RS_QUANT_NATIVE 1
// The pair's operand of vdpbf16ps: value v in bf16 word v (vcvtne2ps2bf16 rounds to nearest
// even as f32_to_bf16 does; no value is NaN or denormal).
inline __m512bh operand(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }
#else
#define RS_QUANT_NATIVE 0
#endif

inline __m512 epilogue(const QCall& c, int64_t n0, __m512 y) {
  if (c.bias == nullptr) return y;
  const int64_t cols = std::min<int64_t>(kNR, c.N - n0);
  return _mm512_add_ps(y, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1u), c.bias + n0));
}

template <int32_t F, int R, int NP, int A>
void tile(const QCall& c, int64_t m0, int64_t p) {
  static_assert(R >= 1 && NP >= 1 && R * NP <= 16, "at most 16 accumulators");
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) acc[r][i] = _mm512_setzero_ps();
  const int64_t G = groups(c.K);
  for (int64_t g = 0; g < G; ++g) {
    Scales sc[NP];
    const uint8_t* grp[NP];
    for (int i = 0; i < NP; ++i) {
      const uint8_t* pan = c.seg + (p + i) * c.panel_bytes;
      grp[i] = pan + header_bytes(F) + g * group_bytes(F);
      load_scales<F>(grp[i], pan, sc[i]);
      _mm_prefetch(reinterpret_cast<const char*>(grp[i] + 4 * group_bytes(F)), _MM_HINT_T0);
    }
    const int64_t npairs = std::min<int64_t>(kGroupPairs, c.K2 - g * kGroupPairs);
    for (int64_t j = 0; j < npairs; ++j) {
      const int64_t jj = g * kGroupPairs + j;
      if constexpr (A == kNativeDot) {
#if RS_QUANT_NATIVE
        __m512bh xb[R];
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, c.rows->xh + (m0 + r) * 2 * c.K2 + 2 * jj, 4);
          xb[r] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int i = 0; i < NP; ++i) {
          __m512 lo, hi;
          expand<F>(grp[i], j, sc[i], lo, hi);
          const __m512bh w = operand(lo, hi);
          for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], xb[r], w);
        }
#endif
      } else {
        for (int i = 0; i < NP; ++i) {
          __m512 lo, hi, we, wo;
          expand<F>(grp[i], j, sc[i], lo, hi);
          if constexpr (A == kF32Native) {
#if RS_QUANT_NATIVE
            const __m512i w = (__m512i)operand(lo, hi);  // word 2c: column c's even k, 2c + 1 its odd k
            we = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            wo = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#endif
          } else {
            split(lo, hi, we, wo);
          }
          for (int r = 0; r < R; ++r) {
            if constexpr (A == kF32Chain || A == kF32Native) {
              const float* x = c.x + (m0 + r) * c.ldx + 2 * jj;
              acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[0]), we, acc[r][i]);
              if (2 * jj + 1 < c.K) acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[1]), wo, acc[r][i]);
            } else {  // chain order: the odd product, then the even one
              const float* x = c.rows->xf + (m0 + r) * 2 * c.K2 + 2 * jj;
              acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[0]), wo, acc[r][i]);
              acc[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[1]), we, acc[r][i]);
            }
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NP; ++i) {
      alignas(64) float buf[kNR];
      _mm512_store_ps(buf, epilogue(c, (p + i) * kNR, acc[r][i]));
      store16(c, m0 + r, p + i, buf);
    }
}

template <int32_t F>
void expand_panel(const uint8_t* pan, int64_t K, bool kmajor, uint16_t* dst) {
  const int64_t K2 = (K + 1) / 2, G = groups(K);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* grp = pan + header_bytes(F) + g * group_bytes(F);
    Scales sc;
    load_scales<F>(grp, pan, sc);
    const int64_t npairs = std::min<int64_t>(kGroupPairs, K2 - g * kGroupPairs);
    for (int64_t j = 0; j < npairs; ++j) {
      const int64_t jj = g * kGroupPairs + j;
      __m512 lo, hi;
      expand<F>(grp, j, sc, lo, hi);
      if (kmajor) {
        __m512 we, wo;
        split(lo, hi, we, wo);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * jj * kNR),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(we), 16)));
        if (2 * jj + 1 < K)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (2 * jj + 1) * kNR),
                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(wo), 16)));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + jj * 32),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(lo), 16)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + jj * 32 + 16),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits(hi), 16)));
      }
    }
  }
}

}  // namespace v5
#else
#define RS_QUANT_AVX512 0
#define RS_QUANT_NATIVE 0
#endif

// ---------------------------------------------------------------- tiling
// Which tile runs r rows (1 .. kMaxTileRows of the path) over np panels: the tile tables by
// format. Every tile computes each element with the same chain, so how a call is cut (its
// row count, a thread's share of panels) changes the speed, never the bits.
using QTile = void (*)(const QCall&, int64_t, int64_t);

struct QPlan {
  int max_rows;                 // rows one tile takes (larger calls: several tiles a panel)
  const int* panels;            // panels a tile takes, by its rows (index r - 1)
  QTile (*tile)(int32_t f, int r, int np);
};

template <template <int32_t, int, int> class T, int R, int NP>
QTile tile_for(int32_t f) {
  switch (f) {
    case kQ8_0: return &T<kQ8_0, R, NP>::run;
    case kQ4_0: return &T<kQ4_0, R, NP>::run;
    case kQ4_1: return &T<kQ4_1, R, NP>::run;
    case kQ5_0: return &T<kQ5_0, R, NP>::run;
    case kQ5_1: return &T<kQ5_1, R, NP>::run;
    case kQ4_K: return &T<kQ4_K, R, NP>::run;
    case kQ5_K: return &T<kQ5_K, R, NP>::run;
    case kQ6_K: return &T<kQ6_K, R, NP>::run;
    default: return &T<kI8C, R, NP>::run;
  }
}

#if RS_QUANT_AVX2
template <int A>
struct V2 {
  template <int32_t F, int R, int NP>
  struct T {
    static void run(const QCall& c, int64_t m0, int64_t p) { v2::tile<F, R, NP, A>(c, m0, p); }
  };
  static constexpr int kPanels[4] = {2, 2, 1, 1};
  static QTile pick(int32_t f, int r, int np) {
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

#if RS_QUANT_AVX512
template <int A>
struct V5 {
  template <int32_t F, int R, int NP>
  struct T {
    static void run(const QCall& c, int64_t m0, int64_t p) { v5::tile<F, R, NP, A>(c, m0, p); }
  };
  static constexpr int kPanels[8] = {4, 4, 2, 2, 1, 1, 1, 1};
  static QTile pick(int32_t f, int r, int np) {
    if (np > 1) {
      switch (r) {
        case 1: return tile_for<T, 1, 4>(f);
        case 2: return tile_for<T, 2, 4>(f);
        case 3: return tile_for<T, 3, 2>(f);
        default: return tile_for<T, 4, 2>(f);
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

// The in-register plan for a call at level `isa` with arithmetic `a`, or nullptr (the
// portable path: expansion into scratch).
bool decode_plan(int64_t isa, int a, QPlan& plan) {
#if RS_QUANT_AVX512
  if (isa >= kIsaAvx512 && (a != kNativeDot || RS_QUANT_NATIVE)) {
    switch (a) {
      case kNativeDot: plan = {8, V5<kNativeDot>::kPanels, &V5<kNativeDot>::pick}; return true;
      case kEmulatedDot: plan = {8, V5<kEmulatedDot>::kPanels, &V5<kEmulatedDot>::pick}; return true;
      default:
        if (RS_QUANT_NATIVE) plan = {8, V5<kF32Native>::kPanels, &V5<kF32Native>::pick};
        else plan = {8, V5<kF32Chain>::kPanels, &V5<kF32Chain>::pick};
        return true;
    }
  }
#endif
#if RS_QUANT_AVX2
  if (isa >= kIsaAvx2 && a != kNativeDot) {
    if (a == kEmulatedDot) plan = {4, V2<kEmulatedDot>::kPanels, &V2<kEmulatedDot>::pick};
    else plan = {4, V2<kF32Chain>::kPanels, &V2<kF32Chain>::pick};
    return true;
  }
#endif
  (void)isa;
  (void)a;
  return false;
}

// Panels [p0, p1) of a call of at most a few tiles' rows: each tile's panels read once from
// memory and expanded in registers.
void run_decode(const QCall& c, const QPlan& plan, int32_t f, int64_t p0, int64_t p1) {
  for (int64_t m0 = 0; m0 < c.M; m0 += plan.max_rows) {
    const int r = static_cast<int>(std::min<int64_t>(plan.max_rows, c.M - m0));
    const int np = plan.panels[r - 1];
    const QTile wide = plan.tile(f, r, np), one = plan.tile(f, r, 1);
    int64_t p = p0;
    for (; p + np <= p1; p += np) wide(c, m0, p);
    for (; p < p1; ++p) one(c, m0, p);
  }
}

// The vectorised expansion of a panel into a dense layout for the path at `isa` (nullptr: the
// portable one).
using PanelFn = void (*)(const uint8_t*, int64_t, bool, uint16_t*);
template <int32_t F>
struct PickPanel2 {
#if RS_QUANT_AVX2
  static constexpr PanelFn fn = &v2::expand_panel<F>;
#else
  static constexpr PanelFn fn = nullptr;
#endif
};
template <int32_t F>
struct PickPanel5 {
#if RS_QUANT_AVX512
  static constexpr PanelFn fn = &v5::expand_panel<F>;
#else
  static constexpr PanelFn fn = nullptr;
#endif
};
template <template <int32_t> class Pick>
PanelFn panel_fn(int32_t f) {
  switch (f) {
    case kQ8_0: return Pick<kQ8_0>::fn;
    case kQ4_0: return Pick<kQ4_0>::fn;
    case kQ4_1: return Pick<kQ4_1>::fn;
    case kQ5_0: return Pick<kQ5_0>::fn;
    case kQ5_1: return Pick<kQ5_1>::fn;
    case kQ4_K: return Pick<kQ4_K>::fn;
    case kQ5_K: return Pick<kQ5_K>::fn;
    case kQ6_K: return Pick<kQ6_K>::fn;
    default: return Pick<kI8C>::fn;
  }
}
PanelFn vector_expander(int64_t isa, int32_t f) {
  if (isa >= kIsaAvx512 && RS_QUANT_AVX512) return panel_fn<PickPanel5>(f);
  if (isa >= kIsaAvx2 && RS_QUANT_AVX2) return panel_fn<PickPanel2>(f);
  return nullptr;
}

}  // namespace

int64_t quant_panel_bytes(int64_t fmt, int64_t K) {
  TORCH_CHECK(known(static_cast<int32_t>(fmt)), "unknown quantized format ", fmt);
  return panel_bytes(static_cast<int32_t>(fmt), K);
}

int64_t quant_block_bytes(int64_t fmt) { return block_bytes(static_cast<int32_t>(fmt)); }
int64_t quant_block_k(int64_t fmt) { return block_k(static_cast<int32_t>(fmt)); }

void pack_quant_kernel(const at::Tensor& rows, int64_t fmt_, int64_t K, at::Tensor& out) {
  const int32_t f = static_cast<int32_t>(fmt_);
  const int64_t n = rows.size(0), ld = rows.stride(0), bk = block_k(f), bb = block_bytes(f);
  const int64_t P = (n + kNR - 1) / kNR, pb = panel_bytes(f, K);
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t b0, int64_t e0) {
    Decoded d;
    for (int64_t p = b0; p < e0; ++p) {
      uint8_t* pan = dst + p * pb;
      std::memset(pan, 0, pb);
      for (int c = 0; c < kNR; ++c) {
        const int64_t r = p * kNR + c;
        if (r >= n) break;
        for (int64_t blk = 0; blk < K / bk; ++blk) {
          decode_block(f, src + r * ld + blk * bb, d);
          check_scales(f, d, r, blk);
          for (int64_t i = 0; i < bk; ++i) {
            const int64_t k = blk * bk + i;
            put_code(f, pan + (k / kGroupK) * group_bytes(f), c, k % kGroupK, d.q[i]);
          }
          for (int64_t g = 0; g < bk / kGroupK; ++g)
            put_scales(f, pan + (blk * bk / kGroupK + g) * group_bytes(f), c, d.sa[g]);
        }
      }
    }
  });
}

void pack_quant_int8_kernel(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out) {
  const int64_t n = codes.size(0), K = codes.size(1), ld = codes.stride(0);
  const int64_t P = (n + kNR - 1) / kNR, pb = panel_bytes(kI8C, K);
  const int8_t* src = codes.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t p = b0; p < e0; ++p) {
      uint8_t* pan = dst + p * pb;
      std::memset(pan, 0, pb);
      for (int c = 0; c < kNR; ++c) {
        const int64_t r = p * kNR + c;
        if (r >= n) break;
        TORCH_CHECK(std::isfinite(sc[r]), "int8 weight: row ", r, " has a non-finite scale");
        std::memcpy(pan + 4 * c, sc + r, 4);
        for (int64_t k = 0; k < K; ++k)
          put_code(kI8C, pan + header_bytes(kI8C) + (k / kGroupK) * group_bytes(kI8C), c, k % kGroupK,
                   static_cast<uint8_t>(src[r * ld + k]));
      }
    }
  });
}

// Column c of an integer-dot panel expanded (the embedding lookup): the dense model's bf16
// weights, value<F> of the stored code (Q8_0's u - 128 is its raw int8 code).
static void idot_column(int32_t f, const uint8_t* pan, int64_t K, int c, uint16_t* out) {
  const int64_t gb = idot_group_bytes(f);
  for (int64_t g = 0; g < groups(K); ++g) {
    const uint8_t* grp = pan + g * gb;
    const float d = f16_to_f32(load_u16(grp + 2 * c));
    const float m = f == kQ4_1 ? f16_to_f32(load_u16(grp + 2 * kNR + 2 * c)) : 0.f;
    const uint8_t* codes = grp + idot_scale_bytes(f);
    for (int k = 0; k < kGroupK && g * kGroupK + k < K; ++k) {
      const uint32_t u = idot_code(f, codes, c, k);
      float v;
      if (f == kQ8_0) v = value<kQ8_0>(u ^ 0x80u, d, m);
      else if (f == kQ4_0) v = value<kQ4_0>(u, d, m);
      else v = value<kQ4_1>(u, d, m);
      out[g * kGroupK + k] = f32_to_bf16(v);
    }
  }
}

void pack_q8dot_kernel(const at::Tensor& rows, int64_t fmt_, int64_t K, at::Tensor& out) {
  const int32_t f = static_cast<int32_t>(fmt_);
  TORCH_CHECK(int_dot_format(f), "format ", f, " has no integer-dot layout");
  const int64_t n = rows.size(0), ld = rows.stride(0), bb = block_bytes(f);
  const int64_t P = (n + kNR - 1) / kNR, pb = idot_panel_bytes(f, K), gb = idot_group_bytes(f);
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t b0, int64_t e0) {
    Decoded d;
    for (int64_t p = b0; p < e0; ++p) {
      uint8_t* pan = dst + p * pb;
      std::memset(pan, 0, pb);
      for (int c = 0; c < kNR; ++c) {
        const int64_t r = p * kNR + c;
        if (r >= n) break;
        for (int64_t g = 0; g < K / kGroupK; ++g) {
          decode_block(f, src + r * ld + g * bb, d);
          check_scales(f, d, r, g);
          uint8_t* grp = pan + g * gb;
          const uint16_t dw = static_cast<uint16_t>(d.sa[0][0]);
          std::memcpy(grp + 2 * c, &dw, 2);
          if (f == kQ4_1) {
            const uint16_t mw = static_cast<uint16_t>(d.sa[0][1]);
            std::memcpy(grp + 2 * kNR + 2 * c, &mw, 2);
          }
          uint8_t* codes = grp + idot_scale_bytes(f);
          for (int k = 0; k < kGroupK; ++k) {
            const uint8_t u = f == kQ8_0 ? static_cast<uint8_t>(d.q[k] ^ 0x80u) : d.q[k];
            codes[idot_code_at(f, c, k)] |= static_cast<uint8_t>(u << idot_code_shift(f, k));
          }
        }
      }
    }
  });
}

void quant_rows_kernel(const at::Tensor& blob_t, const at::Tensor& ids, at::Tensor& out) {
  const Blob blob = parse_blob(blob_t);
  const int64_t T = ids.numel(), K = blob.K;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.size(0) == T && out.size(1) == K &&
                  out.stride(1) == 1, "out must be bfloat16 [ids, K]");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < blob.N, "row id out of range");
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t ldo = out.stride(0);
  at::parallel_for(0, T, 64, [&](int64_t b0, int64_t e0) {
    for (int64_t t = b0; t < e0; ++t) {
      const int64_t n = id[t];
      const Segment* s = &blob.segs[0];
      for (const Segment& x : blob.segs)
        if (n >= x.n0 && n < x.n0 + x.n) s = &x;
      const int64_t r = n - s->n0;
      if (blob.version == kBlobIntDot)
        idot_column(s->fmt, blob.panel(*s, r / kNR), K, static_cast<int>(r % kNR), o + t * ldo);
      else
        column_fn(s->fmt)(blob.panel(*s, r / kNR), K, static_cast<int>(r % kNR), o + t * ldo);
    }
  });
}

void quant_linear_kernel(const at::Tensor& x, const at::Tensor& blob_t, int64_t N,
                         const c10::optional<at::Tensor>& bias, at::Tensor& out, int64_t isa, int64_t arith) {
  const Blob blob = parse_blob(blob_t);
  TORCH_CHECK(blob.N == N && blob.K == x.size(1), "quantized weight is [", blob.N, ", ", blob.K,
              "], the call wants [", N, ", ", x.size(1), "]");
  if (blob.version == kBlobIntDot) {  // its own arithmetic, whatever `arith` says (gemm_q8dot.cpp)
    idot_linear(x, blob, bias, out, isa);
    return;
  }
  if (blob.version == kBlobCodes) {  // gemm_codes.cpp: bf16 dot products on the codes, per block
    codes_linear(x, blob, bias, out, isa, dot_allows_native(arith));
    return;
  }
  const int64_t M = x.size(0), K = blob.K, K2 = (K + 1) / 2;
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  void* o = out.data_ptr();
  const int64_t ldo = out.stride(0);
  const bool out_bf16 = out.scalar_type() == at::kBFloat16;
  const bool f32_chain = arith == kArithF32;
  const DotPath path = f32_chain ? DotPath{} : dot_path(isa, arith);
  const DotRows rows = f32_chain ? DotRows{} : dot_rows(x, path);
  const int a = f32_chain ? kF32Chain : path.native ? kNativeDot : kEmulatedDot;
  QPlan plan;
  const bool in_registers = M <= 8 && decode_plan(isa, a, plan);
  const int64_t panel_values = f32_chain ? K * kNR : K2 * kDotPairRow;
  const int64_t chunk = chunk_panels(panel_values);
  for (const Segment& s : blob.segs) {
    const int64_t P = s.panels();
    QCall c{&rows, x.data_ptr<float>(), x.stride(0), M, K, K2, blob.base + s.offset, panel_bytes(s.fmt, K),
            b != nullptr ? b + s.n0 : nullptr, column(o, out_bf16, s.n0), ldo, out_bf16, s.n};
    const ExpandFn portable = f32_chain ? by_format<PickKmajor>(s.fmt) : by_format<PickDot>(s.fmt);
    const PanelFn vec = vector_expander(isa, s.fmt);
    const int64_t grain = s.n * K < (int64_t{1} << 15) ? P : 1;
    at::parallel_for(0, P, grain, [&](int64_t b0, int64_t e0) {
      if (in_registers) {
#if RS_AVX2
        if (a != kF32Chain) {
          FlushDenormals ftz;
          run_decode(c, plan, s.fmt, b0, e0);
          return;
        }
#endif
        run_decode(c, plan, s.fmt, b0, e0);
        return;
      }
      for (int64_t q0 = b0; q0 < e0; q0 += chunk) {
        const int64_t q1 = std::min(e0, q0 + chunk);
        uint16_t* w = scratch((q1 - q0) * panel_values);
        for (int64_t p = q0; p < q1; ++p) {
          uint16_t* dst = w + (p - q0) * panel_values;
          if (vec != nullptr)
            vec(c.seg + p * c.panel_bytes, K, f32_chain, dst);
          else
            portable(c.seg + p * c.panel_bytes, K, 0, K2, dst);
        }
        if (f32_chain)
          f32_panels_bf16(c.x, c.ldx, M, K, w, q0, q0, q1, s.n, c.bias, c.out, ldo, out_bf16, isa);
        else
          dot_panels(rows, path, w, q0, q0, q1, s.n, c.bias, c.out, ldo, out_bf16);
      }
    });
  }
}

bool quant_gated_kernel(const at::Tensor& x, const at::Tensor& blob_t, int64_t kind, at::Tensor& act, int64_t isa,
                        int64_t arith) {
  const int64_t inter = act.size(1), M = x.size(0);
  if (arith == kArithF32 || inter % kNR != 0) return false;
  const DotPath path = dot_path(isa, arith);
  QPlan plan;  // a decode batch expands in registers (checked first: it is every decode step)
  if (M <= 8 && decode_plan(isa, path.native ? kNativeDot : kEmulatedDot, plan)) return false;
  const Blob blob = parse_blob(blob_t);
  const int64_t K = blob.K, K2 = (K + 1) / 2;
  TORCH_CHECK(blob.N == 2 * inter && K == x.size(1), "quantized weight is [", blob.N, ", ", blob.K,
              "], the gated call wants [", 2 * inter, ", ", x.size(1), "]");
  if (blob.version != kBlobExpand) return false;
  // Every 16 rows in one segment, at a panel of its own: each gate and up panel expands alone.
  for (const Segment& s : blob.segs)
    if (s.n0 % kNR != 0 || s.n % kNR != 0) return false;
  const DotRows rows = dot_rows(x, path);
  const GatedAct out{act.data_ptr<float>(), act.stride(0), inter, kind, isa};
  const int64_t Pg = inter / kNR, panel_values = K2 * kDotPairRow;
  // A chunk's gate panels and their up panels expand side by side: twice a plain chunk.
  const int64_t chunk = std::max<int64_t>(4, chunk_panels(panel_values) / 4 * 4);
  auto expand = [&](int64_t row, uint16_t* dst) {  // the panel of rows [row, row + 16) into dst
    const Segment* seg = nullptr;
    for (const Segment& s : blob.segs)
      if (row >= s.n0 && row < s.n0 + s.n) seg = &s;
    const uint8_t* src = blob.panel(*seg, (row - seg->n0) / kNR);
    if (const PanelFn vec = vector_expander(isa, seg->fmt))
      vec(src, K, false, dst);
    else
      by_format<PickDot>(seg->fmt)(src, K, 0, K2, dst);
  };
  const int64_t grain = 2 * inter * K < (int64_t{1} << 15) ? Pg : 1;
  at::parallel_for(0, Pg, grain, [&](int64_t b0, int64_t e0) {
    for (int64_t q0 = b0; q0 < e0; q0 += chunk) {
      const int64_t q1 = std::min(e0, q0 + chunk), n = q1 - q0;
      uint16_t* w = scratch(2 * n * panel_values);
      for (int64_t p = q0; p < q1; ++p) {
        expand(p * kNR, w + (p - q0) * panel_values);
        expand(inter + p * kNR, w + (n + p - q0) * panel_values);
      }
      dot_gated_panels(rows, path, w, q0, n, q0, q1, out);
    }
  });
  return true;
}

}  // namespace radixserve
