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
// Sliding window (``window`` W > 0, per call: a layer's attention): a row at position p sees
// the keys p - W + 1 .. p only. An item starts at the block holding the first key its first
// row sees; keys before that key are never read (their slots may be stale: a sliding-window
// layer's cache frees them), their K/V pointers repeat that key's row, masked. A block that
// lies wholly before a row's window leaves the row's state as it was (m = -inf, l = 0,
// acc = 0: exp of -inf - -inf is 0 here), so a row's result still depends only on its q and
// the K/V in its window, whatever the split.
//
// Per block and row:
//   s_j  = dot(q, k_j) * scale     dot: fused multiply-adds over d in order (float32 mode),
//                                  or bf16 pair dot products over d pairs (bf16 mode)
//   s_j  = -inf past the row's position, and before its window
//   m'   = max(m, max_j s_j);  a = exp(m - m');  p_j = exp(s_j - m')
//   l    = l * a + halving_sum(p)  (p_i + p_i+16, then + 8, + 4, + 2, + 1)
//   acc  = acc * a;  acc = fma(p_j, v_j, acc) for j in order (float32 mode), or bf16 pair
//          dot products of (p_2i, p_2i+1) and (v_2i, v_2i+1) (bf16 mode)
// Output acc / l. exp is exp_f32 of common.h.
//
// Quantized pools (uint8 rows of head_dim int8 / fp8 e4m3 codes and a float32 scale, see
// radixserve/memory/quant.py): each K and V row a block reads is dequantized first, exactly
// (code * scale, one rounding: dequant_row of common.h), then read as a float32 row; every
// implementation dequantizes alike, so the float32-mode paths still agree bit for bit.
//
// Modes: float32 (float32 or bfloat16 pool; everything in float32) and bf16 (bfloat16 pool,
// AVX512-BF16 CPU: q and p rounded to bfloat16 and multiplied with vdpbf16ps, accumulation
// in float32; twice the float32 rate). The mode depends on the pool dtype and the CPU only.
//
// Work items are (sequence, KV head, a run of query positions); their rows are positions x
// the query heads of that KV head, so GQA shares every K/V read.
//
// Implementations, all computing the operations above (the float32-mode ones agree bit for
// bit), chosen by ``impl`` (kernels.py picks the best one the CPU has, under the
// RADIXSERVE_CPU_ISA cap):
//   kGeneric  portable C++ (this file), any CPU, any head size;
//   kAvx2     AVX2 + FMA, float32 mode (attention_avx2.cpp);
//   kF32      AVX-512, float32 mode; kBf16  AVX512-BF16, bf16 mode (attention_avx512.cpp).
#include "attention.h"

#include <c10/util/Exception.h>

#include <type_traits>

