// RMSNorm (+ residual add), gated activations (SwiGLU, gelu-tanh) and NeoX rotary: one pass per row each.
#include "kernels.h"

namespace kvforge {

void add_rms_norm_rows(const float* x, int64_t xs, const float* res, int64_t rs, const float* w,
                       float* y, float* sum, int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = x + r * xs;
      if (res != nullptr) {
        float* s = sum + r * cols;
        const float* rr = res + r * rs;
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) s[c] = src[c] + rr[c];
        src = s;
      }
      const float inv = 1.f / std::sqrt(dot(src, src, cols) / static_cast<float>(cols) + eps);
      float* yr = y + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) yr[c] = (src[c] * inv) * w[c];
    }
  });
}

namespace {

// out = act(gate) * up over rows of [gate | up], where act(g) = g / (1 + e^(-arg(g))):
// SiLU's arg is g itself; gelu_tanh(g) = 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715
// g^3), is the same form with arg = 2u (tanh(u) = 1 - 2 / (1 + e^(2u)))
template <class Arg>
void gated_rows(const float* in, int64_t is, float* out, int64_t rows, int64_t inter, Arg arg) {
  at::parallel_for(0, rows, grain_rows(inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = in + r * is;
      const float* u = g + inter;
      float* o = out + r * inter;
      int64_t i = 0;
      for (; i + kVecLanes <= inter; i += kVecLanes) {
        const vecn gv = loadn(g + i);
        store_vec(o + i, gv / (1.f + expn(-arg(gv))) * loadn(u + i));
      }
      for (; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-arg(g[i]))) * u[i];
    }
  });
}

constexpr float kTwoSqrt2OverPi = 2.f * 0.7978845608028654f;

}  // namespace

void silu_and_mul_rows(const float* in, int64_t is, float* out, int64_t rows, int64_t inter) {
  gated_rows(in, is, out, rows, inter, [](auto g) { return g; });
}

void gelu_tanh_and_mul_rows(const float* in, int64_t is, float* out, int64_t rows,
                            int64_t inter) {
  gated_rows(in, is, out, rows, inter,
             [](auto g) { return kTwoSqrt2OverPi * (g + 0.044715f * g * g * g); });
}

void rotary_rows(const float* x, int64_t xs, float* out, int64_t os, const float* cos,
                 int64_t cs, const float* sin, int64_t ss, int64_t rows, int64_t heads,
                 int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, grain_rows(heads * dim), [&](int64_t r0, int64_t r1) {
    std::vector<float> head(dim);      // out may alias x: rotate from a copy of the head
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cos + r * cs;
      const float* s = sin + r * ss;
      for (int64_t h = 0; h < heads; ++h) {
        std::copy(x + r * xs + h * dim, x + r * xs + (h + 1) * dim, head.begin());
        const float* xi = head.data();
        float* o = out + r * os + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) o[i] = xi[i] * c[i] + xi[i + half] * s[i];
#pragma omp simd
        for (int64_t i = half; i < dim; ++i) o[i] = xi[i] * c[i] + xi[i - half] * s[i];
      }
    }
  });
}

std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, cols] with contiguous rows");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [cols]");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    check_fp32_cpu(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1, "residual shape");
  }
  const int64_t rows = x.size(0), cols = x.size(1);
  auto y = at::empty({rows, cols}, x.options());
  auto sum = has_res ? at::empty({rows, cols}, x.options()) : x;
  add_rms_norm_rows(x.data_ptr<float>(), x.stride(0),
                    has_res ? residual->data_ptr<float>() : nullptr,
                    has_res ? residual->stride(0) : 0, weight.data_ptr<float>(),
                    y.data_ptr<float>(), has_res ? sum.data_ptr<float>() : nullptr, rows, cols,
                    static_cast<float>(eps));
  return {y, sum};
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_fp32_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * inter] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  silu_and_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), rows,
                    inter);
  return out;
}

at::Tensor rotary_neox(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(cos, "cos");
  check_fp32_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "x must be [tokens, heads, dim] with contiguous heads");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && sin.sizes() == cos.sizes() && cos.stride(1) == 1 &&
                  sin.stride(1) == 1,
              "cos/sin must be [tokens, dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  auto out = at::empty({tokens, heads, dim}, x.options());
  rotary_rows(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), heads * dim,
              cos.data_ptr<float>(), cos.stride(0), sin.data_ptr<float>(), sin.stride(0), tokens,
              heads, dim);
  return out;
}

}  // namespace kvforge
