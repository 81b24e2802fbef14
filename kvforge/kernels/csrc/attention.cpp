// Decode attention straight from the paged cache (one query token per sequence, no gather):
//
//   q [n, H, D] (any row / head stride)   K, V planes [num_blocks, B, KVH, D]   -> out [n, H, Dv]
//
//   key j of sequence s lives in block block_tables[s][j / B] at offset j % B;
//   query head h reads KV head h / group (group = H / KVH), so each (s, kv head) task loads a
//   key row once and scores it against the `group` query heads that share it:
//
//     scores[g][j] = scale * q[s, kvh * group + g] . K[j, kvh]      j < seq_lens[s]
//     out[s, kvh * group + g] = softmax_j(scores[g]) @ V[:, kvh]
#include "kernels.h"

namespace kvforge {

void decode_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, PagedKV keys,
                      PagedKV values, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      float scale, float* out) {
  const int64_t group = heads / kv_heads, dim = keys.dim, dim_v = values.dim;
  const int64_t block = keys.block_size;
  // one task per (sequence, kv head); grain 1 because contexts differ in length
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<float> acc(group * dim_v);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t s = item / kv_heads, kvh = item % kv_heads, len = seq_lens[s];
      const int64_t* table = block_tables + s * table_stride;
      const float* qs = q + s * q_row_stride + kvh * group * q_head_stride;
      scores.resize(static_cast<size_t>(group * len));
      for (int64_t j = 0; j < len; ++j) {
        const float* key = keys.data + table[j / block] * keys.block_stride +
                           (j % block) * keys.token_stride + kvh * keys.head_stride;
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + j] = scale * dot(qs + g * q_head_stride, key, dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores.data() + g * len;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sc[j]);
        float total = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          sc[j] = std::exp(sc[j] - mx);
          total += sc[j];
        }
        const float inv = 1.f / total;
        for (int64_t j = 0; j < len; ++j) sc[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const float* val = values.data + table[j / block] * values.block_stride +
                           (j % block) * values.token_stride + kvh * values.head_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + j];
          float* a = acc.data() + g * dim_v;
#pragma omp simd
          for (int64_t d = 0; d < dim_v; ++d) a[d] += p * val[d];
        }
      }
      std::copy(acc.begin(), acc.end(), out + (s * heads + kvh * group) * dim_v);
    }
  });
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  check_fp32_cpu(q, "q");
  check_fp32_cpu(key_cache, "key_cache");
  check_fp32_cpu(value_cache, "value_cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [n, heads, dim] with contiguous heads");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1 && key_cache.size(3) == q.size(2),
              "caches must be [num_blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous() && block_tables.size(0) == q.size(0) &&
                  seq_lens.numel() == q.size(0),
              "block_tables [n, max_blocks] and seq_lens [n] must be int64");
  const int64_t n = q.size(0), heads = q.size(1), kv_heads = key_cache.size(2);
  TORCH_CHECK(n == 0 || seq_lens.max().item<int64_t>() <= block_tables.size(1) * key_cache.size(1),
              "a seq_len exceeds its block table");
  auto out = at::empty({n, heads, value_cache.size(3)}, q.options());
  PagedKV keys{key_cache.data_ptr<float>(), key_cache.stride(0), key_cache.stride(1),
               key_cache.stride(2), key_cache.size(1), key_cache.size(3)};
  PagedKV values{value_cache.data_ptr<float>(), value_cache.stride(0), value_cache.stride(1),
                 value_cache.stride(2), value_cache.size(1), value_cache.size(3)};
  decode_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), keys, values,
                   block_tables.data_ptr<int64_t>(), block_tables.stride(0),
                   seq_lens.data_ptr<int64_t>(), n, heads, kv_heads, static_cast<float>(scale),
                   out.data_ptr<float>());
  return out;
}

}  // namespace kvforge
