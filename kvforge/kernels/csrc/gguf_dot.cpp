// Few-row GGUF products read straight from the file's blocks (docs/gguf_native.md), and
// GgufWeight: one projection's shards, multiplied by these kernels inside a DecodeStack team or
// from Python.
//
// Activations are quantized once per call (per thread: a few us) to int8 with a step per 16:
//
//   q    int8  [K]          round(x / d), |q| <= 127, d = max |x| / 127 of each 16
//   dv   float [K / 32, 8]  each 32-block's two steps as the dot's lanes take them:
//                           [d_lo d_lo d_lo d_lo | d_hi d_hi d_hi d_hi]
//   s16  float [K / 16]     d * sum(q) of each 16: what a weight offset (min) multiplies
//   s32  float [K / 32]     the same per 32 (s16 pairs)
//
// Each type's kernel turns a block's bytes into unsigned codes in registers (no scratch row)
// and multiplies them by the activations' bytes:
//
//   maddubs(codes u8, q s8) -> 16 int16 pair sums; madd(., 1) -> 8 int32:
//   lanes 0..3 = bytes 0..15, lanes 4..7 = bytes 16..31     (so dv's halves line up)
//
//   dot(w, x) = sum over 32-blocks  cvt(int32 lanes) * weight scale * dv        (vector FMA)
//             + sum over 16/32-wide groups  offset * s16 / s32                  (a few FMAs per
//                                                                              256 weights)
//
// Codes are unsigned so maddubs takes them as they are; a signed format's zero point (Q4_0's
// -8, Q5_0's -16, Q6_K's -32) is an offset like Q4_1's min. Q8_0 (signed bytes) moves the
// sign onto the activations (_mm256_sign_epi8). The step per 16 (llama.cpp rounds per 32 or
// 256) costs one vector load per 32 weights and confines an outlier channel's coarse step to
// 16 values.
//
// Without AVX2 (builds for other CPUs) each row is unpacked to codes (gguf_blocks.cpp) and
// dotted by a scalar loop: the same arithmetic, the reference the tests compare.
#include "kernels.h"

namespace kvforge {
namespace {

struct ActRow {
  const int8_t* q;
  const float *dv, *s16, *s32;
};

struct GgufActivations {
  int64_t k = 0;
  std::vector<int8_t> q;
  std::vector<float> dv, s16, s32;

  void quantize(const float* x, int64_t xs, int64_t rows, int64_t width) {
    k = width;
    q.resize(rows * k);
    dv.resize(rows * k / 32 * 8);
    s16.resize(rows * k / 16);
    s32.resize(rows * k / 32);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < k / 16; ++h) {
        const float* v = x + r * xs + 16 * h;
        int8_t* out = q.data() + r * k + 16 * h;
        float amax = 0.f;
        for (int j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < 16; ++j) {
          const int c = static_cast<int>(std::nearbyint(v[j] * inv));
          out[j] = static_cast<int8_t>(c);
          sum += c;
        }
        const int64_t b = r * (k / 32) + h / 2;
        float* lanes = dv.data() + 8 * b + 4 * (h % 2);
        for (int j = 0; j < 4; ++j) lanes[j] = d;
        s16[r * (k / 16) + h] = d * static_cast<float>(sum);
        s32[b] = (h % 2 ? s32[b] : 0.f) + d * static_cast<float>(sum);
      }
  }
  // the rows as the kernels take them (valid until the next quantize)
  const ActRow* rows(int64_t count) {
    views.resize(count);
    for (int64_t m = 0; m < count; ++m)
      views[m] = {q.data() + m * k, dv.data() + m * (k / 32) * 8, s16.data() + m * (k / 16),
                  s32.data() + m * (k / 32)};
    return views.data();
  }
  std::vector<ActRow> views;
};

// out[m] = W row . activation row m, for m < rows (<= kGgufDotRowsMax)
using RowsDot = void (*)(const uint8_t* row, int64_t k, const ActRow* a, int64_t rows,
                         float* out);

// ---- the reference: codes (gguf_blocks.cpp) . activations ---------------------------------
template <int64_t Type>
void dot_via_codes(const uint8_t* row, int64_t k, const ActRow* acts, int64_t rows, float* out) {
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

// the reference kernel of a type (builds without AVX2 run it; tests compare with it)
RowsDot reference_rows_dot(int64_t type) {
  switch (type) {
    case kQ8_0: return dot_via_codes<kQ8_0>;
    case kQ4_0: return dot_via_codes<kQ4_0>;
    case kQ4_1: return dot_via_codes<kQ4_1>;
    case kQ5_0: return dot_via_codes<kQ5_0>;
    case kQ5_1: return dot_via_codes<kQ5_1>;
    case kQ4_K: return dot_via_codes<kQ4_K>;
    case kQ5_K: return dot_via_codes<kQ5_K>;
    case kQ6_K: return dot_via_codes<kQ6_K>;
    default: return nullptr;
  }
}

#if defined(__AVX2__)
// Each kernel decodes a weight row's blocks once per group of R <= 4 activation rows (a
// verification step or a small batch reuses the codes in registers), R accumulators.
template <class Kernel>
void rows_dot(const uint8_t* row, int64_t k, const ActRow* a, int64_t rows, float* out) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) Kernel::template run<4>(row, k, a + m, out + m);
  switch (rows - m) {
    case 3: return Kernel::template run<3>(row, k, a + m, out + m);
    case 2: return Kernel::template run<2>(row, k, a + m, out + m);
    case 1: return Kernel::template run<1>(row, k, a + m, out + m);
    default: return;
  }
}

