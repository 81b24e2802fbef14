// Few-row GGUF products read straight from the file's blocks (docs/gguf_native.md), and
// GgufWeight: one projection's shards, multiplied by these kernels inside a DecodeStack team or
// from Python.
//
// Activations are quantized once per call (per thread: a few us) to int8, in the form each
// block family's kernel reads (a projection whose shards mix families gets both):
//
//   32-weight formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): a step per 16
//     q    int8  [K]          round(x / d), |q| <= 127, d = max |x| / 127 of each 16
//     dv   float [K / 32, 8]  each 32-block's two steps as the dot's lanes take them:
//                             [d_lo d_lo d_lo d_lo | d_hi d_hi d_hi d_hi]
//     dv4  float [K / 128, 8] the same steps for 4 blocks at a time, as the 4-block loop's
//                             lanes take them: [lo of blocks 0..3 | hi of blocks 0..3]
//     s16  float [K / 16]     d * sum(q) of each 16: what a weight offset (min) multiplies
//     s32  float [K / 32]     the same per 32 (s16 pairs)
//   K-quants (Q4_K, Q5_K, Q6_K): a power-of-two step per 32 under one unit per 256
//     q256     int8  [K]        round(x / step), |q| <= 127; step of each 32 = unit * 2^shift
//     unit256  float [K / 256]  the super-block's finest step: (max |x| of the 256 / 127) / 16;
//                               shift = 4 - e, e the largest <= 4 with max |x of the 32| * 2^e
//                               <= max |x of the 256|: 32 values of small magnitude get a step
//                               up to 16x finer than the super-block's outlier would give them
//     pow2_32  int16 [K/256, 16] 2^shift of 32-block j in lanes j and 8 + j (Q4_K / Q5_K's
//                               scale layout: sub-block j's scale in lane j of each half)
//     bsum16   int16 [K / 16]   sum(q) << shift of each 16 (in units): what Q6_K's zero point
//                               multiplies (|.| <= 16 * 127 * 16 = 32512: fits)
//     sum32    float [K / 32]   step * sum(q) of each 32: what Q4_K / Q5_K's mins multiply
//
// Each type's kernel turns a block's bytes into unsigned codes in registers (no scratch row)
// and multiplies them by the activations' bytes:
//
//   maddubs(codes u8, q s8) -> 16 int16 pair sums; madd(., scale) -> 8 int32:
//   lanes 0..3 = bytes 0..15, lanes 4..7 = bytes 16..31     (so dv's halves line up)
//
//   32-weight formats: dot = sum over 32-blocks  cvt(int32 lanes) * weight scale * dv
//                            + offset * s32      (4 blocks per conversion and FMA, half_sums_4)
//   K-quants:          dot = sum over super-blocks  unit256 * d * sumi  -  dmin * sub-min . sum32
//                      sumi = sum over sub-blocks  (sub-scale << shift) * (codes . q256)  (int32)
//                      (the mins: a vector FMA per super-block)
//
// A K-quant super-block's sub-block scales enter the integer multiply (madd), so its 256
// weights cost one conversion and two FMAs per activation row: the integer sums are exact, so every row count
// (and the portable kernel) gets the same integers. Codes are unsigned so maddubs takes them
// as they are; a signed format's zero point (Q4_0's -8, Q5_0's -16, Q6_K's -32) is an offset
// like Q4_1's min. Q8_0 (signed bytes) moves the sign onto the activations
// (_mm256_sign_epi8). The step per 16 of the small-block formats confines an outlier channel's
// coarse step to 16 values at one vector load per 32 weights. The K-quants accumulate a whole
// super-block in integers, so their steps must be integer multiples of one unit: llama.cpp
// (Q8_K) uses one step per 256, which lets an outlier channel coarsen 255 other values (+0.8%
// perplexity on Qwen2.5-1.5B Q4_K_M). Power-of-two steps per 32 fold into the sub-block scales:
// one int16 multiply per super-block per row (the scales times the row's powers of two), then
// each row broadcasts its own scales (a shift per 32 weights per row instead cost 14-24% of
// the prefill kernels' time).
//
// Without AVX2 (builds for other CPUs) each row is unpacked to codes (gguf_blocks.cpp) and
// dotted by a scalar loop: the same arithmetic, the reference the tests compare.
#include "kernels.h"

