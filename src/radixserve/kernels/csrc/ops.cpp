// Registers the kernels as torch operators (torch.ops.radixserve.*) for CPU tensors.
// Each wrapper checks dtypes, devices and layouts once, so the kernels can index raw memory.
// Results are written into caller-provided tensors: the Python side owns every allocation
// (and can reuse buffers across layers).
#include "common.h"
#include "tiles.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>

namespace radixserve {
namespace {

bool is_f32_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// All entries of a contiguous int64 tensor in [0, hi): a plain loop (a few microseconds for
// a large decode batch) rather than a torch reduction and its dispatch per call.
void check_index(const int64_t* p, int64_t n, int64_t hi, const char* what) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok &= (p[i] >= 0) & (p[i] < hi);
  TORCH_CHECK(ok, what, " out of range [0, ", hi, ")");
}

void check_index(const at::Tensor& t, int64_t hi, const char* what) {
  check_index(t.data_ptr<int64_t>(), t.numel(), hi, what);
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// [rows, n] with unit stride along n (any row stride).
void check_rows(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
  TORCH_CHECK(is_f32_or_bf16(t), name, " must be float32 or bfloat16");
}

// A row's position and the rotary tables it indexes (float32 [positions, head_dim / 2]).
void check_rotary(const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t rows,
                  int64_t head_dim) {
  check_cpu(positions, "positions");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == rows,
              "positions must be int64 [rows]");
  for (const at::Tensor* t : {&cos, &sin}) {
    check_cpu(*t, "cos/sin");
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(1) == head_dim / 2, "cos/sin must be float32 [positions, head_dim/2]");
  }
  check_index(positions, cos.size(0), "position (rotary table)");
}

// The fused gate_up output and the activation-times-up rows it gives.
void check_gated(const at::Tensor& gu, const at::Tensor& out) {
  check_rows(gu, "gu");
  check_rows(out, "out");
  TORCH_CHECK(gu.size(0) == out.size(0) && gu.size(1) == 2 * out.size(1),
              "gu must be [rows, 2 * inter] for out [rows, inter]");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == x.size(1), "weight must be float32 [hidden]");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must have x's shape");
  rms_norm_kernel(x, weight, eps, out);
}

void add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps,
                  at::Tensor out) {
  check_rows(hidden, "hidden");
  check_rows(delta, "delta");
  check_rows(out, "out");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat, "hidden must be float32");
  TORCH_CHECK(delta.sizes() == hidden.sizes() && out.sizes() == hidden.sizes(),
              "delta and out must have hidden's shape");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == hidden.size(1), "weight must be float32 [hidden]");
  add_rms_norm_kernel(hidden, delta, weight, eps, out);
}

void rope_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin, int64_t n_rot_heads, int64_t head_dim) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(n_rot_heads >= 0 && n_rot_heads * head_dim <= qkv.size(1), "qkv is too narrow");
  check_rotary(positions, cos, sin, qkv.size(0), head_dim);
  rope_kernel(qkv, positions, cos, sin, n_rot_heads, head_dim);
}

void silu_mul(const at::Tensor& gu, at::Tensor out, int64_t isa) {
  check_gated(gu, out);
  silu_mul_kernel(gu, out, isa);
}

void gelu_tanh_mul(const at::Tensor& gu, at::Tensor out, int64_t isa) {
  check_gated(gu, out);
  gelu_tanh_mul_kernel(gu, out, isa);
}

void qk_norm_rope(const at::Tensor& qkv, const at::Tensor& weight, double eps, const at::Tensor& positions,
                  const at::Tensor& cos, const at::Tensor& sin, int64_t n_qk_heads, int64_t head_dim,
                  at::Tensor out) {
  check_rows(qkv, "qkv");
  check_cpu(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
              "out must be contiguous float32 [rows, heads * head_dim]");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim must be even and at most ",
              kMaxHeadDim);
  TORCH_CHECK(out.size(0) == qkv.size(0) && out.size(1) == qkv.size(1) && out.size(1) % head_dim == 0,
              "out must have qkv's shape, whole heads");
  TORCH_CHECK(n_qk_heads >= 0 && n_qk_heads * head_dim <= qkv.size(1), "qkv is too narrow");
  check_cpu(weight, "weight");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == n_qk_heads * head_dim, "weight must be float32 [n_qk_heads, head_dim]");
  check_rotary(positions, cos, sin, qkv.size(0), head_dim);
  qk_norm_rope_kernel(qkv, weight, eps, positions, cos, sin, n_qk_heads, head_dim, out);
}

