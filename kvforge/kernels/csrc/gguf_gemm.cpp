// Many activation rows (a prefill chunk, a large batch) times GGUF blocks in int8: each call
// unpacks a block of weight rows once into K-major int8 panels, then multiplies every
// activation row by them with maddubs, keeping the products' sums in int16 across k steps
// (docs/gguf_native.md, "int8 panels").
//
// Why: the dot kernels (gguf_dot.cpp) decode every block once per 4 activation rows and pay a
// madd, scale work and a horizontal layout per 32 weights per row: ~35% of the int8 rate. fp32
// tiles + MKL's GEMM (gguf_blocks.cpp many_rows) run at the fp32 FMA peak. maddubs multiplies
// 32 int8 pairs per instruction, 4x the multiplies of an 8-lane FMA; with the codes unpacked
// once per call and the int16 sums flushed once per 32 weights, the loop is maddubs + add.
//
// Panel of 8 weight rows (output columns n0 .. n0 + 7), the whole of K:
//
//   codes   u8   [K / 4][8][4]   k step t (k = 4t .. 4t + 3) of columns 0..7: one 32-byte vector
//   scale   f32  [K / G][8]      each group's scale per column (G = 32; Q6_K: 16)
//   offset  f32  [K / G][8]      what the group's activation sum multiplies (a min, a zero point)
//
//   w[n][k] = scale[k / G][n] * code[k][n] + offset[k / G][n]     code u8: 0..15, 0..31, 0..63
//
// Activation rows (GemmActivations), per row:
//
//   q     int8 [K]        round(x / step), |q| <= 127
//   step  f32  [K / 32]   max |x| of the 32 / 127
//   sum   f32  [K / 16]   step * sum(q) of each 16 (sum32: the same per 32)
//         f32  [K / 32]
//
//   y[m][n] = sum over groups g   scale[g][n] * step[m][g G / 32] * dot[m][n][g]
//                                 + offset[g][n] * sum[m][g],
//   dot[m][n][g] = sum over k in g   code[k][n] * q[m][k]   (int32)
//           = sum_k w[n][k] * step q[m][k]: the dequantized weights times the rounded activations.
// The offsets take the rounded sums, not exact ones: then a weight's rounding error is
// |w| * step / 2, not |scale * code| * step / 2 (Q6_K's codes sit 32 above the weights they
// encode: exact sums doubled its error on random blocks).
//
// The kernel (panel_tile): R activation rows x P panels (8 columns each). Per k step, a 32-byte
// load of each panel and a 4-byte broadcast of each row; maddubs(codes, q) -> 16 int16 lanes
// = column c's pair sums in lanes 2c, 2c + 1, added in int16 for Flush steps (16 products of a
// 4-bit code and |q| <= 127 fit: 16 * 15 * 127 = 30480; 5-bit codes 4 steps, 6-bit 2), then
// madd(., 1) -> 8 int32 column sums; per group one conversion, a multiply by the row's step and
// two FMAs per row and panel. Where the CPU has VNNI (KVFORGE_INT8_DOT) the tile
// (gguf_panel_tile.inc, compiled once per instruction) takes vpdpbusd instead: the products'
// quadruple sums straight into int32, the same integers, so the same outputs bit for bit.
#include "kernels.h"

