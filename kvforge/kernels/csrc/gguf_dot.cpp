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
// The kernels (gguf_dot_kernels.inc) are compiled once per int8 dot instruction: the maddubs
// + madd above, or VNNI's vpdpbusd / vpdpwssd where the CPU has them (KVFORGE_INT8_DOT), which
// compute the same int32 lanes, so every instruction gives the same outputs bit for bit.
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

// Q4_0 [d][qs:16] w = d * (nib - 8);  Q4_1 [d][m][qs:16] w = d * nib + m
// Q5_0 [d][qh:4][qs:16] w = d * (code - 16);  Q5_1 [d][m][qh:4][qs:16] w = d * code + m
// A block's unsigned codes and its offset (a signed type's zero point times its scale, or
// the min), as the dot kernels and the int8 panels (gguf_gemm.cpp) decode them.
template <int Bytes, bool HasMin, bool FifthBit>
struct LegacyBlock {
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

// The kernels, once per int8 dot instruction (gguf_dot_kernels.inc); the VNNI ones compiled
// for their instructions alone whatever the build's -march, run only where the CPU has them.
namespace gguf_maddubs {
#define GGUF_DOT 0
#include "gguf_dot_kernels.inc"
#undef GGUF_DOT
}  // namespace gguf_maddubs

#if defined(KVFORGE_VNNI)
#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace gguf_avxvnni {
#define GGUF_DOT 1
#include "gguf_dot_kernels.inc"
#undef GGUF_DOT
}  // namespace gguf_avxvnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
namespace gguf_avx512vnni {
#define GGUF_DOT 2
#include "gguf_dot_kernels.inc"
#undef GGUF_DOT
}  // namespace gguf_avx512vnni
#pragma GCC pop_options
#endif
#endif  // __AVX2__

// The kernel of a block type for int8 dot `dot` (an Int8Dot this CPU has: GgufWeight checks),
// or the portable reference (`reference`, a build without AVX2, a type without a kernel)
RowsDot rows_dot_for(int64_t type, bool reference, int64_t dot) {
  RowsDot kernel = nullptr;
#if defined(__AVX2__)
  if (!reference) {
#if defined(KVFORGE_VNNI)
    if (dot == kDotAvxVnni) kernel = gguf_avxvnni::kernel_for(type);
    else if (dot == kDotAvx512Vnni) kernel = gguf_avx512vnni::kernel_for(type);
    else
#endif
      kernel = gguf_maddubs::kernel_for(type);
  }
#endif
  (void)dot;
  return kernel != nullptr ? kernel : reference_rows_dot(type);
}

}  // namespace
}  // namespace kvforge
