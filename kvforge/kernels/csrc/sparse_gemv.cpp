// Activation-sparse projections for few-row decode steps (TEAL / CATS; kvforge/sparsity/).
//
// Batch-1 decode is bound by reading weights. When most inputs of a projection are (set to)
// zero, the weights they multiply need not be read -- but only if a skipped input channel is a
// contiguous run of memory. So the weight is kept transposed, input-major ([in, out]): input
// channel k is row k, and a skipped channel skips a whole row.
//
//   y[r, :] = sum over kept k of  x[r, k] * Wt[k, :]      kept: |x[r', k]| > t for some row r'
//                                                          (per row, x[r, k] with |x| <= t is 0)
//
// The kept rows are shared out between a team's threads (Team::for_shares, the dense kernels'
// balanced claims): each thread adds whole rows, four at a time, into a private accumulator of
// the full output width (L1/L2), prefetching the next four kept rows; then every thread sums
// its even share of the columns over all threads' accumulators. Whole rows four at a time are
// four ascending streams the hardware prefetchers follow; an earlier cut by output columns
// (each thread a part of every kept row, the accumulator in L1) read shorter scattered runs and
// was ~2x slower per byte than the dense kernel at S = 0 (sparse_rows' comment).
// Weights are fp32, or int8 with a scale per output column (W = q * s[n], quant/int8.py).
//
// Rotated inputs (kvforge/sparsity/rotation.py): a projection may carry an orthogonal Q [in, in]
// (the PCA basis of its input on calibration text). Then y = W x = (W Q)(Q^T x): the team
// computes x' = x Q densely, thresholds x', and reads the kept rows of (W Q)^T. In that basis a
// few components carry most of the energy, so zeroing the small ones loses far less than
// zeroing small entries of x itself. x Q is an integer product (w8a8_gemm.cpp's
// W8A8Projection over Q^T in int8, x rounded to int8 per group of inputs: rotation.py's
// CoordinateRotation): every thread rounds all of x itself (a few hundred values: cheaper than
// a hand-off), the team shares Q's panels of 8 coordinates, a barrier, and every thread reads
// all of x' to gather the kept ones.
//
//   x [rows, in] --(int8 x . int8 Q^T panels; barrier)--> x' [rows, in]
//                --(mask_t, kept rows of (W Q)^T)--> y
//
// CATS (CatsMlp): the mask comes from |silu(gate)|: gate is computed densely (rows-major
// gate_up copy), then up only for the kept channels (contiguous rows of the same copy) and down
// input-sparse over its transposed copy.
#include "kernels.h"

#include <cstring>

namespace kvforge {

constexpr int64_t kSparseRowsMax = 4;     // few-row steps; more rows run dense
constexpr int64_t kSparsePrefetch = 4;    // kept rows ahead (software: the rows are scattered)
constexpr int64_t kSparseChunk = 64;      // kept rows per claim, at most
constexpr int kSparseTeamMax = 1024;      // threads a team may have (partial sums' table)
constexpr int64_t kRotationChunk = 4;     // rotation units (w8a8: 2 panels of 8 coords) a claim

namespace {

// The kept input channels of a few rows and their per-row masked values.
struct KeptInputs {
  std::vector<int32_t> ids;
  std::vector<float> values;   // [ids.size(), rows]
  int64_t rows = 0;

