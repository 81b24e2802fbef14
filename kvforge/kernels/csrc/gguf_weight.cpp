// GgufWeight: one projection over GGUF blocks (q | k | v, gate | up: a raw tensor and type per
// shard, as the file stores them), checked once at load and multiplied in place:
//
//   block-quantized shards    integer dot products straight from the blocks (gguf_dot.cpp),
//                             the output rows split between a team's threads (team.h); inside a
//                             DecodeStack step (run) or as one call from Python (linear), in
//                             passes of kGgufDotRowsMax activation rows (prefill chunks)
//   float shards, many rows   weight tiles converted to fp32 for ATen's GEMM (many_rows)
//   block shards, >= gemm_min_rows rows (a prefill chunk, a decode batch of 16+; 0: never),
//   or, all shards on panels, a prompt's rows at any count (linear's force_many_rows: so they
//   round alike in any chunk)
//                             int8_panels: int8 panels (gguf_gemm.cpp; from Python: linear,
//                             inside a DecodeStack step: run_panels), 2-3x the dots; shards
//                             without a panel form (Q8_0) and int8_panels off: the fp32 tiles.
//                             The engine measures the kernel and the crossover once per
//                             machine and block type (kernels/gguf_tiles.py)
//
// The raw tensors are views of the file's memory map (quant/gguf.py): nothing is copied.
#include "kernels.h"

namespace kvforge {

class GgufWeight {
 public:
  // reference_kernels: the portable code-by-code kernels instead of the AVX2 ones (tests)
  // int8_panels: from gemm_min_rows rows on, the shards with a panel form (gguf_gemm.cpp) take
  // int8 panels instead of fp32 tiles
  // int8_dot: the dot kernels' and panels' instruction (Int8Dot, kernels.h: the same outputs
  // from each)
  GgufWeight(std::vector<at::Tensor> raws, std::vector<int64_t> types, int64_t in_features,
             bool reference_kernels, int64_t gemm_min_rows, bool int8_panels, int64_t int8_dot)
      : raws_(std::move(raws)), shards_(raws_, types, in_features), k_(in_features),
        gemm_min_rows_(gemm_min_rows), int8_dot_(int8_dot) {
    TORCH_CHECK(gemm_min_rows >= 0, "gemm_min_rows must be >= 0 (0: never), got ", gemm_min_rows);
    TORCH_CHECK(int8_dot_supported(int8_dot), "GgufWeight: int8 dot ", int8_dot,
                " is not one this CPU and build have (0 maddubs, 1 AVX-VNNI, 2 AVX512-VNNI)");
    all_on_panels_ = int8_panels;
    unit_first_.push_back(0);
    for (size_t s = 0; s < shards_.type.size(); ++s) {
      on_panels_.push_back(int8_panels && panel_format(shards_.type[s]).group > 0);
      any_on_panels_ = any_on_panels_ || on_panels_.back();
      all_on_panels_ = all_on_panels_ && on_panels_.back();
      // run_panels' units: none for a shard off panels
      const int64_t shard_rows = shards_.first_row[s + 1] - shards_.first_row[s];
      unit_first_.push_back(unit_first_.back() + (on_panels_.back() ? (shard_rows + 15) / 16 : 0));
    }
    for (size_t s = 0; s < shards_.type.size(); ++s)
      dots_.push_back(shards_.format[s].quantized
                          ? rows_dot_for(shards_.type[s], reference_kernels, int8_dot)
                          : nullptr);
  }

  int64_t in_features() const { return k_; }
  int64_t out_features() const { return shards_.rows(); }
  // rows from which linear() / run() leave the dot kernels (0: never)
  int64_t gemm_min_rows() const { return gemm_min_rows_; }

