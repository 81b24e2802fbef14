#include "kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace kvforge {
// GGUF block formats (docs/gguf_native.md): their sizes, and each type unpacked to one
// intermediate form, a row of *codes*:
//
//   q   int8  [K]        small integers (0..31, -32..31 or int8)
//   sc  float [K / 16]   scale of each 16 weights
//   off float [K / 32]   constant added to each 32 weights (Q4_1, Q5_1, Q4_K, Q5_K; else 0)
//
//   w[i] = sc[i / 16] * q[i] + off[i / 32]
//
// Codes are the reference form: dequantization (embedding rows, prefill tiles) and the
// portable dot kernel read them; the AVX2 dot kernels (gguf_dot.cpp) decode blocks in registers
// instead. Many rows (prefill): rows of W are dequantized to fp32 tiles and multiplied by
// ATen's GEMM (many_rows).
namespace {

// ggml's enum ggml_type (gguf-py: GGMLQuantizationType)
enum GgmlType : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

struct BlockFormat {
  int64_t weights = 0, bytes = 0;   // weights per block, bytes per block
  bool quantized = false;           // codes (true) or a float row (F32 / F16 / BF16)
};

BlockFormat block_format(int64_t type) {
  switch (type) {
    case kF32: return {1, 4, false};
    case kF16: return {1, 2, false};
    case kBF16: return {1, 2, false};
    case kQ8_0: return {32, 34, true};
    case kQ4_0: return {32, 18, true};
    case kQ4_1: return {32, 20, true};
    case kQ5_0: return {32, 22, true};
    case kQ5_1: return {32, 24, true};
    case kQ4_K: return {256, 144, true};
    case kQ5_K: return {256, 176, true};
    case kQ6_K: return {256, 210, true};
    default:
      TORCH_CHECK(false, "GGML type id ", type, " has no native kernel (supported: F32, F16, "
                  "BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)");
  }
  return {};
}

// one fp16 scale: F16C's conversion instruction where the build has it (x86-64-v3 and up);
// the portable bit manipulation costs ~15 ops, as much as the dot product of a 32-block
inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// ---- one block -> codes -------------------------------------------------------------------
// Each unpacks one block at `b` into q[weights], sc[weights / 16], off[weights / 32]. Byte maps
// (offsets in bytes, little-endian fp16 scales "d" / "m"):

// Q8_0 (32 weights, 34 bytes)   [d:2][q0 .. q31: int8]                      w = d * q
inline void unpack_q8_0(const uint8_t* b, int8_t* q, float* sc, float* off) {
  sc[0] = sc[1] = fp16_at(b);
  off[0] = 0.f;
  std::memcpy(q, b + 2, 32);
}

// Q4_0 (32, 18)   [d:2][qs:16]   byte j = weight j (low nibble) | weight j + 16 (high nibble)
//                                w = d * (nibble - 8)
inline void unpack_q4_0(const uint8_t* b, int8_t* q, float* sc, float* off) {
  sc[0] = sc[1] = fp16_at(b);
  off[0] = 0.f;
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>((qs[j] & 15) - 8);
    q[j + 16] = static_cast<int8_t>((qs[j] >> 4) - 8);
  }
}

// Q4_1 (32, 20)   [d:2][m:2][qs:16]   nibbles as Q4_0      w = d * nibble + m
inline void unpack_q4_1(const uint8_t* b, int8_t* q, float* sc, float* off) {
  sc[0] = sc[1] = fp16_at(b);
  off[0] = fp16_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(qs[j] & 15);
    q[j + 16] = static_cast<int8_t>(qs[j] >> 4);
  }
}

// Q5_0 (32, 22)   [d:2][qh:4][qs:16]   5-bit code j = nibble j | bit j of qh (uint32) << 4
//                                      w = d * (code - 16)
// Q5_1 (32, 24)   [d:2][m:2][qh:4][qs:16]                  w = d * code + m
inline void unpack_q5(const uint8_t* qh_bytes, const uint8_t* qs, int8_t* q, int bias) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - bias);
    q[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
  }
}
inline void unpack_q5_0(const uint8_t* b, int8_t* q, float* sc, float* off) {
  sc[0] = sc[1] = fp16_at(b);
  off[0] = 0.f;
  unpack_q5(b + 2, b + 6, q, 16);
}
inline void unpack_q5_1(const uint8_t* b, int8_t* q, float* sc, float* off) {
  sc[0] = sc[1] = fp16_at(b);
  off[0] = fp16_at(b + 2);
  unpack_q5(b + 4, b + 8, q, 0);
}