// [rows, heads, D] with contiguous heads (any row stride).
void check_heads(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(is_f32_or_bf16(t), name, " must be float32 or bfloat16");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must be [rows, heads, head_dim] with contiguous heads");
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slots) {
  check_heads(k, "k");
  check_heads(v, "v");
  check_heads(k_cache, "k_cache");
  check_heads(v_cache, "v_cache");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k and v must match");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must match");
  TORCH_CHECK(k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2),
              "k heads / head_dim must match the cache");
  check_cpu(slots, "slots");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "slots must be int64 [rows]");
  check_index(slots, k_cache.size(0), "slot");
  store_kv_kernel(k, v, k_cache, v_cache, slots);
}

// A quantized pool's K or V: uint8 [slots, heads, D + kScaleBytes], contiguous heads.
void check_quant_cache(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.scalar_type() == at::kByte, name, " must be uint8 (a quantized pool)");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) && t.size(2) > kScaleBytes, name,
              " must be [slots, heads, head_dim + 4] with contiguous heads");
}

void check_kind(int64_t kind) {
  TORCH_CHECK(kind == kKvInt8 || kind == kKvFp8, "kv_kind must be 1 (int8) or 2 (fp8 e4m3), got ", kind);
}

void store_kv_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const at::Tensor& slots, int64_t kind) {
  check_kind(kind);
  check_heads(k, "k");
  check_heads(v, "v");
  check_quant_cache(k_cache, "k_cache");
  check_quant_cache(v_cache, "v_cache");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "k and v must match");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must match");
  TORCH_CHECK(k.size(1) == k_cache.size(1) && k.size(2) + kScaleBytes == k_cache.size(2),
              "k heads / head_dim must match the cache");
  check_cpu(slots, "slots");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "slots must be int64 [rows]");
  check_index(slots, k_cache.size(0), "slot");
  store_kv_quant_kernel(k, v, k_cache, v_cache, slots, kind);
}

// seq_info [B, 4] int64: (first q row, q rows, first entry in slots, kv length). Slots are
// bounds-checked here once; q rows and slot ranges are checked against the tensors. With a
// window (> 0) only the slots the kernel reads are checked: those of keys before the first
// new token's window may be stale.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, const at::Tensor& seq_info, at::Tensor out,
                     double scale, int64_t impl, int64_t window, int64_t kv_kind) {
  check_heads(q, "q");
  if (kv_kind == kKvFloat) {
    check_heads(k_cache, "k_cache");
    check_heads(v_cache, "v_cache");
  } else {
    check_kind(kv_kind);
    check_quant_cache(k_cache, "k_cache");
    check_quant_cache(v_cache, "v_cache");
  }
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must match");
  const int64_t H = q.size(1), KV = k_cache.size(1), D = q.size(2);
  TORCH_CHECK(k_cache.size(2) == D + (kv_kind == kKvFloat ? 0 : kScaleBytes) && KV > 0 && H % KV == 0,
              "k_cache rows must be head_dim (+ 4 scale bytes when quantized) and q heads a multiple of KV heads");
  check_rows(out, "out");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == H * D, "out must be [rows, heads * head_dim]");
  check_cpu(slots, "slots");
  check_cpu(seq_info, "seq_info");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "slots must be 1-D int64");
  TORCH_CHECK(seq_info.scalar_type() == at::kLong && seq_info.is_contiguous() && seq_info.dim() == 2 &&
                  seq_info.size(1) == 4, "seq_info must be int64 [seqs, 4]");
  TORCH_CHECK(impl >= 0 && impl <= 6, "impl must be 0..6 (attention.h: attn::Impl)");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = no sliding window)");
  const int64_t* si = seq_info.data_ptr<int64_t>();
  for (int64_t b = 0; b < seq_info.size(0); ++b) {
    const int64_t qs = si[4 * b], ql = si[4 * b + 1], ks = si[4 * b + 2], kl = si[4 * b + 3];
    TORCH_CHECK(ql >= 1 && kl >= ql && qs >= 0 && qs + ql <= q.size(0) && ks >= 0 &&
                    ks + kl <= slots.numel(), "seq_info row ", b, " is out of range");
  }
  if (window == 0) {
    check_index(slots, k_cache.size(0), "slot");
  } else {
    for (int64_t b = 0; b < seq_info.size(0); ++b) {
      const int64_t ql = si[4 * b + 1], ks = si[4 * b + 2], kl = si[4 * b + 3];
      const int64_t lo = std::max<int64_t>(0, kl - ql - window + 1);
      check_index(slots.data_ptr<int64_t>() + ks + lo, kl - lo, k_cache.size(0), "slot");
    }
  }
  paged_attention_kernel(q, k_cache, v_cache, slots, seq_info, out, scale, impl, window, kv_kind);
}