namespace kvforge {
namespace {

struct ActRow {
  const int8_t* q;                  // steps per 16
  const float *dv, *dv4, *s16, *s32;
  const int8_t* q256;               // power-of-two steps per 32 under a unit per 256
  const float* unit256;
  const int16_t* pow2_32;
  const int16_t* bsum16;
  const float* sum32;
};

struct GgufActivations {
  int64_t k = 0;
  std::vector<int8_t> q, q256;
  std::vector<float> dv, dv4, s16, s32, unit256, sum32;
  std::vector<int16_t> bsum16, pow2_32;

  void quantize(const float* x, int64_t xs, int64_t rows, int64_t width, bool per_16,
                bool per_256) {
    k = width;
    if (per_16) quantize_per_16(x, xs, rows);
    if (per_256) quantize_per_256(x, xs, rows);
  }
  // the rows as the kernels take them (valid until the next quantize; a form not asked for
  // points at stale or empty buffers its kernels never read)
  const ActRow* rows(int64_t count) {
    views.resize(count);
    for (int64_t m = 0; m < count; ++m)
      views[m] = {q.data() + m * k,           dv.data() + m * (k / 32) * 8,
                  dv4.data() + m * (k / 128) * 8,
                  s16.data() + m * (k / 16),  s32.data() + m * (k / 32),
                  q256.data() + m * k,        unit256.data() + m * (k / 256),
                  pow2_32.data() + m * (k / 256) * 16,
                  bsum16.data() + m * (k / 16),
                  sum32.data() + m * (k / 32)};
    return views.data();
  }
  std::vector<ActRow> views;

 private:
  void quantize_per_16(const float* x, int64_t xs, int64_t rows) {
    q.resize(rows * k);
    dv.resize(rows * k / 32 * 8);
    dv4.resize(rows * (k / 128) * 8);
    s16.resize(rows * k / 16);
    s32.resize(rows * k / 32);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < k / 16; ++h) {
        const float* v = x + r * xs + 16 * h;
        int8_t* out = q.data() + r * k + 16 * h;
        float amax = 0.f;
        for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        const int sum = round_16(v, inv, out);
        const int64_t b = r * (k / 32) + h / 2;
        float* lanes = dv.data() + 8 * b + 4 * (h % 2);
        for (int j = 0; j < 4; ++j) lanes[j] = d;
        const int64_t block = h / 2;                       // of this row
        if (block / 4 < k / 128)                           // a whole group of 4 blocks
          dv4[(r * (k / 128) + block / 4) * 8 + 4 * (h % 2) + block % 4] = d;
        s16[r * (k / 16) + h] = d * static_cast<float>(sum);
        s32[b] = (h % 2 ? s32[b] : 0.f) + d * static_cast<float>(sum);
      }
  }
  // the finest step of a super-block is its coarsest / 2^kMaxShift
  static constexpr int kMaxShift = 4;
  void quantize_per_256(const float* x, int64_t xs, int64_t rows) {
    q256.resize(rows * k);
    unit256.resize(rows * k / 256);
    pow2_32.resize(rows * k / 256 * 16);
    bsum16.resize(rows * k / 16);
    sum32.resize(rows * k / 32);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t sb = 0; sb < k / 256; ++sb) {
        const float* v = x + r * xs + 256 * sb;
        int8_t* out = q256.data() + r * k + 256 * sb;
        int16_t* bsum = bsum16.data() + r * (k / 16) + 16 * sb;
        int16_t* p32 = pow2_32.data() + (r * (k / 256) + sb) * 16;
        float block_max[8], amax = 0.f;
        for (int j = 0; j < 8; ++j) amax = std::max(amax, block_max[j] = abs_max_32(v + 32 * j));
        const float coarsest = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        unit256[r * (k / 256) + sb] = std::ldexp(coarsest, -kMaxShift);
        for (int j = 0; j < 8; ++j) {
          // the finest power-of-two step that keeps this 32's values within +-127 (powers of
          // two scale floats exactly, so the test and the rounding agree on every CPU)
          int e = 0;
          while (e < kMaxShift && std::ldexp(block_max[j], e + 1) <= amax) ++e;
          const int16_t pow2 = static_cast<int16_t>(1 << (kMaxShift - e));
          const int lo = round_16(v + 32 * j, std::ldexp(inv, e), out + 32 * j);
          const int hi = round_16(v + 32 * j + 16, std::ldexp(inv, e), out + 32 * j + 16);
          sum32[r * (k / 32) + 8 * sb + j] = std::ldexp(coarsest, -e) * static_cast<float>(lo + hi);
          bsum[2 * j] = static_cast<int16_t>(lo * pow2);
          bsum[2 * j + 1] = static_cast<int16_t>(hi * pow2);
          p32[j] = p32[8 + j] = pow2;
        }
      }
  }

