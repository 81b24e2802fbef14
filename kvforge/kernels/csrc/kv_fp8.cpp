// fp8 K/V elements (quant/fp8_kv.py's caches) to and from floats, for the compiled decode
// attention and the decode stack's cache writes.
//
//   e5m2  s eeeee mm     bias 15: the top byte of an fp16 (same exponent, 2 of its 10
//                        mantissa bits), so fp16 bits = byte << 8, exactly
//   e4m3  s eeee mmm     bias 7, no infinities (S.1111.111 is NaN, 448 the largest finite):
//                        fp16 bits (s << 15) | (eeeemmm << 7) read as an fp16 are the value
//                        times 2^-8 (exponent field e in place of e + 8), normals and
//                        subnormals alike (e = 0: m/8 * 2^-14 vs m/8 * 2^-6), so one
//                        multiply by 256 finishes it
//
// Rounding a float to fp8 follows torch's cast (c10 Float8_e4m3fn / Float8_e5m2): to nearest,
// ties to even, on the float's bits; below the smallest normal through a float add that rounds
// the value onto the subnormal grid. The Python backends clamp to the format's range first, so
// the stack's writes clamp too (a tensor write and a stack write store the same byte).
#include "kernels.h"

#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvforge {

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp16 bits -> float (the portable loop's path; F16C builds convert 8 at once)
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  if (exp == 0) return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(mant), -24);
  if (exp == 31) return float_of(sign | 0x7F800000 | (mant << 13));
  return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t half_bits(uint8_t b, KVFormat format) {
  return format == KVFormat::kE5M2
             ? static_cast<uint16_t>(b << 8)
             : static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

}  // namespace

KVFormat kv_format_of(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be on CPU");
  switch (cache.scalar_type()) {
    case at::kFloat: return KVFormat::kF32;
    case at::kFloat8_e4m3fn: return KVFormat::kE4M3;
    case at::kFloat8_e5m2: return KVFormat::kE5M2;
    default: TORCH_CHECK(false, name, " must be fp32, float8_e4m3fn or float8_e5m2, got ",
                         cache.scalar_type());
  }
}

void fp8_to_float(const uint8_t* src, float* dst, int64_t n, KVFormat format) {
  // per 8 (AVX-512: 16) values: the bytes into the high halves of 16-bit lanes (b << 8: e5m2's
  // fp16), for e4m3 shifted right by one arithmetically (the sign lands in bits 15 and 14,
  // eeeemmm in bits 13..7) with bit 14 cleared, then F16C's conversion (and x 256 for e4m3)
  const bool e4m3 = format == KVFormat::kE4M3;
  const float unit = e4m3 ? 256.f : 1.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 unit16 = _mm512_set1_ps(unit);
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m256i h = _mm256_set_m128i(_mm_unpackhi_epi8(_mm_setzero_si128(), b),
                                 _mm_unpacklo_epi8(_mm_setzero_si128(), b));
    if (e4m3) h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(-16512));   // 0xBF80
    __m512 f = _mm512_cvtph_ps(h);
    if (e4m3) f = _mm512_mul_ps(f, unit16);
    _mm512_storeu_ps(dst + i, f);
  }
#endif
#if defined(__F16C__)
  const __m256 unit8 = _mm256_set1_ps(unit);
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(),
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    if (e4m3) h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16(-16512));           // 0xBF80
    __m256 f = _mm256_cvtph_ps(h);
    if (e4m3) f = _mm256_mul_ps(f, unit8);
    _mm256_storeu_ps(dst + i, f);
  }
#endif
  for (; i < n; ++i) dst[i] = half_to_float(half_bits(src[i], format)) * unit;
}

uint8_t float_to_fp8(float x, KVFormat format) {
  // format: mantissa bits, exponent bias; the float's smallest exponent that stays normal
  const bool e4m3 = format == KVFormat::kE4M3;
  const int mant = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  uint32_t f = bits_of(x);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint8_t out;
  if (f > 0x7F800000u) {                                    // NaN stays NaN
    out = 0x7F;
  } else if (f >= static_cast<uint32_t>(127 - bias + 1) << 23) {   // normal in fp8
    // round the 23 - mant dropped bits to nearest, ties to the even kept mantissa
    const int drop = 23 - mant;
    const uint32_t odd = (f >> drop) & 1;
    f += (static_cast<uint32_t>(bias - 127) << 23) + ((1u << (drop - 1)) - 1) + odd;
    const uint32_t top = f >> drop;
    // past the largest finite value: e4m3 has no infinity (NaN), e5m2 goes to infinity
    const uint32_t max_finite = e4m3 ? 0x7E : 0x7B;
    out = top > max_finite ? (e4m3 ? 0x7F : 0x7C) : static_cast<uint8_t>(top);
  } else {
    // subnormal (or zero): a float add places the value on the grid of 2^(1 - bias - mant)
    // steps, rounding to nearest even; the sum's low mantissa bits are then the code
    const uint32_t denorm = static_cast<uint32_t>(127 - bias + 23 - mant + 1) << 23;
    out = static_cast<uint8_t>(bits_of(float_of(f) + float_of(denorm)) - denorm);
  }
  return static_cast<uint8_t>(out | (sign >> 24));
}

void store_kv(void* dst, const float* src, int64_t n, KVFormat format) {
  if (format == KVFormat::kF32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const float limit = format == KVFormat::kE4M3 ? 448.f : 57344.f;
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < n; ++i)
    out[i] = float_to_fp8(std::min(limit, std::max(-limit, src[i])), format);
}

void store_kv_op(at::Tensor dst, at::Tensor src) {
  check_fp32_cpu(src, "src");
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous() && src.numel() == dst.numel(),
              "src and dst must be contiguous with the same number of elements");
  store_kv(dst.data_ptr(), src.data_ptr<float>(), src.numel(), kv_format_of(dst, "dst"));
}

}  // namespace kvforge