int64_t packed_elems(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * K; }

void pack_linear(const at::Tensor& w, at::Tensor packed) {
  check_rows(w, "w");
  check_cpu(packed, "packed");
  TORCH_CHECK(is_f32_or_bf16(packed) && packed.is_contiguous(), "packed must be contiguous float32 or bfloat16");
  TORCH_CHECK(packed.numel() == packed_elems(w.size(0), w.size(1)),
              "packed must have ceil(N / 16) * 16 * K elements");
  pack_linear_kernel(w, packed);
}

int64_t packed_dot_elems(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * 2 * ((K + 1) / 2); }

void pack_linear_dot(const at::Tensor& w, at::Tensor packed) {
  check_rows(w, "w");
  check_cpu(packed, "packed");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "packed must be contiguous bfloat16");
  TORCH_CHECK(packed.numel() == packed_dot_elems(w.size(0), w.size(1)),
              "packed must have ceil(N / 16) * 16 * 2 * ceil(K / 2) elements");
  pack_linear_dot_kernel(w, packed);
}

void packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                   const c10::optional<at::Tensor>& bias, at::Tensor out, int64_t isa, int64_t arith) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32");
  check_cpu(packed, "packed");
  TORCH_CHECK(arith >= kArithF32 && arith <= kArithDotTileModel,
              "arith must be 0 (float32 chains), 1 (bf16 dot products), 2 (the same, emulated) or 3 (the same, "
              "tile calls on the tile model)");
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == N, "out must be [rows of x, N]");
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be float32 [N]");
  }
  if (packed.scalar_type() == at::kByte) {  // a quantized weight: its header is checked there
    quant_linear_kernel(x, packed, N, bias, out, isa, arith);
    return;
  }
  TORCH_CHECK(is_f32_or_bf16(packed) && packed.is_contiguous(), "packed must be contiguous float32 or bfloat16");
  if (arith != kArithF32) {
    TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && N > 0 && packed.numel() == packed_dot_elems(N, x.size(1)),
                "packed does not hold [N, K] weights packed by pack_linear_dot for x's K");
  } else {
    TORCH_CHECK(N > 0 && packed.numel() == packed_elems(N, x.size(1)),
                "packed does not hold [N, K] weights for x's K");
  }
  if (arith == kArithF32)
    packed_linear_kernel(x, packed, N, bias, out, isa);
  else
    packed_linear_dot_kernel(x, packed, N, bias, out, isa, arith);
}

// act = gate(x Wg) * (x Wu) from a fused gate_up weight `packed` ([2 I, K]; kind kGateSilu or
// kGateGeluTanh). In one pass where the weight is dense bfloat16 dot panels
// (packed_gated_dot_kernel) or blocks that expand to them (quant_gated_kernel), I a multiple of
// 16, act float32 and `fuse` allows it; otherwise the GEMM into gu [T, 2 I] and then the gate,
// two passes. The same bits either way.
void gated_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, at::Tensor gu, at::Tensor act,
                  int64_t isa, int64_t arith, bool fuse) {
  check_gated(gu, act);
  TORCH_CHECK(kind == kGateSilu || kind == kGateGeluTanh, "kind must be 0 (silu) or 1 (gelu_tanh)");
  const int64_t inter = act.size(1);
  const bool can = fuse && arith != kArithF32 && inter % 16 == 0 && act.scalar_type() == at::kFloat;
  if (can) {
    check_rows(x, "x");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(0) == act.size(0), "x must be float32 [rows of act, K]");
    check_cpu(packed, "packed");
    if (packed.scalar_type() == at::kByte) {  // quantized: its header is checked there
      if (quant_gated_kernel(x, packed, kind, act, isa, arith)) return;
    } else if (packed.scalar_type() == at::kBFloat16) {
      TORCH_CHECK(packed.is_contiguous() && packed.numel() == packed_dot_elems(2 * inter, x.size(1)),
                  "packed does not hold [2 I, K] weights packed by pack_linear_dot for x's K");
      packed_gated_dot_kernel(x, packed, kind, act, isa, arith);
      return;
    }
  }
  packed_linear(x, packed, 2 * inter, c10::nullopt, gu, isa, arith);
  if (kind == kGateSilu)
    silu_mul(gu, act, isa);
  else
    gelu_tanh_mul(gu, act, isa);
}

