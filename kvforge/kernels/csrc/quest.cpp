// QUEST sparse decode straight from the paged cache (attention/quest.py is the reference):
//
//   cache [2, num_blocks, KVH * B + KVH, D] (head-major): per block, KVH contiguous runs of B K
//   (plane 0) / V (plane 1) rows, then one key min (plane 0) / key max (plane 1) row per head:
//
//     float offset of (plane p, block b, head h, slot o) = p * plane + b * block_stride
//                                                        + h * head_stride + o * D
//     ... of head h's bound row                          = p * plane + b * block_stride
//                                                        + bounds_offset + h * D
//     head_stride = B * D,  bounds_offset = KVH * head_stride,
//     block_stride = bounds_offset + KVH * D,  plane = num_blocks * block_stride
//
// Per (sequence s, KV head h), with its group's queries q_g:
//   bound[b] = sum_d max over the sign of (sum_g q_g)[d] of kmin[b][d], kmax[b][d]
//            = (sum_g max(q_g, 0)) . kmax[b] + (sum_g min(q_g, 0)) . kmin[b]
//   chosen   = the current (last, partial) block + the k - 1 other blocks with the largest bound
//   out[g]   = softmax attention of q_g over the chosen blocks' keys (order does not matter,
//              so the current block goes last and only it is partial)
#include "kernels.h"

namespace kvforge {

namespace {
struct QuestLayout {      // float strides of the head-major cache (the map above)
  int64_t head_stride, bounds_offset, block_stride, plane;
  QuestLayout(int64_t num_blocks, int64_t kv_heads, int64_t block, int64_t dim)
      : head_stride(block * dim),
        bounds_offset(kv_heads * block * dim),
        block_stride(kv_heads * (block + 1) * dim),
        plane(num_blocks * kv_heads * (block + 1) * dim) {}
};

// K and V of one token, KV heads [h0, h1) (k, v: their rows, dim floats each, adjacent), into
// slot `off` of block b
inline void quest_store_heads(float* cache, const QuestLayout& layout, int64_t dim, int64_t b,
                              int64_t off, const float* k, const float* v, int64_t h0,
                              int64_t h1) {
  for (int64_t h = h0; h < h1; ++h) {
    float* dst = cache + b * layout.block_stride + h * layout.head_stride + off * dim;
    std::copy(k + (h - h0) * dim, k + (h - h0 + 1) * dim, dst);
    std::copy(v + (h - h0) * dim, v + (h - h0 + 1) * dim, dst + layout.plane);
  }
}

// block b's key min (plane 0) / max (plane 1) row of KV head h, over its slots 0 .. last_off:
// from scratch, so a reused block, chunked prefill and a speculative rewrite stay exact
inline void quest_block_bounds(float* cache, const QuestLayout& layout, int64_t dim, int64_t b,
                               int64_t h, int64_t last_off) {
  const float* keys = cache + b * layout.block_stride + h * layout.head_stride;
  float* kmin = cache + b * layout.block_stride + layout.bounds_offset + h * dim;
  float* kmax = kmin + layout.plane;
  std::copy(keys, keys + dim, kmin);
  std::copy(keys, keys + dim, kmax);
  for (int64_t o = 1; o <= last_off; ++o)
    for (int64_t c = 0; c < dim; ++c) {
      kmin[c] = std::min(kmin[c], keys[o * dim + c]);
      kmax[c] = std::max(kmax[c], keys[o * dim + c]);
    }
}
}  // namespace

QuestDecodePlan::QuestDecodePlan(const int64_t* seq_lens, int64_t num_seqs,
                                 const int64_t* block_tables, int64_t table_stride,
                                 int64_t heads, int64_t kv_heads, int64_t dim,
                                 int64_t block_size, int64_t num_blocks, int64_t k_blocks)
    : seq_lens_(seq_lens), tables_(block_tables), table_stride_(table_stride),
      num_seqs_(num_seqs), heads_(heads), kv_heads_(kv_heads), group_(heads / kv_heads),
      dim_(dim), block_(block_size), k_blocks_(k_blocks) {
  const QuestLayout layout(num_blocks, kv_heads, block_size, dim);
  head_stride_ = layout.head_stride, bounds_offset_ = layout.bounds_offset;
  block_stride_ = layout.block_stride, plane_ = layout.plane;
  const int64_t n = num_seqs;
  num_logical_.resize(n);
  sparse_.resize(n);
  for (int64_t s = 0; s < n; ++s) {
    num_logical_[s] = (seq_lens[s] + block_size - 1) / block_size;
    sparse_[s] = num_logical_[s] > k_blocks;
  }
  //   bounds of sequence s, KV head h, other block b: bounds_[bound_base_[s] + h * (nb - 1) + b]
  bound_base_.assign(n + 1, 0);
  bound_task_.assign(n + 1, 0);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t others = sparse_[s] ? num_logical_[s] - 1 : 0;
    bound_base_[s + 1] = bound_base_[s] + kv_heads * others;
    bound_task_[s + 1] = bound_task_[s] + (others + kBoundBlocks - 1) / kBoundBlocks;
  }
  bounds_.resize(bound_base_[n]);
  chosen_.resize(n * kv_heads * k_blocks);
  num_chosen_.resize(n * kv_heads);
  // keys each (s, h) reads: the chosen blocks whole but the current one (last, partial); how
  // many are chosen does not depend on the bounds, so the attention tasks are known here
  first_task_.assign(n * kv_heads + 1, 0);
  keys_read_.resize(n * kv_heads);
  for (int64_t item = 0; item < n * kv_heads; ++item) {
    const int64_t s = item / kv_heads;
    const int64_t chosen = sparse_[s] ? k_blocks : num_logical_[s];
    keys_read_[item] = (chosen - 1) * block_size +
                       (seq_lens[s] - (num_logical_[s] - 1) * block_size);
    first_task_[item + 1] = first_task_[item] + (keys_read_[item] + kChunk - 1) / kChunk;
  }
  parts_.resize(first_task_.back());
}

