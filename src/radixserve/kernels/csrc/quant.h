// Quantized weights as the kernels keep them: GGUF's block formats (and a per-output-channel
// int8 format) repacked into panels of 16 output columns, and the arithmetic that expands a
// stored value back to the bfloat16 weight the dense model would hold.
//
// The reference a quantized linear is exact to: the dense bfloat16 model loaded from the same
// GGUF, which dequantizes every tensor to float32 with the gguf package's numpy arithmetic and
// rounds it to bfloat16 (to nearest even). So a stored value expands with the same float32
// operations in the same order as gguf-py's dequantize_blocks (Q8_0: q * d; Q4_0: d * (q - 8);
// Q4_1: d * q + m; Q4_K: (d * sc) * q - dmin * m; Q6_K: (d * sc) * (q - 32); ...), then rounds
// to bfloat16, and the GEMM takes that bfloat16 value: the same bits as the dense model.
// Where a multiply-add is fused (the vector paths), its product is exact (at most 11 + 6 + 5
// significant bits), so the fused and the separate forms round once, alike. fp16 scales widen
// to float32 exactly; no expanded value is a float32 denormal (every one is 0 or a multiple of
// 2^-24), so flushing denormals cannot change one.
//
// Layout of one segment (rows of one format): panels of 16 output columns; a panel is an
// optional header and then one 32-k group after another. A group holds the scales of its 16
// columns, then its codes, k pair by k pair: the 32 values of pair j in the order the dot
// products take them, v = 2 c + e for column c and k = 2 j + e (so that a pair expands
// straight into the operand of vdpbf16ps). Codes: 8-bit (byte v), 4-bit (byte v & 15 of the
// pair's 16, low nibble for v < 16), 5-bit (the 4-bit plane, then the high bits: bit v of a
// 32-bit word per pair), 6-bit (the 4-bit plane, then two bits 2v.. of a 64-bit word per pair).
#pragma once

#include "common.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace radixserve {
namespace quant {

// Formats: GGML's type numbers for the GGUF ones.
constexpr int32_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
// Per-output-channel int8 (weight-only): value = q * scale[n]; the panel header holds the scales.
constexpr int32_t kI8C = 100;

constexpr int64_t kNR = 16;      // output columns per panel
constexpr int64_t kGroupK = 32;  // k values per group
constexpr int64_t kGroupPairs = kGroupK / 2;

inline bool known(int32_t f) {
  switch (f) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: case kI8C:
      return true;
    default:
      return false;
  }
}

inline int code_bits(int32_t f) {
  switch (f) {
    case kQ8_0: case kI8C: return 8;
    case kQ4_0: case kQ4_1: case kQ4_K: return 4;
    case kQ5_0: case kQ5_1: case kQ5_K: return 5;
    default: return 6;  // kQ6_K
  }
}

// Bytes of a group's scales: fp16 d (and m) per column for the 32-blocks (as GGUF stores
// them); float32 (d * sc) and (dmin * m), or the two 16-k scales of Q6_K, for the K formats.
inline int64_t scale_bytes(int32_t f) {
  switch (f) {
    case kQ8_0: case kQ4_0: case kQ5_0: return 2 * kNR;
    case kQ4_1: case kQ5_1: return 4 * kNR;
    case kQ4_K: case kQ5_K: case kQ6_K: return 8 * kNR;
    default: return 0;  // kI8C: in the panel header
  }
}

inline int64_t low_plane_bytes(int32_t f) { return code_bits(f) == 8 ? 32 * kGroupPairs : 16 * kGroupPairs; }
inline int64_t high_plane_bytes(int32_t f) {
  return code_bits(f) == 5 ? 4 * kGroupPairs : code_bits(f) == 6 ? 8 * kGroupPairs : 0;
}
inline int64_t group_bytes(int32_t f) { return scale_bytes(f) + low_plane_bytes(f) + high_plane_bytes(f); }
inline int64_t header_bytes(int32_t f) { return f == kI8C ? 4 * kNR : 0; }
inline int64_t groups(int64_t K) { return (K + kGroupK - 1) / kGroupK; }
inline int64_t panel_bytes(int32_t f, int64_t K) { return header_bytes(f) + groups(K) * group_bytes(f); }

