// The AMX tile unit behind one interface, in two implementations: the CPU's own (AMX-TILE and
// AMX-BF16: tileloadd, tdpbf16ps, tilestored) and a software model of it that follows the
// Intel SDM's definition of those instructions.
//
// Why a model: the tile kernels (gemm_dot.cpp's "tile calls") must give the bits of the
// vdpbf16ps chain, and most machines that build and test this code have no AMX. The kernels
// are templates over the unit, so the same kernel code (its padding, its pair order, its
// blocking, its epilogue) runs against the model on any AVX512-BF16 CPU and is checked there
// bit for bit; on an AMX CPU the same code runs on the tiles, and a startup probe
// (amx_status) admits them only if they reproduce the model on inputs chosen to tell chains
// apart. What the model cannot check is whether the hardware rounds as the SDM says: that is
// the probe's job.
//
// Every tile here is configured as 16 rows of 64 bytes (palette 1), so one configuration
// serves every call and ldtilecfg (which zeroes the tiles) runs once per call and thread.
#pragma once

#include "common.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#define RS_TILES 1
#include <immintrin.h>
#else
#define RS_TILES 0
#endif

namespace radixserve {

constexpr int64_t kTileRows = 16;    // rows of every tile
constexpr int64_t kTileBytes = 64;   // bytes of a tile row
constexpr int64_t kTilePairs = 16;   // bf16 pairs along a tile row (the k block of one tdpbf16ps)

// Which tile unit a call runs on: none, the CPU's AMX tiles, or their software model (tests).
constexpr int kTilesNone = 0, kTilesHardware = 1, kTilesModel = 2;

#if RS_TILES
// The model of the tile unit: eight 1 KiB tiles in memory. dot<C, A, B>() is tdpbf16ps as the
// SDM's pseudo-code defines it:
//
//   for m, k, n:  C[m][n] += A[m][2k] * B[k][2n];  C[m][n] += A[m][2k+1] * B[k][2n+1]
//
// each += one rounding to nearest even of an exact bf16 product's sum, denormal inputs read as
// zero and denormal results flushed: an fma under MXCSR's FTZ and DAZ (set here for the
// call, as the hardware ignores MXCSR), vectorised over n. Note the order: the element at the even position of a
// pair first, where vdpbf16ps takes the odd one first (the tile kernels swap each pair of both
// operands, so that the two chains are one).
class ModelTiles {
 public:
  void configure() { std::memset(t_, 0, sizeof t_); }
  void release() {}
  template <int T>
  void zero() {
    std::memset(t_[T], 0, sizeof t_[T]);
  }
  template <int T>
  void load(const void* base, int64_t stride) {
    for (int64_t r = 0; r < kTileRows; ++r)
      std::memcpy(t_[T] + r * kTileBytes, static_cast<const char*>(base) + r * stride, kTileBytes);
  }
  template <int T>
  void store(void* base, int64_t stride) const {
    for (int64_t r = 0; r < kTileRows; ++r)
      std::memcpy(static_cast<char*>(base) + r * stride, t_[T] + r * kTileBytes, kTileBytes);
  }
  template <int C, int A, int B>
  void dot() {
    const unsigned mxcsr = _mm_getcsr();
    _mm_setcsr(mxcsr | 0x8040u);
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    __m512 even[kTilePairs], odd[kTilePairs];  // B's row k: its even and odd elements as float32
    for (int64_t k = 0; k < kTilePairs; ++k) {
      const __m512i v = _mm512_loadu_si512(t_[B] + k * kTileBytes);
      even[k] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[k] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    }
    for (int64_t m = 0; m < kTileRows; ++m) {
      float* c = reinterpret_cast<float*>(t_[C] + m * kTileBytes);
      const uint16_t* a = reinterpret_cast<const uint16_t*>(t_[A] + m * kTileBytes);
      __m512 acc = _mm512_loadu_ps(c);
      for (int64_t k = 0; k < kTilePairs; ++k) {
        acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(a[2 * k])), even[k], acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(bf16_to_f32(a[2 * k + 1])), odd[k], acc);
      }
      _mm512_storeu_ps(c, acc);
    }
    _mm_setcsr(mxcsr);
  }

 private:
  alignas(64) unsigned char t_[8][kTileRows * kTileBytes];
};

// The CPU's tile unit. The instructions as inline assembly (the assembler knows them whatever
// -march says), each with a memory clobber: GCC's own tileloadd macro has none, so stores to
// the buffer it reads could move past it.
class HardwareTiles {
 public:
  void configure() {
    alignas(64) unsigned char cfg[64] = {};
    cfg[0] = 1;  // palette 1
    for (int t = 0; t < 8; ++t) {
      const uint16_t colsb = kTileBytes;
      std::memcpy(cfg + 16 + 2 * t, &colsb, 2);
      cfg[48 + t] = kTileRows;
    }
    asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
  }
  void release() { asm volatile("tilerelease" : : : "memory"); }
  template <int T>
  void zero() {
    asm volatile("tilezero %%tmm%c0" : : "i"(T) : "memory");
  }
  template <int T>
  void load(const void* base, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" : : "r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  void store(void* base, int64_t stride) const {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" : : "r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int C, int A, int B>
  void dot() {
    asm volatile("tdpbf16ps %%tmm%c0, %%tmm%c1, %%tmm%c2" : : "i"(B), "i"(A), "i"(C) : "memory");
  }
};

// The unit of the calling thread (the model's tiles are per thread, as the hardware's are).
template <class Unit>
Unit& tile_unit() {
  static thread_local Unit unit;
  return unit;
}
#endif  // RS_TILES

// Whether this process may run the CPU's tiles: 0 yes; otherwise why not (kAmx*). The first
// call decides, once per process: it checks the build and the CPU (cpuid), then a child
// process asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM) and runs the probe
// (gemm_dot.cpp); kAmxProbeFailed: the child could not run it or died (a fault, a signal).
constexpr int64_t kAmxReady = 0, kAmxNotBuilt = 1, kAmxNoCpu = 2, kAmxNoOs = 3, kAmxProbeDiffers = 4,
                  kAmxProbeFailed = 5;
int64_t amx_status();
// The probe alone, whatever the CPU (for tests): on the hardware or the model, with or
// without asking Linux for the tile state first; a kAmx* code. On a CPU without AMX the
// hardware probe's child dies of the trap, which is what kAmxProbeFailed guards against.
int64_t tile_probe(bool hardware, bool ask_os);

}  // namespace radixserve