void QuestDecodePlan::bound_task(int64_t t, const float* q, int64_t q_row_stride,
                                 int64_t q_head_stride, const float* cache) {
  const int64_t s =
      std::upper_bound(bound_task_.begin(), bound_task_.end(), t) - bound_task_.begin() - 1;
  const int64_t others = num_logical_[s] - 1, dim = dim_;
  const int64_t b0 = (t - bound_task_[s]) * kBoundBlocks;
  const int64_t b1 = std::min(others, b0 + kBoundBlocks);
  const int64_t* row = tables_ + s * table_stride_;
  // the group's positive / negative query sums per KV head: bound = q_pos . kmax + q_neg . kmin
  thread_local std::vector<float> q_pos, q_neg;
  q_pos.assign(kv_heads_ * dim, 0.f);
  q_neg.assign(kv_heads_ * dim, 0.f);
  for (int64_t h = 0; h < kv_heads_; ++h)
    for (int64_t g = 0; g < group_; ++g)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = q[s * q_row_stride + (h * group_ + g) * q_head_stride + d];
        ((v > 0 ? q_pos : q_neg)[h * dim + d]) += v;
      }
  for (int64_t b = b0; b < b1; ++b) {
    if (b + 8 < b1) {        // bounds rows sit in random blocks: fetch 8 blocks ahead
      const float* next = cache + row[b + 8] * block_stride_ + bounds_offset_;
      for (int64_t c = 0; c < kv_heads_ * dim; c += 16) {
        __builtin_prefetch(next + c);
        __builtin_prefetch(next + plane_ + c);
      }
    }
    const float* kmin = cache + row[b] * block_stride_ + bounds_offset_;
    const float* kmax = kmin + plane_;
    for (int64_t h = 0; h < kv_heads_; ++h)
      bounds_[bound_base_[s] + h * others + b] =
          dot(q_pos.data() + h * dim, kmax + h * dim, dim) +
          dot(q_neg.data() + h * dim, kmin + h * dim, dim);
  }
}

void QuestDecodePlan::select(int64_t item, std::vector<int64_t>& order) {
  const int64_t s = item / kv_heads_, h = item % kv_heads_, nb = num_logical_[s];
  const int64_t* row = tables_ + s * table_stride_;
  int64_t* dst = chosen_.data() + item * k_blocks_;
  if (!sparse_[s]) {                            // every block: dense over this sequence
    std::copy(row, row + nb, dst);
    num_chosen_[item] = nb;
    return;
  }
  const float* bs = bounds_.data() + bound_base_[s] + h * (nb - 1);
  order.resize(nb - 1);
  for (int64_t b = 0; b + 1 < nb; ++b) order[b] = b;
  std::nth_element(order.begin(), order.begin() + (k_blocks_ - 1), order.end(),
                   [&](int64_t a, int64_t b) { return bs[a] > bs[b]; });
  for (int64_t i = 0; i < k_blocks_ - 1; ++i) dst[i] = row[order[i]];
  dst[k_blocks_ - 1] = row[nb - 1];
  num_chosen_[item] = k_blocks_;
}

void QuestDecodePlan::attend_task(int64_t t, const float* q, int64_t q_row_stride,
                                  int64_t q_head_stride, const float* cache, float scale,
                                  std::vector<float>& scores) {
  // the chosen list is a block table of its own: keys [0, keys_read) of (s, h), every block
  // whole but the current one (last); one KV head's rows: a contiguous B x D run per block
  const int64_t item =
      std::upper_bound(first_task_.begin(), first_task_.end(), t) - first_task_.begin() - 1;
  const int64_t s = item / kv_heads_, h = item % kv_heads_;
  const int64_t j0 = (t - first_task_[item]) * kChunk;
  const int64_t j1 = std::min(keys_read_[item], j0 + kChunk);
  const float* run = cache + h * head_stride_;
  const PagedKV keys{run, block_stride_, dim_, head_stride_, block_, dim_};
  const PagedKV values{run + plane_, block_stride_, dim_, head_stride_, block_, dim_};
  attend_chunk(q + s * q_row_stride + h * group_ * q_head_stride, q_head_stride, keys, values,
               chosen_.data() + item * k_blocks_, j0, j1, 0, group_, group_, scale, parts_[t],
               scores);
}