  // This thread's part of y [rows, out] (row stride ys) = x [rows, K] @ W^T (+ bias) inside a
  // team's region (rows <= kGgufDotRowsMax). Every thread quantizes the activations itself (a
  // few us: cheaper than a barrier), then claims output rows (`claims`: team-size zeroed).
  void run(const float* x, int64_t xs, const float* bias, float* y, int64_t ys, int64_t rows,
           const Team& team, ShareClaim* claims) const {
    if (all_on_panels_ && gemm_min_rows_ > 0 && rows >= gemm_min_rows_)
      return run_panels(x, xs, bias, y, ys, rows, team, claims, team_act_);
    thread_local GgufActivations act;
    thread_local std::vector<float> values;
    const ActRow* acts = nullptr;
    if (shards_.any_quantized) {
      act.quantize(x, xs, rows, k_, shards_.any_per_16, shards_.any_per_256);
      acts = act.rows(rows);
    }
    // Many activation rows (a prefill pass) run as tiles: the chunk's weight rows (<= 32, in
    // L1/L2) against one group of 8 activation rows after another, so each group's int8 rows
    // stay in L1 (L2 past K = 6144) across the chunk instead of all the pass's rows (64 x K
    // bytes: 98 KB at K = 1536, more than L2 at 8960) streaming again for every weight row.
    //
    //   tile[i][m] = W row (n0 + i) . activation row m      groups of 8 rows m, kernel calls
    //                 i: 0 .. n1 - n0  (inner loop)          as when a row runs alone
    float tile[kChunkRows][kGgufDotRowsMax];
    team.for_shares(out_features(), kChunkRows, claims, [&](int64_t n0, int64_t n1,
                                                            int64_t ahead_end) {
      const uint8_t* row_at[kChunkRows];
      const uint8_t* prefetch_at[kChunkRows];
      size_t shard_at[kChunkRows];
      size_t s = shards_.shard_of(n0);
      for (int64_t n = n0; n < n1; ++n) {
        while (shards_.first_row[s + 1] <= n) ++s;
        const uint8_t* row = shards_.row(s, n);
        // the bytes kGgufPrefetchAhead further on, while this thread will still read them
        // (its share, within the shard: rows are contiguous there)
        const int64_t stride = shards_.row_stride[s];
        const int64_t later = n + (kGgufPrefetchAhead + stride - 1) / stride;
        row_at[n - n0] = row;
        shard_at[n - n0] = s;
        prefetch_at[n - n0] = later < std::min(ahead_end, shards_.first_row[s + 1])
                                  ? row + kGgufPrefetchAhead : nullptr;
      }
      for (int64_t m0 = 0; m0 < rows; m0 += kGgufDotGroupRows) {
        const int64_t group = std::min(kGgufDotGroupRows, rows - m0);
        for (int64_t i = 0; i < n1 - n0; ++i)
          if (dots_[shard_at[i]] != nullptr)      // the first group streams the rows in
            dots_[shard_at[i]](row_at[i], k_, acts + m0, group, tile[i] + m0,
                               m0 == 0 ? prefetch_at[i] : nullptr);
      }
      for (int64_t n = n0; n < n1; ++n) {
        const size_t sh = shard_at[n - n0];
        const float b = bias != nullptr ? bias[n] : 0.f;
        if (dots_[sh] != nullptr) {
          for (int64_t m = 0; m < rows; ++m) y[m * ys + n] = tile[n - n0][m] + b;
        } else {                         // a float row (F32 / F16 / BF16): fp32 dot products
          values.resize(k_);
          float_row(shards_.type[sh], row_at[n - n0], k_, values.data());
          for (int64_t m = 0; m < rows; ++m) y[m * ys + n] = dot(x + m * xs, values.data(), k_) + b;
        }
      }
    });
  }

