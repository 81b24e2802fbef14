#include "kernels.h"

namespace kvforge {
// y [M, N] = x [M, K] @ W[N, K]^T for a few rows M (decode batches, speculative verification).
// Memory-bound: each W row is streamed once and multiplied into all M rows of x while it is in
// registers. 16-float vectors via GCC vector extensions (AVX-512 or 2x AVX2, whatever -march
// gives); M accumulators per W row give the FMA pipes independent chains. Threads split N into
// contiguous row ranges, i.e. sequential streams the hardware prefetcher follows.
namespace {

template <int M>
void rows_times_weight(const float* __restrict xp, int64_t xs, const float* __restrict wp,
                       float* __restrict yp, int64_t out_features, int64_t in, int64_t n0,
                       int64_t n1) {
  const int64_t in16 = in - in % 16;
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = wp + n * in;
    vec16 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vec16{};
    for (int64_t k = 0; k < in16; k += 16) {
      const vec16 w = *reinterpret_cast<const vec16*>(wr + k);
      for (int m = 0; m < M; ++m) acc[m] += w * *reinterpret_cast<const vec16*>(xp + m * xs + k);
    }
    for (int m = 0; m < M; ++m) {
      float total = hsum(acc[m]);
      for (int64_t k = in16; k < in; ++k) total += wr[k] * xp[m * xs + k];
      yp[m * out_features + n] = total;
    }
  }
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