void check_quant_format(int64_t fmt) {
  TORCH_CHECK(quant_block_bytes(fmt) > 0, "not a GGUF block format this build repacks: ", fmt);
}

int64_t quant_panel_bytes_op(int64_t fmt, int64_t K) {
  TORCH_CHECK(K > 0, "K must be positive");
  return quant_panel_bytes(fmt, K);
}

// A GGUF tensor's rows of blocks and the panels they are packed into (both layouts, the
// expansion's and the codes', are ceil(n / 16) panels of quant_panel_bytes).
void check_block_rows(const at::Tensor& rows, int64_t fmt, int64_t K, const at::Tensor& out) {
  check_quant_format(fmt);
  check_cpu(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.stride(1) == 1,
              "rows must be uint8 [n, bytes per row] with contiguous rows");
  TORCH_CHECK(K > 0 && K % quant_block_k(fmt) == 0 && rows.size(1) == K / quant_block_k(fmt) * quant_block_bytes(fmt),
              "rows must hold K / ", quant_block_k(fmt), " blocks of ", quant_block_bytes(fmt), " bytes");
  check_cpu(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.numel() == (rows.size(0) + 15) / 16 * quant_panel_bytes(fmt, K),
              "out must be contiguous uint8 of ceil(n / 16) panels");
}

void pack_quant(const at::Tensor& rows, int64_t fmt, int64_t K, at::Tensor out) {
  check_block_rows(rows, fmt, K, out);
  pack_quant_kernel(rows, fmt, K, out);
}

void pack_quant_int8(const at::Tensor& codes, const at::Tensor& scales, at::Tensor out) {
  check_cpu(codes, "codes");
  check_cpu(scales, "scales");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.stride(1) == 1,
              "codes must be int8 [n, K] with contiguous rows");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == codes.size(0),
              "scales must be float32 [n]");
  check_cpu(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.numel() == (codes.size(0) + 15) / 16 * quant_panel_bytes(100, codes.size(1)),
              "out must be contiguous uint8 of ceil(n / 16) panels");
  pack_quant_int8_kernel(codes, scales, out);
}

void pack_codes(const at::Tensor& rows, int64_t fmt, int64_t K, at::Tensor out) {
  check_block_rows(rows, fmt, K, out);
  pack_codes_kernel(rows, fmt, K, out);
}

int64_t q8dot_panel_bytes_op(int64_t fmt, int64_t K) {
  TORCH_CHECK(K > 0, "K must be positive");
  return q8dot_panel_bytes(fmt, K);
}

void pack_q8dot(const at::Tensor& rows, int64_t fmt, int64_t K, at::Tensor out) {
  check_quant_format(fmt);
  check_cpu(rows, "rows");
  TORCH_CHECK(rows.scalar_type() == at::kByte && rows.dim() == 2 && rows.stride(1) == 1,
              "rows must be uint8 [n, bytes per row] with contiguous rows");
  TORCH_CHECK(K > 0 && K % quant_block_k(fmt) == 0 && rows.size(1) == K / quant_block_k(fmt) * quant_block_bytes(fmt),
              "rows must hold K / ", quant_block_k(fmt), " blocks of ", quant_block_bytes(fmt), " bytes");
  check_cpu(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() &&
                  out.numel() == (rows.size(0) + 15) / 16 * q8dot_panel_bytes(fmt, K),
              "out must be contiguous uint8 of ceil(n / 16) panels");
  pack_q8dot_kernel(rows, fmt, K, out);
}

void q8dot_quantize(const at::Tensor& x, at::Tensor q, at::Tensor d, at::Tensor s) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(1) % 32 == 0, "x must be float32 [M, K], K a multiple of 32");
  const int64_t M = x.size(0), G = x.size(1) / 32;
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.numel() == M * x.size(1), "q must be int8 [M, K]");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == M * G, "d must be float32 [M, K / 32]");
  TORCH_CHECK(s.scalar_type() == at::kInt && s.is_contiguous() && s.numel() == M * G, "s must be int32 [M, K / 32]");
  q8dot_quantize_kernel(x, q, d, s);
}

void quant_rows(const at::Tensor& blob, const at::Tensor& ids, at::Tensor out) {
  check_cpu(ids, "ids");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be contiguous int64");
  check_cpu(out, "out");
  quant_rows_kernel(blob, ids, out);
}