  void gather(const float* x, int64_t xs, int64_t nrows, int64_t k, float threshold) {
    rows = nrows;
    ids.resize(k);
    values.resize(k * nrows);
    int64_t n = 0;
    for (int64_t c = 0; c < k; ++c) {
      bool keep = false;
      for (int64_t r = 0; r < nrows; ++r) keep |= std::fabs(x[r * xs + c]) > threshold;
      if (!keep) continue;
      ids[n] = static_cast<int32_t>(c);
      for (int64_t r = 0; r < nrows; ++r) {
        const float v = x[r * xs + c];
        values[n * nrows + r] = std::fabs(v) > threshold ? v : 0.f;
      }
      ++n;
    }
    ids.resize(n);
    values.resize(n * nrows);
  }
};

// acc[r, 0:n] += x[r, k] * wt[k, 0:n] for kept entries j in [j0, j1): whole rows of wt, four
// at a time (four ascending streams; the accumulator is loaded and stored once per four rows)
template <class T>
void sparse_rows(const KeptInputs& kept, const T* wt, int64_t n, float* acc, int64_t j0,
                 int64_t j1) {
  const int64_t nnz = static_cast<int64_t>(kept.ids.size()), rows = kept.rows;
  const int32_t* ids = kept.ids.data();
  const float* values = kept.values.data();
  const int64_t run_bytes = n * static_cast<int64_t>(sizeof(T));
  auto prefetch = [&](int64_t j) {
    if (j >= nnz) return;
    const char* p = reinterpret_cast<const char*>(wt + ids[j] * n);
    for (int64_t off = 0; off < run_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
  };
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    for (int q = 0; q < 4; ++q) prefetch(j + kSparsePrefetch + q);
    const T* __restrict w0 = wt + ids[j] * n;
    const T* __restrict w1 = wt + ids[j + 1] * n;
    const T* __restrict w2 = wt + ids[j + 2] * n;
    const T* __restrict w3 = wt + ids[j + 3] * n;
    for (int64_t r = 0; r < rows; ++r) {
      const float x0 = values[j * rows + r], x1 = values[(j + 1) * rows + r],
                  x2 = values[(j + 2) * rows + r], x3 = values[(j + 3) * rows + r];
      float* __restrict a = acc + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        a[i] += (x0 * static_cast<float>(w0[i]) + x1 * static_cast<float>(w1[i])) +
                (x2 * static_cast<float>(w2[i]) + x3 * static_cast<float>(w3[i]));
    }
  }
  for (; j < j1; ++j) {
    const T* __restrict w = wt + ids[j] * n;
    for (int64_t r = 0; r < rows; ++r) {
      const float xv = values[j * rows + r];
      float* __restrict a = acc + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) a[i] += xv * static_cast<float>(w[i]);
    }
  }
}

template <class T>
inline float dot_as_float(const float* __restrict x, const T* __restrict w, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += x[i] * static_cast<float>(w[i]);
  return acc;
}

// y[r, out_col(j)] = x[r, :] . w[row(j), :] * scale[row(j)] for j in [j0, j1): rows of a
// row-major [N, K] weight (all of them, or a list)
template <class T>
void row_dots(const float* x, int64_t xs, int64_t rows, const T* w, int64_t k,
              const float* scale, const int32_t* list, int64_t row_offset, float* y, int64_t ys,
              int64_t y_offset, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t i = list != nullptr ? list[j] : j;
    const T* wr = w + (row_offset + i) * k;
    const float s = scale != nullptr ? scale[row_offset + i] : 1.f;
    for (int64_t r = 0; r < rows; ++r) y[r * ys + y_offset + i] = dot_as_float(x + r * xs, wr, k) * s;
  }
}

float silu(float g) { return g / (1.f + std::exp(-g)); }

// A weight copy in one of the two element types, with its per-output scales (int8) as fp32.
struct TypedWeight {
  at::Tensor data, scale;   // scale undefined for fp32

  static TypedWeight from(const at::Tensor& w, const c10::optional<at::Tensor>& s) {
    TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous(),
                "sparse weight must be a contiguous 2-D CPU tensor");
    TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kChar,
                "sparse weight must be float32 or int8, got ", w.scalar_type());
    TypedWeight t{w, at::Tensor()};
    if (w.scalar_type() == at::kChar) {
      TORCH_CHECK(s.has_value(), "an int8 weight needs its scales");
      t.scale = s->to(at::kFloat).contiguous();
    } else {
      TORCH_CHECK(!s.has_value(), "an fp32 weight takes no scales");
    }
    return t;
  }
  bool is_int8() const { return data.scalar_type() == at::kChar; }
  const float* scale_ptr() const { return scale.defined() ? scale.data_ptr<float>() : nullptr; }
};

}  // namespace