 public:
  // (also the int8 panels' rounding, gguf_gemm.cpp)
  // max |v| of 32 values (max is exact: any order gives the same result)
  static float abs_max_32(const float* v) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(v));
    for (int j = 8; j < 32; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    return amax;
#endif
  }
  // out = round-to-nearest-even(v * inv) for 16 values (|out| <= 127); returns their sum
  static int round_16(const float* v, float inv, int8_t* out) {
#if defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(inv);
    // cvtps rounds as nearbyint does (the default MXCSR mode: to nearest, ties to even)
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), scale));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), scale));
    const __m256i sum = _mm256_add_epi32(a, b);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    // int32 -> int16 -> int8 (values fit: no saturation), lanes back in order
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1)));
    return _mm_cvtsi128_si32(s4) + _mm_extract_epi32(s4, 1);
#else
    int sum = 0;
    for (int j = 0; j < 16; ++j) {
      const int c = static_cast<int>(std::nearbyint(v[j] * inv));
      out[j] = static_cast<int8_t>(c);
      sum += c;
    }
    return sum;
#endif
  }
};

// out[m] = W row . activation row m, for m < rows (1..kGgufDotGroupRows)
// `prefetch`: the bytes this thread reads kGgufPrefetchAhead bytes later (nullptr: none)
using RowsDot = void (*)(const uint8_t* row, int64_t k, const ActRow* a, int64_t rows,
                         float* out, const uint8_t* prefetch);

// ---- the reference: codes (gguf_blocks.cpp) . activations ---------------------------------
template <int64_t Type>
void dot_via_codes(const uint8_t* row, int64_t k, const ActRow* acts, int64_t rows, float* out,
                   const uint8_t*) {
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> sc, off;
  q.resize(k);
  sc.resize(k / 16);
  off.resize(k / 32);
  unpack_row(Type, row, k, q.data(), sc.data(), off.data());
  for (int64_t m = 0; m < rows; ++m) {
    const ActRow& a = acts[m];
    float total = 0.f;
    for (int64_t b = 0; b < k / 32; ++b) {
      int32_t lo = 0, hi = 0;
      for (int j = 0; j < 16; ++j) lo += q[32 * b + j] * a.q[32 * b + j];
      for (int j = 16; j < 32; ++j) hi += q[32 * b + j] * a.q[32 * b + j];
      total += sc[2 * b] * a.dv[8 * b] * static_cast<float>(lo) +
               sc[2 * b + 1] * a.dv[8 * b + 4] * static_cast<float>(hi) + off[b] * a.s32[b];
    }
    out[m] = total;
  }
}
// K-quants: integer sums per super-block (each 16's scale times its 32's power of two), two
// float products
template <int64_t Type>
void k_dot_via_codes(const uint8_t* row, int64_t k, const ActRow* acts, int64_t rows,
                     float* out, const uint8_t*) {
  constexpr int64_t kBytes = Type == kQ4_K ? 144 : Type == kQ5_K ? 176 : 210;
  for (int64_t m = 0; m < rows; ++m) out[m] = 0.f;
  KQuantBlock blk;
  for (int64_t sb = 0; sb < k / 256; ++sb) {
    unpack_k_block(Type, row + kBytes * sb, blk);
    for (int64_t m = 0; m < rows; ++m) {
      const int8_t* x = acts[m].q256 + 256 * sb;
      const int16_t* pow2 = acts[m].pow2_32 + 16 * sb;     // of 32-block j: lane j
      int64_t sumi = 0;
      float mins = 0.f;
      for (int i = 0; i < 16; ++i) {
        int32_t dot16 = 0;
        for (int j = 16 * i; j < 16 * i + 16; ++j) dot16 += blk.q[j] * x[j];
        sumi += int64_t{blk.scale[i]} * pow2[i / 2] * dot16;
      }
      for (int i = 0; i < 8; ++i)       // min per 32 (Q6_K: 0)
        mins += blk.dmin * static_cast<float>(blk.min[2 * i]) * acts[m].sum32[8 * sb + i];
      out[m] += blk.d * acts[m].unit256[sb] * static_cast<float>(sumi) - mins;
    }
  }
}

