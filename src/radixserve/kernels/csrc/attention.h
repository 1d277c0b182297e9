// Internal interface of the paged attention kernel, shared by its implementations: the
// problem description, work items, per-thread scratch and the helpers whose operation
// sequence every implementation must repeat (see attention.cpp for the arithmetic).
//
// Each instruction set has its own file (attention_avx2.cpp, attention_avx512.cpp), compiled
// to a stub that reports "not built" when the compiler does not target that instruction set
// (the library is built for the host CPU, so "built" means "this CPU has it").
#pragma once

#include "common.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace radixserve {
namespace attn {

constexpr int64_t kBlockK = 32;    // keys per online-softmax step (part of the arithmetic)
constexpr int64_t kMaxRows = 48;   // rows per work item: 3 vectors of q.k accumulators
constexpr int64_t kFewRows = 8;    // items with at most this many rows use keys-in-lanes
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Implementations (the ``impl`` argument of the operator; kernels.py names them).
// kAmx: the bf16 mode with a prefill item's q.k and p.v on the AMX tiles (attention_avx512.cpp,
// "tile blocks"); kAmxModel: the same on the tiles' software model (tiles.h; tests). Both give
// kBf16's bits.
enum Impl : int64_t { kAuto = 0, kGeneric = 1, kF32 = 2, kBf16 = 3, kAvx2 = 4, kAmx = 5, kAmxModel = 6 };

struct SeqInfo {
  int64_t q_start, q_len, kv_start, kv_len;
};

struct Problem {
  const void* q;
  int64_t q_rs;  // q[t * q_rs + h * D + d]
  const void* k;
  const void* v;
  int64_t kv_ss;  // k[slot * kv_ss + kh * hs + d]
  int64_t hs;     // elements per head row: D, or D + kScaleBytes in a quantized (uint8) pool
  int64_t kv_kind;  // kKvFloat (float32 / bfloat16 by pool dtype), kKvInt8 or kKvFp8
  const float* fp8;  // e4m3 code table (kKvFp8)
  const int64_t* slots;
  const SeqInfo* seqs;
  void* out;
  int64_t o_rs;  // out[t * o_rs + h * D + d]
  int64_t H, KV, G, D;
  float scale;
  int64_t window;  // sliding window W: a row at position p sees keys p - W + 1 .. p; 0 = all
  bool q_bf16, out_bf16;
  int tiles = 0;  // kTiles* (tiles.h): the unit a prefill item's blocks run on in the bf16 mode
};

// The first key position the row at position `pos` sees (0 without a window). For a work
// item, that of its first row is the first key it reads: the slots of keys before it are
// never read (a sliding-window layer's cache may have freed them).
inline int64_t first_key(const Problem& P, int64_t pos) {
  return P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0;
}

// Query positions [p0, p1) (indices into the sequence's new tokens) x heads [g0, g1) of
// KV head kh. Row r of the item is position p0 + r / (g1 - g0), head g0 + r % (g1 - g0).
struct Item {
  int64_t seq, kh, g0, g1, p0, p1, cost;
};

std::vector<Item> make_items(const Problem& P, int64_t nseq);

// 64-byte aligned per-thread scratch, grown on demand and kept for later calls.
float* thread_scratch(size_t n);

// Below this much work (Item::cost units) one thread is done before a parallel region
// would have started and joined its workers (decode of one short sequence, say).
constexpr int64_t kInlineCost = 500;

// Runs fn on every element of `items` (Item or anything else with a `cost`), costliest
// first as ordered, handed out dynamically to the threads.
template <typename T, typename F>
void run_items(const std::vector<T>& items, F&& fn) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  int64_t total = 0;
  for (const T& it : items) total += it.cost;
  if (nt <= 1 || total < kInlineCost || at::in_parallel_region()) {
    for (const T& it : items) fn(it);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(items[i]);
  });
}

// max as vmaxps computes it: a > b ? a : b.
inline float max_ps(float a, float b) { return a > b ? a : b; }

