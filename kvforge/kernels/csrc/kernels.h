// kvforge CPU kernels: the per-layer ops of a decode step as single fused loops over fp32 data.
//
// Why: at batch 1 a SmolLM2 decode step streams ~540 MB of weights (~17 ms at this box's
// bandwidth) but also made ~20 small ATen calls per layer, ~9 ms in all (RMSNorm alone ~15 us
// for 576 floats: TensorIterator set-up, temporaries, a parallel region per op). Here every op
// is one pass, and DecodeStack runs a whole Llama decode step in one call from Python.
//
// Threads come from ATen's pool (at::parallel_for), never an OpenMP runtime of our own: the
// extension is built with -fopenmp-simd only, so `omp simd` vectorises and links nothing.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace kvforge {

// rows per parallel task so that a task touches >= ~64K floats (less work stays serial)
inline int64_t grain_rows(int64_t cols) {
  return std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(cols, 1));
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void check_fp32_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, " must be fp32 on CPU");
}

// ---- raw cores (pointers + row strides), shared by the tensor ops and DecodeStack ----------

// y = rms_norm(x + res) * w; sum = x + res (res == nullptr: sum unused, x normalised as is)
void add_rms_norm_rows(const float* x, int64_t xs, const float* res, int64_t rs, const float* w,
                       float* y, float* sum, int64_t rows, int64_t cols, float eps);

// out[r, i] = silu(in[r, i]) * in[r, inter + i]; in rows of stride `is`, out contiguous
void silu_and_mul_rows(const float* in, int64_t is, float* out, int64_t rows, int64_t inter);

// NeoX rotary of `heads` heads of `dim` floats per row, x -> out (may alias x), cos = [c | c],
// sin = [-s | s] per row: out[i] = x[i] * cos[i] + x[(i + dim/2) % dim] * sin[i]
void rotary_rows(const float* x, int64_t xs, float* out, int64_t os, const float* cos,
                 int64_t cs, const float* sin, int64_t ss, int64_t rows, int64_t heads,
                 int64_t dim);

// y [rows, out] = x [rows, in] @ w[out, in]^T for 1 <= rows <= kSmallMMax
constexpr int64_t kSmallMMax = 8;
void linear_rows(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out);

struct PagedKV {               // one layer's K or V plane: [num_blocks, block, kv_heads, dim]
  const float* data;
  int64_t block_stride, token_stride, head_stride, block_size, dim;
};

// One query token per sequence over its paged context (see attention.cpp for the map).
void decode_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, PagedKV keys,
                      PagedKV values, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      float scale, float* out);

// ---- tensor ops (bindings.cpp) ------------------------------------------------------------
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor rotary_neox(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor linear_small_m(at::Tensor x, at::Tensor weight);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale);

}  // namespace kvforge