// the reference kernel of a type (builds without AVX2 run it; tests compare with it)
RowsDot reference_rows_dot(int64_t type) {
  switch (type) {
    case kQ8_0: return dot_via_codes<kQ8_0>;
    case kQ4_0: return dot_via_codes<kQ4_0>;
    case kQ4_1: return dot_via_codes<kQ4_1>;
    case kQ5_0: return dot_via_codes<kQ5_0>;
    case kQ5_1: return dot_via_codes<kQ5_1>;
    case kQ4_K: return k_dot_via_codes<kQ4_K>;
    case kQ5_K: return k_dot_via_codes<kQ5_K>;
    case kQ6_K: return k_dot_via_codes<kQ6_K>;
    default: return nullptr;
  }
}

#if defined(__AVX2__)
// Software prefetch of a weight stream, line by line, as a kernel reads its blocks: the
// hardware prefetchers stop at 4 KB page boundaries, so a row stream read at ~10 GB/s a core
// stalls at each new page; prefetching ~8 KB ahead keeps the misses in flight (timed on a
// Q4_K LM head of 131 MB: 7.8 -> 11.0 GB/s on one core, 14.8 -> 21 GB/s on two).
class StreamPrefetch {
 public:
  explicit StreamPrefetch(const uint8_t* start) : next_(start) {}
  // every line below `end` not yet prefetched
  void upto(const uint8_t* end) {
    if (next_ == nullptr) return;
    for (; next_ < end; next_ += 64) _mm_prefetch(reinterpret_cast<const char*>(next_), _MM_HINT_T0);
  }

 private:
  const uint8_t* next_;
};

// Each kernel decodes a weight row's blocks once for a group of R <= kGgufDotGroupRows
// activation rows (a verification step or a small batch reuses the codes in registers), R
// accumulators; GgufWeight calls one group at a time (its tiles, gguf_weight.cpp).
template <class Kernel>
void rows_dot(const uint8_t* row, int64_t k, const ActRow* a, int64_t rows, float* out,
              const uint8_t* prefetch) {
  static_assert(kGgufDotGroupRows == 4, "the cases below");
  switch (rows) {
    case 4: return Kernel::template run<4>(row, k, a, out, prefetch);
    case 3: return Kernel::template run<3>(row, k, a, out, prefetch);
    case 2: return Kernel::template run<2>(row, k, a, out, prefetch);
    case 1: return Kernel::template run<1>(row, k, a, out, prefetch);
    default: TORCH_CHECK(false, "a GGUF dot group takes 1..", kGgufDotGroupRows, " rows, got ", rows);
  }
}

// 8 int32 sums of 32 unsigned codes times 32 signed activation bytes, each int16 pair sum
// multiplied by `scale` (int16 lanes) before the int32 sums, as floats
inline __m256 scaled_dot_u8(__m256i codes, const int8_t* x, __m256i scale) {
  const __m256i pairs =
      _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale));
}
// the same as 8 int32 sums (K-quants accumulate a super-block in integers)
inline __m256i scaled_isum_u8(__m256i codes, const int8_t* x, __m256i scale) {
  return _mm256_madd_epi16(
      _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
      scale);
}
// pow2_32's layout [p0..p7 | p0..p7] as Q6_K's scales take it, one per 16 weights:
// [p0 p0 p1 p1 .. p3 p3 | p4 p4 .. p7 p7]
inline __m256i per_16(__m256i pow2) {
  return _mm256_blend_epi32(_mm256_unpacklo_epi16(pow2, pow2), _mm256_unpackhi_epi16(pow2, pow2),
                            0xF0);
}
// 32 nibbles of 16 bytes: byte j -> codes j (low nibble) and j + 16 (high nibble)
inline __m256i nibbles_32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}
// byte j = 0x10 where bit j of the 32 bits at p is set, else 0 (Q5_0 / Q5_1's fifth bits)
inline __m256i fifth_bits_32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  // byte j takes source byte j / 8 (the shuffle indexes within each 128-bit lane, and every
  // lane holds all 4 bytes), then keeps bit j % 8
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}
inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 4 blocks' 8-lane int32 sums (madd's layout: [lo partials 0..3 | hi partials 0..3]) folded
// into their half sums, exactly: [lo0 lo1 lo2 lo3 | hi0 hi1 hi2 hi3] (the 32-weight kernels
// convert and scale 4 blocks at once: one conversion and FMA per 128 weights a row)
inline __m256i half_sums_4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
}
// the 4 blocks' weight scales as half_sums_4's lanes take them
inline __m256 scales_4(float d0, float d1, float d2, float d3) {
  const __m128 d = _mm_setr_ps(d0, d1, d2, d3);
  return _mm256_set_m128(d, d);
}

