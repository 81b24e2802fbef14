// ZeroQuant's W8A8 projection (kvforge/quant/zeroquant.py) as one call: int8 weights with a
// scale per output column and group of G input channels, activations quantized here per row
// (and group) to int8, exact int32 group sums, rescaled and summed in fp32.
//
// Why: the PyTorch path ran one torch._int_mm per group (oneDNN: ~25 us a call, 12 calls for a
// 1536-wide input at G = 128) plus ~10 elementwise ops, and without VNNI it falls back to fp32
// GEMMs of the int8 values: slower than the float layer it replaces. Here a layer is one pass:
// the weights live in K-major panels of 8 columns (a 32-byte vector per k step of 4; the layer's
// only copy, packed by kvforge/kernels/ops.py pack_w8a8_panels), every activation row times
// every panel in register tiles (w8a8_tile.inc), one group's int32 sums per tile at a time.
//
// Packed weight, panel p = output columns 8p .. 8p + 7 (columns past n: zero codes, scales):
//
//   codes      int8  [panels][Kp / 4][8][4]     k step t of column c: 4 bytes at 32 t + 4 c
//   scales     f32   [panels][Kp / G][8]        w[n][k] = scales[g][c] * code[k][c]
//   code_sums  int32 [panels][Kp / G][8]        128 * the group's codes summed (VNNI's offset)
//
// Activations (this call's rows): codes int8 [T][Kp] = round(x / step) clamped to +-127 (the
// padding past K: 0), step = max|x| / 127 of the row's group (act_groups) or of the whole row
// (then repeated per group) -- the rounding of quant/zeroquant.py's PyTorch path, bit for bit,
// so both give the same int32 sums.
#include "kernels.h"

#include <cstdlib>
#include <cstring>

namespace kvforge {
namespace {

// One register tile's operands (w8a8_tile.inc)
struct W8A8TileArgs {
  const int8_t* x_codes;    // row r's code of k at x_codes[r * x_stride + k] (VNNI: code + 128)
  int64_t x_stride;
  const float* x_steps;     // row r's step of group g at x_steps[r * groups + g]
  const int8_t* w_codes;    // panel p, k step t, column c, j: [p * K * 8 + 32 t + 4 c + j]
  const float* w_scales;    // panel p, group g, column c: [(p * groups + g) * 8 + c]
  const int32_t* code_sums; // 128 * sum of the group's codes, laid out like w_scales
  int64_t groups, steps_per_group;
  float* out;               // row r, column 8 p + c: out[r * out_stride + 8 p + c]
  int64_t out_stride;
};

namespace w8a8_maddubs {
#define W8A8_DOT 0
#include "w8a8_tile.inc"
#undef W8A8_DOT
}  // namespace w8a8_maddubs

// The VNNI tiles are compiled for their instructions alone (`#pragma GCC target`), whatever
// the build's -march, and run only where the CPU reports them (Int8Dot, kernels.h).
#if defined(KVFORGE_VNNI)
#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace w8a8_avxvnni {
#define W8A8_DOT 1
#include "w8a8_tile.inc"
#undef W8A8_DOT
}  // namespace w8a8_avxvnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
namespace w8a8_avx512vnni {
#define W8A8_DOT 2
#include "w8a8_tile.inc"
#undef W8A8_DOT
}  // namespace w8a8_avx512vnni
#pragma GCC pop_options
#endif

// Register tiles (rows x panels): R x P int32 group sums, R x P float sums, P code vectors (and
// for maddubs P |codes|). Timed at 32 rows on the shapes of SmolLM2-135M and Qwen2.5-1.5B
// (576 x 3072, 1536 x 576, 576 x 960, 1536 x 8960; Xeon, 2 threads) among 2x4, 3x2, 3x3, 4x2,
// 4x3, 6x2, 8x2: the AVX-512 build (32 registers) 8 x 2 for both dots (VNNI 1354 us on the
// 1536 x 8960 against 1587 for 4 x 3); the AVX2 build (16) 3 x 2 (maddubs 3239 us against
// 3439 for 4 x 2; taller tiles spill the float sums).
#if defined(__AVX512F__)
constexpr int kW8A8Rows = 8, kW8A8Panels = 2;
#else
constexpr int kW8A8Rows = 3, kW8A8Panels = 2;
#endif

#if defined(__AVX2__)
template <int R, int P>
void w8a8_run_tile(int64_t dot, int64_t rows, const W8A8TileArgs& a) {
#if defined(KVFORGE_VNNI)
  switch (dot) {
    case kDotAvxVnni:
      return w8a8_avxvnni::tile_rows<R, P>(rows, a);
    case kDotAvx512Vnni:
      return w8a8_avx512vnni::tile_rows<R, P>(rows, a);
    default:
      return w8a8_maddubs::tile_rows<R, P>(rows, a);
  }
#else
  (void)dot;
  return w8a8_maddubs::tile_rows<R, P>(rows, a);
#endif
}
#endif

}  // namespace

