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
//   computed per chunk of keys (tasks run in parallel), then merged per sequence. K / V planes
//   are fp32 or fp8 (quant/fp8_kv.py), the latter read through float copies of each block.
#include "kernels.h"

namespace kvforge {

namespace {

// Keys per task. A task reads whole token rows (all KV heads, contiguous in a block) in logical
// order; long contexts split into several tasks whose partial softmaxes merge at the end
// (flash-decoding), so even one sequence keeps every thread busy. Fixed, so that where a row's
// chunks start depends on its own length only: a row gives the same bits alone and beside any
// other rows (batch invariance: speculative verification rows equal decoding the same tokens
// one at a time, and a request's tokens do not depend on what it is batched with).
constexpr int64_t kChunk = 256;

using Partial = DecodeAttentionPlan::Partial;

// Every row of one block that a task reads: KV heads [kv0, kv1), runs of dim floats per slot
// (adjacent in the token-major paged layout, B x dim runs apart in QUEST's head-major one).
inline void prefetch_block(const PagedKV& plane, int64_t block_id, int64_t kv0, int64_t kv1) {
  const int64_t bytes = kv_element_bytes(plane.format);
  const char* base = static_cast<const char*>(plane.data) + block_id * plane.block_stride * bytes;
  for (int64_t t = 0; t < plane.block_size; ++t)
    for (int64_t h = kv0; h < kv1; ++h)
      for (int64_t d = 0; d < plane.dim * bytes; d += 64)
        __builtin_prefetch(base + (t * plane.token_stride + h * plane.head_stride) * bytes + d);
}

// Rows [t0, t0 + len) of one block of an fp8 plane, KV heads [kv0, kv1), as floats:
//
//   scratch [len][kv1 - kv0][dim]      token stride (kv1 - kv0) * dim, head stride dim
//
// The fp32 loops below then read them as they read an fp32 plane (the same order of sums:
// a row's bits are those of the fp32 kernel over the same values).
inline const float* fp8_rows(const PagedKV& plane, int64_t block_id, int64_t t0, int64_t len,
                             int64_t kv0, int64_t kv1, std::vector<float>& scratch) {
  const int64_t heads = kv1 - kv0, dim = plane.dim;
  scratch.resize(static_cast<size_t>(len * heads * dim));
  const uint8_t* base = static_cast<const uint8_t*>(plane.data) + block_id * plane.block_stride;
  for (int64_t t = 0; t < len; ++t)
    for (int64_t h = 0; h < heads; ++h)
      fp8_to_float(base + (t0 + t) * plane.token_stride + (kv0 + h) * plane.head_stride,
                   scratch.data() + (t * heads + h) * dim, dim, plane.format);
  return scratch.data();
}

// 16 vectors -> one vector of their 16 horizontal sums (lane t = sum of v[t]), by a halving
// tree: each level adds the two halves of pairs of vectors, interleaving the pairs,
//   level 1: [v0 | v1] halves of 8 lanes, level 2: 4 keys x 4 lanes, 3: 8 x 2, 4: 16 x 1
// (45 vector ops for 16 dot products, where 16 separate horizontal sums take ~130).
inline vec16 transpose_sum(const vec16* v) {
  vec16 c[8], d[4], e[2];
  for (int i = 0; i < 8; ++i)
    c[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// 8 vectors -> one vector of their 8 horizontal sums, the same halving tree in 256-bit terms
// (AVX2 builds: 16 ymm registers, where the 16-key tree above spills every vector to the stack
// and ran 5x slower than the AVX-512 build at batch 64):
//   level 1: [v0 | v1] halves of 4 lanes (a 128-bit permute), level 2: 4 keys x 2 lanes,
//   level 3: 8 keys x 1 lane in the order [0 2 4 6 | 1 3 5 7] (in-lane shuffles), put in order
inline vec8 transpose_sum(const vec8* v) {
  vec8 c[4], d[2];
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  //   c[i] = [key 2i: 4 partials | key 2i+1: 4 partials]
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  //   d[i] = [key 4i: 2 | key 4i+2: 2 | key 4i+1: 2 | key 4i+3: 2]
  const vec8 e = __builtin_shufflevector(d[0], d[1], 0, 2, 8, 10, 4, 6, 12, 14) +
                 __builtin_shufflevector(d[0], d[1], 1, 3, 9, 11, 5, 7, 13, 15);
  //   e = [keys 0 2 4 6 | 1 3 5 7]
  return __builtin_shufflevector(e, e, 0, 4, 1, 5, 2, 6, 3, 7);
}

// q . K[t] for as many keys t as a V has lanes (token rows `stride` floats apart): one vector
// accumulator a key, one transposed reduction (dim a multiple of the lanes)
template <class V>
inline V key_dots(const float* qh, const float* key, int64_t stride, int64_t dim) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  const auto at = [](const float* p) { return *reinterpret_cast<const V*>(p); };
  V acc[kLanes];
  for (int t = 0; t < kLanes; ++t) acc[t] = at(qh) * at(key + t * stride);
  for (int64_t d = kLanes; d < dim; d += kLanes) {
    const V qd = at(qh + d);
    for (int t = 0; t < kLanes; ++t) acc[t] += qd * at(key + t * stride + d);
  }
  return transpose_sum(acc);
}

// scale * q . K[t] for 16 keys t into sc[0..15], in tiles of one register's width (kernels.h's
// vecn): one 16-key tile with AVX-512, two of 8 keys with AVX2 (8 ymm accumulators + q fit its
// 16 registers)
inline void scores_16(const float* qh, const float* key, int64_t stride, int64_t dim, float scale,
                      float* sc) {
  for (int t0 = 0; t0 < 16; t0 += kVecLanes)
    store_vec(sc + t0, key_dots<vecn>(qh, key + t0 * stride, stride, dim) * scale);
}

// a[0..dim_v) += sum_t sc[t] * V[t] over len token rows (`stride` floats apart); dim_v a
// multiple of kVecLanes. 4 vectors of dims at a time: 4 independent FMA chains over keys
inline void accumulate_values(float* a, const float* val, int64_t stride, int64_t len,
                              int64_t dim_v, const float* sc) {
  constexpr int64_t L = kVecLanes;
  int64_t d = 0;
  for (; d + 4 * L <= dim_v; d += 4 * L) {
    vecn ad[4];
    for (int c = 0; c < 4; ++c) ad[c] = loadn(a + d + L * c);
    for (int64_t t = 0; t < len; ++t)
      for (int c = 0; c < 4; ++c) ad[c] += sc[t] * loadn(val + t * stride + d + L * c);
    for (int c = 0; c < 4; ++c) store_vec(a + d + L * c, ad[c]);
  }
  for (; d < dim_v; d += L) {
    vecn ad = loadn(a + d);
    for (int64_t t = 0; t < len; ++t) ad += sc[t] * loadn(val + t * stride + d);
    store_vec(a + d, ad);
  }
}

// Softmax attention of one query token (heads [h0, h1)) over keys [j0, j1) of a paged sequence,
// block by block with an online softmax: per head a running max m, sum l and accumulator acc,
// rescaled by e^(m_old - m_new) when a block raises the max. Per block and KV head:
//
//   scores[t] = scale * q_h . K[t]       16 keys at once (scores_16): a vector accumulator
//                                        a key, one transposed reduction (transpose_sum)
//   acc_h    += sum_t e^(scores[t] - m) V[t]   one register per 16 (AVX2: 8) dims, carried
//                                              over the rows (accumulate_values)
//
// so a block's K and V rows are read back to back while the next block is prefetched.
void attend_chunk(const float* q, int64_t q_head_stride, const PagedKV& keys,
                  const PagedKV& values, const int64_t* table, int64_t j0, int64_t j1,
                  int64_t h0, int64_t h1, int64_t group, float scale, Partial& part,
                  std::vector<float>& scores) {
  const int64_t dim = keys.dim, dim_v = values.dim;
  const int64_t block = keys.block_size;
  const bool lanes = dim % kVecLanes == 0 && dim_v % kVecLanes == 0;
  const int64_t kv0 = h0 / group, kv1 = (h1 - 1) / group + 1;
  part.max.assign(h1 - h0, -INFINITY);
  part.sum.assign(h1 - h0, 0.f);
  part.acc.assign((h1 - h0) * dim_v, 0.f);
  scores.resize(static_cast<size_t>(block));
  // an fp8 plane is read through per-block float copies of the task's KV heads (fp8_rows)
  const bool fp8 = keys.format != KVFormat::kF32;
  thread_local std::vector<float> key_rows, value_rows;
  for (int64_t b = j0 / block; b * block < j1; ++b) {
    if ((b + 1) * block < j1) {                   // the next block (blocks are scattered)
      prefetch_block(keys, table[b + 1], kv0, kv1);
      prefetch_block(values, table[b + 1], kv0, kv1);
    }
    const int64_t t0 = std::max(j0, b * block) - b * block;
    const int64_t len = std::min(j1, (b + 1) * block) - b * block - t0;
    const float *kb, *vb;
    int64_t k_token, k_head, v_token, v_head, kv_first;
    if (fp8) {
      kb = fp8_rows(keys, table[b], t0, len, kv0, kv1, key_rows);
      vb = fp8_rows(values, table[b], t0, len, kv0, kv1, value_rows);
      k_token = (kv1 - kv0) * dim, v_token = (kv1 - kv0) * dim_v, k_head = dim, v_head = dim_v;
      kv_first = kv0;
    } else {
      kb = static_cast<const float*>(keys.data) + table[b] * keys.block_stride +
           t0 * keys.token_stride;
      vb = static_cast<const float*>(values.data) + table[b] * values.block_stride +
           t0 * values.token_stride;
      k_token = keys.token_stride, v_token = values.token_stride;
      k_head = keys.head_stride, v_head = values.head_stride, kv_first = 0;
    }
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t i = h - h0;                   // the head's place in the partial
      const float* key = kb + (h / group - kv_first) * k_head;
      const float* val = vb + (h / group - kv_first) * v_head;
      const float* qh = q + h * q_head_stride;
      float* sc = scores.data();
      if (lanes && len == 16) {
        scores_16(qh, key, k_token, dim, scale, sc);
      } else {
        for (int64_t t = 0; t < len; ++t) sc[t] = scale * dot(qh, key + t * k_token, dim);
      }
      float mx = part.max[i];
      for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sc[t]);
      float* a = part.acc.data() + i * dim_v;
      if (mx > part.max[i]) {                     // rescale what the old max weighted
        const float corr = std::exp(part.max[i] - mx);
        part.sum[i] *= corr;
#pragma omp simd
        for (int64_t d = 0; d < dim_v; ++d) a[d] *= corr;
        part.max[i] = mx;
      }
      part.sum[i] += exp_shift_sum(sc, len, mx);
      if (lanes) {
        accumulate_values(a, val, v_token, len, dim_v, sc);
      } else {
        for (int64_t t = 0; t < len; ++t)
#pragma omp simd
          for (int64_t d = 0; d < dim_v; ++d) a[d] += sc[t] * val[t * v_token + d];
      }
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

DecodeAttentionPlan::DecodeAttentionPlan(const int64_t* seq_lens, int64_t num_seqs,
                                         int64_t heads, int64_t kv_heads, int64_t dim_v,
                                         int threads, int64_t window, int64_t sinks)
    : seq_lens_(seq_lens), num_seqs_(num_seqs), heads_(heads), group_(heads / kv_heads),
      dim_v_(dim_v), sinks_(sinks) {
  // tasks: (sequence s, head range p, chunk c) -> keys [max(lo, (c0 + c) * chunk),
  // min((c0 + c + 1) * chunk, len)) of heads [p * heads / splits, (p + 1) * heads / splits),
  // where lo = max(0, len - window) is the row's first visible key (0 without a window) and
  // c0 = lo / chunk: chunks stay at whole multiples of the chunk in absolute positions.
  //
  //   keys   0 ....... 256 ....... 512 ....... 768      len = 700, window = 512: lo = 188
  //   chunks           [188, 256)  [256, 512)  [512, 700)
  //
  // Fewer chunk tasks than ~2 per
  // thread (batch 1 at 64 or 300 tokens: 1 or 2 chunks) split the heads as well; a head's sums
  // do not depend on which task runs it, so the split keeps the rows' bits. Tasks go to the
  // threads in contiguous runs, so a row's chunks of one head range share a thread: batch 1 at
  // 300 tokens gives each thread one head range's 256 + 44 keys, not one thread 256 keys and
  // the other 44. (Chunks sized to the batch balanced that too, but moved a row's chunk bounds
  // with the number of rows, and its rounding with them.)
  //
  // Sinks (window > 0): a row whose window starts past them (lo > sinks) reads them as one more
  // chunk, its chunk 0, keys [0, sinks) with the sinks' query; one whose window reaches them
  // reads every key [0, len) as a row without a window does (the two sets join):
  //
  //   keys   0 1 2 3 . . . . . . 256 ..... 700     len = 700, window = 512, sinks = 4
  //   chunks [0, 4) (q_sink)    [188, 256)  [256, 512)  [512, 700)
  TORCH_CHECK(window >= 0, "attention window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(sinks >= 0 && (sinks == 0 || window > 0),
              "attention sinks must be >= 0 and come with a window, got ", sinks);
  chunk_ = kChunk;
  const int64_t want_tasks = 2 * static_cast<int64_t>(threads);
  chunks_.resize(num_seqs);
  first_key_.resize(num_seqs);
  sink_chunk_.assign(num_seqs, 0);
  int64_t chunk_tasks = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    int64_t lo = window > 0 ? std::max<int64_t>(0, seq_lens[s] - window) : 0;
    if (sinks > 0 && lo > sinks) sink_chunk_[s] = 1;
    else if (sinks > 0) lo = 0;
    first_key_[s] = lo;
    const int64_t c0 = lo / chunk_, c1 = (seq_lens[s] + chunk_ - 1) / chunk_;
    chunks_[s] = std::max<int64_t>(1, c1 - c0) + sink_chunk_[s];
    chunk_tasks += chunks_[s];
  }
  splits_ = chunk_tasks >= want_tasks
                ? 1 : std::min(heads, (want_tasks + chunk_tasks - 1) / chunk_tasks);
  needs_merge_ = chunk_tasks != num_seqs;
  //   tasks of sequence s: first_task[s] + p * chunks[s] + c
  first_task_.assign(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s)
    first_task_[s + 1] = first_task_[s] + splits_ * chunks_[s];
  parts_.resize(first_task_.back());
}

void DecodeAttentionPlan::run_task(int64_t t, const float* q, int64_t q_row_stride,
                                   int64_t q_head_stride, const PagedKV& keys,
                                   const PagedKV& values, const int64_t* block_tables,
                                   int64_t table_stride, float scale, float* out,
                                   std::vector<float>& scores, const float* q_sink,
                                   int64_t q_sink_row_stride) {
  const int64_t s = std::upper_bound(first_task_.begin(), first_task_.end(), t) -
                    first_task_.begin() - 1;
  const int64_t p = (t - first_task_[s]) / chunks_[s], c = (t - first_task_[s]) % chunks_[s];
  const int64_t h0 = p * heads_ / splits_, h1 = (p + 1) * heads_ / splits_;
  const int64_t* table = block_tables + s * table_stride;
  if (sink_chunk_[s] && c == 0) {               // the sinks, with their own query
    const float* qs = q_sink != nullptr ? q_sink + s * q_sink_row_stride : q + s * q_row_stride;
    attend_chunk(qs, q_head_stride, keys, values, table, 0, sinks_, h0, h1, group_, scale,
                 parts_[t], scores);
    return;                                     // chunks_[s] >= 2: merged after
  }
  const int64_t lo = first_key_[s], base = (lo / chunk_ + c - sink_chunk_[s]) * chunk_;
  const int64_t j0 = std::max(lo, base), j1 = std::min(seq_lens_[s], base + chunk_);
  attend_chunk(q + s * q_row_stride, q_head_stride, keys, values, table, j0, j1, h0, h1, group_,
               scale, parts_[t], scores);
  if (chunks_[s] == 1)           // the whole sequence: normalise in place, nothing to merge
    merge_partials(&parts_[t], 1, h1 - h0, dim_v_, out + (s * heads_ + h0) * dim_v_);
}

// merge chunk partials per sequence and head range (flash-decoding)
void DecodeAttentionPlan::merge(int64_t i, float* out) const {
  const int64_t s = i / splits_, p = i % splits_;
  if (chunks_[s] == 1) return;
  const int64_t h0 = p * heads_ / splits_, h1 = (p + 1) * heads_ / splits_;
  merge_partials(parts_.data() + first_task_[s] + p * chunks_[s], chunks_[s], h1 - h0, dim_v_,
                 out + (s * heads_ + h0) * dim_v_);
}

void decode_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, PagedKV keys,
                      PagedKV values, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      float scale, float* out, int64_t window, int64_t sinks,
                      const float* q_sink, int64_t q_sink_row_stride) {
  DecodeAttentionPlan plan(seq_lens, num_seqs, heads, kv_heads, values.dim,
                           at::get_num_threads(), window, sinks);
  at::parallel_for(0, plan.num_tasks(), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t)
      plan.run_task(t, q, q_row_stride, q_head_stride, keys, values, block_tables, table_stride,
                    scale, out, scores, q_sink, q_sink_row_stride);
  });
  at::parallel_for(0, plan.num_merges(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) plan.merge(i, out);
  });
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window, int64_t sinks, c10::optional<at::Tensor> q_sink) {
  check_fp32_cpu(q, "q");
  const KVFormat format = kv_format_of(key_cache, "key_cache");
  TORCH_CHECK(kv_format_of(value_cache, "value_cache") == format,
              "key_cache and value_cache must have one dtype");
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
  const bool has_q_sink = q_sink.has_value() && q_sink->defined();
  if (has_q_sink) {
    check_fp32_cpu(*q_sink, "q_sink");
    TORCH_CHECK(q_sink->sizes() == q.sizes() && q_sink->stride(1) == q.stride(1) &&
                    q_sink->stride(2) == 1, "q_sink must be shaped and head-strided like q");
  }
  auto out = at::empty({n, heads, value_cache.size(3)}, q.options());
  PagedKV keys{key_cache.data_ptr(), key_cache.stride(0), key_cache.stride(1),
               key_cache.stride(2), key_cache.size(1), key_cache.size(3), format};
  PagedKV values{value_cache.data_ptr(), value_cache.stride(0), value_cache.stride(1),
                 value_cache.stride(2), value_cache.size(1), value_cache.size(3), format};
  decode_attention(q.data_ptr<float>(), q.stride(0), q.stride(1), keys, values,
                   block_tables.data_ptr<int64_t>(), block_tables.stride(0),
                   seq_lens.data_ptr<int64_t>(), n, heads, kv_heads, static_cast<float>(scale),
                   out.data_ptr<float>(), window, sinks,
                   has_q_sink ? q_sink->data_ptr<float>() : nullptr,
                   has_q_sink ? q_sink->stride(0) : 0);
  return out;
}

}  // namespace kvforge