namespace kvforge {
namespace {
// Register tiles (rows x panels) of the 4-bit codes and of the codes that flush more often
// (5- and 6-bit: they also hold int32 group sums). AVX2 has 16 ymm registers; the AVX-512 build
// compiles the same ymm code with 32 (EVEX), where taller tiles reuse each panel load more
// (timed on the 1.5B's shapes at 32 / 512 rows: Q4_K 6 x 2 vs 4 x 2 +10% at 32 rows on the
// 17920 x 1536 gate|up, even elsewhere; Q6_K 4 x 2 vs 3 x 2 +2-4%). The AVX2 shapes: below.
#if defined(__AVX512F__)
constexpr int kQ4Rows = 6, kQ4Panels = 2, kFlushRows = 4, kFlushPanels = 2;
#else
constexpr int kQ4Rows = 4, kQ4Panels = 2, kFlushRows = 3, kFlushPanels = 2;
#endif

// The panel form of a block type: its group (scale) size, how many bits its codes have, and
// the bias that makes its codes unsigned (Q4_0's nibble - 8 is stored as the nibble).
struct PanelFormat {
  int group = 0;        // 0: the type has no panel form (Q8_0's 8-bit codes, float rows)
  int code_bits = 0;
  int bias = 0;
};
PanelFormat panel_format(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 4, 8};
    case kQ4_1: return {32, 4, 0};
    case kQ5_0: return {32, 5, 16};
    case kQ5_1: return {32, 5, 0};
    case kQ4_K: return {32, 4, 0};
    case kQ5_K: return {32, 5, 0};
    case kQ6_K: return {16, 6, 32};
    default: return {};
  }
}

// One weight row (column n of y) in panel form, before the 8-column interleave:
// codes u8 [K], scale / offset f32 [K / group].
struct PanelRow {
  std::vector<uint8_t> codes;
  std::vector<float> scale, offset;
  std::vector<int8_t> q;               // the portable path's signed codes
  std::vector<float> sc16, off32;
};

void panel_row(int64_t type, const PanelFormat& pf, const uint8_t* row, int64_t k,
               PanelRow& out) {
  out.codes.resize(k);
  out.scale.resize(k / pf.group);
  out.offset.resize(k / pf.group);
  // through the reference codes (w = sc16 * q + off32); AVX2 builds pack Q4_K / Q6_K and the
  // 32-weight types straight from the blocks instead (pack_k_panels, pack_legacy_panels)
  out.q.resize(k);
  out.sc16.resize(k / 16 + 1);
  out.off32.resize(k / 32 + 1);
  unpack_row(type, row, k, out.q.data(), out.sc16.data(), out.off32.data());
  for (int64_t i = 0; i < k; ++i) out.codes[i] = static_cast<uint8_t>(out.q[i] + pf.bias);
  const int per = pf.group / 16;
  for (int64_t g = 0; g < k / pf.group; ++g) {
    const float s = out.sc16[g * per];
    out.scale[g] = s;
    out.offset[g] = out.off32[g * pf.group / 32] - static_cast<float>(pf.bias) * s;
  }
}

// Weight rows [n0, n0 + 8 * panels) of one shard as panels (rows past the shard's end: zero
// codes, scales and offsets, so their columns come out 0 and are not written).
struct Panels {
  std::vector<uint8_t> codes;          // [panels][K / 4][8][4]
  std::vector<float> scale, offset;    // [panels][K / G][8]
};

// 8 rows of 32 bytes (row c = column c's codes of 8 k steps) -> 8 vectors, vector t = k step t
// of the 8 columns (4 bytes each): a transpose of 8 x 8 dwords
//
//   in:  r_c = [c:t0 c:t1 .. c:t7]   (4 bytes each)      out: o_t = [0:t 1:t .. 7:t]
inline void transpose_8x8_dwords(__m256i r[8]) {
  const __m256i a0 = _mm256_unpacklo_epi32(r[0], r[1]), a1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i a2 = _mm256_unpacklo_epi32(r[2], r[3]), a3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i a4 = _mm256_unpacklo_epi32(r[4], r[5]), a5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i a6 = _mm256_unpacklo_epi32(r[6], r[7]), a7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i b0 = _mm256_unpacklo_epi64(a0, a2), b1 = _mm256_unpackhi_epi64(a0, a2);
  const __m256i b2 = _mm256_unpacklo_epi64(a1, a3), b3 = _mm256_unpackhi_epi64(a1, a3);
  const __m256i b4 = _mm256_unpacklo_epi64(a4, a6), b5 = _mm256_unpackhi_epi64(a4, a6);
  const __m256i b6 = _mm256_unpacklo_epi64(a5, a7), b7 = _mm256_unpackhi_epi64(a5, a7);
  // b0 = [0:t0 1:t0 2:t0 3:t0 | 0:t4 ..], b4 = [4:t0 .. 7:t0 | 4:t4 ..]; b1: t1 / t5, b2: t2 / t6,
  // b3: t3 / t7
  r[0] = _mm256_permute2x128_si256(b0, b4, 0x20);
  r[4] = _mm256_permute2x128_si256(b0, b4, 0x31);
  r[1] = _mm256_permute2x128_si256(b1, b5, 0x20);
  r[5] = _mm256_permute2x128_si256(b1, b5, 0x31);
  r[2] = _mm256_permute2x128_si256(b2, b6, 0x20);
  r[6] = _mm256_permute2x128_si256(b2, b6, 0x31);
  r[3] = _mm256_permute2x128_si256(b3, b7, 0x20);
  r[7] = _mm256_permute2x128_si256(b3, b7, 0x31);
}