  // The columns of the shards on panels (all of them inside run(); linear() leaves the others
  // to the tiles), from gemm_min_rows rows on (a decode batch, a prefill chunk): the team
  // quantizes the rows into `act`, one buffer for the team (each thread its share, then a
  // barrier), then claims output columns in units of 2 panels, each claim unpacking its
  // columns once for all rows (gguf_gemm.cpp).
  void run_panels(const float* x, int64_t xs, const float* bias, float* y, int64_t ys,
                  int64_t rows, const Team& team, ShareClaim* claims,
                  GemmActivations& act) const {
    if (team.rank() == 0) act.resize(rows, k_);
    team.barrier();
    act.quantize_rows(x, xs, Team::split(rows, team.rank(), team.size()),
                      Team::split(rows, team.rank() + 1, team.size()));
    team.barrier();
    // units of 16 columns per shard: unit u of shard s = columns first_row[s] + 16 (u - u_s) ..
    constexpr int64_t kUnit = 16;
    const int64_t max_chunk = std::max<int64_t>(1, panel_block_columns(k_) / kUnit);
    team.for_shares(unit_first_.back(), max_chunk, claims, [&](int64_t u0, int64_t u1, int64_t) {
      size_t s = 0;
      while (unit_first_[s + 1] <= u0) ++s;
      for (int64_t u = u0; u < u1;) {            // the chunk's part in each shard it spans
        while (unit_first_[s + 1] <= u) ++s;
        const int64_t u_end = std::min(u1, unit_first_[s + 1]);
        const int64_t first = shards_.first_row[s];
        const int64_t n0 = first + kUnit * (u - unit_first_[s]);
        const int64_t n1 =
            std::min(shards_.first_row[s + 1], first + kUnit * (u_end - unit_first_[s]));
        panel_columns(act, rows, shards_, s, n0, n1, bias, y, ys, int8_dot_);
        u = u_end;
      }
    });
  }

  // force_many_rows: take the int8 panels whatever the row count, where every shard is on them
  // (gemm_min_rows > 0): the rows of a prompt, so that each rounds as it does in any chunk of
  // any length (a prefix-cache hit's few tail rows as in the whole prompt). Not the fp32 tiles:
  // ATen's GEMM sums a row by the call's row count anyway, and a tile converts 256 weight rows
  // to fp32 however few activation rows it has.
  at::Tensor linear(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                    bool force_many_rows) const {
    check_fp32_cpu(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) >= 1 && x.size(1) == k_,
                "GGUF linear: x must be [M >= 1, ", k_, "] with contiguous rows, got ",
                x.sizes());
    const float* b = nullptr;
    if (bias.has_value() && bias->defined()) {
      check_fp32_cpu(*bias, "bias");
      TORCH_CHECK(bias->numel() == out_features() && bias->is_contiguous(), "bias has ",
                  bias->numel(), " entries for ", out_features(), " outputs");
      b = bias->data_ptr<float>();
    }
    const int64_t rows = x.size(0);
    at::Tensor y = at::empty({rows, out_features()}, x.options());
    const bool many =
        gemm_min_rows_ > 0 && ((force_many_rows && all_on_panels_) || rows >= gemm_min_rows_);
    const bool tiles = (shards_.any_float && rows > kGgufDotRowsMax) || many;
    if (!tiles) {
      const int64_t xs = x.stride(0), ys = out_features();
      for (int64_t m0 = 0; m0 < rows; m0 += kGgufDotRowsMax) {
        const int64_t pass = std::min(kGgufDotRowsMax, rows - m0);
        std::vector<ShareClaim> claims(std::max(1, at::get_num_threads()));
        run_team([&](const Team& team) {
          run(x.data_ptr<float>() + m0 * xs, xs, b, y.data_ptr<float>() + m0 * ys, ys, pass,
              team, claims.data());
        });
      }
    } else if (!any_on_panels_ || !many) {
      many_rows(x, shards_, y);
      if (b != nullptr) y.add_(*bias);
    } else {
      GemmActivations act;            // this call's: linear() may run on several threads
      std::vector<ShareClaim> claims(std::max(1, at::get_num_threads()));
      run_team([&](const Team& team) {
        run_panels(x.data_ptr<float>(), x.stride(0), nullptr, y.data_ptr<float>(),
                   out_features(), rows, team, claims.data(), act);
      });
      std::vector<char> rest(on_panels_.size());
      bool any_rest = false;
      for (size_t s = 0; s < rest.size(); ++s) any_rest = any_rest || (rest[s] = !on_panels_[s]);
      if (any_rest) many_rows(x, shards_, y, &rest);
      if (b != nullptr) y.add_(*bias);
    }
    return y;
  }

