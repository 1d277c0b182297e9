// Shared helpers of the radixserve CPU kernels: bfloat16 conversions, a vectorisable exp,
// and the kernel entry points that ops.cpp registers with torch.
//
// Every function here is plain C++ on purpose: the compiler vectorises the loops that call
// them, and the same arithmetic runs on any CPU. The AVX2 and AVX-512 attention code
// (attention_avx2.cpp, attention_avx512.cpp) reproduces these operation sequences exactly
// (same roundings, same fused multiply-adds), so its results equal the portable path's bit
// for bit.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace radixserve {

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, NaN -> quiet NaN: the same bits as torch's float -> bfloat16 cast.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0u)
                                          : static_cast<uint16_t>(rounded);
}

// ---- quantized KV rows --------------------------------------------------------------------
// A quantized pool stores each head's row as head_dim one-byte codes and then the row's float32
// scale (radixserve/memory/quant.py has the format). `kv_kind` arguments: the pool's element
// dtype says float32 / bfloat16; uint8 pools say which code.
constexpr int64_t kKvFloat = 0, kKvInt8 = 1, kKvFp8 = 2;
constexpr int64_t kScaleBytes = 4;
constexpr float kInt8Max = 127.0f, kFp8Max = 448.0f;

// e4m3fn code -> float32, for every code (the same values as torch's float8_e4m3fn cast).
inline const float* fp8_e4m3_table() {
  static const struct Table {
    float v[256];
    Table() {
      for (int i = 0; i < 256; ++i) v[i] = c10::detail::fp8e4m3fn_to_fp32_value(static_cast<uint8_t>(i));
    }
  } table;
  return table.v;
}