// An input-sparse projection: y = mask_t(x) @ W^T (+ bias) over Wt = W^T [in, out].
class SparseProjection {
 public:
  SparseProjection(at::Tensor weight_t, double threshold, c10::optional<at::Tensor> scales,
                   c10::optional<at::Tensor> bias,
                   c10::optional<W8A8Projection> rotation = c10::nullopt,
                   int64_t rotation_dot = kDotMaddubs)
      : w_(TypedWeight::from(weight_t, scales)), threshold_(static_cast<float>(threshold)),
        rotation_dot_(rotation_dot) {
    TORCH_CHECK(threshold >= 0, "threshold must be >= 0, got ", threshold);
    if (rotation.has_value()) {
      TORCH_CHECK(rotation->in_features() == in_features() &&
                      rotation->out_features() == in_features(),
                  "rotation must map ", in_features(), " inputs to as many coordinates, got ",
                  rotation->in_features(), " -> ", rotation->out_features());
      TORCH_CHECK(int8_dot_supported(rotation_dot), "rotation_dot ", rotation_dot,
                  " is not an int8 dot this CPU / build has");
      rotation_ = rotation;
      rotated_.resize(kSparseRowsMax * in_features());
    }
    if (w_.scale.defined())
      TORCH_CHECK(w_.scale.numel() == out_features(), "int8 scales: one per output column");
    if (bias.has_value() && bias->numel() > 0) {
      check_fp32_cpu(*bias, "bias");
      TORCH_CHECK(bias->numel() == out_features(), "bias has ", bias->numel(), " entries for ",
                  out_features(), " outputs");
      bias_ = bias->contiguous();
    }
  }

  int64_t in_features() const { return w_.data.size(0); }
  int64_t out_features() const { return w_.data.size(1); }
  float threshold() const { return threshold_; }

  bool rotated() const { return rotation_.has_value(); }

  // this thread's part of y [rows, out] (rows <= kSparseRowsMax), inside a team's region;
  // rotation_claims: the rotation's own zeroed claims (a rotated projection only)
  void run(const float* x, int64_t xs, float* y, int64_t rows, const Team& team,
           ShareClaim* claims, ShareClaim* rotation_claims = nullptr) const {
    if (rotation_.has_value()) {
      TORCH_CHECK(rotation_claims != nullptr, "a rotated projection needs the rotation's claims");
      thread_local std::vector<int8_t> codes;
      thread_local std::vector<float> steps;
      codes.resize(rows * rotation_->padded_in());
      steps.resize(rows * rotation_->groups());
      rotation_->quantize_rows(x, xs, 0, rows, true, rotation_dot_ != kDotMaddubs, codes.data(),
                               steps.data());
      float* xr = rotated_.data();          // every thread gathers from all of x'
      team.for_shares(rotation_->units(), kRotationChunk, rotation_claims,
                      [&](int64_t u0, int64_t u1, int64_t) {
        rotation_->multiply_units(codes.data(), steps.data(), rows, rotation_dot_, u0, u1, xr,
                                  in_features());
      });
      team.barrier();
      x = xr;
      xs = in_features();
    }
    thread_local KeptInputs kept;
    kept.gather(x, xs, rows, in_features(), threshold_);
    run_kept(kept, y, out_features(), team, claims);
  }

  // y from inputs already gathered (CatsMlp's down projection)
  void run_kept(const KeptInputs& kept, float* y, int64_t ys, const Team& team,
                ShareClaim* claims) const {
    const int64_t n = out_features();
    const float* b = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
    const int64_t rows = kept.rows, nnz = static_cast<int64_t>(kept.ids.size());
    TORCH_CHECK(team.size() <= kSparseTeamMax, "team of ", team.size(), " threads");
    thread_local std::vector<float> part;      // this thread's sums over its kept rows
    part.assign(rows * n, 0.f);
    parts_[team.rank()] = part.data();
    team.for_shares(nnz, kSparseChunk, claims, [&](int64_t j0, int64_t j1, int64_t) {
      if (w_.is_int8())
        sparse_rows(kept, w_.data.data_ptr<int8_t>(), n, part.data(), j0, j1);
      else
        sparse_rows(kept, w_.data.data_ptr<float>(), n, part.data(), j0, j1);
    });
    team.barrier();
    // y = sum of the threads' parts (* scale + bias), an even split of the columns each
    const int64_t c0 = Team::split(n, team.rank(), team.size()),
                  c1 = Team::split(n, team.rank() + 1, team.size());
    const float* s = w_.scale_ptr();
    for (int64_t r = 0; r < rows; ++r) {
      float* out = y + r * ys;
      for (int64_t c = c0; c < c1; ++c) {
        float v = 0.f;
        for (int t = 0; t < team.size(); ++t) v += parts_[t][r * n + c];
        if (s != nullptr) v *= s[c];
        if (b != nullptr) v += b[c];
        out[c] = v;
      }
    }
  }