// IEEE half -> float, exact (subnormals, infinities and NaN included).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in float32
  const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float load_f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The expanded float32 value of raw code q (the stored bits, unsigned) with the column's scale
// s and offset m: gguf-py's operations, in its order (see the header comment).
template <int32_t F>
inline float value(uint32_t q, float s, float m) {
  if constexpr (F == kQ8_0 || F == kI8C) {
    return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(q))) * s;
  } else if constexpr (F == kQ4_0) {
    return s * static_cast<float>(static_cast<int32_t>(q) - 8);
  } else if constexpr (F == kQ5_0) {
    return s * static_cast<float>(static_cast<int32_t>(q) - 16);
  } else if constexpr (F == kQ6_K) {
    return s * static_cast<float>(static_cast<int32_t>(q) - 32);
  } else if constexpr (F == kQ4_1 || F == kQ5_1) {
    return s * static_cast<float>(q) + m;
  } else {  // kQ4_K, kQ5_K
    return s * static_cast<float>(q) - m;
  }
}

// One group's scales as per-value arrays (value v of a pair belongs to column v >> 1):
// s[0] for pairs 0..7, s[1] for pairs 8..15 (they differ only for Q6_K), m the offsets.
template <int32_t F>
inline void group_scales(const uint8_t* group, const uint8_t* panel_header, float s[2][32], float m[32]) {
  for (int v = 0; v < 32; ++v) {
    const int c = v >> 1;
    float a, b = 0.f, off = 0.f;
    if constexpr (F == kI8C) {
      a = load_f32(panel_header + 4 * c);
      b = a;
    } else if constexpr (F == kQ8_0 || F == kQ4_0 || F == kQ5_0) {
      a = b = f16_to_f32(load_u16(group + 2 * c));
    } else if constexpr (F == kQ4_1 || F == kQ5_1) {
      a = b = f16_to_f32(load_u16(group + 2 * c));
      off = f16_to_f32(load_u16(group + 2 * kNR + 2 * c));
    } else if constexpr (F == kQ6_K) {
      a = load_f32(group + 4 * c);
      b = load_f32(group + 4 * kNR + 4 * c);
    } else {  // kQ4_K, kQ5_K
      a = b = load_f32(group + 4 * c);
      off = load_f32(group + 4 * kNR + 4 * c);
    }
    s[0][v] = a;
    s[1][v] = b;
    m[v] = off;
  }
}

// The 32 raw codes of pair j of a group.
template <int32_t F>
inline void pair_codes(const uint8_t* group, int64_t j, uint8_t q[32]) {
  const uint8_t* low = group + scale_bytes(F);
  if constexpr (F == kQ8_0 || F == kI8C) {
    std::memcpy(q, low + 32 * j, 32);
  } else {
    const uint8_t* b = low + 16 * j;
    for (int i = 0; i < 16; ++i) {
      q[i] = b[i] & 15u;
      q[16 + i] = b[i] >> 4;
    }
    const uint8_t* high = low + low_plane_bytes(F);
    if constexpr (F == kQ5_0 || F == kQ5_1 || F == kQ5_K) {
      const uint32_t h = load_u32(high + 4 * j);
      for (int v = 0; v < 32; ++v) q[v] |= static_cast<uint8_t>(((h >> v) & 1u) << 4);
    } else if constexpr (F == kQ6_K) {
      const uint64_t h = load_u64(high + 8 * j);
      for (int v = 0; v < 32; ++v) q[v] |= static_cast<uint8_t>(((h >> (2 * v)) & 3u) << 4);
    }
  }
}

// ---------------------------------------------------------------- blobs
// A quantized weight as the kernels take it (uint8): a 64-byte header (magic "RSQW", the
// layout's version, N, K, the number of segments), a 32-byte entry per segment (format, first
// output column, columns, byte offset of its panels) and the segments' panels. Version
// kBlobExpand: the panels above, expanded to the dense bfloat16 weights (gemm_quant.cpp);
// version kBlobIntDot: the integer-dot panels below (gemm_q8dot.cpp); version kBlobCodes: the
// panels above (Q8_0, Q4_0, Q4_1), computed on their codes with the scale per block
// (gemm_codes.cpp).
constexpr uint32_t kBlobMagic = 0x57515352u;  // "RSQW"
constexpr uint32_t kBlobExpand = 1, kBlobIntDot = 2, kBlobCodes = 3;
constexpr int64_t kBlobHeader = 64, kSegEntry = 32;

