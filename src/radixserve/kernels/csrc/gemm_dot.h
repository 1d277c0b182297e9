// The bfloat16 dot-product GEMM of gemm_dot.cpp as a building block for other weight formats
// (gemm_quant.cpp): the rows converted once per call, and the tiles run over panels in the
// dot layout that the caller supplies (expanded from another storage into scratch). Whatever
// supplies the panels, every output element is the same fixed chain, so a weight format that
// expands to the same bfloat16 values gives the same bits as the packed bfloat16 weight.
#pragma once

#include "common.h"
#include "simd_avx2.h"
#include "tiles.h"

namespace radixserve {

#if RS_AVX2
// Denormals read as zero and flushed to zero on this thread while alive (vdpbf16ps does so
// whatever MXCSR says; the FMA emulation and the epilogue need the bits set).
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  // The MXCSR the thread had before (what code outside the GEMM runs under).
  unsigned outer() const { return saved_; }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};
#endif

// Output columns per panel and bf16 values per panel per k pair (the dot layout's line).
constexpr int64_t kDotNR = 16;
constexpr int64_t kDotPairRow = 2 * kDotNR;

// The rows of one call as the dot paths read them: bf16 pairs (xh, [M, 2 K2]) for the native
// instruction, their float32 values in chain order (xf: x[2j+1], x[2j]) for the emulations.
// For the tile calls (DotPath::tiles) also xs: each row's pairs swapped (x[2j+1], x[2j]),
// K2p - K2 zero pairs in front (K2p: K2 rounded up to whole 16-pair tile rows), Mp rows (M
// rounded up to whole 16-row tiles, zero past M).
struct DotRows {
  const uint16_t* xh = nullptr;
  const float* xf = nullptr;
  const uint16_t* xs = nullptr;
  int64_t K2 = 0, M = 0, K2p = 0, Mp = 0;
};

// The fewest rows a call takes the tile unit for (fewer: the native tiles, the same bits).
constexpr int64_t kTileMinRows = 16;

// Which tiles a call runs: `plan` (opaque; nullptr = the portable loop), whether they read
// the bf16 pairs (native) or the float32 chain-order rows, and which tile unit (if any) takes
// calls of kTileMinRows rows or more (kTiles*, tiles.h).
struct DotPath {
  const void* plan = nullptr;
  bool pairs = false;
  bool native = false;
  int tiles = kTilesNone;
};

// The path for instruction-set level `isa` (kIsa*) and arithmetic `arith` (kArith*, not
// kArithF32): kArithDotEmulated keeps vdpbf16ps out, kArithDotTileModel runs the tile calls on
// the model; kArithDot runs the AMX tiles at level kIsaAmx when amx_status() admits them.
DotPath dot_path(int64_t isa, int64_t arith);
// x [M, K] float32 rounded to bf16 in the form `path` reads, in buffers of the calling thread
// (valid until its next call).
DotRows dot_rows(const at::Tensor& x, const DotPath& path);
// Output columns [16 p0, 16 p1) of out [M, N] (row stride ldo, float32 or bf16) from panels
// p0..p1-1 of dot-layout weights whose panel wp0 starts at w (+ bias[n], may be nullptr).
// Runs on the calling thread, under FTZ/DAZ on the vector paths.
void dot_panels(const DotRows& rows, const DotPath& path, const uint16_t* w, int64_t wp0, int64_t p0,
                int64_t p1, int64_t N, const float* bias, void* out, int64_t ldo, bool out_bf16);

// Where a gated call (dot_gated_panels) writes act(gate) * up: act [M, inter] float32 with row
// stride ld, inter a multiple of 16; kind kGateSilu or kGateGeluTanh; isa as gated_segment's.
struct GatedAct {
  float* act = nullptr;
  int64_t ld = 0, inter = 0, kind = 0, isa = 0;
};

// act[:, 16 p0 .. 16 p1) from dot-layout gate_up panels: gate panel p at w + (p - wp0) panels,
// its up panel up_off panels further (a packed weight: wp0 0, up_off inter / 16; a chunk of
// expanded scratch: its first gate panel and the chunk's width). The bits of the plain call's
// gate_up rows through gated_segment, without writing those rows out.
void dot_gated_panels(const DotRows& rows, const DotPath& path, const uint16_t* w, int64_t wp0, int64_t up_off,
                      int64_t p0, int64_t p1, const GatedAct& out);

// The float32-chain GEMM of gemm.cpp over bf16 panels in its layout ([p][k][16], k-major)
// that the caller supplies: out[:, 16 p0 .. 16 p1) = x . w^T, one in-order fma chain over k
// per element; panel wp0 starts at w.
void f32_panels_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t wp0,
                     int64_t p0, int64_t p1, int64_t N, const float* bias, void* out, int64_t ldo,
                     bool out_bf16, int64_t isa);

}  // namespace radixserve