class W8A8Projection {
 public:
  // The packed weight (kvforge/kernels/ops.py pack_w8a8_panels; held, not copied): codes
  // [panels, Kp / 4, 8, 4] int8, scales and code_sums [panels, Kp / G, 8] fp32 / int32;
  // out_features n <= 8 panels, in_features: the logical K (<= Kp); bias [n] or None
  W8A8Projection(at::Tensor codes, at::Tensor scales, at::Tensor code_sums, int64_t out_features,
                 int64_t in_features, c10::optional<at::Tensor> bias)
      : codes_(codes), scales_(scales), code_sums_(code_sums) {
    TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kChar && codes.device().is_cpu() &&
                    codes.is_contiguous() && codes.size(2) == 8 && codes.size(3) == 4,
                "W8A8Projection: codes must be a contiguous int8 CPU tensor [panels, K / 4, 8, 4]");
    check_fp32_cpu(scales, "W8A8Projection scales");
    panels_ = codes.size(0);
    kp_ = 4 * codes.size(1);
    groups_ = scales.dim() == 3 ? scales.size(1) : 0;
    TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.size(0) == panels_ &&
                    scales.size(2) == 8 && groups_ > 0 && kp_ % groups_ == 0,
                "W8A8Projection: scales must be contiguous [", panels_, ", groups, 8] with groups "
                "dividing ", kp_);
    TORCH_CHECK(code_sums.scalar_type() == at::kInt && code_sums.is_contiguous() &&
                    code_sums.sizes() == scales.sizes(),
                "W8A8Projection: code_sums must be contiguous int32 shaped like scales");
    group_ = kp_ / groups_;
    TORCH_CHECK(group_ % 4 == 0, "W8A8Projection: group width ", group_,
                " is not a multiple of 4");
    TORCH_CHECK(out_features > 8 * (panels_ - 1) && out_features <= 8 * panels_,
                "W8A8Projection: out_features ", out_features, " does not fill ", panels_,
                " panels of 8");
    TORCH_CHECK(in_features > kp_ - group_ && in_features <= kp_, "W8A8Projection: in_features ",
                in_features, " does not pad to ", kp_, " in groups of ", group_);
    n_ = out_features;
    k_ = in_features;
    if (bias.has_value()) {
      check_fp32_cpu(*bias, "W8A8Projection bias");
      TORCH_CHECK(bias->numel() == n_, "W8A8Projection: bias has ", bias->numel(),
                  " values for ", n_, " columns");
      const at::Tensor b = bias->contiguous();
      bias_.assign(b.data_ptr<float>(), b.data_ptr<float>() + n_);
    }
  }

  int64_t in_features() const { return k_; }
  int64_t out_features() const { return n_; }
  int64_t padded_in() const { return kp_; }      // Kp: a row of quantize_rows' codes
  int64_t groups() const { return groups_; }     // a row's steps

  // y [T, n] = x [T, K] times the weight; dot: an Int8Dot this CPU has (int8_dot_supported)
  at::Tensor forward(const at::Tensor& x_in, bool act_groups, int64_t dot) const {
    check_fp32_cpu(x_in, "W8A8Projection input");
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k_, "W8A8Projection: input must be [T, ", k_,
                "], got ", x_in.sizes());
    TORCH_CHECK(int8_dot_supported(dot), "W8A8Projection: int8 dot ", dot,
                " is not available on this CPU / build");
    const at::Tensor x = x_in.contiguous();
    const int64_t rows = x.size(0);
    at::Tensor y = at::empty({rows, n_}, x.options());
    if (rows == 0) return y;
    std::vector<int8_t> codes(rows * kp_);
    std::vector<float> steps(rows * groups_);
    at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
      quantize_rows(x.data_ptr<float>(), k_, r0, r1, act_groups, dot != kDotMaddubs,
                    codes.data(), steps.data());
    });
    at::parallel_for(0, units(), 1, [&](int64_t u0, int64_t u1) {
      multiply_units(codes.data(), steps.data(), rows, dot, u0, u1, y.data_ptr<float>(), n_);
    });
    return y;
  }

  // The two halves of forward for a caller that shares the work out itself (a team's threads:
  // SparseProjection's rotation). Codes [rows][Kp] (VNNI: + 128, stored as the byte ^ 0x80),
  // steps [rows][groups]; rows r0 .. r1 of x (row stride xs) quantized here, serially.
  void quantize_rows(const float* x, int64_t xs, int64_t r0, int64_t r1, bool act_groups,
                     bool unsigned_codes, int8_t* codes, float* steps) const {
    const int8_t flip = unsigned_codes ? static_cast<int8_t>(0x80) : 0;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * xs;
      int8_t* qr = codes + r * kp_;
      float* sr = steps + r * groups_;
      const int64_t span = act_groups ? group_ : kp_;
      for (int64_t g0 = 0; g0 < kp_; g0 += span) {
        const int64_t end = std::min(g0 + span, k_);
        float amax = 0.f;
        for (int64_t k = g0; k < end; ++k) amax = std::max(amax, std::fabs(xr[k]));
        const float step = std::max(amax, 1e-12f) / 127.f;
        for (int64_t g = g0 / group_; g < (g0 + span) / group_; ++g) sr[g] = step;
        round_codes(xr + g0, std::max<int64_t>(end - g0, 0), step, qr + g0, flip);
        for (int64_t k = std::max(end, g0); k < g0 + span; ++k) qr[k] = flip;
      }
    }
  }

  // units of kW8A8Panels panels (8 output columns each): what multiply_units shares out
  int64_t units() const { return (panels_ + kW8A8Panels - 1) / kW8A8Panels; }

  // y [rows, n] (row stride ys), the columns of units u0 .. u1, from quantize_rows' codes
  void multiply_units(const int8_t* codes, const float* steps, int64_t rows, int64_t dot,
                      int64_t u0, int64_t u1, float* y, int64_t ys) const {
#if defined(__AVX2__)
    // All rows in one pass: each unit of panels streams every row's codes (a 512-row chunk of
    // an 8960-wide input: 4.6 MB). Passes of L2-sized row blocks timed the same on the Xeon
    // (1536 x 8960 at 512 rows: 27.2 ms either way, fp32 46.5), whose L3 holds the codes.
    constexpr int R = kW8A8Rows, P = kW8A8Panels;
    const int8_t* w_codes = codes_.data_ptr<int8_t>();
    const float* w_scales = scales_.data_ptr<float>();
    const int32_t* w_sums = code_sums_.data_ptr<int32_t>();
    float tile_out[R * P * 8];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t p0 = u * P, np = std::min<int64_t>(P, panels_ - p0);
      for (int64_t r0 = 0; r0 < rows; r0 += R) {
        const int64_t nr = std::min<int64_t>(R, rows - r0);
        const W8A8TileArgs a{codes + r0 * kp_, kp_, steps + r0 * groups_,
                             w_codes + p0 * kp_ * 8, w_scales + p0 * groups_ * 8,
                             w_sums + p0 * groups_ * 8, groups_, group_ / 4, tile_out, P * 8};
        if (np == P) {
          w8a8_run_tile<R, P>(dot, nr, a);
        } else {            // the last unit's remaining panels, one at a time
          for (int64_t p = 0; p < np; ++p) {
            W8A8TileArgs one = a;
            one.w_codes += p * kp_ * 8;
            one.w_scales += p * groups_ * 8;
            one.code_sums += p * groups_ * 8;
            one.out += 8 * p;
            w8a8_run_tile<R, 1>(dot, nr, one);
          }
        }
        for (int64_t r = 0; r < nr; ++r) {
          float* out = y + (r0 + r) * ys;
          for (int64_t c = 8 * p0; c < std::min(8 * (p0 + np), n_); ++c)
            out[c] = tile_out[r * P * 8 + c - 8 * p0] + (bias_.empty() ? 0.f : bias_[c]);
        }
      }
    }