// Q8_0  [d][q0..q31 int8]                      w = d * q
// Four blocks at a time like LegacyKernel (below); the blocks after the last whole 4 one by one.
struct Q8_0Kernel {
  // |w| (<= 128) unsigned against x with w's sign: pair sums fit int16; 8 int32 sums
  static __m256i isum(__m256i w, __m256i w_abs, const int8_t* x) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv, w)),
                             _mm256_set1_epi16(1));
  }

  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out,
                  const uint8_t* prefetch) {
    StreamPrefetch ahead(prefetch);
    const int64_t blocks = k / 32, groups = blocks / 4;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = row + 34 * 4 * g;
      if (prefetch != nullptr) ahead.upto(prefetch + 34 * 4 * (g + 1));
      __m256i w[4], w_abs[4];
      for (int j = 0; j < 4; ++j) {
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 34 * j + 2));
        w_abs[j] = _mm256_sign_epi8(w[j], w[j]);
      }
      const __m256 dw = scales_4(fp16_at(blk), fp16_at(blk + 34), fp16_at(blk + 68),
                                 fp16_at(blk + 102));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a[r].q + 128 * g;
        const __m256i sums = half_sums_4(isum(w[0], w_abs[0], x), isum(w[1], w_abs[1], x + 32),
                                         isum(w[2], w_abs[2], x + 64),
                                         isum(w[3], w_abs[3], x + 96));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                 _mm256_mul_ps(dw, _mm256_loadu_ps(a[r].dv4 + 8 * g)), acc[r]);
      }
    }
    for (int64_t b = 4 * groups; b < blocks; ++b) {      // the last 0..3 blocks one by one
      const uint8_t* blk = row + 34 * b;
      if (prefetch != nullptr) ahead.upto(prefetch + 34 * (b + 1));
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i w_abs = _mm256_sign_epi8(w, w);
      const __m256 d = _mm256_set1_ps(fp16_at(blk));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum(w, w_abs, a[r].q + 32 * b)),
                                 _mm256_mul_ps(d, _mm256_loadu_ps(a[r].dv + 8 * b)), acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = hsum_ps(acc[r]);
  }
};

// Q4_0 [d][qs:16] w = d * (nib - 8);  Q4_1 [d][m][qs:16] w = d * nib + m
// Q5_0 [d][qh:4][qs:16] w = d * (code - 16);  Q5_1 [d][m][qh:4][qs:16] w = d * code + m
//
// Four blocks at a time: their 8-lane int32 sums (4 partial sums of each half, madd's layout)
// fold by three hadds into one vector of the 4 blocks' half sums, so a row pays one
// conversion and one FMA per 128 weights instead of per 32, and one 4-lane FMA for the 4
// blocks' offsets instead of 4 scalar ones (the conversions and FMAs shared the multiply
// ports with maddubs / madd: this loop does ~half the port work a row):
//
//   s_j = madd(maddubs(codes_j, x_j), 1)   [lo partials 0..3 | hi partials 0..3]  j = 0..3
//   hadd(hadd(s0, s1), hadd(s2, s3))       [lo0 lo1 lo2 lo3 | hi0 hi1 hi2 hi3]  (exact ints)
//   acc += cvt(.) * ([d0 d1 d2 d3 | d0 d1 d2 d3] * dv4)
//
// The blocks after the last whole group of 4 take the one-block path.
template <int Bytes, bool HasMin, bool FifthBit>
struct LegacyKernel {
  static constexpr int kCodes = (HasMin ? 4 : 2) + (FifthBit ? 4 : 0);   // offset of qs
  static constexpr float kZero = FifthBit ? 16.f : 8.f;                  // signed types' zero

