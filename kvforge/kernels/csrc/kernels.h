// kvforge CPU kernels: the per-layer ops of a decode step as single fused loops over fp32 data.
//
// Why: at batch 1 a SmolLM2 decode step streams ~540 MB of weights (~17 ms at this box's
// bandwidth) but also made ~20 small ATen calls per layer, ~9 ms in all (RMSNorm alone ~15 us
// for 576 floats: TensorIterator set-up, temporaries, a parallel region per op). Here every op
// is one pass, and DecodeStack runs a whole Llama decode step in one call from Python.
//
// Threads come from ATen's pool: at::parallel_for, or one `omp parallel` region of
// torch.get_num_threads() threads running a whole decode step or matmul as a team (team.h).
// Torch's OpenMP build inlines its `omp parallel` into this extension, so we compile with
// -fopenmp (without it at::parallel_for silently runs serially); the libgomp.so.1 we link is the
// one torch already loaded (same soname), so there is one thread pool, sized by
// torch.set_num_threads.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <cmath>
#include <utility>
#include <vector>

#include "team.h"

namespace kvforge {

// The int8 dot instruction an integer kernel multiplies with (KVFORGE_INT8_DOT, kernels/ops.py):
// AVX2's maddubs (+ madd) on every AVX2 CPU, or VNNI's vpdpbusd / vpdpwssd, VEX-encoded
// (AVX-VNNI) or EVEX-encoded on ymm (AVX512-VNNI + VL). The VNNI kernels (w8a8_gemm.cpp,
// gguf_dot.cpp) are compiled under `#pragma GCC target` whatever the build's -march, so GCC
// only (clang has no such pragma: there the kernels have maddubs).
enum Int8Dot : int64_t { kDotMaddubs = 0, kDotAvxVnni = 1, kDotAvx512Vnni = 2 };
#if defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__)
#define KVFORGE_VNNI 1
#endif

// Whether this CPU and build have int8 dot `dot`: maddubs with any AVX2 build
inline bool int8_dot_supported(int64_t dot) {
#if defined(KVFORGE_VNNI)
  __builtin_cpu_init();
  switch (dot) {
    case kDotMaddubs: return true;
    case kDotAvxVnni: return __builtin_cpu_supports("avxvnni");
    case kDotAvx512Vnni:
      return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    default: return false;
  }
#else
  return dot == kDotMaddubs;   // AVX2 without the VNNI kernels, or the portable loops
#endif
}

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

// 16-float vectors via GCC/clang vector extensions: AVX-512, 2x AVX2 or 4x SSE, whatever -march
// gives. may_alias + aligned(4): loaded straight from any float pointer.
typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));
typedef float vec8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef float vec4 __attribute__((vector_size(16), aligned(4), may_alias));

inline vec16 load16(const float* p) { return *reinterpret_cast<const vec16*>(p); }
inline vec8 load8(const float* p) { return *reinterpret_cast<const vec8*>(p); }
// v to p (any alignment) as one vector store: __builtin_memcpy of a vector to memory went
// through the stack and general registers in GCC 12's AVX2 code (a store-forwarding stall a
// vector: the SiLU loop ran at half speed)
inline void store_vec(float* p, vec16 v) { *reinterpret_cast<vec16*>(p) = v; }
inline void store_vec(float* p, vec8 v) { *reinterpret_cast<vec8*>(p) = v; }

// horizontal sums by halving (the halves are free register views, no scalar loop)
inline float hsum(vec8 v) {
  vec4 c, d;
  __builtin_memcpy(&c, &v, sizeof c);
  __builtin_memcpy(&d, reinterpret_cast<const char*>(&v) + sizeof c, sizeof d);
  const vec4 s4 = c + d;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
inline float hsum(vec16 v) {
  vec8 a, b;
  __builtin_memcpy(&a, &v, sizeof a);
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&v) + sizeof a, sizeof b);
  return hsum(a + b);
}

typedef int32_t ivec16 __attribute__((vector_size(64)));
typedef int32_t ivec8 __attribute__((vector_size(32)));

// The build's native float vector, one register of its ISA: 16 lanes with AVX-512, 8 with
// AVX2. Loops over plain arrays (SiLU, softmax, argmax) take it: with AVX2 a 16-lane vector is
// split into two ymm halves, and its compares, blends and int conversions went through the
// stack (the AVX2 build's SiLU ran 6.6x, its argmax 20x slower than the AVX-512 build's).
#if defined(__AVX512F__)
constexpr int kVecLanes = 16;
using vecn = vec16;
using ivecn = ivec16;
#else
constexpr int kVecLanes = 8;
using vecn = vec8;
using ivecn = ivec8;
#endif
inline vecn loadn(const float* p) { return *reinterpret_cast<const vecn*>(p); }