// The 8 weight rows of the panel whose first column is n0 (nullptr past the shard's end)
inline void panel_rows(const Shards& shards, size_t s, int64_t n0, const uint8_t* rows[8]) {
  for (int c = 0; c < 8; ++c)
    rows[c] = n0 + c < shards.first_row[s + 1] ? shards.row(s, n0 + c) : nullptr;
}

// Panel p of a block of panels starting at column n0: its weight rows and where its codes,
// scales and offsets go (`groups` scale groups along K)
struct PanelSlot {
  const uint8_t* rows[8];
  float *scale, *offset;
  uint8_t* codes;
};
inline PanelSlot panel_slot(const Shards& shards, size_t s, int64_t n0, int64_t p, int64_t k,
                            int64_t groups, Panels& out) {
  PanelSlot slot;
  panel_rows(shards, s, n0 + 8 * p, slot.rows);
  slot.scale = out.scale.data() + p * groups * 8;
  slot.offset = out.offset.data() + p * groups * 8;
  slot.codes = out.codes.data() + p * k * 8;
  return slot;
}

#if defined(__AVX2__)
// The 32 codes of 32-group j (0..7) of a K-quant super-block at b, in a vector (a column's
// sub-block: what transpose_8x8_dwords interleaves with 7 other columns')
inline __m256i q4_k_codes_32(const uint8_t* b, int j) {     // chunk j / 2: low / high nibbles
  const __m256i bytes = load32(b + 16 + 32 * (j / 2));
  return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(15));
}
inline __m256i q6_k_codes_32(const uint8_t* b, int j) {     // half j / 4, group j % 4
  const int h = j / 4, g = j % 4;
  const __m256i l = load32(b + 64 * h + 32 * (g % 2));
  const __m256i low = _mm256_and_si256(g < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(15));
  const __m256i high = _mm256_and_si256(
      _mm256_srl_epi16(load32(b + 128 + 32 * h), _mm_cvtsi32_si128(2 * g)), _mm256_set1_epi8(3));
  return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

// Q4_K / Q6_K panels straight from the blocks: per super-block of each panel, each column's
// scales decoded in vector lanes, and each 32-group's codes of the 8 columns loaded, interleaved
// (transpose_8x8_dwords) and stored; no per-column scratch (the per-column path through
// panel_row took ~23% of a batch-32 decode step of Qwen2.5-1.5B)
template <int64_t Type>
void pack_k_panels(const Shards& shards, size_t s, int64_t n0, int64_t panels, int64_t k,
                   Panels& out) {
  constexpr int64_t kBytes = Type == kQ4_K ? 144 : 210;
  constexpr int kGroups = Type == kQ4_K ? 8 : 16;           // scale groups per super-block
  const int64_t groups = k / 256 * kGroups;
  for (int64_t p = 0; p < panels; ++p) {
    const PanelSlot slot = panel_slot(shards, s, n0, p, k, groups, out);
    const uint8_t* const* rows = slot.rows;
    float *scale = slot.scale, *offset = slot.offset;
    uint8_t* dst = slot.codes;
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      // each column's scales and offsets of this super-block (8 or 16 groups: vectors h of 8),
      // then the 8 columns interleaved like the codes: [group][column]
      constexpr int kHalves = kGroups / 8;
      __m256i sc[kHalves][8], off[kHalves][8];
      for (int c = 0; c < 8; ++c) {
        if (rows[c] == nullptr) {
          for (int h = 0; h < kHalves; ++h) sc[h][c] = off[h][c] = _mm256_setzero_si256();
          continue;
        }
        const uint8_t* b = rows[c] + kBytes * sb;
        if constexpr (Type == kQ4_K) {
          const __m128i sm8 = k_scales_mins(b + 4);
          sc[0][c] = _mm256_castps_si256(_mm256_mul_ps(
              _mm256_set1_ps(fp16_at(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm8))));
          off[0][c] = _mm256_castps_si256(_mm256_mul_ps(
              _mm256_set1_ps(-fp16_at(b + 2)),
              _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm8, 8)))));
        } else {
          const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
          const __m256 d = _mm256_set1_ps(fp16_at(b + 208)), zero = _mm256_set1_ps(-32.f);
          for (int h = 0; h < 2; ++h) {
            const __m256 v = _mm256_mul_ps(
                d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc8, 8) : sc8)));
            sc[h][c] = _mm256_castps_si256(v);
            off[h][c] = _mm256_castps_si256(_mm256_mul_ps(zero, v));
          }
        }
      }
      for (int h = 0; h < kHalves; ++h) {
        transpose_8x8_dwords(sc[h]);
        transpose_8x8_dwords(off[h]);
        for (int g = 0; g < 8; ++g) {
          const int64_t at = (sb * kGroups + 8 * h + g) * 8;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(scale + at), sc[h][g]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(offset + at), off[h][g]);
        }
      }
      for (int j = 0; j < 8; ++j) {                          // 32-group j of the 8 columns
        __m256i r[8];
        for (int c = 0; c < 8; ++c)
          r[c] = rows[c] == nullptr ? _mm256_setzero_si256()
                 : Type == kQ4_K    ? q4_k_codes_32(rows[c] + kBytes * sb, j)
                                    : q6_k_codes_32(rows[c] + kBytes * sb, j);
        transpose_8x8_dwords(r);
        uint8_t* at = dst + (sb * 256 + 32 * j) / 4 * 32;
        for (int t = 0; t < 8; ++t)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + 32 * t), r[t]);
      }
    }
  }
}
#endif