  static __m256i codes_at(const uint8_t* blk) {
    __m256i codes = nibbles_32(blk + kCodes);
    if constexpr (FifthBit) codes = _mm256_or_si256(codes, fifth_bits_32(blk + kCodes - 4));
    return codes;
  }
  static float offset_at(const uint8_t* blk, float d) {
    return HasMin ? fp16_at(blk + 2) : -kZero * d;
  }
  // the 8 int32 sums of 32 codes times 32 activation bytes (madd's lane layout)
  static __m256i isum(__m256i codes, const int8_t* x) {
    return _mm256_madd_epi16(
        _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
        _mm256_set1_epi16(1));
  }

  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out,
                  const uint8_t* prefetch) {
    StreamPrefetch ahead(prefetch);
    const int64_t blocks = k / 32, groups = blocks / 4;
    __m256 acc[R];
    __m128 off_acc[R];
    float offsets[R] = {};
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
      off_acc[r] = _mm_setzero_ps();
    }
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = row + Bytes * 4 * g;
      if (prefetch != nullptr) ahead.upto(prefetch + Bytes * 4 * (g + 1));
      const __m256i c0 = codes_at(blk), c1 = codes_at(blk + Bytes), c2 = codes_at(blk + 2 * Bytes),
                    c3 = codes_at(blk + 3 * Bytes);
      const float d0 = fp16_at(blk), d1 = fp16_at(blk + Bytes), d2 = fp16_at(blk + 2 * Bytes),
                  d3 = fp16_at(blk + 3 * Bytes);
      const __m256 dw = scales_4(d0, d1, d2, d3);
      const __m128 offw = _mm_setr_ps(offset_at(blk, d0), offset_at(blk + Bytes, d1),
                                      offset_at(blk + 2 * Bytes, d2),
                                      offset_at(blk + 3 * Bytes, d3));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a[r].q + 128 * g;
        const __m256i sums = half_sums_4(isum(c0, x), isum(c1, x + 32), isum(c2, x + 64),
                                         isum(c3, x + 96));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                 _mm256_mul_ps(dw, _mm256_loadu_ps(a[r].dv4 + 8 * g)), acc[r]);
        off_acc[r] = _mm_fmadd_ps(offw, _mm_loadu_ps(a[r].s32 + 4 * g), off_acc[r]);
      }
    }
    for (int64_t b = 4 * groups; b < blocks; ++b) {      // the last 0..3 blocks one by one
      const uint8_t* blk = row + Bytes * b;
      if (prefetch != nullptr) ahead.upto(prefetch + Bytes * (b + 1));
      const __m256i codes = codes_at(blk);
      const float d = fp16_at(blk);
      const float offset = offset_at(blk, d);
      const __m256 dv = _mm256_set1_ps(d);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum(codes, a[r].q + 32 * b)),
                                 _mm256_mul_ps(dv, _mm256_loadu_ps(a[r].dv + 8 * b)), acc[r]);
        offsets[r] += offset * a[r].s32[b];
      }
    }
    for (int r = 0; r < R; ++r) {
      __m128 o = _mm_add_ps(off_acc[r], _mm_movehl_ps(off_acc[r], off_acc[r]));
      o = _mm_add_ss(o, _mm_movehdup_ps(o));
      out[r] = hsum_ps(acc[r]) + _mm_cvtss_f32(o) + offsets[r];
    }
  }
};

// K-quant scales of Q4_K / Q5_K (gguf_blocks.cpp's map), all eight at once: 12 bytes ->
// scales s0..s7 in bytes 0..7 and mins m0..m7 in bytes 8..15. As 32-bit words w0 w1 w2:
//   lane 0  s0..s3 = w0 & 0x3f3f3f3f           lane 2  m0..m3 = w1 & 0x3f3f3f3f
//   lane 1  s4..s7 = (w2 & 0x0f0f0f0f)         lane 3  m4..m7 = ((w2 >> 4) & 0x0f0f0f0f)
//                    | ((w0 >> 2) & 0x30303030)                 | ((w1 >> 2) & 0x30303030)
// (sub-blocks 4..7: 4 bits from bytes 8..11, 2 high bits from bits 7:6 of bytes 0..7), in
// vector lanes: [w0 w2 w1 w2] >> [0 0 0 4] and [w0 w0 w1 w1] >> [0 2 0 2], each masked per lane
// (8 vector ops where the scalar words took ~20). `p` may be read 4 bytes past its 12: a
// block's codes follow its scales.
inline __m128i k_scales_mins(const uint8_t* p) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_and_si128(
      _mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4)),
      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m128i high = _mm_and_si128(
      _mm_srli_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(1, 1, 0, 0)), 2),
      _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(low, high);
}