// 8 int32 sums of 32 unsigned codes times 32 signed activation bytes, as floats
inline __m256 dot_u8(__m256i codes, const int8_t* x) {
  const __m256i pairs =
      _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
// the same with each int16 pair sum multiplied by `scale` (int16 lanes) before the int32 sums
inline __m256 scaled_dot_u8(__m256i codes, const int8_t* x, __m256i scale) {
  const __m256i pairs =
      _mm256_maddubs_epi16(codes, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scale));
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

// Q8_0  [d][q0..q31 int8]                      w = d * q
struct Q8_0Kernel {
  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out) {
    __m256 even[R], odd[R];                 // two FMA chains, alternate blocks (K4Kernel)
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    auto block = [&](int64_t b, __m256* acc) {
      const uint8_t* blk = row + 34 * b;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      const __m256i w_abs = _mm256_sign_epi8(w, w);
      const __m256 d = _mm256_set1_ps(fp16_at(blk));
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].q + 32 * b));
        // |w| (<= 128) unsigned against x with w's sign: pair sums fit int16
        const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_loadu_ps(a[r].dv + 8 * b)), acc[r]);
      }
    };
    int64_t b = 0;
    for (; b + 2 <= k / 32; b += 2) {
      block(b, even);
      block(b + 1, odd);
    }
    if (b < k / 32) block(b, even);
    for (int r = 0; r < R; ++r) out[r] = hsum_ps(_mm256_add_ps(even[r], odd[r]));
  }
};

// Q4_0 [d][qs:16] w = d * (nib - 8);  Q4_1 [d][m][qs:16] w = d * nib + m
// Q5_0 [d][qh:4][qs:16] w = d * (code - 16);  Q5_1 [d][m][qh:4][qs:16] w = d * code + m
template <int Bytes, bool HasMin, bool FifthBit>
struct LegacyKernel {
  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out) {
    constexpr int kCodes = (HasMin ? 4 : 2) + (FifthBit ? 4 : 0);   // offset of qs
    constexpr float kZero = FifthBit ? 16.f : 8.f;                  // the signed types' zero
    __m256 even[R], odd[R];                 // two FMA chains, alternate blocks (K4Kernel)
    float offsets[R] = {};
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm256_setzero_ps();
    auto block = [&](int64_t b, __m256* acc) {
      const uint8_t* blk = row + Bytes * b;
      __m256i codes = nibbles_32(blk + kCodes);
      if constexpr (FifthBit) codes = _mm256_or_si256(codes, fifth_bits_32(blk + kCodes - 4));
      const float d = fp16_at(blk);
      const float offset = HasMin ? fp16_at(blk + 2) : -kZero * d;
      const __m256 dv = _mm256_set1_ps(d);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(dot_u8(codes, a[r].q + 32 * b),
                                 _mm256_mul_ps(dv, _mm256_loadu_ps(a[r].dv + 8 * b)), acc[r]);
        offsets[r] += offset * a[r].s32[b];
      }
    };
    int64_t b = 0;
    for (; b + 2 <= k / 32; b += 2) {
      block(b, even);
      block(b + 1, odd);
    }
    if (b < k / 32) block(b, even);
    for (int r = 0; r < R; ++r) out[r] = hsum_ps(_mm256_add_ps(even[r], odd[r])) + offsets[r];
  }
};

// K-quant scales of Q4_K / Q5_K (gguf_blocks.cpp's map), all eight at once: 12 bytes ->
// scales s0..s7 in bytes 0..7 and mins m0..m7 in bytes 8..15
inline __m128i k_scales_mins(const uint8_t* p) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, p, 4);
  std::memcpy(&w1, p + 4, 4);
  std::memcpy(&w2, p + 8, 4);
  const uint32_t s_lo = w0 & 0x3f3f3f3f, m_lo = w1 & 0x3f3f3f3f;
  // sub-blocks 4..7: 4 bits from bytes 8..11, 2 high bits from bits 7:6 of bytes 0..7
  const uint32_t s_hi = (w2 & 0x0f0f0f0f) | ((w0 >> 2) & 0x30303030);
  const uint32_t m_hi = ((w2 >> 4) & 0x0f0f0f0f) | ((w1 >> 2) & 0x30303030);
  return _mm_set_epi32(static_cast<int>(m_hi), static_cast<int>(m_lo), static_cast<int>(s_hi),
                       static_cast<int>(s_lo));
}