namespace radixserve {
namespace attn {

std::vector<Item> make_items(const Problem& P, int64_t nseq) {
  std::vector<Item> items;
  const int64_t gsz = std::min<int64_t>(P.G, kMaxRows);
  const int64_t bq = std::max<int64_t>(1, kMaxRows / gsz);
  for (int64_t b = 0; b < nseq; ++b) {
    const SeqInfo& s = P.seqs[b];
    const int64_t base = s.kv_len - s.q_len;
    for (int64_t p0 = 0; p0 < s.q_len; p0 += bq) {
      const int64_t p1 = std::min(p0 + bq, s.q_len);
      const int64_t blocks = (base + p1 - 1) / kBlockK - first_key(P, base + p0) / kBlockK + 1;
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

namespace {

// ------------------------------------------------------------------ portable path
// KT: float, uint16_t (bfloat16) or uint8_t (a quantized pool: rows are dequantized into
// float32 first, key by key for K and block by block for V).
template <typename KT>
void attend_generic(const Problem& P, const Item& it) {
  static_assert(kBlockK == 32, "halving_sum32 assumes 32-key blocks");
  constexpr bool kQuant = std::is_same_v<KT, uint8_t>;
  const int64_t D = P.D;
  const SeqInfo& sq = P.seqs[it.seq];
  const int64_t ng = it.g1 - it.g0, M = (it.p1 - it.p0) * ng;
  const int64_t base = sq.kv_len - sq.q_len;
  float* s = thread_scratch(static_cast<size_t>(M * D * 2 + M * (kBlockK + 8) + (kQuant ? (kBlockK + 1) * D : 0)));
  float* q = s;             // [M][D]
  float* acc = q + M * D;   // [M][D]
  float* st = acc + M * D;  // [kBlockK][M]
  float* m = st + kBlockK * M;
  float* l = m + M;
  float* alpha = l + M;
  int64_t* pos = reinterpret_cast<int64_t*>(alpha + M);
  float* kq = reinterpret_cast<float*>(pos + M);  // quantized pool: one K row in float32
  float* vq = kq + D;                             // ... and the block's V rows
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
  const int64_t klo = first_key(P, base + it.p0);  // keys before it are never read
  const int64_t* slots = P.slots + sq.kv_start;
  for (int64_t kb = klo / kBlockK; kb < nkb; ++kb) {
    const int64_t k0 = kb * kBlockK, kn = std::min(kBlockK, sq.kv_len - k0);
    for (int64_t j = 0; j < kBlockK; ++j) {
      const KT* krow = j < kn && k0 + j >= klo ? kp + slots[k0 + j] * P.kv_ss + it.kh * P.hs : nullptr;
      if constexpr (kQuant)
        if (krow != nullptr) dequant_row(krow, D, P.kv_kind, P.fp8, kq);
      for (int64_t r = 0; r < M; ++r) {
        float x = kNegInf;
        if (krow != nullptr && k0 + j <= pos[r] && k0 + j >= first_key(P, pos[r])) {
          float a = 0.f;
          if constexpr (kQuant)
            for (int64_t d = 0; d < D; ++d) a = std::fma(kq[d], q[r * D + d], a);
          else
            for (int64_t d = 0; d < D; ++d) a = std::fma(load_f32(krow, d), q[r * D + d], a);
          x = a * P.scale;
        }
        st[j * M + r] = x;
      }
    }
    if constexpr (kQuant)
      for (int64_t j = 0; j < kn; ++j)
        dequant_row(vp + slots[std::max(k0 + j, klo)] * P.kv_ss + it.kh * P.hs, D, P.kv_kind, P.fp8, vq + j * D);
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
        // (p is 0 for a key before the window; its V row is the first key's, as in the
        // vectorised paths, so that fma(0, v, a) has the same operands everywhere.)
        const float pj = st[j * M + r];
        if constexpr (kQuant) {
          for (int64_t d = 0; d < D; ++d) a[d] = std::fma(pj, vq[j * D + d], a[d]);
        } else {
          const KT* vrow = vp + slots[std::max(k0 + j, klo)] * P.kv_ss + it.kh * P.hs;
          for (int64_t d = 0; d < D; ++d) a[d] = std::fma(pj, load_f32(vrow, d), a[d]);
        }
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t t = sq.q_start + it.p0 + r / ng, h = it.kh * P.G + it.g0 + r % ng;
    for (int64_t d = 0; d < D; ++d) store_out(P, t * P.o_rs + h * D + d, acc[r * D + d] / l[r]);
  }
}

}  // namespace

// Which implementations exist for this pool storage and head size on this CPU. The bf16
// mode needs a bfloat16 pool; every other implementation serves every storage.
bool impl_available(int64_t impl, Store store, int64_t D) {
  switch (impl) {
    case kGeneric: return true;
    case kAvx2: return avx2_built() && avx2_head_dim(D);
    case kF32: return avx512_built(false) && avx512_head_dim(D);
    case kBf16: return avx512_built(true) && avx512_head_dim(D) && store == Store::kBf16;
    case kAmxModel: return avx512_built(true) && tile_head_dim(D) && store == Store::kBf16 && RS_TILES;
    case kAmx: return impl_available(kAmxModel, store, D) && amx_status() == kAmxReady;
    default: return false;
  }
}

// The fastest available: AMX tiles, AVX-512 bf16 dot products (bf16 pools), AVX-512, AVX2,
// portable.
int64_t pick_impl(Store store, int64_t D) {
  for (int64_t impl : {kAmx, kBf16, kF32, kAvx2})
    if (impl_available(impl, store, D)) return impl;
  return kGeneric;
}

Store store_of(const at::Tensor& k_cache, int64_t kv_kind) {
  if (kv_kind != kKvFloat) return Store::kQuant;
  return k_cache.scalar_type() == at::kBFloat16 ? Store::kBf16 : Store::kF32;
}

}  // namespace attn

using namespace attn;

int64_t attention_impl(const at::Tensor& q, const at::Tensor& k_cache) {
  return pick_impl(store_of(k_cache, k_cache.scalar_type() == at::kByte ? kKvInt8 : kKvFloat), q.size(-1));
}

bool attention_impl_available(int64_t impl, const at::Tensor& k_cache, int64_t head_dim, int64_t kv_kind) {
  return impl_available(impl, store_of(k_cache, kv_kind), head_dim);
}

void paged_attention_kernel(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& seq_info, at::Tensor& out, double scale,
                            int64_t impl, int64_t window, int64_t kv_kind) {
  Problem P;
  P.q = q.data_ptr();
  P.q_rs = q.stride(0);
  P.k = k_cache.data_ptr();
  P.v = v_cache.data_ptr();
  P.kv_ss = k_cache.stride(0);
  P.hs = k_cache.size(2);
  P.kv_kind = kv_kind;
  P.fp8 = kv_kind == kKvFp8 ? fp8_e4m3_table() : nullptr;
  P.slots = slots.data_ptr<int64_t>();
  P.seqs = reinterpret_cast<const SeqInfo*>(seq_info.data_ptr<int64_t>());
  P.out = out.data_ptr();
  P.o_rs = out.stride(0);
  P.H = q.size(1);
  P.KV = k_cache.size(1);
  P.G = P.H / P.KV;
  P.D = q.size(2);
  P.scale = static_cast<float>(scale);
  P.window = window;
  P.q_bf16 = q.scalar_type() == at::kBFloat16;
  P.out_bf16 = out.scalar_type() == at::kBFloat16;
  const Store store = store_of(k_cache, kv_kind);
  if (impl == kAuto) impl = pick_impl(store, P.D);
  TORCH_CHECK(impl_available(impl, store, P.D), "paged_attention: impl ", impl,
              " is not available for this pool dtype / head size / CPU");
  const auto items = make_items(P, seq_info.size(0));
  bool done = false;
  switch (impl) {
    case kAvx2: done = run_avx2(P, items, store); break;
    case kF32: done = run_avx512(P, items, store, false); break;
    case kBf16: done = run_avx512(P, items, store, true); break;
    case kAmx:
    case kAmxModel:
      P.tiles = impl == kAmx ? kTilesHardware : kTilesModel;
      done = run_avx512(P, items, store, true);
      break;
    default: break;
  }
  if (done) return;
  TORCH_CHECK(impl == kGeneric, "paged_attention: impl ", impl, " did not run");
  switch (store) {
    case Store::kBf16: run_items(items, [&](const Item& it) { attend_generic<uint16_t>(P, it); }); break;
    case Store::kQuant: run_items(items, [&](const Item& it) { attend_generic<uint8_t>(P, it); }); break;
    default: run_items(items, [&](const Item& it) { attend_generic<float>(P, it); }); break;
  }
}

}  // namespace radixserve