#if defined(__AVX2__)
// Q4_0 / Q4_1 / Q5_0 / Q5_1 panels straight from the blocks: each 32-block's codes of the 8
// columns decoded as the dot kernels decode them (LegacyBlock::codes_at: unsigned codes, the
// signed types' zero point an offset), interleaved and stored; the block's scale and offset
// per column
template <class Legacy, int64_t Bytes>
void pack_legacy_panels(const Shards& shards, size_t s, int64_t n0, int64_t panels, int64_t k,
                        Panels& out) {
  const int64_t blocks = k / 32;
  for (int64_t p = 0; p < panels; ++p) {
    const PanelSlot slot = panel_slot(shards, s, n0, p, k, blocks, out);
    const uint8_t* const* rows = slot.rows;
    float *scale = slot.scale, *offset = slot.offset;
    uint8_t* dst = slot.codes;
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i r[8];
      for (int c = 0; c < 8; ++c) {
        if (rows[c] == nullptr) {
          r[c] = _mm256_setzero_si256();
          scale[8 * b + c] = offset[8 * b + c] = 0.f;
          continue;
        }
        const uint8_t* blk = rows[c] + Bytes * b;
        r[c] = Legacy::codes_at(blk);
        const float d = fp16_at(blk);
        scale[8 * b + c] = d;
        offset[8 * b + c] = Legacy::offset_at(blk, d);
      }
      transpose_8x8_dwords(r);
      for (int t = 0; t < 8; ++t)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (8 * b + t) * 32), r[t]);
    }
  }
}
#endif

