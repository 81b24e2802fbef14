#include "kernels.h"

namespace kvforge {
// y [M, N] = x [M, K] @ W[N, K]^T for a few rows M (decode batches, speculative verification).
// Memory-bound: each W row is streamed once and multiplied into all M rows of x while it is in
// registers. 16-float vectors via GCC vector extensions (AVX-512 or 2x AVX2, whatever -march
// gives); M accumulators per W row give the FMA pipes independent chains. Threads split N into
// contiguous row ranges, i.e. sequential streams the hardware prefetcher follows.
namespace {

// R rows of W at a time: R independent memory streams and R*M independent FMA chains keep the
// load and FMA pipes busy (one row at a time streamed ~15% slower than MKL here).
template <int M, int R>
void weight_rows(const float* __restrict xp, int64_t xs, const float* __restrict wp,
                 float* __restrict yp, int64_t out_features, int64_t in, int64_t n) {
  const int64_t in16 = in - in % 16;
  vec16 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = vec16{};
  for (int64_t k = 0; k < in16; k += 16) {
    vec16 w[R];
    for (int r = 0; r < R; ++r) {
      w[r] = load16(wp + (n + r) * in + k);
      __builtin_prefetch(wp + (n + r) * in + k + 512, 0, 0);   // 2 KiB ahead, streaming
    }
    for (int m = 0; m < M; ++m) {
      const vec16 xv = load16(xp + m * xs + k);
      for (int r = 0; r < R; ++r) acc[r][m] += w[r] * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* wr = wp + (n + r) * in;
    for (int m = 0; m < M; ++m) {
      float total = hsum(acc[r][m]);
      for (int64_t k = in16; k < in; ++k) total += wr[k] * xp[m * xs + k];
      yp[m * out_features + n + r] = total;
    }
  }
}

template <int M>
void rows_times_weight(const float* __restrict xp, int64_t xs, const float* __restrict wp,
                       float* __restrict yp, int64_t out_features, int64_t in, int64_t n0,
                       int64_t n1) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);     // R * M accumulators fit the registers
  int64_t n = n0;
  for (; n + R <= n1; n += R) weight_rows<M, R>(xp, xs, wp, yp, out_features, in, n);
  for (; n < n1; ++n) weight_rows<M, 1>(xp, xs, wp, yp, out_features, in, n);
}

using RowsKernel = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t,
                            int64_t);
constexpr RowsKernel kRowsKernels[] = {rows_times_weight<1>, rows_times_weight<2>,
                                       rows_times_weight<3>, rows_times_weight<4>,
                                       rows_times_weight<5>, rows_times_weight<6>,
                                       rows_times_weight<7>, rows_times_weight<8>};
}  // namespace

void linear_rows(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out) {
  const RowsKernel kernel = kRowsKernels[rows - 1];
  // >= ~16K floats of W per task, so small layers do not pay for waking threads
  const int64_t grain = std::max<int64_t>(16, (16 * 1024) / std::max<int64_t>(in, 1));
  at::parallel_for(0, out, grain, [&](int64_t n0, int64_t n1) { kernel(x, xs, w, y, out, in, n0, n1); });
}

at::Tensor linear_small_m(at::Tensor x, at::Tensor weight) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shape mismatch");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "rows must be contiguous");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kSmallMMax, "linear_small_m takes 1..8 rows");
  auto y = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), y.data_ptr<float>(),
              x.size(0), x.size(1), weight.size(0));
  return y;
}

}  // namespace kvforge