// K-quants: super-blocks of 256 weights.
//
// Q4_K (256, 144)  [d:2][dmin:2][scales:12][qs:128]
// Q5_K (256, 176)  [d:2][dmin:2][scales:12][qh:32][qs:128]
//   8 sub-blocks of 32, each with a 6-bit scale s and 6-bit min m:  w = d * s * code - dmin * m
//   scales (bits, high to low; s0..s7, m0..m7):
//     byte 0..3    s4..s7 [5:4] | s0..s3        (2 high bits of s4+i over 6 bits of s i)
//     byte 4..7    m4..m7 [5:4] | m0..m3
//     byte 8..11   m4..m7 [3:0] | s4..s7 [3:0]  (high nibble m, low nibble s)
//   qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles, 2c+1 in its high
//   Q5_K's fifth bit of sub-block s, weight j: bit s of qh[j]
inline void k_scale_min(const uint8_t* s, int sub, int* scale, int* min) {
  if (sub < 4) {
    *scale = s[sub] & 63;
    *min = s[sub + 4] & 63;
  } else {
    *scale = (s[sub + 4] & 15) | ((s[sub - 4] >> 6) << 4);
    *min = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
  }
}
inline void k_scales(const uint8_t* b, float* sc, float* off) {
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  for (int sub = 0; sub < 8; ++sub) {
    int scale, min;
    k_scale_min(b + 4, sub, &scale, &min);
    sc[2 * sub] = sc[2 * sub + 1] = d * static_cast<float>(scale);
    off[sub] = -dmin * static_cast<float>(min);
  }
}
inline void k_nibbles(const uint8_t* qs, int8_t* q) {
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 32; ++j) {
      q[64 * c + j] = static_cast<int8_t>(qs[32 * c + j] & 15);
      q[64 * c + 32 + j] = static_cast<int8_t>(qs[32 * c + j] >> 4);
    }
}
inline void unpack_q4_k(const uint8_t* b, int8_t* q, float* sc, float* off) {
  k_scales(b, sc, off);
  k_nibbles(b + 16, q);
}
inline void unpack_q5_k(const uint8_t* b, int8_t* q, float* sc, float* off) {
  k_scales(b, sc, off);
  k_nibbles(b + 48, q);
  const uint8_t* qh = b + 16;
  for (int sub = 0; sub < 8; ++sub)
    for (int j = 0; j < 32; ++j)
      q[32 * sub + j] = static_cast<int8_t>(q[32 * sub + j] | (((qh[j] >> sub) & 1) << 4));
}

// Q6_K (256, 210)  [ql:128][qh:64][scales:16 int8][d:2]
//   16 sub-blocks of 16 weights, w = d * scale[i / 16] * (code - 32), 6-bit code = 4 low bits
//   from ql | 2 high bits from qh << 4. Two halves h of 128 weights; in half h, 32-groups g:
//     g   ql byte (j = 0..31)        qh bits of byte qh[32h + j]
//     0   ql[64h + j]      & 15      [1:0]
//     1   ql[64h + 32 + j] & 15      [3:2]
//     2   ql[64h + j]      >> 4      [5:4]
//     3   ql[64h + 32 + j] >> 4      [7:6]
inline void unpack_q6_k(const uint8_t* b, int8_t* q, float* sc, float* off) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16_at(b + 208);
  for (int i = 0; i < 16; ++i) sc[i] = d * static_cast<float>(scales[i]);
  for (int i = 0; i < 8; ++i) off[i] = 0.f;
  for (int h = 0; h < 2; ++h) {
    const uint8_t *l = ql + 64 * h, *hb = qh + 32 * h;
    int8_t* o = q + 128 * h;
    for (int j = 0; j < 32; ++j) {
      o[j] = static_cast<int8_t>(((l[j] & 15) | ((hb[j] & 3) << 4)) - 32);
      o[32 + j] = static_cast<int8_t>(((l[32 + j] & 15) | (((hb[j] >> 2) & 3) << 4)) - 32);
      o[64 + j] = static_cast<int8_t>(((l[j] >> 4) | (((hb[j] >> 4) & 3) << 4)) - 32);
      o[96 + j] = static_cast<int8_t>(((l[32 + j] >> 4) | (((hb[j] >> 6) & 3) << 4)) - 32);
    }
  }
}