// Q4_K [d][dmin][scales:12][qs:128]  and  Q5_K [d][dmin][scales:12][qh:32][qs:128]
//   sub-block j (32 weights): w = d * s_j * code - dmin * m_j; 32-byte chunk c of qs holds
//   sub-block 2c in its low nibbles, 2c + 1 in its high; Q5_K's fifth bit: bit j of qh[i]
template <bool FifthBit>
struct K4Kernel {
  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out) {
    constexpr int64_t kBytes = FifthBit ? 176 : 144, kQs = FifthBit ? 48 : 16;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    alignas(16) int16_t scale[8];
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const uint8_t* blk = row + kBytes * sb;
      const __m128i sm = k_scales_mins(blk + 4);
      // the 6-bit scales as int16 (madd multiplies each pair sum by its sub-block's scale, so
      // the float work per 32 weights is one conversion and one FMA); the super-block's d
      // multiplies once per 256 weights
      _mm_store_si128(reinterpret_cast<__m128i*>(scale), _mm_cvtepu8_epi16(sm));
      const __m256 m = _mm256_mul_ps(
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
          _mm256_set1_ps(fp16_at(blk + 2)));
      const __m256 d = _mm256_set1_ps(fp16_at(blk));
      const uint8_t* qs = blk + kQs;
      __m256i qh;
      if constexpr (FifthBit) qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16));
      // two FMA chains per row (low and high nibbles): at one row a single chain's ~4-cycle
      // FMA latency would bound the loop; every row count sums in the same order, so a row
      // gets the same bits in a group as alone
      __m256 part[R], part_hi[R];
      for (int r = 0; r < R; ++r) part[r] = part_hi[r] = _mm256_setzero_ps();
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
        const __m256i s_lo = _mm256_set1_epi16(scale[2 * c]);
        const __m256i s_hi = _mm256_set1_epi16(scale[2 * c + 1]);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a[r].q + 256 * sb + 64 * c;
          const float* dv = a[r].dv + 64 * sb + 16 * c;
                    part[r] = _mm256_fmadd_ps(scaled_dot_u8(lo, x, s_lo), _mm256_loadu_ps(dv), part[r]);
          part_hi[r] = _mm256_fmadd_ps(scaled_dot_u8(hi, x + 32, s_hi),
                                       _mm256_loadu_ps(dv + 8), part_hi[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        part[r] = _mm256_add_ps(part[r], part_hi[r]);
        acc[r] = _mm256_fmadd_ps(part[r], d, acc[r]);
        acc[r] = _mm256_fnmadd_ps(m, _mm256_loadu_ps(a[r].s32 + 8 * sb), acc[r]);
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
struct Q6KKernel {
  template <int R>
  static void run(const uint8_t* row, int64_t k, const ActRow* a, float* out) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    alignas(32) int16_t scale[16];
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const uint8_t* blk = row + 210 * sb;
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
      _mm256_store_si256(reinterpret_cast<__m256i*>(scale), _mm256_cvtepi8_epi16(sc8));
      const float d_scalar = fp16_at(blk + 208);
      const __m256 d = _mm256_set1_ps(d_scalar);
      // the zero point: -32 d sum_i scale_i s16_i
      const __m256 z = _mm256_set1_ps(-32.f * d_scalar);
      const __m256 s_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8));
      const __m256 s_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)));
      __m256 part[R], part_odd[R];           // two FMA chains (see K4Kernel)
      for (int r = 0; r < R; ++r) {
        part_odd[r] = _mm256_setzero_ps();
        __m256 zero = _mm256_mul_ps(s_lo, _mm256_loadu_ps(a[r].s16 + 16 * sb));
        zero = _mm256_fmadd_ps(s_hi, _mm256_loadu_ps(a[r].s16 + 16 * sb + 8), zero);
        acc[r] = _mm256_fmadd_ps(zero, z, acc[r]);
        part[r] = _mm256_setzero_ps();
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
        for (int g = 0; g < 4; ++g) {
          const int blk32 = 4 * h + g;                      // 32-block in the super-block
          // int16 lanes 0..7 (bytes 0..15) take scale 2 blk32, lanes 8..15 scale 2 blk32 + 1
          const __m256i s = _mm256_set_m128i(_mm_set1_epi16(scale[2 * blk32 + 1]),
                                             _mm_set1_epi16(scale[2 * blk32]));
          __m256* chain = g % 2 ? part_odd : part;     // g is unrolled: a fixed choice
          for (int r = 0; r < R; ++r)
            chain[r] = _mm256_fmadd_ps(
                scaled_dot_u8(codes[g], a[r].q + 256 * sb + 32 * blk32, s),
                _mm256_loadu_ps(a[r].dv + 64 * sb + 8 * blk32), chain[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        part[r] = _mm256_add_ps(part[r], part_odd[r]);
        acc[r] = _mm256_fmadd_ps(part[r], d, acc[r]);
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