// The rows `rows` (strictly increasing int64 indices) of a row-major tensor moved, in order,
// to its first rows.size(0) rows; the view of those rows is returned. In place: row i comes
// from row rows[i] >= i, which no earlier move has overwritten.
at::Tensor compact_rows(at::Tensor t, const at::Tensor& rows) {
  const int64_t R = rows.size(0), T = t.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  const size_t bytes = static_cast<size_t>(t.size(1)) * t.element_size();
  char* base = static_cast<char*>(t.data_ptr());
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(r[i] >= i && r[i] < T && (i == 0 || r[i] > r[i - 1]),
                "tail rows must be strictly increasing row indices of the step");
    if (r[i] != i) std::memmove(base + i * bytes, base + r[i] * bytes, bytes);
  }
  return t.narrow(0, 0, R);
}

// A layer's rows past its attention cut down to `tail`: the tensors in `moved` (row-aligned
// with the step: the residual, the attention output) get the tail rows in front
// (compact_rows), those in `narrowed` (buffers each op rewrites) are narrowed to as many rows.
// False when the tail is empty: nothing past the attention is needed.
bool to_tail(const at::Tensor& tail, std::initializer_list<at::Tensor*> moved,
             std::initializer_list<at::Tensor*> narrowed) {
  const int64_t R = tail.size(0);
  if (R == 0) return false;
  for (at::Tensor* t : moved) *t = compact_rows(*t, tail);
  for (at::Tensor* t : narrowed) *t = t->narrow(0, 0, R);
  return true;
}

void check_tail(const c10::optional<at::Tensor>& tail, const at::Tensor& hidden) {
  if (!tail.has_value()) return;
  check_cpu(*tail, "tail");
  TORCH_CHECK(tail->scalar_type() == at::kLong && tail->dim() == 1 && tail->is_contiguous() &&
                  tail->size(0) <= hidden.size(0),
              "tail must be a contiguous 1-D int64 tensor of at most T row indices");
  TORCH_CHECK(hidden.is_contiguous() && hidden.dim() == 2, "hidden must be contiguous [T, hidden]");
}