inline float halving_sum32(const float* p, int64_t stride) {
  float a[16];
  for (int i = 0; i < 16; ++i) a[i] = p[i * stride] + p[(i + 16) * stride];
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a[i] = a[i] + a[i + w];
  return a[0];
}

inline float load_q(const Problem& P, int64_t off) {
  return P.q_bf16 ? load_f32(static_cast<const uint16_t*>(P.q), off)
                  : load_f32(static_cast<const float*>(P.q), off);
}

inline void store_out(const Problem& P, int64_t off, float x) {
  if (P.out_bf16)
    store_f32(static_cast<uint16_t*>(P.out), off, x);
  else
    store_f32(static_cast<float*>(P.out), off, x);
}
// Full key blocks, before every query position of both sequences, that sequence sm's slots
// share with s0's (the same slots hold the same K/V: a cached prefix both extend). A
// decode step's sequences that share them can read each such block once for all of them.
inline int64_t shared_blocks(const Problem& P, const SeqInfo& s0, const SeqInfo& sm) {
  const int64_t limit = std::min(s0.kv_len - s0.q_len + 1, sm.kv_len - sm.q_len + 1) / kBlockK;
  const int64_t* a = P.slots + s0.kv_start;
  const int64_t* b = P.slots + sm.kv_start;
  int64_t n = 0;
  while (n < limit && std::memcmp(a + n * kBlockK, b + n * kBlockK, sizeof(int64_t) * kBlockK) == 0) ++n;
  return n;
}

// A thread's unit of work: units [first, first + n) of a reordered list, one unit or a bundle
// of units whose sequences start with the same slot (they share their prefix blocks).
struct Task {
  int64_t cost, first, n;
};

// Reorders `units` (anything with a `cost`) so that each bundle's sit side by side, and
// returns the tasks, costliest first. keyed: (first slot, index) of the units that may be
// bundled. Units with the same first slot form bundles of at most max_size, split so that
// every thread gets one where there are enough; a part of one unit runs alone, as do the
// units not keyed.
template <typename U>
std::vector<Task> bundle_by_first_slot(std::vector<U>& units, std::vector<std::pair<int64_t, int64_t>> keyed,
                                       int64_t max_size) {
  const int64_t nt = at::get_num_threads();
  std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<U> order;
  std::vector<Task> tasks;
  order.reserve(units.size());
  std::vector<char> bundled(units.size(), 0);
  for (size_t a = 0; a < keyed.size();) {
    size_t b = a;
    while (b < keyed.size() && keyed[b].first == keyed[a].first) ++b;
    const int64_t cnt = static_cast<int64_t>(b - a);
    const int64_t parts = std::max<int64_t>((cnt + max_size - 1) / max_size, std::min(cnt, nt));
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t i0 = p * cnt / parts, i1 = (p + 1) * cnt / parts;
      if (i1 - i0 < 2) continue;
      Task t{0, static_cast<int64_t>(order.size()), i1 - i0};
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t u = keyed[a + i].second;
        bundled[u] = 1;
        t.cost += units[u].cost;
        order.push_back(units[u]);
      }
      tasks.push_back(t);
    }
    a = b;
  }
  for (size_t i = 0; i < units.size(); ++i)
    if (!bundled[i]) {
      tasks.push_back({units[i].cost, static_cast<int64_t>(order.size()), 1});
      order.push_back(units[i]);
    }
  units.swap(order);
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

// Implementations in their own files. Each returns false (and does nothing) when it was not
// built for this CPU or does not serve this head size.
bool avx512_built(bool bf16_mode);
bool avx512_head_dim(int64_t D);
// Whether the bf16 mode can run head size D on a tile unit (whole 16-pair tile rows of q.k).
bool tile_head_dim(int64_t D);
// Pool storage, as the implementations dispatch on it.
enum class Store { kF32, kBf16, kQuant };
bool run_avx512(const Problem& P, const std::vector<Item>& items, Store store, bool bf16_mode);
bool avx2_built();
bool avx2_head_dim(int64_t D);
bool run_avx2(const Problem& P, const std::vector<Item>& items, Store store);

}  // namespace attn
}  // namespace radixserve