  // the whole product as one call (tests, benchmarks): x [rows, in] -> y [rows, out]
  at::Tensor forward(const at::Tensor& x) const {
    check_fp32_cpu(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features() && x.stride(1) == 1 &&
                    x.size(0) >= 1 && x.size(0) <= kSparseRowsMax,
                "x must be [1..", kSparseRowsMax, ", ", in_features(), "] with contiguous rows");
    at::Tensor y = at::empty({x.size(0), out_features()}, x.options());
    const int threads = at::get_num_threads();
    std::vector<ShareClaim> claims(2 * threads);     // the projection's, the rotation's
    run_team([&](const Team& team) {
      run(x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), x.size(0), team, claims.data(),
          claims.data() + threads);
    });
    return y;
  }

 private:
  TypedWeight w_;
  at::Tensor bias_;
  float threshold_;
  c10::optional<W8A8Projection> rotation_;        // x -> x Q before the mask; empty: none
  int64_t rotation_dot_;                          // its int8 dot (Int8Dot)
  mutable std::vector<float> rotated_;            // x Q [kSparseRowsMax, in], shared by the team
  // each team thread's partial sums (thread-local buffers), read by all in the reduction; one
  // step runs at a time per model, so one table per projection
  mutable std::vector<float*> parts_ = std::vector<float*>(kSparseTeamMax);
};

// CATS MLP: gate dense, then up and down only for the channels with |silu(gate)| > t.
//   gate_up: row-major [2I, H] ([gate | up] rows), down_t: down's weight transposed [I, H]
class CatsMlp {
 public:
  CatsMlp(at::Tensor gate_up, at::Tensor down_t, double threshold,
          c10::optional<at::Tensor> gate_up_scales, c10::optional<at::Tensor> down_scales)
      : gate_up_(TypedWeight::from(gate_up, gate_up_scales)),
        down_(down_t, 0.0, down_scales, c10::nullopt), threshold_(static_cast<float>(threshold)) {
    TORCH_CHECK(threshold >= 0, "threshold must be >= 0, got ", threshold);
    TORCH_CHECK(gate_up.size(0) == 2 * down_.in_features(), "gate_up rows must be 2 x down's "
                "inputs, got ", gate_up.size(0), " and ", down_.in_features());
    TORCH_CHECK(gate_up.size(1) == down_.out_features(), "gate_up width ", gate_up.size(1),
                " != down's outputs ", down_.out_features());
    if (gate_up_.scale.defined())
      TORCH_CHECK(gate_up_.scale.numel() == gate_up.size(0), "gate_up scales: one per row");
  }

  int64_t hidden() const { return gate_up_.data.size(1); }
  int64_t inter() const { return down_.in_features(); }

