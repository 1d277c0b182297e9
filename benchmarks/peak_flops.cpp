// Peak arithmetic rate of this CPU (for benchmarks/bench_linear.py): every thread runs
// independent chains of fused multiply-adds (float32) or bf16 pair dot products, enough
// chains to hide the instruction latency, 512-bit (AVX-512) or 256-bit (AVX2 + FMA) as asked.
// Returns FLOP/s over all threads (0 for bf16 where the CPU has no bf16 arithmetic).
#include <omp.h>

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// 512-bit FMAs or bf16 pair dot products on every thread; fills flops and seconds.
void peak_512(int bf16, int64_t iters, int threads, double& flops, double& seconds, float& sink) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.f);
    const __m512 a = _mm512_set1_ps(1e-3f);
    const double t0 = omp_get_wtime();
    bool ran = !bf16;
    if (bf16) {
#if defined(__AVX512BF16__)
      const __m512bh h = (__m512bh)_mm512_set1_epi16(0x3a83);
      for (int64_t n = 0; n < iters; ++n)
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], h, h);
      ran = true;
#endif
    } else {
      for (int64_t n = 0; n < iters; ++n)
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(a, a, acc[i]);
    }
    const double t = omp_get_wtime() - t0;
    for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    // 16 lanes x 2 FLOP (fma) or x 4 FLOP (two products and two adds per lane)
    const double f = ran ? static_cast<double>(iters) * 12 * 16 * (bf16 ? 4 : 2) : 0.0;
#pragma omp critical
    {
      flops += f;
      if (t > seconds) seconds = t;
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 256-bit FMAs on every thread (AVX2 has no bf16 arithmetic: no bf16 peak).
void peak_256(int64_t iters, int threads, double& flops, double& seconds, float& sink) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.f);
    const __m256 a = _mm256_set1_ps(1e-3f);
    const double t0 = omp_get_wtime();
    for (int64_t n = 0; n < iters; ++n)
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(a, a, acc[i]);
    const double t = omp_get_wtime() - t0;
    float lanes[8];
    for (int i = 0; i < 12; ++i) {
      _mm256_storeu_ps(lanes, acc[i]);
      for (float x : lanes) sink += x;
    }
    const double f = static_cast<double>(iters) * 12 * 8 * 2;
#pragma omp critical
    {
      flops += f;
      if (t > seconds) seconds = t;
    }
  }
}
#endif

}  // namespace

// width 512 measures 512-bit vectors (0 where the CPU lacks AVX-512), width 256 the AVX2
// ones: a run capped to AVX2 (RADIXSERVE_CPU_ISA) compares its kernels with the 256-bit peak.
extern "C" double radixserve_peak_flops(int bf16, int64_t iters, int threads, int width) {
  double flops = 0.0, seconds = 0.0;
  float sink = 0.f;
#if defined(__AVX512F__)
  if (width == 512) peak_512(bf16, iters, threads, flops, seconds, sink);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (width == 256 && !bf16) peak_256(iters, threads, flops, seconds, sink);
#endif
  return sink == 12345.f ? 0.0 : (seconds > 0 ? flops / seconds : 0.0);
}

// Read bandwidth: every thread sums its share of `n` floats at `buf` (8 independent float32
// accumulators, which the compiler vectorises), best of `reps` passes. Returns bytes/s.
extern "C" double radixserve_read_bandwidth(const float* buf, int64_t n, int threads, int reps) {
  double best = 0.0;
  float sink = 0.f;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t b = n * t / nt, e = n * (t + 1) / nt;
      float acc[8] = {0};
      int64_t i = b;
      for (; i + 8 <= e; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += buf[i + j];
      for (; i < e; ++i) acc[0] += buf[i];
      for (int j = 0; j < 8; ++j) sink += acc[j];
    }
    const double dt = omp_get_wtime() - t0;
    if (dt > 0 && n * 4.0 / dt > best) best = n * 4.0 / dt;
  }
  return sink == 12345.f ? 0.0 : best;
}