  // row n of W in fp32 (an embedding lookup)
  void dequantize_row(int64_t n, float* out) const {
    const size_t s = shards_.shard_of(n);
    RowScratch scratch(k_);
    kvforge::dequantize_row(shards_.type[s], shards_.format[s], shards_.row(s, n), k_, scratch,
                            out);
  }

  // rows `ids` (all rows when absent) in fp32
  at::Tensor dequantize(const c10::optional<at::Tensor>& ids) const {
    at::Tensor picked;
    if (ids.has_value() && ids->defined()) {
      TORCH_CHECK(ids->dim() == 1 && ids->scalar_type() == at::kLong,
                  "GGUF dequantize: ids must be a 1-D int64 tensor");
      picked = ids->contiguous();
    }
    const int64_t n = picked.defined() ? picked.size(0) : out_features();
    const int64_t* id = picked.defined() ? picked.data_ptr<int64_t>() : nullptr;
    for (int64_t i = 0; id != nullptr && i < n; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < out_features(), "row id ", id[i], " out of range for ",
                  out_features(), " rows");
    at::Tensor out = at::empty({n, k_}, at::TensorOptions().dtype(at::kFloat));
    float* o = out.data_ptr<float>();
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequantize_row(id ? id[r] : r, o + r * k_);
    });
    return out;
  }

 private:
  // output rows a claim takes at most (team.h): ~15-30 KB of blocks at K = 1536
  static constexpr int64_t kChunkRows = 32;

  std::vector<at::Tensor> raws_;     // owns the mapped bytes the shards point into
  Shards shards_;
  int64_t k_;
  int64_t gemm_min_rows_;            // rows from which linear() takes tiles / panels (0: never)
  int64_t int8_dot_;                 // the dots' and panels' instruction (Int8Dot)
  std::vector<char> on_panels_;      // per shard: int8 panels from gemm_min_rows rows on
  bool any_on_panels_ = false, all_on_panels_ = false;
  std::vector<int64_t> unit_first_;  // run_panels' 16-column units: prefix sums per shard
  mutable GemmActivations team_act_; // run()'s rows on panels, shared by the team
  std::vector<RowsDot> dots_;        // per shard; nullptr: a float row
};

at::Tensor gguf_linear(at::Tensor x, std::vector<at::Tensor> raws, std::vector<int64_t> types,
                       c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be [M, K]");
  return GgufWeight(std::move(raws), std::move(types), x.size(1), false, 0, false, kDotMaddubs)
      .linear(x, bias, false);
}

at::Tensor gguf_dequantize(at::Tensor raw, int64_t type, int64_t k,
                           c10::optional<at::Tensor> ids) {
  return GgufWeight({raw}, {type}, k, false, 0, false, kDotMaddubs).dequantize(ids);
}

void bind_gguf_weight(pybind11::module& m) {
  namespace py = pybind11;
  using release_gil = py::call_guard<py::gil_scoped_release>;
  py::class_<GgufWeight>(m, "GgufWeight", py::module_local())
      .def(py::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, bool, int64_t, bool,
                    int64_t>(),
           py::arg("raws"), py::arg("types"), py::arg("in_features"),
           py::arg("reference_kernels") = false, py::arg("gemm_min_rows") = 0,
           py::arg("int8_panels") = false, py::arg("int8_dot") = 0)
      .def_property_readonly("in_features", &GgufWeight::in_features)
      .def_property_readonly("out_features", &GgufWeight::out_features)
      .def_property_readonly("gemm_min_rows", &GgufWeight::gemm_min_rows)
      .def("linear", &GgufWeight::linear, py::arg("x"), py::arg("bias") = py::none(),
           py::arg("force_many_rows") = false, release_gil())
      .def("dequantize", &GgufWeight::dequantize, py::arg("ids") = py::none(), release_gil());
}

}  // namespace kvforge