void pack_panels(const Shards& shards, size_t s, const PanelFormat& pf, int64_t n0,
                 int64_t panels, int64_t k, Panels& out) {
  const int64_t groups = k / pf.group;
  out.codes.resize(panels * k * 8);
  out.scale.resize(panels * groups * 8);
  out.offset.resize(panels * groups * 8);
#if defined(__AVX2__)
  if (shards.type[s] == kQ4_K) return pack_k_panels<kQ4_K>(shards, s, n0, panels, k, out);
  if (shards.type[s] == kQ6_K) return pack_k_panels<kQ6_K>(shards, s, n0, panels, k, out);
  using Q4_0 = LegacyBlock<18, false, false>;
  using Q4_1 = LegacyBlock<20, true, false>;
  using Q5_0 = LegacyBlock<22, false, true>;
  using Q5_1 = LegacyBlock<24, true, true>;
  switch (shards.type[s]) {
    case kQ4_0: return pack_legacy_panels<Q4_0, 18>(shards, s, n0, panels, k, out);
    case kQ4_1: return pack_legacy_panels<Q4_1, 20>(shards, s, n0, panels, k, out);
    case kQ5_0: return pack_legacy_panels<Q5_0, 22>(shards, s, n0, panels, k, out);
    case kQ5_1: return pack_legacy_panels<Q5_1, 24>(shards, s, n0, panels, k, out);
    default: break;
  }
#endif
  thread_local PanelRow rows[8];
  for (int64_t p = 0; p < panels; ++p) {
    const PanelSlot slot = panel_slot(shards, s, n0, p, k, groups, out);
    const uint8_t* col_codes[8];
    for (int c = 0; c < 8; ++c) {
      float* sc = slot.scale + c;
      float* off = slot.offset + c;
      if (slot.rows[c] != nullptr) {
        panel_row(shards.type[s], pf, slot.rows[c], k, rows[c]);
        for (int64_t g = 0; g < groups; ++g) {
          sc[8 * g] = rows[c].scale[g];
          off[8 * g] = rows[c].offset[g];
        }
      } else {
        rows[c].codes.assign(k, 0);
        for (int64_t g = 0; g < groups; ++g) sc[8 * g] = off[8 * g] = 0.f;
      }
      col_codes[c] = rows[c].codes.data();
    }
    uint8_t* dst = slot.codes;
#if defined(__AVX2__)
    for (int64_t k0 = 0; k0 < k; k0 += 32) {       // 8 k steps of the 8 columns at a time
      __m256i r[8];
      for (int c = 0; c < 8; ++c) r[c] = load32(col_codes[c] + k0);
      transpose_8x8_dwords(r);
      for (int t = 0; t < 8; ++t)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (k0 / 4 + t) * 32), r[t]);
    }
#else
    for (int64_t t = 0; t < k / 4; ++t)
      for (int c = 0; c < 8; ++c)
        for (int j = 0; j < 4; ++j) dst[t * 32 + 4 * c + j] = col_codes[c][4 * t + j];
#endif
  }
}

// The activation rows of one call, quantized once (shared by the threads).
struct GemmActivations {
  int64_t k = 0;
  std::vector<int8_t> q;               // [rows][K]
  std::vector<float> step, sum32;      // [rows][K / 32]
  std::vector<float> sum16;            // [rows][K / 16]

  void resize(int64_t rows, int64_t width) {
    k = width;
    q.resize(rows * k);
    step.resize(rows * (k / 32));
    sum32.resize(rows * (k / 32));
    sum16.resize(rows * (k / 16));
  }
  // rows [r0, r1) of x (after resize)
  void quantize_rows(const float* x, int64_t xs, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < k / 32; ++b) quantize_32(x + r * xs + 32 * b, r, b);
  }

 private:
  // the dot kernels' rounding of 16 values (round half to even of v * inv, as cvtps and
  // nearbyint do in the default rounding mode) under one step per 32
  void quantize_32(const float* v, int64_t r, int64_t b) {
    const float amax = GgufActivations::abs_max_32(v);
    const float inv = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
    int8_t* out = q.data() + r * k + 32 * b;
    const int lo = GgufActivations::round_16(v, inv, out);
    const int hi = GgufActivations::round_16(v + 16, inv, out + 16);
    step[r * (k / 32) + b] = d;
    sum16[r * (k / 16) + 2 * b] = d * static_cast<float>(lo);
    sum16[r * (k / 16) + 2 * b + 1] = d * static_cast<float>(hi);
    sum32[r * (k / 32) + b] = d * static_cast<float>(lo + hi);
  }
};

