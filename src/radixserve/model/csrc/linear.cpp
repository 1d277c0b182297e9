// out[t, n] = dot(x[t], w[n]) in float32 for bfloat16 (or float32) weights and rows: the
// logits of a bfloat16 model without rounding them to bfloat16.
//
// Why: a bfloat16 matmul writes bfloat16 — 8 bits of mantissa, so logits near 25 are
// multiples of 0.125 and two candidate tokens a few hundredths apart come out equal; greedy
// decoding then takes whichever has the lower id. Computing the lm_head with float32
// accumulation and output keeps the model's ranking (the weights stay bfloat16).
//
// Each dot product sums in one fixed order — 16 running partial sums over k (k mod 16),
// the tail into the first partials, then a halving reduction — whatever the row count and
// thread count, so a row's logits do not depend on the batch it was computed in. Plain
// loops: the compiler vectorises them (16 lanes = two AVX2 or one AVX-512 register).
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace radixserve {
namespace {

constexpr int64_t kParts = 16;
constexpr int64_t kCols = 4;  // weight rows per inner step: x is loaded once for four dots

template <typename XT, typename WT>
void dot_cols(const XT* x, const WT* const* w, int64_t K, int64_t ncol, float* out) {
  float part[kCols][kParts] = {};
  int64_t k = 0;
  for (; k + kParts <= K; k += kParts) {
    float xv[kParts];
    for (int64_t j = 0; j < kParts; ++j) xv[j] = load_f32(x, k + j);
    for (int64_t c = 0; c < kCols; ++c)
      for (int64_t j = 0; j < kParts; ++j) part[c][j] = std::fma(xv[j], load_f32(w[c], k + j), part[c][j]);
  }
  for (int64_t j = 0; k < K; ++k, ++j)
    for (int64_t c = 0; c < kCols; ++c) part[c][j] = std::fma(load_f32(x, k), load_f32(w[c], k), part[c][j]);
  for (int64_t c = 0; c < ncol; ++c) {
    float* p = part[c];
    for (int64_t h = kParts / 2; h >= 1; h /= 2)
      for (int64_t j = 0; j < h; ++j) p[j] = p[j] + p[j + h];
    out[c] = p[0];
  }
}

template <typename XT, typename WT>
void linear_rows(const XT* x, int64_t xs, const WT* w, int64_t ws, float* out, int64_t os,
                 int64_t T, int64_t N, int64_t K) {
  // Blocks of output columns per task; every row of the batch reuses a block's weights
  // while they are in cache.
  const int64_t cols_per_task = 64;
  at::parallel_for(0, (N + cols_per_task - 1) / cols_per_task, 1, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t n0 = blk * cols_per_task, n1 = std::min(N, n0 + cols_per_task);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t n = n0; n < n1; n += kCols) {
          const int64_t nc = std::min(kCols, n1 - n);
          const WT* rows[kCols];
          for (int64_t c = 0; c < kCols; ++c) rows[c] = w + std::min(n + c, n1 - 1) * ws;
          dot_cols(x + t * xs, rows, K, nc, out + t * os + n);
        }
      }
    }
  });
}

}  // namespace

void linear_f32out_kernel(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const bool xb = x.scalar_type() == at::kBFloat16, wb = w.scalar_type() == at::kBFloat16;
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ws = w.stride(0), os = out.stride(0);
  const void* xp = x.data_ptr();
  const void* wp = w.data_ptr();
  auto X16 = static_cast<const uint16_t*>(xp);
  auto X32 = static_cast<const float*>(xp);
  auto W16 = static_cast<const uint16_t*>(wp);
  auto W32 = static_cast<const float*>(wp);
  if (xb && wb) linear_rows(X16, xs, W16, ws, op, os, T, N, K);
  else if (xb) linear_rows(X16, xs, W32, ws, op, os, T, N, K);
  else if (wb) linear_rows(X32, xs, W16, ws, op, os, T, N, K);
  else linear_rows(X32, xs, W32, ws, op, os, T, N, K);
}

}  // namespace radixserve