// A K-quant super-block in integers: the form of the per-256 dot arithmetic (gguf_dot.cpp),
// which the portable dot kernel reads.
//   q      int8 [256]  codes (Q6_K: code - 32)
//   scale  [16]        integer scale of each 16 weights; min [16] its integer min (Q6_K: 0)
//   w[i] = d * scale[i / 16] * q[i] - dmin * min[i / 16]
struct KQuantBlock {
  int8_t q[256];
  int scale[16], min[16];
  float d = 0.f, dmin = 0.f;
};
inline void unpack_k_block(int64_t type, const uint8_t* b, KQuantBlock& out) {
  float sc[16], off[8];
  if (type == kQ6_K) {
    unpack_q6_k(b, out.q, sc, off);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    for (int i = 0; i < 16; ++i) {
      out.scale[i] = scales[i];
      out.min[i] = 0;
    }
    out.d = fp16_at(b + 208);
    return;
  }
  TORCH_CHECK(type == kQ4_K || type == kQ5_K, "GGML type id ", type, " is not a K-quant");
  if (type == kQ4_K) unpack_q4_k(b, out.q, sc, off); else unpack_q5_k(b, out.q, sc, off);
  for (int sub = 0; sub < 8; ++sub) {
    int scale, min;
    k_scale_min(b + 4, sub, &scale, &min);
    out.scale[2 * sub] = out.scale[2 * sub + 1] = scale;
    out.min[2 * sub] = out.min[2 * sub + 1] = min;
  }
  out.d = fp16_at(b);
  out.dmin = fp16_at(b + 2);
}

template <void (*Unpack)(const uint8_t*, int8_t*, float*, float*), int64_t W, int64_t Bytes>
void unpack_blocks(const uint8_t* row, int64_t k, int8_t* q, float* sc, float* off) {
  for (int64_t i = 0; i < k / W; ++i)
    Unpack(row + i * Bytes, q + i * W, sc + i * (W / 16), off + i * (W / 32));
}

// one row of a quantized type -> codes (the switch once per row, the blocks inlined)
void unpack_row(int64_t type, const uint8_t* row, int64_t k, int8_t* q, float* sc, float* off) {
  switch (type) {
    case kQ8_0: return unpack_blocks<unpack_q8_0, 32, 34>(row, k, q, sc, off);
    case kQ4_0: return unpack_blocks<unpack_q4_0, 32, 18>(row, k, q, sc, off);
    case kQ4_1: return unpack_blocks<unpack_q4_1, 32, 20>(row, k, q, sc, off);
    case kQ5_0: return unpack_blocks<unpack_q5_0, 32, 22>(row, k, q, sc, off);
    case kQ5_1: return unpack_blocks<unpack_q5_1, 32, 24>(row, k, q, sc, off);
    case kQ4_K: return unpack_blocks<unpack_q4_k, 256, 144>(row, k, q, sc, off);
    case kQ5_K: return unpack_blocks<unpack_q5_k, 256, 176>(row, k, q, sc, off);
    case kQ6_K: return unpack_blocks<unpack_q6_k, 256, 210>(row, k, q, sc, off);
    default: TORCH_CHECK(false, "GGML type id ", type, " is not a block-quantized type");
  }
}

// a float row (F32 / F16 / BF16) -> fp32
void float_row(int64_t type, const uint8_t* row, int64_t k, float* out) {
  if (type == kF32) {
    std::memcpy(out, row, k * sizeof(float));
  } else if (type == kF16) {
    for (int64_t i = 0; i < k; ++i) out[i] = fp16_at(row + 2 * i);
  } else {
    for (int64_t i = 0; i < k; ++i) {
      uint16_t bits;
      std::memcpy(&bits, row + 2 * i, 2);
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;   // bf16 = the high half of fp32
      std::memcpy(out + i, &wide, 4);
    }
  }
}