// exp of each lane (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial, 2^n in the
// exponent bits); relative error ~2e-7, inputs clamped to [-87.3, 88.7] (exp(-87.3) ~ 1e-38:
// softmax and SiLU never need smaller). Lane by lane the same operations at any width.
inline vecn expn(vecn x) {
  const vecn hi = vecn{} + 88.7f, lo = vecn{} - 87.3f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const vecn n = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + (x >= 0 ? 0.5f : -0.5f), ivecn), vecn);
  const vecn r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vecn p = vecn{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const ivecn bits = (__builtin_convertvector(n, ivecn) + 127) << 23;
  vecn scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// in place: x[i] = exp(x[i] - shift), returns the sum
inline float exp_shift_sum(float* x, int64_t n, float shift) {
  vecn total{};
  int64_t i = 0;
  for (; i + kVecLanes <= n; i += kVecLanes) {
    const vecn e = expn(loadn(x + i) - shift);
    store_vec(x + i, e);
    total += e;
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
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
// gelu(gate, approximate="tanh") * up (Gemma's MLP), the same layout
void gelu_tanh_and_mul_rows(const float* in, int64_t is, float* out, int64_t rows,
                            int64_t inter);

// NeoX rotary of `heads` heads of `dim` floats per row, x -> out (may alias x), cos = [c | c],
// sin = [-s | s] per row: out[i] = x[i] * cos[i] + x[(i + dim/2) % dim] * sin[i]
void rotary_rows(const float* x, int64_t xs, float* out, int64_t os, const float* cos,
                 int64_t cs, const float* sin, int64_t ss, int64_t rows, int64_t heads,
                 int64_t dim);

// y [rows, out] = x [rows, in] @ w[out, in]^T for any rows >= 1 (linear.cpp, register tiles).
// Callers use it for kLinearRowsMin..kLinearRowsMax rows: it matches or beats MKL's best form
// from 1 row up, and F.linear wins on long prefill chunks (benchmarks/linear_kernel.py).
constexpr int64_t kLinearRowsMin = 1;
constexpr int64_t kLinearRowsMax = 256;
// Vector lanes of the build (AVX-512: 16, AVX2: 8) and rows the few-rows tile serves in one
// pass over W. The packed layout P[N / kPackRows][K][kPackRows]: K-major panels of kPanelVecs
// vectors (AVX-512: 32 rows, 2 zmm; AVX2: 24 rows, 3 ymm), multiplied by outer-product tiles
// of up to kPanelRowsMax rows of x (linear.cpp); kPackLanes = 1: the layout's innermost
// dimension in ops.packed_layout's 4-D view.
#if defined(__AVX512F__)
constexpr int kLanes = 16, kFewRowsMax = 8;
constexpr int kPackRows = 32, kPackLanes = 1, kPanelRowsMax = 8;
#else
constexpr int kLanes = 8, kFewRowsMax = 4;
constexpr int kPackRows = 24, kPackLanes = 1, kPanelRowsMax = 4;
#endif
constexpr int kPanelVecs = kPackRows / kLanes;
static_assert(kPanelVecs * kLanes == kPackRows, "a panel is whole vectors wide");
// whether layers should be packed (ops.packing_pays): each build's packed kernel is its faster
// one from 1 row up (linear.cpp)
constexpr bool kPackingPays = true;
void linear_rows(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out);
// The same product over a packed weight [ceil(out / kPackRows), in / kPackLanes, kPackRows,
// kPackLanes] (rows past `out` are padding): one sequential stream per thread (linear.cpp).
void linear_packed(const float* x, int64_t xs, const float* packed, float* y, int64_t rows,
                   int64_t in, int64_t out);
// row `row` of a packed weight (in floats wide) into out[0:in] (a tied LM head's embedding)
void packed_row(const float* packed, int64_t in, int64_t row, float* out);
// torch.argmax of one row: the first index of the maximum, the first NaN if any (argmax.cpp)
int64_t argmax_row(const float* x, int64_t n);
// Data cache sizes per core in bytes (sysconf), read once.
struct CacheSizes {
  int64_t l1d, l2;
};
CacheSizes detected_cache_sizes();
// How the tiled kernel runs one product (linear_plan.cpp): the register tile, the cache
// blocking, how far ahead row-major tiles prefetch W, or MKL instead (use_mkl: callers outside
// a team run at::linear; a team still runs the tile plan, see resolve_linear_plan).
struct LinearPlan {
  int tile_m = 0, tile_n = 0;          // rows of x, rows of W per register tile (1..8)
  int64_t block_k = 0, block_m = 0;    // K per pass, x rows per L2 block
  int prefetch_tiles = -1;             // row-major: prefetch the W tile this many tiles on
  bool use_mkl = false;
};
// The plan tuned for [rows, in] @ [out, in]^T (set_linear_plans), or an empty plan (all zero:
// the defaults) when there is none for that shape and row count.
LinearPlan tuned_linear_plan(int64_t in, int64_t out, int64_t rows);
// `plan` with every unset field (0 / -1) given the default for rows x in (the build's tile for
// the rows, blocking from the detected cache sizes) and every field clamped to what the
// kernel can run; throws for a tile outside 1..8.
LinearPlan resolve_linear_plan(LinearPlan plan, int64_t rows, int64_t in, bool packed);
// One thread's part of y = x @ W^T (+ bias, or nullptr) inside a team's region, W packed or
// row-major (any rows for packed, kLinearRowsMin..kLinearRowsMax row-major): the columns in
// balanced shares (Team::for_shares, `claims`: team-size zeroed ShareClaims, used once).
void linear_team(const float* x, int64_t xs, const float* w, bool packed, const float* bias,
                 float* y, int64_t rows, int64_t in, int64_t out, const Team& team,
                 ShareClaim* claims);
void linear_team_plan(const float* x, int64_t xs, const float* w, bool packed, const float* bias,
                      float* y, int64_t rows, int64_t in, int64_t out, const LinearPlan& plan,
                      const Team& team, ShareClaim* claims);
// throws unless `packed` is an fp32 weight [out, in] in that layout
void check_packed_weight(const at::Tensor& packed, int64_t in, int64_t out);

// How a paged K/V plane stores its elements: fp32, or one byte of fp8 as torch stores
// float8_e4m3fn / float8_e5m2 (quant/fp8_kv.py: the K/V rounded, a scale of 1)
enum class KVFormat : int8_t { kF32 = 0, kE4M3 = 1, kE5M2 = 2 };
inline int64_t kv_element_bytes(KVFormat format) {
  return format == KVFormat::kF32 ? 4 : 1;
}

// The format of a cache tensor's dtype (fp32, float8_e4m3fn, float8_e5m2); throws for another
KVFormat kv_format_of(const at::Tensor& cache, const char* name);
// n fp8 values -> floats (exact)
void fp8_to_float(const uint8_t* src, float* dst, int64_t n, KVFormat format);
// float -> fp8, rounded to nearest even as torch's cast rounds (the caller saturates first)
uint8_t float_to_fp8(float x, KVFormat format);
// n floats into a cache plane at `dst` (element offset already applied): a copy, or rounded to
// fp8 -- the value the Python backends write (quant/fp8_kv.py: clamp, then the cast)
void store_kv(void* dst, const float* src, int64_t n, KVFormat format);
void store_kv_op(at::Tensor dst, at::Tensor src);      // the binding (tests)

struct PagedKV {               // one layer's K or V plane: [num_blocks, block, kv_heads, dim]
  const void* data;            // floats or fp8 bytes (format)
  int64_t block_stride, token_stride, head_stride, block_size, dim;   // in elements
  KVFormat format = KVFormat::kF32;
};

// One query token per sequence over its paged context (see attention.cpp for the map), or
// over its last `window` keys (a sliding window: keys p - window < k <= p; 0 = all keys) and
// the first `sinks` keys (StreamingLLM: k < sinks, scored with a query of their own, q_sink,
// where the caller gives one). Cut into tasks (sequence, head range, chunk of keys) whose
// partial softmaxes of sequences in several chunks are merged after: the same cut for every
// layer of a step.
class DecodeAttentionPlan {
 public:
  DecodeAttentionPlan(const int64_t* seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      int64_t dim_v, int threads, int64_t window = 0, int64_t sinks = 0);
  int64_t num_tasks() const { return first_task_.back(); }
  // merge items (sequence, head range); 0 when every sequence fits one chunk (normalised in
  // its task)
  int64_t num_merges() const { return needs_merge_ ? num_seqs_ * splits_ : 0; }
  // task t of one layer: q [n, heads, dim] rows, that layer's K and V planes, out [n, heads, dv];
  // q_sink: the sinks' queries (rows q_sink_row_stride apart, heads as q's), null: q's
  void run_task(int64_t t, const float* q, int64_t q_row_stride, int64_t q_head_stride,
                const PagedKV& keys, const PagedKV& values, const int64_t* block_tables,
                int64_t table_stride, float scale, float* out, std::vector<float>& scores,
                const float* q_sink = nullptr, int64_t q_sink_row_stride = 0);
  void merge(int64_t i, float* out) const;   // after every task of the layer

  struct Partial {        // softmax state of one (query, chunk) for a range of heads
    std::vector<float> max, sum, acc;   // [heads], [heads], [heads * Dv]
  };

 private:
  const int64_t* seq_lens_;
  int64_t num_seqs_, heads_, group_, dim_v_, sinks_, chunk_ = 0, splits_ = 1;
  bool needs_merge_ = false;
  // per sequence: chunks (its sink chunk included), first window key, whether chunk 0 is the
  // sinks' [0, sinks) apart from the window
  std::vector<int64_t> chunks_, first_key_, first_task_;
  std::vector<char> sink_chunk_;
  std::vector<Partial> parts_;
};
void decode_attention(const float* q, int64_t q_row_stride, int64_t q_head_stride, PagedKV keys,
                      PagedKV values, const int64_t* block_tables, int64_t table_stride,
                      const int64_t* seq_lens, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                      float scale, float* out, int64_t window = 0, int64_t sinks = 0,
                      const float* q_sink = nullptr, int64_t q_sink_row_stride = 0);

// QUEST's sparse decode (quest.cpp has the head-major cache's map): one query token per
// sequence; a sequence longer than k_blocks blocks attends to its current block and the
// k_blocks - 1 others with the largest key bound, a shorter one to every block. Four phases,
// each a set of independent work items (a barrier between phases), split finely enough to keep
// every thread busy at batch 1; the same plan serves every layer of a step:
//   1. bound tasks  (s, 64 blocks): q+ . kmax + q- . kmin of each block but the current one
//   2. selects      (s, KV head): the chosen blocks' physical ids
//   3. attend tasks (s, KV head, kChunk chosen keys): partial softmaxes
//   4. merges       (s, KV head): out [n, heads, dim] (flash-decoding's merge)
class QuestDecodePlan {
 public:
  QuestDecodePlan(const int64_t* seq_lens, int64_t num_seqs, const int64_t* block_tables,
                  int64_t table_stride, int64_t heads, int64_t kv_heads, int64_t dim,
                  int64_t block_size, int64_t num_blocks, int64_t k_blocks);
  int64_t num_bound_tasks() const { return bound_task_.back(); }
  int64_t num_items() const { return num_seqs_ * kv_heads_; }     // selects and merges
  int64_t num_attend_tasks() const { return first_task_.back(); }
  // q rows [n, heads, dim] (strides in floats); cache: one layer's [2, num_blocks, rows, dim]
  void bound_task(int64_t t, const float* q, int64_t q_row_stride, int64_t q_head_stride,
                  const float* cache);
  void select(int64_t item, std::vector<int64_t>& order);
  void attend_task(int64_t t, const float* q, int64_t q_row_stride, int64_t q_head_stride,
                   const float* cache, float scale, std::vector<float>& scores);
  void merge(int64_t item, float* out) const;

 private:
  static constexpr int64_t kBoundBlocks = 64;
  const int64_t *seq_lens_, *tables_;
  int64_t table_stride_, num_seqs_, heads_, kv_heads_, group_, dim_, block_, k_blocks_;
  int64_t head_stride_ = 0, bounds_offset_ = 0, block_stride_ = 0, plane_ = 0;
  std::vector<int64_t> num_logical_, bound_base_, bound_task_, chosen_, num_chosen_,
      first_task_, keys_read_;
  std::vector<char> sparse_;
  std::vector<float> bounds_;
  std::vector<DecodeAttentionPlan::Partial> parts_;
};
// every phase of `plan` through at::parallel_for
void quest_attention(QuestDecodePlan& plan, const float* q, int64_t q_row_stride,
                     int64_t q_head_stride, const float* cache, float scale, float* out);

// ---- tensor ops (bindings.cpp) ------------------------------------------------------------
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
at::Tensor rotary_neox(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor argmax_rows(at::Tensor logits);
at::Tensor linear_rows_op(at::Tensor x, at::Tensor weight);
at::Tensor linear_packed_op(at::Tensor x, at::Tensor packed, int64_t out_features);
at::Tensor packed_rows(at::Tensor packed, at::Tensor ids, int64_t out_features);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor key_cache, at::Tensor value_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window = 0, int64_t sinks = 0,
                                  c10::optional<at::Tensor> q_sink = c10::nullopt);
void quest_write(at::Tensor kv_cache, at::Tensor k, at::Tensor v, at::Tensor slot_mapping);
at::Tensor quest_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                        at::Tensor seq_lens, int64_t k_blocks, double scale, int64_t kv_heads);
// GGUF weights in their block formats (gguf_blocks.cpp): y = x @ [W_0; W_1; ...]^T (+ bias)
// over raw uint8 [rows, row_bytes] shards of ggml type ids `types`; rows of any subset `ids`
// (or all) of one raw tensor dequantized to fp32
at::Tensor gguf_linear(at::Tensor x, std::vector<at::Tensor> raws, std::vector<int64_t> types,
                       c10::optional<at::Tensor> bias);
at::Tensor gguf_dequantize(at::Tensor raw, int64_t type, int64_t k, c10::optional<at::Tensor> ids);

}  // namespace kvforge