void QuestDecodePlan::merge(int64_t item, float* out) const {
  const int64_t s = item / kv_heads_, h = item % kv_heads_;
  merge_partials(parts_.data() + first_task_[item], first_task_[item + 1] - first_task_[item],
                 group_, dim_, out + (s * heads_ + h * group_) * dim_);
}

void quest_attention(QuestDecodePlan& plan, const float* q, int64_t q_row_stride,
                     int64_t q_head_stride, const float* cache, float scale, float* out) {
  at::parallel_for(0, plan.num_bound_tasks(), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) plan.bound_task(t, q, q_row_stride, q_head_stride, cache);
  });
  at::parallel_for(0, plan.num_items(), 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> order;
    for (int64_t i = i0; i < i1; ++i) plan.select(i, order);
  });
  at::parallel_for(0, plan.num_attend_tasks(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t)
      plan.attend_task(t, q, q_row_stride, q_head_stride, cache, scale, scores);
  });
  at::parallel_for(0, plan.num_items(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) plan.merge(i, out);
  });
}

at::Tensor quest_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                        at::Tensor seq_lens, int64_t k_blocks, double scale, int64_t kv_heads) {
  check_fp32_cpu(q, "q");
  check_fp32_cpu(kv_cache, "kv_cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [n, heads, dim]");
  TORCH_CHECK(kv_heads >= 1 && q.size(1) % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(3) == q.size(2) && kv_cache.size(2) % kv_heads == 0 &&
                  kv_cache.size(2) / kv_heads >= 2,
              "kv_cache must be contiguous [2, num_blocks, kv_heads * (B + 1), dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.is_contiguous() && block_tables.size(0) == q.size(0) &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                  seq_lens.numel() == q.size(0),
              "block_tables [n, m] / seq_lens [n] int64");
  TORCH_CHECK(k_blocks >= 1, "k_blocks must be >= 1");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), block = kv_cache.size(2) / kv_heads - 1;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block, "seq_len exceeds its block table");
    for (int64_t b = 0; b < (lens[s] + block - 1) / block; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "block id out of range");
  }
  auto out = at::empty({n, heads, dim}, q.options());
  QuestDecodePlan plan(lens, n, tables, max_blocks, heads, kv_heads, dim, block, num_blocks,
                       k_blocks);
  quest_attention(plan, q.data_ptr<float>(), q.stride(0), q.stride(1),
                  kv_cache.data_ptr<float>(), static_cast<float>(scale),
                  out.data_ptr<float>());
  return out;
}

// The step's K/V into their slots, then each written block's key min/max recomputed over
// slots 0 .. the last one written (attention/quest.py write_kv_and_bounds: exact under block
// reuse, chunked prefill and speculative rollback).   slot = block * B + offset
void quest_write(at::Tensor kv_cache, at::Tensor k, at::Tensor v, at::Tensor slot_mapping) {
  check_fp32_cpu(kv_cache, "kv_cache");
  check_fp32_cpu(k, "k");
  check_fp32_cpu(v, "v");
  const int64_t kv_heads = k.dim() == 3 ? k.size(1) : 0;
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_heads >= 1 && kv_cache.size(2) % kv_heads == 0 &&
                  kv_cache.size(2) / kv_heads >= 2,
              "kv_cache must be contiguous [2, num_blocks, kv_heads * (B + 1), dim]");
  const int64_t num_blocks = kv_cache.size(1), block = kv_cache.size(2) / kv_heads - 1;
  const int64_t dim = kv_cache.size(3);
  const int64_t tokens = slot_mapping.numel();
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == tokens && v.size(0) == tokens &&
                  k.size(1) == kv_heads && v.size(1) == kv_heads && k.size(2) == dim &&
                  v.size(2) == dim && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.stride(1) == dim && v.stride(1) == dim,
              "k / v must be [tokens, kv_heads, dim] with contiguous heads");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_blocks * block, "slot out of range");
  float* cache = kv_cache.data_ptr<float>();
  const QuestLayout layout(num_blocks, kv_heads, block, dim);
  // (block, last offset written) per touched block
  std::vector<std::pair<int64_t, int64_t>> touched;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t b = slots[t] / block, off = slots[t] % block;
    quest_store_heads(cache, layout, dim, b, off, k.data_ptr<float>() + t * k.stride(0),
                      v.data_ptr<float>() + t * v.stride(0), 0, kv_heads);
    touched.emplace_back(b, off);
  }
  std::sort(touched.begin(), touched.end());
  std::vector<std::pair<int64_t, int64_t>> last;
  for (const auto& bo : touched) {
    if (!last.empty() && last.back().first == bo.first) last.back().second = bo.second;
    else last.push_back(bo);
  }
  // per (touched block, KV head): rows 0 .. last written of its contiguous run -> row B
  const int64_t items = static_cast<int64_t>(last.size()) * kv_heads;
  at::parallel_for(0, items, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      quest_block_bounds(cache, layout, dim, last[i / kv_heads].first, i % kv_heads,
                         last[i / kv_heads].second);
  });
}

}  // namespace kvforge