#if defined(__AVX2__)
// Q4_K / Q6_K rows straight to fp32 in registers (the K-quants of Q4_K_M files): the codes
// pass through memory cost ~0.6 G weights/s a core, which on fp32 prefill tiles was ~15% of a
// 512-token prefill of Qwen2.5-1.5B. Multiply, then add: the scalar loop's rounding (no FMA
// contraction in ISO C++), so both give the same bits.
inline void store8(__m256i q32, __m256 scale, __m256 off, float* o) {
  _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(q32)), off));
}
// 32 int8 codes -> weights 0..15 under (s0, off0), 16..31 under (s1, off1)
inline void store32(__m256i codes, float s0, float s1, float off0, float off1, float* o) {
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  const __m256 a = _mm256_set1_ps(s0), b = _mm256_set1_ps(s1);
  const __m256 oa = _mm256_set1_ps(off0), ob = _mm256_set1_ps(off1);
  store8(_mm256_cvtepi8_epi32(lo), a, oa, o);
  store8(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)), a, oa, o + 8);
  store8(_mm256_cvtepi8_epi32(hi), b, ob, o + 16);
  store8(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)), b, ob, o + 24);
}
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
// Q4_K: chunk c of qs = sub-block 2c (low nibbles, weights 64c..64c+31), 2c+1 (high nibbles)
void q4_k_row_fp32(const uint8_t* row, int64_t k, float* out) {
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int64_t i = 0; i < k / 256; ++i) {
    const uint8_t* b = row + i * 144;
    float sc[16], off[8];
    k_scales(b, sc, off);
    float* o = out + i * 256;
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = load32(b + 16 + 32 * c);
      const __m256i lo = _mm256_and_si256(bytes, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4);
      store32(lo, sc[4 * c], sc[4 * c], off[2 * c], off[2 * c], o + 64 * c);
      store32(hi, sc[4 * c + 2], sc[4 * c + 2], off[2 * c + 1], off[2 * c + 1], o + 64 * c + 32);
    }
  }
}
// Q6_K: the 32-groups g of half h as in unpack_q6_k, 16 weights a scale
void q6_k_row_fp32(const uint8_t* row, int64_t k, float* out) {
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  const __m256i m32 = _mm256_set1_epi8(32);
  for (int64_t i = 0; i < k / 256; ++i) {
    const uint8_t* b = row + i * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = fp16_at(b + 208);
    float* o = out + i * 256;
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32);
      const __m256i hb = load32(b + 128 + 32 * h);
      const __m256i high[4] = {
          _mm256_and_si256(hb, m3), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m3),
          _mm256_and_si256(_mm256_srli_epi16(hb, 4), m3),
          _mm256_and_si256(_mm256_srli_epi16(hb, 6), m3)};
      const __m256i low[4] = {
          _mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
          _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
          _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
      for (int g = 0; g < 4; ++g) {
        const __m256i codes = _mm256_sub_epi8(
            _mm256_or_si256(low[g], _mm256_slli_epi16(high[g], 4)), m32);
        const int sub = 8 * h + 2 * g;
        store32(codes, d * static_cast<float>(scales[sub]),
                d * static_cast<float>(scales[sub + 1]), 0.f, 0.f, o + 128 * h + 32 * g);
      }
    }
  }
}
#endif

// Per-thread buffers of one weight row's codes (dequantize_row).
struct RowScratch {
  std::vector<int8_t> q;
  std::vector<float> sc, off;
  explicit RowScratch(int64_t k) : q(k), sc(k / 16 + 1), off(k / 32 + 1) {}
};

// one row of any supported type -> fp32 values
void dequantize_row(int64_t type, const BlockFormat& f, const uint8_t* row, int64_t k,
                    RowScratch& s, float* out) {
  if (!f.quantized) return float_row(type, row, k, out);
#if defined(__AVX2__)
  if (type == kQ4_K) return q4_k_row_fp32(row, k, out);
  if (type == kQ6_K) return q6_k_row_fp32(row, k, out);
#endif
  unpack_row(type, row, k, s.q.data(), s.sc.data(), s.off.data());
  // 16 at a time under one scale and offset: a loop the compiler vectorizes (an index
  // division per weight kept it scalar; fp32 tiles for long prefill chunks decode every row)
  for (int64_t g = 0; g < k / 16; ++g) {
    const float scale = s.sc[g], offset = s.off[g / 2];
    const int8_t* q = s.q.data() + 16 * g;
    float* o = out + 16 * g;
    for (int j = 0; j < 16; ++j) o[j] = scale * static_cast<float>(q[j]) + offset;
  }
}

// A projection's shards (q | k | v, gate | up): each its own raw tensor and type.
struct Shards {
  std::vector<const uint8_t*> data;
  std::vector<int64_t> row_stride, type, first_row;   // first_row: prefix sums, + total at end
  std::vector<BlockFormat> format;
  bool any_quantized = false;
  // which activation forms the shards' dot kernels read (gguf_dot.cpp): steps per 16 (the
  // 32-weight formats) and steps per 256 (K-quants)
  bool any_per_16 = false, any_per_256 = false;
  bool any_float = false;                               // F32 / F16 / BF16 shards