struct Segment {
  int32_t fmt;
  int64_t n0, n, offset;
  int64_t panels() const { return (n + kNR - 1) / kNR; }
};

inline int64_t idot_panel_bytes(int32_t f, int64_t K);

struct Blob {
  const uint8_t* base;
  uint32_t version;
  int64_t N, K;
  std::vector<Segment> segs;
  int64_t panel_bytes_of(const Segment& s) const {
    return version == kBlobIntDot ? idot_panel_bytes(s.fmt, K) : panel_bytes(s.fmt, K);
  }
  const uint8_t* panel(const Segment& s, int64_t p) const { return base + s.offset + p * panel_bytes_of(s); }
};

// The header of a quantized weight, checked (gemm_quant.cpp).
Blob parse_blob(const at::Tensor& blob);

// ---------------------------------------------------------------- the integer-dot layout
// Formats computed with integer dot products (weight codes against 8-bit activations).
inline bool int_dot_format(int32_t f) { return f == kQ8_0 || f == kQ4_0 || f == kQ4_1; }

// A panel of 16 columns is one 32-k group after another. A group holds the fp16 scale d of
// each column (32 bytes; Q4_1: then its fp16 offset m, 32 bytes), then the codes as unsigned
// bytes u, four consecutive k of one column in one 32-bit word: word (t * 16 + c) holds
// column c's k = 4t .. 4t + 3, so one 64-byte line t is the operand of an integer dot
// product over four k for all 16 columns. 8-bit codes (Q8_0): u = q + 128, lines t = 0..7.
// 4-bit codes: lines t = 0..3, the low nibble k = 4t + i, the high nibble k = 16 + 4t + i.
// The signed code a weight stands for is u - idot_offset(f) (Q4_1: u, with its offset m).
inline int idot_offset(int32_t f) { return f == kQ8_0 ? 128 : f == kQ4_0 ? 8 : 0; }
inline int64_t idot_scale_bytes(int32_t f) { return f == kQ4_1 ? 4 * kNR : 2 * kNR; }
inline int64_t idot_code_bytes(int32_t f) { return f == kQ8_0 ? 32 * kNR : 16 * kNR; }
inline int64_t idot_group_bytes(int32_t f) { return idot_scale_bytes(f) + idot_code_bytes(f); }
inline int64_t idot_panel_bytes(int32_t f, int64_t K) { return groups(K) * idot_group_bytes(f); }
// Byte of column c's code at k (0..31) within a group's codes, and the nibble's shift.
inline int64_t idot_code_at(int32_t f, int c, int k) {
  const int kk = f == kQ8_0 ? k : (k & 15);
  return ((kk >> 2) * kNR + c) * 4 + (kk & 3);
}
inline int idot_code_shift(int32_t f, int k) { return f == kQ8_0 || k < 16 ? 0 : 4; }
inline uint32_t idot_code(int32_t f, const uint8_t* codes, int c, int k) {
  const uint8_t b = codes[idot_code_at(f, c, k)];
  return f == kQ8_0 ? b : (b >> idot_code_shift(f, k)) & 15u;
}

// A linear on an integer-dot blob: out [M, N] = x [M, K] (float32) against the blob's
// columns, each element the chain gemm_q8dot.cpp defines (+ bias), stored in out's dtype.
void idot_linear(const at::Tensor& x, const Blob& blob, const c10::optional<at::Tensor>& bias, at::Tensor& out,
                 int64_t isa);

// A linear on a block-codes blob (kBlobCodes): out [M, N] = x [M, K] (float32, rounded to
// bfloat16) against the blob's columns, each element the chain gemm_codes.cpp defines (+ bias),
// stored in out's dtype; allow_native=false keeps vdpbf16ps out (its emulation: the same bits).
void codes_linear(const at::Tensor& x, const Blob& blob, const c10::optional<at::Tensor>& bias, at::Tensor& out,
                  int64_t isa, bool allow_native);

}  // namespace quant
}  // namespace radixserve