// The decoder layers of a Llama-family model in one call: the sequence of calls the Python
// loop of LlamaForCausalLM._layers_fused makes, through the same checked entry points, so the
// result is the same bits. A batch-1 decode step is ~300 kernel calls of a few microseconds
// each; from Python every one pays dispatch and argument parsing.
// Per layer l: x = norm_in(h) (l = 0) or h += delta, x = norm_in(h); qkv = x Wqkv (+ b);
// RoPE on the q and k heads; K/V into the pool; attention; h += o Wo, x = norm_post(h);
// gu = x Wgu; act = silu(g) * u; delta = act Wdown. After the last layer h += delta.
// Buffers (float32 rows of the batch): x [T, hidden], qkv [T, (H + 2 KV) D], attn [T, H D],
// d and delta [T, hidden], gu [T, 2 I], act [T, I].
// With `tail` (see compact_rows): the last layer runs past its attention on those rows only
// (every row's K/V is in the pool by then), and they end in hidden's first rows. A row's bits
// do not depend on the rows beside it, so they are the rows a full last layer gives.
void llama_layers(at::Tensor hidden, at::Tensor x, at::Tensor qkv, at::Tensor attn, at::Tensor d,
                  at::Tensor delta, at::Tensor gu, at::Tensor act, at::TensorList norm_in,
                  at::TensorList w_qkv, const c10::List<c10::optional<at::Tensor>>& b_qkv,
                  at::TensorList w_o, at::TensorList norm_post, at::TensorList w_gu,
                  at::TensorList w_down, at::TensorList k_caches, at::TensorList v_caches,
                  const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& out_slots, const at::Tensor& slots, const at::Tensor& seq_info,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                  double scale, int64_t impl, int64_t kv_kind, int64_t isa, int64_t arith,
                  const c10::optional<at::Tensor>& tail, bool fused_gate) {
  const size_t L = norm_in.size();
  check_tail(tail, hidden);
  TORCH_CHECK(w_qkv.size() == L && b_qkv.size() == L && w_o.size() == L && norm_post.size() == L &&
                  w_gu.size() == L && w_down.size() == L && k_caches.size() == L && v_caches.size() == L,
              "every per-layer list must have one entry per layer");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0, "heads and head_dim must be positive");
  for (const at::Tensor* t : {&qkv, &attn, &d, &delta, &gu, &act}) check_rows(*t, "buffer");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && attn.scalar_type() == at::kFloat,
              "qkv and attn must be float32");
  const int64_t T = hidden.size(0), qs = num_heads * head_dim, kvs = num_kv_heads * head_dim;
  TORCH_CHECK(qkv.size(0) == T && qkv.size(1) == qs + 2 * kvs, "qkv must be [T, (H + 2 KV) * D]");
  TORCH_CHECK(gu.size(1) == 2 * act.size(1), "gu must be [T, 2 * inter] for act [T, inter]");
  const int64_t hid = hidden.size(1), inter = act.size(1);
  // Views made once: the buffers are reused by every layer.
  const at::Tensor q = qkv.narrow(1, 0, qs).view({T, num_heads, head_dim});
  const at::Tensor k = qkv.narrow(1, qs, kvs).view({T, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, qs + kvs, kvs).view({T, num_kv_heads, head_dim});
  for (size_t l = 0; l < L; ++l) {
    if (l == 0)
      rms_norm(hidden, norm_in[l], eps, x);
    else
      add_rms_norm(hidden, delta, norm_in[l], eps, x);
    packed_linear(x, w_qkv[l], qs + 2 * kvs, b_qkv.get(l), qkv, isa, arith);
    rope_(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
    if (kv_kind == kKvFloat)
      store_kv(k, v, k_caches[l], v_caches[l], out_slots);
    else
      store_kv_quant(k, v, k_caches[l], v_caches[l], out_slots, kv_kind);
    paged_attention(q, k_caches[l], v_caches[l], slots, seq_info, attn, scale, impl, 0, kv_kind);
    at::Tensor h = hidden, a = attn, dd = d, xx = x, g = gu, ac = act, de = delta;
    if (l + 1 == L && tail.has_value() && !to_tail(*tail, {&h, &a}, {&dd, &xx, &g, &ac, &de})) return;
    packed_linear(a, w_o[l], hid, c10::nullopt, dd, isa, arith);
    add_rms_norm(h, dd, norm_post[l], eps, xx);
    gated_linear(xx, w_gu[l], kGateSilu, g, ac, isa, arith, fused_gate);
    packed_linear(ac, w_down[l], hid, c10::nullopt, de, isa, arith);
    if (l + 1 == L) h.add_(de);
  }
}

// The decoder layers of Gemma 3 in one call: the kernel-path loop of
// Gemma3ForCausalLM._run_layers, through the same checked entry points (see llama_layers).
// Per layer l, whose K/V live in k_caches[l] / v_caches[l] with that pool's out_slots, slots
// and seq_info (a hybrid model's sliding layers use the window pool's), window windows[l] and
// RoPE table cos[l] / sin[l]: qkv = x Wqkv (+ b); q, k per-head normed and rotated, v copied
// (qk_norm_rope into qk); K/V into the pool; attention; d = norm_post_attn(attn Wo);
// h += d, x = norm_pre_ff(h); d = norm_post_ff(gelu_tanh(g) * u Wdown); h += d and, but after
// the last layer, x = norm_in[l + 1](h). x = norm_in[0](h) first.
// Buffers (float32 rows): x [T, hidden], qkv and qk [T, (H + 2 KV) D], attn [T, H D],
// d and dn [T, hidden], gu [T, 2 I], act [T, I]. `tail`: as llama_layers'.
void gemma3_layers(at::Tensor hidden, at::Tensor x, at::Tensor qkv, at::Tensor qk, at::Tensor attn,
                   at::Tensor d, at::Tensor dn, at::Tensor gu, at::Tensor act, at::TensorList norm_in,
                   at::TensorList w_qkv, const c10::List<c10::optional<at::Tensor>>& b_qkv,
                   at::TensorList qk_norm, at::TensorList w_o, at::TensorList norm_post_attn,
                   at::TensorList norm_pre_ff, at::TensorList w_gu, at::TensorList w_down,
                   at::TensorList norm_post_ff, at::TensorList k_caches, at::TensorList v_caches,
                   at::TensorList out_slots, at::TensorList slots, at::TensorList seq_info,
                   at::IntArrayRef windows, at::TensorList cos, at::TensorList sin,
                   at::IntArrayRef impl, at::IntArrayRef kv_kind, const at::Tensor& positions,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                   int64_t isa, int64_t arith, const c10::optional<at::Tensor>& tail, bool fused_gate) {
  const size_t L = norm_in.size();
  check_tail(tail, hidden);
  for (size_t n : {w_qkv.size(), b_qkv.size(), qk_norm.size(), w_o.size(), norm_post_attn.size(),
                   norm_pre_ff.size(), w_gu.size(), w_down.size(), norm_post_ff.size(), k_caches.size(),
                   v_caches.size(), out_slots.size(), slots.size(), seq_info.size(), windows.size(),
                   cos.size(), sin.size(), impl.size(), kv_kind.size()})
    TORCH_CHECK(n == L, "every per-layer list must have one entry per layer");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && head_dim > 0, "heads and head_dim must be positive");
  for (const at::Tensor* t : {&qkv, &qk, &attn, &d, &dn, &gu, &act}) check_rows(*t, "buffer");
  const int64_t T = hidden.size(0), qs = num_heads * head_dim, kvs = num_kv_heads * head_dim;
  TORCH_CHECK(qkv.size(0) == T && qkv.size(1) == qs + 2 * kvs && qk.is_contiguous() &&
                  attn.scalar_type() == at::kFloat, "qkv and qk must be [T, (H + 2 KV) * D], attn float32");
  TORCH_CHECK(gu.size(1) == 2 * act.size(1), "gu must be [T, 2 * inter] for act [T, inter]");
  const int64_t hid = hidden.size(1), inter = act.size(1);
  const at::Tensor q = qk.narrow(1, 0, qs).view({T, num_heads, head_dim});
  const at::Tensor k = qk.narrow(1, qs, kvs).view({T, num_kv_heads, head_dim});
  const at::Tensor v = qk.narrow(1, qs + kvs, kvs).view({T, num_kv_heads, head_dim});
  if (L > 0) rms_norm(hidden, norm_in[0], eps, x);
  for (size_t l = 0; l < L; ++l) {
    packed_linear(x, w_qkv[l], qs + 2 * kvs, b_qkv.get(l), qkv, isa, arith);
    qk_norm_rope(qkv, qk_norm[l], eps, positions, cos[l], sin[l], num_heads + num_kv_heads, head_dim, qk);
    if (kv_kind[l] == kKvFloat)
      store_kv(k, v, k_caches[l], v_caches[l], out_slots[l]);
    else
      store_kv_quant(k, v, k_caches[l], v_caches[l], out_slots[l], kv_kind[l]);
    paged_attention(q, k_caches[l], v_caches[l], slots[l], seq_info[l], attn, scale, impl[l], windows[l],
                    kv_kind[l]);
    at::Tensor h = hidden, a = attn, dd = d, ddn = dn, xx = x, g = gu, ac = act;
    if (l + 1 == L && tail.has_value() && !to_tail(*tail, {&h, &a}, {&dd, &ddn, &xx, &g, &ac})) return;
    packed_linear(a, w_o[l], hid, c10::nullopt, dd, isa, arith);
    rms_norm(dd, norm_post_attn[l], eps, ddn);
    add_rms_norm(h, ddn, norm_pre_ff[l], eps, xx);
    gated_linear(xx, w_gu[l], kGateGeluTanh, g, ac, isa, arith, fused_gate);
    packed_linear(ac, w_down[l], hid, c10::nullopt, dd, isa, arith);
    rms_norm(dd, norm_post_ff[l], eps, ddn);
    if (l + 1 < L)
      add_rms_norm(h, ddn, norm_in[l + 1], eps, xx);
    else
      h.add_(ddn);
  }
}

}  // namespace
}  // namespace radixserve