#if defined(__AVX2__)
inline __m256i broadcast_4_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The tiles, once per int8 dot instruction (gguf_panel_tile.inc)
namespace gguf_panels_maddubs {
#define GGUF_DOT 0
#include "gguf_panel_tile.inc"
#undef GGUF_DOT
}  // namespace gguf_panels_maddubs

#if defined(KVFORGE_VNNI)
#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace gguf_panels_avxvnni {
#define GGUF_DOT 1
#include "gguf_panel_tile.inc"
#undef GGUF_DOT
}  // namespace gguf_panels_avxvnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
namespace gguf_panels_avx512vnni {
#define GGUF_DOT 2
#include "gguf_panel_tile.inc"
#undef GGUF_DOT
}  // namespace gguf_panels_avx512vnni
#pragma GCC pop_options
#endif

// panel_tile of R = rows (1..Rmax) rows on int8 dot `dot`
template <int Rmax, int P, int G, int Flush, class... Args>
void panel_tile_rows(int64_t dot, int64_t rows, Args... args) {
#if defined(KVFORGE_VNNI)
  if (dot == kDotAvxVnni)
    return gguf_panels_avxvnni::panel_tile_rows<Rmax, P, G, Flush>(rows, args...);
  if (dot == kDotAvx512Vnni)
    return gguf_panels_avx512vnni::panel_tile_rows<Rmax, P, G, Flush>(rows, args...);
#endif
  (void)dot;
  return gguf_panels_maddubs::panel_tile_rows<Rmax, P, G, Flush>(rows, args...);
}
#endif

// out [rows][8 * panels] (row stride out_stride) = activation rows [m0, m0 + rows) . panels,
// in tiles of R rows x P panels
template <int G, int Flush, int R, int P>
void panels_times_rows(int64_t dot, const GemmActivations& act, int64_t m0, int64_t rows,
                       const Panels& w, int64_t panels, int64_t k, float* out,
                       int64_t out_stride) {
  const int64_t groups = k / G;
  const int64_t sum_stride = G == 16 ? k / 16 : k / 32;
  const float* sums = G == 16 ? act.sum16.data() : act.sum32.data();
#if defined(__AVX2__)
  for (int64_t r0 = m0; r0 < m0 + rows; r0 += R) {
    const int64_t rn = std::min<int64_t>(R, m0 + rows - r0);
    for (int64_t p0 = 0; p0 < panels; p0 += P) {
      const int8_t* xq = act.q.data() + r0 * k;
      const float* st = act.step.data() + r0 * (k / 32);
      const float* sm = sums + r0 * sum_stride;
      const uint8_t* c = w.codes.data() + p0 * k * 8;
      const float* sc = w.scale.data() + p0 * groups * 8;
      const float* of = w.offset.data() + p0 * groups * 8;
      float* o = out + (r0 - m0) * out_stride + 8 * p0;
      if (panels - p0 >= P)
        panel_tile_rows<R, P, G, Flush>(dot, rn, xq, k, st, sm, sum_stride, c, sc, of, k, o,
                                        out_stride);
      else        // the last panels, one at a time
        for (int64_t p = p0; p < panels; ++p)
          panel_tile_rows<R, 1, G, Flush>(dot, rn, xq, k, st, sm, sum_stride, c + (p - p0) * k * 8,
                                          sc + (p - p0) * groups * 8, of + (p - p0) * groups * 8,
                                          k, o + 8 * (p - p0), out_stride);
    }
  }
#else
  // portable: the same sums in the same order, scalar
  (void)dot;
  for (int64_t m = m0; m < m0 + rows; ++m)
    for (int64_t p = 0; p < panels; ++p)
      for (int c = 0; c < 8; ++c) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t isum = 0;
          for (int64_t kk = g * G; kk < (g + 1) * G; ++kk)
            isum += int32_t{w.codes[p * k * 8 + (kk / 4) * 32 + 4 * c + kk % 4]} * act.q[m * k + kk];
          const float d = static_cast<float>(isum) * act.step[m * (k / 32) + g * G / 32];
          acc = std::fma(d, w.scale[(p * groups + g) * 8 + c], acc);
          acc = std::fma(sums[m * sum_stride + g], w.offset[(p * groups + g) * 8 + c], acc);
        }
        out[(m - m0) * out_stride + 8 * p + c] = acc;
      }