#else
    // portable: the same int32 sums, scalar
    const int8_t* w_codes = codes_.data_ptr<int8_t>();
    const float* w_scales = scales_.data_ptr<float>();
    const int64_t c1 = std::min(8 * u1 * kW8A8Panels, n_);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 8 * u0 * kW8A8Panels; c < c1; ++c) {
        const int64_t p = c / 8, cc = c % 8;
        float acc = 0.f;
        for (int64_t g = 0; g < groups_; ++g) {
          int32_t sum = 0;
          for (int64_t k = g * group_; k < (g + 1) * group_; ++k)
            sum += int32_t{w_codes[p * kp_ * 8 + (k / 4) * 32 + 4 * cc + k % 4]} *
                   int32_t{codes[r * kp_ + k]};
          acc = std::fma(static_cast<float>(sum) * w_scales[(p * groups_ + g) * 8 + cc],
                         steps[r * groups_ + g], acc);
        }
        y[r * ys + c] = acc + (bias_.empty() ? 0.f : bias_[c]);
      }
    (void)dot;
#endif
  }

 private:
  // q[i] = clamp(round-half-even(x[i] / step), +-127) ^ flip
  static void round_codes(const float* x, int64_t n, float step, int8_t* q, int8_t flip) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(step), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    for (; i + 8 <= n; i += 8) {
      __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), s),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm256_max_ps(_mm256_min_ps(v, hi), lo);
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_cvtps_epi32(v));
      for (int j = 0; j < 8; ++j) q[i + j] = static_cast<int8_t>(lanes[j]) ^ flip;
    }
#endif
    for (; i < n; ++i) {
      const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / step)));
      q[i] = static_cast<int8_t>(static_cast<int32_t>(v)) ^ flip;
    }
  }

  at::Tensor codes_, scales_, code_sums_;
  int64_t n_ = 0, k_ = 0, kp_ = 0, groups_ = 0, group_ = 0, panels_ = 0;
  std::vector<float> bias_;
};

void bind_w8a8_gemm(pybind11::module& m) {
  pybind11::class_<W8A8Projection>(m, "W8A8Projection", pybind11::module_local())
      .def(pybind11::init<at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t,
                          c10::optional<at::Tensor>>(),
           pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("code_sums"),
           pybind11::arg("out_features"), pybind11::arg("in_features"),
           pybind11::arg("bias") = pybind11::none())
      .def_property_readonly("in_features", &W8A8Projection::in_features)
      .def_property_readonly("out_features", &W8A8Projection::out_features)
      .def("forward", &W8A8Projection::forward, pybind11::arg("x"), pybind11::arg("act_groups"),
           pybind11::arg("dot"), pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace kvforge