TORCH_LIBRARY(radixserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.def("rope_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int n_rot_heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gu, Tensor(a!) out, int isa=0) -> ()");
  m.def("gelu_tanh_mul(Tensor gu, Tensor(a!) out, int isa=0) -> ()");
  m.def("qk_norm_rope(Tensor qkv, Tensor weight, float eps, Tensor positions, Tensor cos, Tensor sin, "
        "int n_qk_heads, int head_dim, Tensor(a!) out) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.def("store_kv_quant(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int kv_kind) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor seq_info, "
        "Tensor(a!) out, float scale, int impl, int window=0, int kv_kind=0) -> ()");
  m.def("pack_linear(Tensor w, Tensor(a!) packed) -> ()");
  m.def("pack_linear_dot(Tensor w, Tensor(a!) packed) -> ()");
  m.def("packed_linear(Tensor x, Tensor packed, int n, Tensor? bias, Tensor(a!) out, int isa, int arith=0) -> ()");
  m.def("gated_linear(Tensor x, Tensor packed, int kind, Tensor(a!) gu, Tensor(b!) act, int isa, int arith, "
        "bool fuse=True) -> ()");
  m.def("dot_native_built() -> bool", &radixserve::dot_native_built);
  m.def("amx_status() -> int", &radixserve::amx_status);
  m.def("tile_probe(bool hardware, bool ask_os) -> int", &radixserve::tile_probe);
  m.def("quant_panel_bytes(int fmt, int k) -> int", &radixserve::quant_panel_bytes_op);
  m.def("pack_quant(Tensor rows, int fmt, int k, Tensor(a!) out) -> ()");
  m.def("pack_quant_int8(Tensor codes, Tensor scales, Tensor(a!) out) -> ()");
  m.def("quant_rows(Tensor blob, Tensor ids, Tensor(a!) out) -> ()");
  m.def("q8dot_panel_bytes(int fmt, int k) -> int", &radixserve::q8dot_panel_bytes_op);
  m.def("pack_q8dot(Tensor rows, int fmt, int k, Tensor(a!) out) -> ()");
  m.def("pack_codes(Tensor rows, int fmt, int k, Tensor(a!) out) -> ()");
  m.def("q8dot_quantize(Tensor x, Tensor(a!) q, Tensor(b!) d, Tensor(c!) s) -> ()");
  m.def("llama_layers(Tensor(a!) hidden, Tensor(b!) x, Tensor(c!) qkv, Tensor(d!) attn, Tensor(e!) d, "
        "Tensor(f!) delta, Tensor(g!) gu, Tensor(h!) act, Tensor[] norm_in, Tensor[] w_qkv, Tensor?[] b_qkv, "
        "Tensor[] w_o, Tensor[] norm_post, Tensor[] w_gu, Tensor[] w_down, Tensor(i!)[] k_caches, "
        "Tensor(j!)[] v_caches, Tensor positions, Tensor cos, Tensor sin, Tensor out_slots, Tensor slots, "
        "Tensor seq_info, int num_heads, int num_kv_heads, int head_dim, float eps, float scale, int impl, "
        "int kv_kind, int isa, int arith=0, Tensor? tail=None, bool fused_gate=True) -> ()");
  m.def("gemma3_layers(Tensor(a!) hidden, Tensor(b!) x, Tensor(c!) qkv, Tensor(d!) qk, Tensor(e!) attn, "
        "Tensor(f!) d, Tensor(g!) dn, Tensor(h!) gu, Tensor(i!) act, Tensor[] norm_in, Tensor[] w_qkv, "
        "Tensor?[] b_qkv, Tensor[] qk_norm, Tensor[] w_o, Tensor[] norm_post_attn, Tensor[] norm_pre_ff, "
        "Tensor[] w_gu, Tensor[] w_down, Tensor[] norm_post_ff, Tensor(j!)[] k_caches, Tensor(k!)[] v_caches, "
        "Tensor[] out_slots, Tensor[] slots, Tensor[] seq_info, int[] windows, Tensor[] cos, Tensor[] sin, "
        "int[] impl, int[] kv_kind, Tensor positions, int num_heads, int num_kv_heads, int head_dim, "
        "float eps, float scale, int isa, int arith=0, Tensor? tail=None, bool fused_gate=True) -> ()");
  m.def("attention_impl(Tensor q, Tensor k_cache) -> int");
  m.def("attention_impl_available(int impl, Tensor k_cache, int head_dim, int kv_kind=0) -> bool");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("rms_norm", &radixserve::rms_norm);
  m.impl("add_rms_norm", &radixserve::add_rms_norm);
  m.impl("rope_", &radixserve::rope_);
  m.impl("silu_mul", &radixserve::silu_mul);
  m.impl("gelu_tanh_mul", &radixserve::gelu_tanh_mul);
  m.impl("qk_norm_rope", &radixserve::qk_norm_rope);
  m.impl("store_kv", &radixserve::store_kv);
  m.impl("store_kv_quant", &radixserve::store_kv_quant);
  m.impl("paged_attention", &radixserve::paged_attention);
  m.impl("pack_linear", &radixserve::pack_linear);
  m.impl("pack_linear_dot", &radixserve::pack_linear_dot);
  m.impl("packed_linear", &radixserve::packed_linear);
  m.impl("gated_linear", &radixserve::gated_linear);
  m.impl("pack_quant", &radixserve::pack_quant);
  m.impl("pack_quant_int8", &radixserve::pack_quant_int8);
  m.impl("quant_rows", &radixserve::quant_rows);
  m.impl("pack_q8dot", &radixserve::pack_q8dot);
  m.impl("pack_codes", &radixserve::pack_codes);
  m.impl("q8dot_quantize", &radixserve::q8dot_quantize);
  m.impl("llama_layers", &radixserve::llama_layers);
  m.impl("gemma3_layers", &radixserve::gemma3_layers);
  m.impl("attention_impl", &radixserve::attention_impl);
  m.impl("attention_impl_available", &radixserve::attention_impl_available);
}