#endif
}

void panels_times_rows(const PanelFormat& pf, int64_t dot, const GemmActivations& act,
                       int64_t m0, int64_t rows, const Panels& w, int64_t panels, int64_t k,
                       float* out, int64_t out_stride) {
  // The AVX2 build's tiles, timed on Qwen2.5-1.5B's shapes at 32 and 512 rows (Xeon; GFLOP/s
  // at 512):
  // 4-bit 4 x 2 (355-375; 3 x 2 277-304, 5 x 2 310, 2 x 4 300-324, 4 x 3 279-297, 6 x 2
  // 274-283: 16 ymm hold 8 int16 sums, 2 panels' codes and a broadcast); the codes that flush
  // every 4 or 2 steps also hold int32 group sums: 3 x 2 (Q6_K 288-299; 4 x 2 276-283, 2 x 2
  // 280-306, 4 x 1 291-293, 2 x 3 241-267)
  // (VNNI keeps these shapes: its group sums take the registers the int16 sums took)
  if (pf.group == 16)
    return panels_times_rows<16, 2, kFlushRows, kFlushPanels>(dot, act, m0, rows, w, panels, k,
                                                              out, out_stride);
  if (pf.code_bits == 5)
    return panels_times_rows<32, 4, kFlushRows, kFlushPanels>(dot, act, m0, rows, w, panels, k,
                                                              out, out_stride);
  return panels_times_rows<32, 8, kQ4Rows, kQ4Panels>(dot, act, m0, rows, w, panels, k, out,
                                                      out_stride);
}

// Output columns per unpacked block: its codes (cols x K bytes) held in half of L2 while every
// activation row passes them, 16..128.
int64_t panel_block_columns(int64_t k) {
  const int64_t l2 = detected_cache_sizes().l2;
  return std::clamp<int64_t>(l2 / 2 / k / 16 * 16, 16, 128);
}

// Columns [n0, n1) of y (row stride ys) = activation rows . weight rows [n0, n1) of shard s
// (+ bias[n], if given): the columns unpacked to panels once (a per-thread buffer), then every
// row multiplied, in passes of 64 rows whose outputs stay in cache; `dot`: the Int8Dot the
// tiles multiply with (the same outputs from each).
void panel_columns(const GemmActivations& act, int64_t rows, const Shards& shards, size_t s,
                   int64_t n0, int64_t n1, const float* bias, float* y, int64_t ys,
                   int64_t dot) {
  thread_local Panels w;
  thread_local std::vector<float> tile;
  const int64_t k = act.k;
  const PanelFormat pf = panel_format(shards.type[s]);
  const int64_t panels = (n1 - n0 + 7) / 8;
  pack_panels(shards, s, pf, n0, panels, k, w);
  constexpr int64_t kPassRows = 64;
  tile.resize(kPassRows * panels * 8);
  for (int64_t m0 = 0; m0 < rows; m0 += kPassRows) {
    const int64_t pass = std::min(kPassRows, rows - m0);
    panels_times_rows(pf, dot, act, m0, pass, w, panels, k, tile.data(), panels * 8);
    for (int64_t m = 0; m < pass; ++m) {
      const float* t = tile.data() + m * panels * 8;
      float* out = y + (m0 + m) * ys;
      if (bias == nullptr)
        std::memcpy(out + n0, t, (n1 - n0) * sizeof(float));
      else
        for (int64_t n = n0; n < n1; ++n) out[n] = t[n - n0] + bias[n];
    }
  }
}

}  // namespace
}  // namespace kvforge