  // This thread's part of out [rows, H] from h [rows, H] (rows <= kSparseRowsMax). gu: shared
  // [rows, 2I] scratch; claims: 3 x team size zeroed ShareClaims. Ends without a barrier
  // after down (the caller's).
  void run(const float* h, int64_t hs, float* gu, float* out, int64_t rows, const Team& team,
           ShareClaim* claims) const {
    const int64_t I = inter(), H = hidden(), gus = 2 * I;
    const int threads = team.size();
    team.for_shares(I, 64, claims, [&](int64_t j0, int64_t j1, int64_t) {
      dots(h, hs, rows, nullptr, 0, gu, gus, 0, j0, j1);
    });
    team.barrier();
    thread_local std::vector<int32_t> kept_ids;
    thread_local KeptInputs kept;
    kept_ids.resize(I);
    int64_t n = 0;
    for (int64_t i = 0; i < I; ++i) {
      bool keep = false;
      for (int64_t r = 0; r < rows; ++r) keep |= std::fabs(silu(gu[r * gus + i])) > threshold_;
      if (keep) kept_ids[n++] = static_cast<int32_t>(i);
    }
    kept_ids.resize(n);
    team.for_shares(n, 64, claims + threads, [&](int64_t j0, int64_t j1, int64_t) {
      dots(h, hs, rows, kept_ids.data(), I, gu, gus, I, j0, j1);
    });
    team.barrier();
    kept.rows = rows;
    kept.ids.assign(kept_ids.begin(), kept_ids.end());
    kept.values.resize(n * rows);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t r = 0; r < rows; ++r) {
        const float s = silu(gu[r * gus + kept_ids[j]]);
        kept.values[j * rows + r] = std::fabs(s) > threshold_ ? s * gu[r * gus + I + kept_ids[j]]
                                                               : 0.f;
      }
    down_.run_kept(kept, out, H, team, claims + 2 * threads);
  }

  at::Tensor forward(const at::Tensor& h) const {
    check_fp32_cpu(h, "h");
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden() && h.is_contiguous() && h.size(0) >= 1 &&
                    h.size(0) <= kSparseRowsMax,
                "h must be contiguous [1..", kSparseRowsMax, ", ", hidden(), "]");
    at::Tensor out = at::empty({h.size(0), hidden()}, h.options());
    at::Tensor gu = at::empty({h.size(0), 2 * inter()}, h.options());
    const int threads = at::get_num_threads();
    std::vector<ShareClaim> claims(3 * threads);
    run_team([&](const Team& team) {
      run(h.data_ptr<float>(), hidden(), gu.data_ptr<float>(), out.data_ptr<float>(), h.size(0),
          team, claims.data());
    });
    return out;
  }

 private:
  void dots(const float* h, int64_t hs, int64_t rows, const int32_t* list, int64_t row_offset,
            float* y, int64_t ys, int64_t y_offset, int64_t j0, int64_t j1) const {
    if (gate_up_.is_int8())
      row_dots(h, hs, rows, gate_up_.data.data_ptr<int8_t>(), hidden(), gate_up_.scale_ptr(),
               list, row_offset, y, ys, y_offset, j0, j1);
    else
      row_dots(h, hs, rows, gate_up_.data.data_ptr<float>(), hidden(), nullptr, list, row_offset,
               y, ys, y_offset, j0, j1);
  }

  TypedWeight gate_up_;
  SparseProjection down_;
  float threshold_;
};

void bind_sparse_gemv(pybind11::module& m) {
  m.attr("sparse_rows_max") = kSparseRowsMax;
  pybind11::class_<SparseProjection>(m, "SparseProjection", pybind11::module_local())
      .def(pybind11::init<at::Tensor, double, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, c10::optional<W8A8Projection>, int64_t>(),
           pybind11::arg("weight_t"), pybind11::arg("threshold"),
           pybind11::arg("scales") = pybind11::none(), pybind11::arg("bias") = pybind11::none(),
           pybind11::arg("rotation") = pybind11::none(),
           pybind11::arg("rotation_dot") = static_cast<int64_t>(kDotMaddubs))
      .def_property_readonly("in_features", &SparseProjection::in_features)
      .def_property_readonly("rotated", &SparseProjection::rotated)
      .def_property_readonly("out_features", &SparseProjection::out_features)
      .def_property_readonly("threshold", &SparseProjection::threshold)
      .def("forward", &SparseProjection::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<CatsMlp>(m, "CatsMlp", pybind11::module_local())
      .def(pybind11::init<at::Tensor, at::Tensor, double, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>>(),
           pybind11::arg("gate_up"), pybind11::arg("down_t"), pybind11::arg("threshold"),
           pybind11::arg("gate_up_scales") = pybind11::none(),
           pybind11::arg("down_scales") = pybind11::none())
      .def("forward", &CatsMlp::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace kvforge
