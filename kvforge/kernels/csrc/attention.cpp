// Decode attention straight from the paged cache (one query token per sequence, no gather):
//
//   q [n, H, D] (any row / head stride)   K, V planes [num_blocks, B, KVH, D]   -> out [n, H, Dv]
//
//   key j of sequence s lives in block block_tables[s][j / B] at offset j % B; query head h
//   reads KV head h / group (group = H / KVH) -- no K/V copies per query head:
//
//     scores[h][j] = scale * q[s, h] . K[j, h / group]      j < seq_lens[s]
//     out[s, h] = softmax_j(scores[h]) @ V[:, h / group]
//
//   computed per chunk of kChunk keys (tasks run in parallel), then merged per sequence.
#include "kernels.h"

namespace kvforge {

namespace {

// Keys per task. A task reads whole token rows (all KV heads, contiguous in a block) in logical
// order; long contexts split into several tasks whose partial softmaxes merge at the end
// (flash-decoding), so even one sequence keeps every thread busy.
constexpr int64_t kChunk = 256;

struct Partial {        // softmax state of one (query, chunk) for every head
  std::vector<float> max, sum, acc;   // [H], [H], [H * Dv]
};

// Every row of one block that a task reads: kv_heads runs of dim floats per slot (adjacent in
// the token-major paged layout, B x dim runs apart in QUEST's head-major one).
inline void prefetch_block(const PagedKV& plane, int64_t block_id, int64_t kv_heads) {
  const float* base = plane.data + block_id * plane.block_stride;
  for (int64_t t = 0; t < plane.block_size; ++t)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t d = 0; d < plane.dim; d += 16)
        __builtin_prefetch(base + t * plane.token_stride + h * plane.head_stride + d);
}

void attend_chunk(const float* q, int64_t q_head_stride, const PagedKV& keys,
                  const PagedKV& values, const int64_t* table, int64_t j0, int64_t j1,
                  int64_t heads, int64_t kv_heads, float scale, Partial& part,
                  std::vector<float>& scores) {
  const int64_t group = heads / kv_heads, dim = keys.dim, dim_v = values.dim, len = j1 - j0;
  const int64_t block = keys.block_size;
  const bool lanes = dim % 16 == 0;
  scores.resize(static_cast<size_t>(heads * len));
  //   scores[h * len + (j - j0)] = scale * q[h] . K[j, h / group]
  for (int64_t j = j0; j < j1; ++j) {
    if (j % block == 0 && j + block < j1)       // next block's key rows (blocks are scattered)
      prefetch_block(keys, table[j / block + 1], kv_heads);
    const float* row = keys.data + table[j / block] * keys.block_stride + (j % block) * keys.token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float* key = row + (h / group) * keys.head_stride;
      const float* qh = q + h * q_head_stride;
      float score;
      if (lanes) {        // whole 16-float vectors, one horizontal sum per key
        vec16 acc = load16(qh) * load16(key);
        for (int64_t d = 16; d < dim; d += 16) acc += load16(qh + d) * load16(key + d);
        score = hsum(acc);
      } else {
        score = dot(qh, key, dim);
      }
      scores[h * len + (j - j0)] = scale * score;
    }
  }
  part.max.assign(heads, -INFINITY);
  part.sum.assign(heads, 0.f);
  part.acc.assign(heads * dim_v, 0.f);
  for (int64_t h = 0; h < heads; ++h) {
    float* sc = scores.data() + h * len;
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sc[j]);
    part.max[h] = mx;
    part.sum[h] = exp_shift_sum(sc, len, mx);
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (j % block == 0 && j + block < j1) prefetch_block(values, table[j / block + 1], kv_heads);
    const float* row = values.data + table[j / block] * values.block_stride + (j % block) * values.token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float p = scores[h * len + (j - j0)];
      const float* val = row + (h / group) * values.head_stride;
      float* a = part.acc.data() + h * dim_v;
#pragma omp simd
      for (int64_t d = 0; d < dim_v; ++d) a[d] += p * val[d];
    }
  }
}

// out[h] = sum_c e^(m_c - M) acc_c[h] / sum_c e^(m_c - M) l_c[h] over num_parts partials
void merge_partials(const Partial* parts, int64_t num_parts, int64_t heads, int64_t dim_v,
                    float* out) {
  for (int64_t h = 0; h < heads; ++h) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < num_parts; ++t) mx = std::max(mx, parts[t].max[h]);
    float* o = out + h * dim_v;
    std::fill(o, o + dim_v, 0.f);
    float total = 0.f;
    for (int64_t t = 0; t < num_parts; ++t) {
      const float w = std::exp(parts[t].max[h] - mx);
      total += w * parts[t].sum[h];
      const float* a = parts[t].acc.data() + h * dim_v;
#pragma omp simd
      for (int64_t d = 0; d < dim_v; ++d) o[d] += w * a[d];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t d = 0; d < dim_v; ++d) o[d] *= inv;
  }
}

}  // namespace

void decode_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, PagedKV keys,
                      PagedKV values, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      float scale, float* out) {
  const int64_t dim_v = values.dim;
  // tasks: (sequence s, chunk c) -> keys [c * kChunk, min((c + 1) * kChunk, len))
  std::vector<int64_t> first_task(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s)
    first_task[s + 1] = first_task[s] + std::max<int64_t>(1, (seq_lens[s] + kChunk - 1) / kChunk);
  const int64_t num_tasks = first_task[num_seqs];
  std::vector<Partial> parts(num_tasks);
  at::parallel_for(0, num_tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    int64_t s = std::upper_bound(first_task.begin(), first_task.end(), t0) - first_task.begin() - 1;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first_task[s + 1]) ++s;
      const int64_t c = t - first_task[s];
      const int64_t j0 = c * kChunk, j1 = std::min(seq_lens[s], j0 + kChunk);
      attend_chunk(q + s * q_row_stride, q_head_stride, keys, values,
                   block_tables + s * table_stride, j0, j1, heads, kv_heads, scale, parts[t],
                   scores);
    }
  });
  // merge chunk partials per sequence (flash-decoding)
  at::parallel_for(0, num_seqs, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      merge_partials(parts.data() + first_task[s], first_task[s + 1] - first_task[s], heads,
                     dim_v, out + s * heads * dim_v);
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