inline float row_scale(const uint8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// dst[d] = float(code[d]) * scale: one float32 rounding, so every path that dequantizes this
// way reads the same values (a plain loop: the compiler vectorises it for the file's target).
inline void dequant_row(const uint8_t* row, int64_t D, int64_t kind, const float* fp8, float* dst) {
  const float s = row_scale(row, D);
  if (kind == kKvInt8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(row);
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(c[d]) * s;
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = fp8[row[d]] * s;
  }
}

// The stored row of x[0..D): scale = max |x| / QMAX (1 if 0), codes of x / scale.
template <typename T>
inline void quantize_row(const T* x, int64_t D, int64_t kind, uint8_t* dst);

// Element loads / stores for the two storage types the kernels accept.
inline float load_f32(const float* p, int64_t i) { return p[i]; }
inline float load_f32(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
inline void store_f32(float* p, int64_t i, float x) { p[i] = x; }
inline void store_f32(uint16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }

template <typename T>
inline void quantize_row(const T* x, int64_t D, int64_t kind, uint8_t* dst) {
  const float qmax = kind == kKvInt8 ? kInt8Max : kFp8Max;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(load_f32(x, d)));
  float s = amax / qmax;
  if (!(s > 0.f)) s = 1.f;
  for (int64_t d = 0; d < D; ++d) {
    const float y = load_f32(x, d) / s;
    if (kind == kKvInt8) {
      const float r = std::min(std::max(std::nearbyint(y), -kInt8Max), kInt8Max);
      dst[d] = static_cast<uint8_t>(static_cast<int8_t>(r));
    } else {
      dst[d] = c10::detail::fp8e4m3fn_from_fp32_value(std::min(std::max(y, -kFp8Max), kFp8Max));
    }
  }
  std::memcpy(dst + D, &s, sizeof s);
}

// exp(x) in float32 (Cephes' expf polynomial, ~1 ulp): 0 for x < -87.3 (and for -inf),
// exactly 1 for x == 0. Written as a fixed sequence of roundings and fused multiply-adds
// (no library call) so that loops over it vectorise and the AVX-512 version in
// attention.cpp can repeat it operation for operation.
constexpr float kExpLo = -87.3365447505531f;
constexpr float kExpHi = 88.0f;  // keeps 2^n finite (n <= 127)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500E-4f;
constexpr float kExpP1 = 1.3981999507E-3f;
constexpr float kExpP2 = 8.3334519073E-3f;
constexpr float kExpP3 = 4.1665795894E-2f;
constexpr float kExpP4 = 1.6666665459E-1f;
constexpr float kExpP5 = 5.0000001201E-1f;
constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23: x + magic - magic rounds to even

inline float exp_f32(float x) {
  const bool under = !(x >= kExpLo);  // also true for NaN... which softmax never produces
  float xc = x < kExpHi ? x : kExpHi;
  xc = xc > kExpLo ? xc : kExpLo;
  const float n = (xc * kLog2e + kRoundMagic) - kRoundMagic;
  float r = std::fma(n, -kLn2Hi, xc);
  r = std::fma(n, -kLn2Lo, r);
  const float r2 = r * r;
  float p = std::fma(kExpP0, r, kExpP1);
  p = std::fma(p, r, kExpP2);
  p = std::fma(p, r, kExpP3);
  p = std::fma(p, r, kExpP4);
  p = std::fma(p, r, kExpP5);
  p = std::fma(p, r2, r);
  p = p + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  const float scale = bits_to_f32(static_cast<uint32_t>(e) << 23);
  return under ? 0.0f : p * scale;
}

// ---- kernel entry points (validated and registered in ops.cpp) ---------------------------

// out[t] = rms_norm(x[t]) * weight, in x's float32, written in out's dtype.
void rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
// hidden[t] += delta[t] (in place, float32), then out[t] = rms_norm(hidden[t]) * weight.
void add_rms_norm_kernel(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight,
                         double eps, at::Tensor& out);
// Rotate-half RoPE in place on the first n_rot_heads heads of every row of qkv.
void rope_kernel(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, int64_t n_rot_heads, int64_t head_dim);
// Instruction-set levels of the `isa` arguments (radixserve.kernels.isa.ISAS, in order).
constexpr int64_t kIsaGeneric = 0, kIsaAvx2 = 1, kIsaAvx512 = 2, kIsaAmx = 3;

// out[t] = silu(gu[t, :I]) * gu[t, I:], in float32, written in out's dtype; `isa` caps the
// instruction set (the result is the same on every level).
void silu_mul_kernel(const at::Tensor& gu, at::Tensor& out, int64_t isa);

void gelu_tanh_mul_kernel(const at::Tensor& gu, at::Tensor& out, int64_t isa);

// The gates of the fused gate_up projections (the `kind` of gated_segment and the gated linear).
constexpr int64_t kGateSilu = 0, kGateGeluTanh = 1;
// o[i] = act(g[i]) * u[i] for i < n, act silu or gelu_tanh by `kind`: one row segment of
// silu_mul_kernel / gelu_tanh_mul_kernel on float32, the same bits however a row is cut.
void gated_segment(int64_t kind, const float* g, const float* u, float* o, int64_t n, int64_t isa);

// Largest head_dim of qk_norm_rope (its per-head scratch row lives on the stack).
constexpr int64_t kMaxHeadDim = 512;

void qk_norm_rope_kernel(const at::Tensor& qkv, const at::Tensor& weight, double eps,
                         const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t n_qk_heads, int64_t head_dim, at::Tensor& out);
// k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t] (converted to the cache dtype).
void store_kv_kernel(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slots);
// The same into a quantized pool (uint8 [slots, kv_heads, D + 4]): each row's codes and scale.
void store_kv_quant_kernel(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slots, int64_t kind);
// Paged causal attention of every query row over its sequence's K/V, read in place by slot;
// window > 0: a sliding window of that many keys (the row's own included), and the slots of
// keys before a row's window are never read.
void paged_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& seq_info, at::Tensor& out, double scale,
                            int64_t impl, int64_t window, int64_t kv_kind);
// Packs w [N, K] (float32/bf16) into 16-column k-major panels of packed's dtype
// (float32/bf16, [ceil(N / 16) * 16 * K] elements).
void pack_linear_kernel(const at::Tensor& w, at::Tensor& packed);
// out [M, N] (float32/bf16) = x [M, K] (float32) . w^T (+ bias), w packed by pack_linear;
// float32 accumulation, one in-order fma chain per element (batch-invariant); `isa` caps
// the instruction set (same result on every level).
void packed_linear_kernel(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                          const c10::optional<at::Tensor>& bias, at::Tensor& out, int64_t isa);
// The bfloat16 dot-product arithmetic of gemm_dot.cpp (arith kArithDot): w [N, K] packed into
// 16-column panels of interleaved k pairs (bf16, [ceil(N / 16) * 16 * 2 * ceil(K / 2)]).
void pack_linear_dot_kernel(const at::Tensor& w, at::Tensor& packed);
// out = bf16(x) . w^T (+ bias), each element one fixed chain of bf16 pair products (see
// gemm_dot.cpp); the same bits on every path; arith picks it (kArithDot and the rest).
void packed_linear_dot_kernel(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const c10::optional<at::Tensor>& bias, at::Tensor& out, int64_t isa,
                              int64_t arith);
