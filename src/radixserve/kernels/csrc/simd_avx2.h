// AVX2 + FMA versions of common.h's helpers, operation for operation (so code built on them
// gives the portable code's bits): exp, bfloat16 loads and rounding. RS_AVX2 says whether
// the compiler targets AVX2 + FMA (the kernels are built for the host CPU).
#pragma once

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#define RS_AVX2 1
#include <immintrin.h>
#else
#define RS_AVX2 0
#endif

#if RS_AVX2
namespace radixserve {

inline __m256 exp256(__m256 x) {  // exp_f32 of common.h, operation for operation
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_NGE_UQ);
  __m256 xc = _mm256_min_ps(x, _mm256_set1_ps(kExpHi));
  xc = _mm256_max_ps(xc, _mm256_set1_ps(kExpLo));
  const __m256 magic = _mm256_set1_ps(kRoundMagic);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)), magic), magic);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kExpP0), r, _mm256_set1_ps(kExpP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP5));
  p = _mm256_fmadd_ps(p, r2, r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, sc));
}

inline __m256 bf16x8_to_f32(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

// f32_to_bf16 of common.h on 8 lanes (NaN -> quiet NaN), packed to 8 x 16 bits.
inline __m128i f32_to_bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
  return _mm256_castsi256_si128(packed);
}

}  // namespace radixserve
#endif  // RS_AVX2
