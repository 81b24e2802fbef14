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
}  // namespace

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
  const int64_t group = heads / kv_heads;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * block, "seq_len exceeds its block table");
    for (int64_t b = 0; b < (lens[s] + block - 1) / block; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < num_blocks,
                  "block id out of range");
  }
  const float* cache = kv_cache.data_ptr<float>();
  const QuestLayout layout(num_blocks, kv_heads, block, dim);
  const int64_t head_stride = layout.head_stride, bounds_offset = layout.bounds_offset;
  const int64_t block_stride = layout.block_stride, plane = layout.plane;
  auto out = at::empty({n, heads, dim}, q.options());
  float* op = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const int64_t heads_stride = q.stride(1);

  // Three parallel phases, each split finely enough to keep every thread busy at batch 1:
  //   1. bounds   tasks (s, 64 blocks): a block's min/max rows of every KV head, one run per plane
  //   2. top-k    tasks (s, h): the chosen blocks' physical ids -> chosen[(s, h)]
  //   3. attend   tasks (s, h, 16 chosen blocks): partial softmaxes, merged per (s, h) as in
  //               decode attention (flash-decoding)
  std::vector<int64_t> num_logical(n);
  std::vector<char> sparse(n);
  for (int64_t s = 0; s < n; ++s) {
    num_logical[s] = (lens[s] + block - 1) / block;
    sparse[s] = num_logical[s] > k_blocks;
  }
  // the group's positive / negative query sums per (s, h): bound = q_pos . kmax + q_neg . kmin
  std::vector<float> q_pos(n * kv_heads * dim, 0.f), q_neg(n * kv_heads * dim, 0.f);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d) {
          const float v = qp[s * q.stride(0) + (h * group + g) * heads_stride + d];
          ((v > 0 ? q_pos : q_neg)[(s * kv_heads + h) * dim + d]) += v;
        }

  // ---- 1. bounds of every block but the current one: bounds[bound_base[s] + h * (nb - 1) + b]
  constexpr int64_t kBoundBlocks = 64;
  std::vector<int64_t> bound_base(n + 1, 0), bound_task(n + 1, 0);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t others = sparse[s] ? num_logical[s] - 1 : 0;
    bound_base[s + 1] = bound_base[s] + kv_heads * others;
    bound_task[s + 1] = bound_task[s] + (others + kBoundBlocks - 1) / kBoundBlocks;
  }
  std::vector<float> bounds(bound_base[n]);
  at::parallel_for(0, bound_task[n], 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t s =
          std::upper_bound(bound_task.begin(), bound_task.end(), t) - bound_task.begin() - 1;
      const int64_t others = num_logical[s] - 1;
      const int64_t b0 = (t - bound_task[s]) * kBoundBlocks;
      const int64_t b1 = std::min(others, b0 + kBoundBlocks);
      const int64_t* row = tables + s * max_blocks;
      for (int64_t b = b0; b < b1; ++b) {
        if (b + 8 < b1) {        // bounds rows sit in random blocks: fetch 8 blocks ahead
          const float* next = cache + row[b + 8] * block_stride + bounds_offset;
          for (int64_t c = 0; c < kv_heads * dim; c += 16) {
            __builtin_prefetch(next + c);
            __builtin_prefetch(next + plane + c);
          }
        }
        const float* kmin = cache + row[b] * block_stride + bounds_offset;
        const float* kmax = kmin + plane;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t qi = (s * kv_heads + h) * dim;
          bounds[bound_base[s] + h * others + b] =
              dot(q_pos.data() + qi, kmax + h * dim, dim) +
              dot(q_neg.data() + qi, kmin + h * dim, dim);
        }
      }
    }
  });

  // ---- 2. chosen physical blocks per (s, h); the current block last (only it is partial)
  std::vector<int64_t> chosen(n * kv_heads * k_blocks), num_chosen(n * kv_heads);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> order;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads, nb = num_logical[s];
      const int64_t* row = tables + s * max_blocks;
      int64_t* dst = chosen.data() + item * k_blocks;
      if (!sparse[s]) {                            // every block: dense over this sequence
        std::copy(row, row + nb, dst);
        num_chosen[item] = nb;
        continue;
      }
      const float* bs = bounds.data() + bound_base[s] + h * (nb - 1);
      order.resize(nb - 1);
      for (int64_t b = 0; b + 1 < nb; ++b) order[b] = b;
      std::nth_element(order.begin(), order.begin() + (k_blocks - 1), order.end(),
                       [&](int64_t a, int64_t b) { return bs[a] > bs[b]; });
      for (int64_t i = 0; i < k_blocks - 1; ++i) dst[i] = row[order[i]];
      dst[k_blocks - 1] = row[nb - 1];
      num_chosen[item] = k_blocks;
    }
  });

  // ---- 3. attention over the chosen keys, kChunk keys per task, then the merge
  //   the chosen list is a block table of its own: keys [0, keys_read) of (s, h), every block
  //   whole but the current one (last); one KV head's rows: a contiguous B x D run per block
  std::vector<int64_t> first_task(n * kv_heads + 1, 0), keys_read(n * kv_heads);
  for (int64_t item = 0; item < n * kv_heads; ++item) {
    const int64_t s = item / kv_heads;
    keys_read[item] = (num_chosen[item] - 1) * block + (lens[s] - (num_logical[s] - 1) * block);
    first_task[item + 1] = first_task[item] + (keys_read[item] + kChunk - 1) / kChunk;
  }
  std::vector<Partial> parts(first_task[n * kv_heads]);
  at::parallel_for(0, first_task[n * kv_heads], 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t item =
          std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin() - 1;
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t j0 = (t - first_task[item]) * kChunk;
      const int64_t j1 = std::min(keys_read[item], j0 + kChunk);
      const float* run = cache + h * head_stride;
      const PagedKV keys{run, block_stride, dim, head_stride, block, dim};
      const PagedKV values{run + plane, block_stride, dim, head_stride, block, dim};
      attend_chunk(qp + s * q.stride(0) + h * group * heads_stride, heads_stride, keys, values,
                   chosen.data() + item * k_blocks, j0, j1, 0, group, group,
                   static_cast<float>(scale), parts[t], scores);
    }
  });
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      merge_partials(parts.data() + first_task[item], first_task[item + 1] - first_task[item],
                     group, dim, op + (s * heads + h * group) * dim);
    }
  });
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
  const int64_t head_stride = layout.head_stride, bounds_offset = layout.bounds_offset;
  const int64_t block_stride = layout.block_stride, plane = layout.plane;
  // (block, last offset written) per touched block
  std::vector<std::pair<int64_t, int64_t>> touched;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t b = slots[t] / block, off = slots[t] % block;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* kt = k.data_ptr<float>() + t * k.stride(0) + h * dim;
      const float* vt = v.data_ptr<float>() + t * v.stride(0) + h * dim;
      float* dst = cache + b * block_stride + h * head_stride + off * dim;
      std::copy(kt, kt + dim, dst);
      std::copy(vt, vt + dim, dst + plane);
    }
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
    for (int64_t i = i0; i < i1; ++i) {
      const auto& [b, last_off] = last[i / kv_heads];
      const float* keys = cache + b * block_stride + (i % kv_heads) * head_stride;
      float* kmin = cache + b * block_stride + bounds_offset + (i % kv_heads) * dim;
      float* kmax = kmin + plane;
      std::copy(keys, keys + dim, kmin);
      std::copy(keys, keys + dim, kmax);
      for (int64_t o = 1; o <= last_off; ++o)
        for (int64_t c = 0; c < dim; ++c) {
          kmin[c] = std::min(kmin[c], keys[o * dim + c]);
          kmax[c] = std::max(kmax[c], keys[o * dim + c]);
        }
    }
  });
}

}  // namespace kvforge