// Q4_K [d][dmin][scales:12][qs:128]  and  Q5_K [d][dmin][scales:12][qh:32][qs:128]
//   sub-block j (32 weights): w = d * s_j * code - dmin * m_j; 32-byte chunk c of qs holds
//   sub-block 2c in its low nibbles, 2c + 1 in its high; Q5_K's fifth bit: bit j of qh[i]
template <bool FifthBit>
struct K4Kernel {
  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out,
                  const uint8_t* prefetch) {
    StreamPrefetch ahead(prefetch);
    constexpr int64_t kBytes = FifthBit ? 176 : 144, kQs = FifthBit ? 48 : 16;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const uint8_t* blk = row + kBytes * sb;
      if (prefetch != nullptr) ahead.upto(prefetch + kBytes * (sb + 1));
      // int16 s0..s7; the mins as floats times dmin, for every row's sum32
      const __m128i sm8 = k_scales_mins(blk + 4);
      const __m128i scales = _mm_cvtepu8_epi16(sm8);
      const __m256 mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm8, 8))),
                                        _mm256_set1_ps(fp16_at(blk + 2)));
      const uint8_t* qs = blk + kQs;
      __m256i qh;
      if constexpr (FifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      // each row's scales times its 32-blocks' powers of two (<= 63 * 16: int16), each twice
      // in a dword: a dword broadcast from memory (a load, no shuffle) puts sub-block j's
      // scale in every int16 lane for the madd
      //   scale_pairs[r][j] = (s_j << shift_rj) * 0x00010001
      alignas(16) int32_t scale_pairs[R][8];
      __m256i sum[R], sum_hi[R];
      for (int r = 0; r < R; ++r) {
        sum[r] = sum_hi[r] = _mm256_setzero_si256();
        const __m128i row_scales = _mm_mullo_epi16(
            scales, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a[r].pow2_32 + 16 * sb)));
        _mm_store_si128(reinterpret_cast<__m128i*>(scale_pairs[r]),
                        _mm_unpacklo_epi16(row_scales, row_scales));
        _mm_store_si128(reinterpret_cast<__m128i*>(scale_pairs[r] + 4),
                        _mm_unpackhi_epi16(row_scales, row_scales));
      }
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(raw, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        if constexpr (FifthBit) {
          const __m256i bit_lo = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
          const __m256i bit_hi = _mm256_set1_epi8(static_cast<char>(2 << (2 * c)));
          const __m256i sixteen = _mm256_set1_epi8(0x10);
          lo = _mm256_or_si256(lo, _mm256_and_si256(
              _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_lo), bit_lo), sixteen));
          hi = _mm256_or_si256(hi, _mm256_and_si256(
              _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_hi), bit_hi), sixteen));
        }
        // one row: two accumulators keep two maddubs -> madd -> add chains in flight; more
        // rows are chains of their own, and a second set of registers would spill (timed:
        // one accumulator a row runs ~15% faster at 4 rows, two ~7% faster at 1 row)
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a[r].q256 + 256 * sb + 64 * c;
          // sub-block 2c's scale << the row's shift in every int16 lane, 2c + 1's
          const __m256i s_lo = _mm256_set1_epi32(scale_pairs[r][2 * c]);
          const __m256i s_hi = _mm256_set1_epi32(scale_pairs[r][2 * c + 1]);
          if constexpr (R == 1) {
            sum[r] = _mm256_add_epi32(sum[r], scaled_isum_u8(lo, x, s_lo));
            sum_hi[r] = _mm256_add_epi32(sum_hi[r], scaled_isum_u8(hi, x + 32, s_hi));
          } else {
            sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(scaled_isum_u8(lo, x, s_lo),
                                                               scaled_isum_u8(hi, x + 32, s_hi)));
          }
        }
      }
      const float d = fp16_at(blk);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(sum[r], sum_hi[r])),
                                 _mm256_set1_ps(d * a[r].unit256[sb]), acc[r]);
        acc[r] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(a[r].sum32 + 8 * sb), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum_ps(acc[r]);
  }
};