  Shards(const std::vector<at::Tensor>& raws, const std::vector<int64_t>& types, int64_t k) {
    TORCH_CHECK(!raws.empty() && raws.size() == types.size(),
                "gguf_linear needs one type per raw tensor (got ", raws.size(), " tensors, ",
                types.size(), " types)");
    first_row.push_back(0);
    for (size_t i = 0; i < raws.size(); ++i) {
      const at::Tensor& r = raws[i];
      const BlockFormat f = block_format(types[i]);
      TORCH_CHECK(r.scalar_type() == at::kByte && r.device().is_cpu() && r.dim() == 2 &&
                      r.stride(1) == 1,
                  "raw GGUF weights must be uint8 [rows, row_bytes] on CPU with contiguous rows");
      TORCH_CHECK(k % f.weights == 0 && (!f.quantized || k % 32 == 0),
                  "GGML type id ", types[i], " needs rows of whole blocks of ", f.weights,
                  " weights (and of 32 for the activation blocks); K = ", k);
      TORCH_CHECK(r.size(1) == k / f.weights * f.bytes, "raw GGUF shard ", i, " has ",
                  r.size(1), " bytes per row; type id ", types[i], " at K = ", k, " needs ",
                  k / f.weights * f.bytes);
      data.push_back(r.data_ptr<uint8_t>());
      row_stride.push_back(r.stride(0));
      type.push_back(types[i]);
      format.push_back(f);
      first_row.push_back(first_row.back() + r.size(0));
      any_quantized = any_quantized || f.quantized;
      any_per_16 = any_per_16 || (f.quantized && f.weights == 32);
      any_per_256 = any_per_256 || (f.quantized && f.weights == 256);
      any_float = any_float || !f.quantized;
    }
  }
  int64_t rows() const { return first_row.back(); }
  size_t shard_of(int64_t n) const {
    size_t s = 0;
    while (first_row[s + 1] <= n) ++s;
    return s;
  }
  const uint8_t* row(size_t s, int64_t n) const {
    return data[s] + (n - first_row[s]) * row_stride[s];
  }
};

// Activation rows one pass of the dot kernels takes (their per-thread buffers); more rows run
// as passes of this many. The kernels decode each weight block once per group of 8 rows, so
// a pass of 64 rows reads the weights once per 64 rows and multiplies in int8 at the rate of
// fp32 FMA: timed on a Q4_K gate|up of Qwen2.5-1.5B (2 AVX2 cores), 0.22 ms a row at 64 rows,
// where fp32 tiles + ATen's GEMM took 0.22-0.42 ms a row at 65-512 rows (an AMD CPU: on Intel
// with MKL the tiles win from ~64 rows, GgufWeight's gemm_min_rows). Float shards (F32 /
// F16 / BF16) of a projection with more rows keep the tiles (many_rows): their dot is a plain
// fp32 loop without blocking.
constexpr int64_t kGgufDotRowsMax = 64;
// activation rows one dot kernel call takes (a block's codes decoded once for all of them)
constexpr int64_t kGgufDotGroupRows = 8;
// how far ahead of its reads a dot kernel prefetches the weight stream (gguf_dot.cpp)
constexpr int64_t kGgufPrefetchAhead = 8192;

// `only`: the shards to multiply (nullptr: all)
void many_rows(const at::Tensor& x, const Shards& shards, at::Tensor& y,
               const std::vector<char>* only = nullptr) {
  const int64_t k = x.size(1);
  // tiles of 256 weight rows: MKL's GEMM ran 10-20% slower on 117-row tiles of a K = 8960
  // weight (4 MB) and on 682-row ones at K = 1536 than on 256-row tiles (Qwen2.5-1.5B, 512 rows)
  const int64_t tile = 256;
  for (size_t s = 0; s < shards.data.size(); ++s) {
    if (only != nullptr && !(*only)[s]) continue;
    const int64_t first = shards.first_row[s], end = shards.first_row[s + 1];
    for (int64_t t0 = first; t0 < end; t0 += tile) {
      const int64_t t1 = std::min(end, t0 + tile);
      at::Tensor w = at::empty({t1 - t0, k}, x.options());
      float* wp = w.data_ptr<float>();
      at::parallel_for(t0, t1, 8, [&](int64_t n0, int64_t n1) {
        RowScratch scratch(k);
        for (int64_t n = n0; n < n1; ++n)
          dequantize_row(shards.type[s], shards.format[s], shards.row(s, n), k, scratch,
                         wp + (n - t0) * k);
      });
      // straight into y's columns (a strided C the GEMM writes with its leading dimension):
      // a temporary and a copy per tile cost 2.5% of a 512-token prefill of the 1.5B model
      at::Tensor out = y.narrow(1, t0, t1 - t0);
      at::mm_out(out, x, w.t());
    }
  }
}

}  // namespace
}  // namespace kvforge