// act [M, I] (float32) = gate(x . Wg^T) * (x . Wu^T) for a gate_up weight [2 I, K] packed by
// pack_linear_dot (I a multiple of 16): the bits of packed_linear_dot_kernel into [M, 2 I] and
// then silu_mul_kernel / gelu_tanh_mul_kernel (kind), without the [M, 2 I] rows in memory.
void packed_gated_dot_kernel(const at::Tensor& x, const at::Tensor& packed, int64_t kind, at::Tensor& act,
                             int64_t isa, int64_t arith);
// packed_gated_dot_kernel for a quantized gate_up weight whose blocks expand to the dense
// model's (the bits of quant_linear_kernel and then the gate); false, with nothing written,
// where it does not apply (another layout, float32 chains, a decode batch, odd segments).
bool quant_gated_kernel(const at::Tensor& x, const at::Tensor& blob, int64_t kind, at::Tensor& act, int64_t isa,
                        int64_t arith);
// Quantized weights (quant.h, gemm_quant.cpp): bytes of one 16-column panel of format `fmt` for
// K inputs; a GGUF block's bytes and k values.
int64_t quant_panel_bytes(int64_t fmt, int64_t K);
int64_t quant_block_bytes(int64_t fmt);
int64_t quant_block_k(int64_t fmt);
// Repacks rows [n, K / block_k * block_bytes] of GGUF blocks of format fmt into the panels of
// out (uint8, ceil(n / 16) * quant_panel_bytes(fmt, K)).
void pack_quant_kernel(const at::Tensor& rows, int64_t fmt, int64_t K, at::Tensor& out);
// The same for per-output-channel int8: codes int8 [n, K], scales float32 [n].
void pack_quant_int8_kernel(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out);
// The integer-dot layout of the same blocks (quant.h, gemm_q8dot.cpp; Q8_0, Q4_0, Q4_1): bytes of
// one panel, and the repacking of GGUF rows into it.
int64_t q8dot_panel_bytes(int64_t fmt, int64_t K);
void pack_q8dot_kernel(const at::Tensor& rows, int64_t fmt, int64_t K, at::Tensor& out);
// The block-codes panels (gemm_codes.cpp): quant_panel_bytes(fmt, K) each, Q8_0/Q4_0/Q4_1.
void pack_codes_kernel(const at::Tensor& rows, int64_t fmt, int64_t K, at::Tensor& out);
// The activation rows x [M, K] (float32, K a multiple of 32) quantized as the integer-dot
// linears take them: codes int8 [M, K], scales float32 [M, K / 32], code sums int32 [M, K / 32].
void q8dot_quantize_kernel(const at::Tensor& x, at::Tensor& q, at::Tensor& d, at::Tensor& s);
// out [T, K] bf16 = the expanded rows ids of a quantized weight (the embedding lookup).
void quant_rows_kernel(const at::Tensor& blob, const at::Tensor& ids, at::Tensor& out);
// packed_linear on a quantized weight: arith kArithF32 (float32 chains on the expanded
// bf16 weights, as gemm.cpp on the dense ones) or kArithDot / kArithDotEmulated (gemm_dot.cpp).
void quant_linear_kernel(const at::Tensor& x, const at::Tensor& blob, int64_t N,
                         const c10::optional<at::Tensor>& bias, at::Tensor& out, int64_t isa, int64_t arith);
// Whether this build has the native dot-product path (AVX512-BF16).
bool dot_native_built();
// The `arith` argument of packed_linear: float32 fma chains (weights float32 or bf16) or bf16
// dot products (weights packed by pack_linear_dot); kArithDotEmulated never runs vdpbf16ps;
// kArithDotTileModel runs the calls that would take the AMX tiles on their software model
// (tiles.h; for tests, on any CPU with AVX512-BF16). All of them: the same bits.
constexpr int64_t kArithF32 = 0, kArithDot = 1, kArithDotEmulated = 2, kArithDotTileModel = 3;
// Whether arith may run vdpbf16ps (the CPU's bf16 dot products).
inline bool dot_allows_native(int64_t arith) { return arith == kArithDot || arith == kArithDotTileModel; }
// Which attention implementation `impl=0` picks for these shapes (for tests and logs).
int64_t attention_impl(const at::Tensor& q, const at::Tensor& k_cache);
// Whether implementation `impl` serves this pool dtype and head size on this CPU.
bool attention_impl_available(int64_t impl, const at::Tensor& k_cache, int64_t head_dim, int64_t kv_kind);

}  // namespace radixserve