// Q6_K [ql:128][qh:64][scales:16 int8][d]: 16 sub-blocks of 16, w = d * scale_i * (code - 32).
// Half h (128 weights) = 32-blocks 4h .. 4h + 3 (gguf_blocks.cpp's map):
//   block 4h+0: ql[64h + j] & 15       | qh[32h + j] bits 1:0 << 4
//   block 4h+1: ql[64h + 32 + j] & 15  | bits 3:2 << 2
//   block 4h+2: ql[64h + j] >> 4       | bits 5:4
//   block 4h+3: ql[64h + 32 + j] >> 4  | bits 7:6 >> 2
// (16-bit shifts: whatever crosses a byte is masked away by 0x0F / 0x30)
// The zero point in integers: sum_i scale_i (code_i - 32) q_i = codes' sum - 32 sum_i scale_i
// bsum16_i.
struct Q6KKernel {
  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out,
                  const uint8_t* prefetch) {
    StreamPrefetch ahead(prefetch);
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const uint8_t* blk = row + 210 * sb;
      if (prefetch != nullptr) ahead.upto(prefetch + 210 * (sb + 1));
      // int16 scales 0..7 | 8..15
      const __m256i sc =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      // each row's scales times its 32-blocks' powers of two (|.| <= 128 * 16: int16), each
      // half (8 scales) in both 128-bit lanes for the shuffles below
      __m256i sum[R], sum_odd[R], halves[2][R];
      for (int r = 0; r < R; ++r) {
        sum[r] = sum_odd[r] = _mm256_setzero_si256();
        const __m256i scaled = _mm256_mullo_epi16(
            sc, per_16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].pow2_32 + 16 * sb))));
        halves[0][r] = _mm256_permute2x128_si256(scaled, scaled, 0x00);
        halves[1][r] = _mm256_permute2x128_si256(scaled, scaled, 0x11);
      }
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
        const __m256i ql1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
        const __m256i qh =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i codes[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, low4),
                            _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2)),
            _mm256_or_si256(_mm256_and_si256(ql1, low4),
                            _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                            _mm256_and_si256(qh, high2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2)),
        };
        // int16 lanes 0..7 (bytes 0..15) of 32-group g take scale 2 (4h + g), lanes 8..15 the
        // next: in a half's scales (8h..8h+7 in each lane) they are int16 2g and 2g + 1
        for (int g = 0; g < 4; ++g) {
          const __m256i pick = _mm256_set_m128i(
              _mm_set1_epi16(static_cast<short>(0x0100 * (4 * g + 3) + 4 * g + 2)),
              _mm_set1_epi16(static_cast<short>(0x0100 * (4 * g + 1) + 4 * g)));
          // two chains at one row, one a row at more (see K4Kernel); g is unrolled
          __m256i* chain = R == 1 && g % 2 ? sum_odd : sum;
          for (int r = 0; r < R; ++r)
            chain[r] = _mm256_add_epi32(
                chain[r], scaled_isum_u8(codes[g], a[r].q256 + 256 * sb + 128 * h + 32 * g,
                                         _mm256_shuffle_epi8(halves[h][r], pick)));
        }
      }
      const float d = fp16_at(blk + 208);
      for (int r = 0; r < R; ++r) {
        const __m256i zero = _mm256_madd_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].bsum16 + 16 * sb)), sc);
        const __m256i total = _mm256_sub_epi32(_mm256_add_epi32(sum[r], sum_odd[r]),
                                               _mm256_slli_epi32(zero, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * a[r].unit256[sb]),
                                 acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum_ps(acc[r]);
  }
};
#endif  // __AVX2__

RowsDot rows_dot_for(int64_t type, bool reference) {
#if defined(__AVX2__)
  if (!reference) switch (type) {
    case kQ8_0: return rows_dot<Q8_0Kernel>;
    case kQ4_0: return rows_dot<LegacyKernel<18, false, false>>;
    case kQ4_1: return rows_dot<LegacyKernel<20, true, false>>;
    case kQ5_0: return rows_dot<LegacyKernel<22, false, true>>;
    case kQ5_1: return rows_dot<LegacyKernel<24, true, true>>;
    case kQ4_K: return rows_dot<K4Kernel<false>>;
    case kQ5_K: return rows_dot<K4Kernel<true>>;
    case kQ6_K: return rows_dot<Q6KKernel>;
    default: break;
  }
#endif
  return reference_rows_dot(type);
}

}  // namespace
}  // namespace kvforge
