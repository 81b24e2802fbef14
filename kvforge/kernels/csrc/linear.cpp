#include "kernels.h"

namespace kvforge {
// y [M, N] = x [M, K] @ W[N, K]^T: the projections of decode steps, speculative verification
// and short prefill chunks (M = kLinearRowsMin .. kLinearRowsMax), where MKL runs at 40-100
// GFLOP/s on these thin shapes (K = 576) and this kernel at ~28 GB/s (1-8 rows: memory speed)
// to 175 GFLOP/s (many rows; benchmarks/linear_kernel.py).
//
// Register tiles in dot-product form, because both x and W rows are contiguous along K:
//
//        k ->  (one vector of L floats per step)
//   x rows m .. m+MR-1   ----------------->   xv[MR]   loaded once per k step
//   W rows n .. n+NR-1   ----------------->   wv       loaded once, feeds MR FMAs
//   acc[MR][NR] vectors: acc[i][j] += xv[i] * wv[j]; at the end y[m+i, n+j] = hsum(acc[i][j])
//
// MR * NR accumulators + MR x vectors + 1 W vector fill the register file (32 zmm with
// AVX-512, 16 ymm with AVX2), so every load feeds several FMAs. Few rows (decode batches): MR =
// M and a wide NR keeps several W streams in flight (memory-bound); more rows: 4 x 6 (AVX-512)
// or 3 x 4 (AVX2) tiles, each W tile reused from L1 by every row tile (compute-bound).
// Threads split N in contiguous tile ranges (balanced at the end: linear_team); the first row
// tile of each W tile prefetches the
// W tile after next into L2, spread over its k steps. With few rows each tile is ~60% compute,
// so a prefetch one tile ahead arrived late and the kernel alternated between computing and
// waiting (7 rows: 19.4 ms for SmolLM2's 120 projections); two tiles ahead keeps memory busy
// under the FMAs (15.0 ms, as fast as 1 row: verification rows ride along with the weights).
//
// Two weight layouts:
//
//   row-major W[N][K]        the dot-product tiles here (HF layout: any weight we do not own,
//                            and the engine's choice when speculation verifies 5-8 rows)
//   packed    P[N/R][K][R]   K-major panels of R = 24 (AVX2) or 32 (AVX-512) rows, the
//                            outer-product tile's operand (the panel section at the end)
namespace {

// Tile widths: MR x vectors + NR x MR accumulators + 1 W vector fit the register file.
#if defined(__AVX512F__)
typedef float vreg __attribute__((vector_size(64), aligned(4), may_alias));
#else
typedef float vreg __attribute__((vector_size(32), aligned(4), may_alias));
#endif
typedef float vec8_ __attribute__((vector_size(32), aligned(4), may_alias));
typedef float vec4_ __attribute__((vector_size(16), aligned(4), may_alias));
constexpr int kMaxTile = 8;                 // tile table: MR, NR in 1..8

inline vreg load_reg(const float* p) { return *reinterpret_cast<const vreg*>(p); }

// horizontal sum by a shuffle tree (512 -> 256 -> 128 -> 64 bits, then one scalar add)
inline float hsum_reg(vreg v) {
#if defined(__AVX512F__)
  const vec8_ h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vec8_ h = v;
#endif
  const vec4_ q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                  __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const vec4_ s = q + __builtin_shufflevector(q, q, 2, 3, 0, 1);
  return s[0] + s[1];
}

// y[0:MR, 0:NR] (+)= x[0:MR, k0:k1] . w[0:NR, k0:k1], W row-major; prefetch: the W tile to
// pull into L2 meanwhile, or nullptr
template <int MR, int NR>
void tile(const float* __restrict x, int64_t xs, const float* __restrict w, int64_t ws,
          float* __restrict y, int64_t ys, int64_t k0, int64_t k1, bool accumulate,
          const float* prefetch) {
  vreg acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = vreg{};
  const int64_t kv = k0 + (k1 - k0) / kLanes * kLanes;
  for (int64_t k = k0; k < kv; k += kLanes) {
    if (prefetch)
      for (int n = 0; n < NR; ++n) __builtin_prefetch(prefetch + n * ws + k, 0, 1);
    vreg xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = load_reg(x + m * xs + k);
    for (int n = 0; n < NR; ++n) {
      vreg wv = load_reg(w + n * ws + k);
      asm("" : "+v"(wv));   // one register load feeding MR FMAs (gcc would re-load it per FMA)
      for (int m = 0; m < MR; ++m) acc[m][n] += xv[m] * wv;
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      float total = hsum_reg(acc[m][n]);
      for (int64_t k = kv; k < k1; ++k) total += x[m * xs + k] * w[n * ws + k];
      y[m * ys + n] = accumulate ? y[m * ys + n] + total : total;
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, bool, const float*);

template <int MR, int... NRs>
constexpr void fill_row(TileFn* row, std::integer_sequence<int, NRs...>) {
  ((row[NRs] = &tile<MR, NRs + 1>), ...);
}
template <int... MRs>
constexpr void fill_table(TileFn (*fn)[kMaxTile], std::integer_sequence<int, MRs...>) {
  (fill_row<MRs + 1>(fn[MRs], std::make_integer_sequence<int, kMaxTile>{}), ...);
}
struct TileTable {                        // fn[MR - 1][NR - 1]: edge tiles of any size
  TileFn fn[kMaxTile][kMaxTile];
  constexpr TileTable() : fn{} {
    fill_table(fn, std::make_integer_sequence<int, kMaxTile>{});
  }
};
constexpr TileTable kTiles{};

// columns [n0, n1) of y from a row-major W; n0 is a multiple of the tile width; tiles up to
// column ahead_end (>= n1: this thread reads on there next) are prefetched. Loop nest (the
// plan's blocking, linear_plan.cpp):
//
//   for each K block of plan.block_k:             W tile [tile_n x block_k] stays in L1/L2
//     for each row block of plan.block_m:         x block [block_m x block_k] stays in L2
//       for each W tile n (tile_n rows of W):     the first row tile prefetches tile n + P
//         for each row tile m in the row block:   tile<tile_m, tile_n>: y[m.., n..] (+)= ...
void linear_rows_range(const float* x, int64_t xs, const float* w, float* y, int64_t rows,
                       int64_t in, int64_t out, int64_t n0, int64_t n1, const LinearPlan& plan,
                       int64_t ahead_end) {
  const int64_t ahead = plan.prefetch_tiles;
  for (int64_t k0 = 0; k0 < in; k0 += plan.block_k) {
    const int64_t k1 = std::min(in, k0 + plan.block_k);
    for (int64_t m0 = 0; m0 < rows; m0 += plan.block_m) {
      const int64_t m1 = std::min(rows, m0 + plan.block_m);
      for (int64_t n = n0; n < n1; n += plan.tile_n) {
        const int nr = static_cast<int>(std::min<int64_t>(plan.tile_n, n1 - n));
        // the W tile `ahead` tiles on (see the header), while it is this thread's to read
        const float* next = (ahead > 0 && n + (ahead + 1) * plan.tile_n <= ahead_end)
                                ? w + (n + ahead * plan.tile_n) * in : nullptr;
        for (int64_t m = m0; m < m1; m += plan.tile_m) {
          const int mr = static_cast<int>(std::min<int64_t>(plan.tile_m, m1 - m));
          kTiles.fn[mr - 1][nr - 1](x + m * xs, xs, w + n * in, in, y + m * out + n, out, k0,
                                    k1, k0 > 0, m == m0 ? next : nullptr);
        }
      }
    }
  }
}

// ---- the packed weight in panels, multiplied in outer-product form -------------------------
//
//   panel g = output columns Rg .. Rg+R-1, K-major:   P[g][k][0..R-1] = W[Rg .. Rg+R-1][k]
//
//        k ->                                          (AVX2: R = 24, 3 ymm; AVX-512: 32, 2 zmm)
//   x rows m .. m+MR-1:   x[m][k], one float each, broadcast      MR broadcasts per k
//   panel row k:          | w 0..7 | w 8..15 | w 16..23 |         R / lanes vector loads per k
//   acc[m][v] += broadcast(x[m][k]) * w[v]          ->  y[m][Rg + lanes v ..], no horizontal sums
//
// AVX2, 4 rows x 24 columns: 12 accumulators + 3 W vectors + 1 broadcast fill the 16 ymm
// registers, 7 loads per 12 FMAs. The dot-product 3 x 4 tile also loads 7 per 12, but its x
// rows come from L2 at 96 B per k step (8 k) and each tile ends in 12 horizontal sums; here a
// panel block [block_k x R] stays in L1 for every row tile and x comes from L2 at 16 B per k.
// AVX-512, 8 rows x 32 columns: 16 accumulators + 2 + 1 of the 32 zmm, 10 loads per 16 FMAs
// (SmolLM2's shapes at 64 rows: 325-342 GFLOP/s; the row-major tiles and MKL 248-276). Few
// rows keep several k steps in flight (separate accumulators: 8+ independent FMA chains); one
// row streams W as fast as an 8-row lane-block layout read in 256-bit halves did.
// prefetch: the rows of a panel block to pull into L2 meanwhile, one k row per k step, or nullptr
template <int MR>
void panel_tile(const float* __restrict x, int64_t xs, const float* __restrict panel,
                float* __restrict y, int64_t ys, int64_t kn, bool accumulate, int64_t valid,
                const float* prefetch) {
  constexpr int U = MR == 1 ? 4 : MR == 2 ? 2 : 1;      // k steps in flight
  vecn acc[U][MR][kPanelVecs];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < kPanelVecs; ++v) acc[u][m][v] = vecn{};
  const auto step = [&](int u, int64_t k) {
    const float* pk = panel + k * kPackRows;
    if (prefetch) __builtin_prefetch(prefetch + k * kPackRows, 0, 1);
    vecn w[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) {
      w[v] = loadn(pk + v * kLanes);
      asm("" : "+v"(w[v]));           // one load each, not one per row folded into the FMAs
    }
    for (int m = 0; m < MR; ++m) {
      // one vbroadcastss from memory: x - 0.f is x for every x, so gcc folds the subtraction
      // (x + 0.f is not: -0.f + 0.f = 0.f; the pointer intrinsic _mm256_broadcast_ss made gcc
      // spill the accumulators around it)
      const vecn b = x[m * xs + k] - vecn{};
      for (int v = 0; v < kPanelVecs; ++v) acc[u][m][v] += b * w[v];
    }
  };
  int64_t k = 0;
  for (; k + U <= kn; k += U)
    for (int u = 0; u < U; ++u) step(u, k + u);
  for (; k < kn; ++k) step(0, k);
  for (int m = 0; m < MR; ++m) {
    vecn total[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) {
      total[v] = acc[0][m][v];
      for (int u = 1; u < U; ++u) total[v] += acc[u][m][v];
    }
    float* row = y + m * ys;
    if (valid == kPackRows) {
      for (int v = 0; v < kPanelVecs; ++v)
        store_vec(row + v * kLanes, accumulate ? loadn(row + v * kLanes) + total[v] : total[v]);
    } else {                            // the last panel's padding columns are not y's
      float part[kPackRows];
      for (int v = 0; v < kPanelVecs; ++v) store_vec(part + v * kLanes, total[v]);
      for (int64_t c = 0; c < valid; ++c) row[c] = accumulate ? row[c] + part[c] : part[c];
    }
  }
}

using PanelFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, bool,
                         int64_t, const float*);
template <int... Ms>
constexpr std::array<PanelFn, sizeof...(Ms)> panel_table(std::integer_sequence<int, Ms...>) {
  return {&panel_tile<Ms + 1>...};
}
// kPanelTiles[MR - 1]: MR = 1 .. kPanelRowsMax rows of x
constexpr auto kPanelTiles = panel_table(std::make_integer_sequence<int, kPanelRowsMax>{});

// One tile of rows reads a thread's panels as one stream: prefetched this far (floats) ahead.
constexpr int64_t kPanelAhead = 4096 / 4;

// panels [g0, g1) of a packed W: for each K block, each panel block (in L1) meets every row
// tile of x (in L2). The first row tile prefetches the next panel's block, which starts
// [in x 24] floats on: the hardware's stream prefetch does not cross that jump in time.
void linear_packed_range(const float* x, int64_t xs, const float* p, float* y, int64_t rows,
                         int64_t in, int64_t out, int64_t g0, int64_t g1, const LinearPlan& plan,
                         int64_t ahead_end) {
  const int64_t panel_floats = kPackRows * in;
  const bool one_pass = plan.block_k >= in && rows <= plan.tile_m;
  for (int64_t k0 = 0; k0 < in; k0 += plan.block_k) {
    const int64_t kn = std::min(in, k0 + plan.block_k) - k0;
    for (int64_t m0 = 0; m0 < rows; m0 += plan.block_m) {    // x block [block_m x kn] in L2
      const int64_t m1 = std::min(rows, m0 + plan.block_m);
      for (int64_t g = g0; g < g1; ++g) {
        const float* panel = p + g * panel_floats + k0 * kPackRows;
        const int64_t valid = std::min<int64_t>(kPackRows, out - g * kPackRows);
        const float* ahead = plan.prefetch_tiles == 0 ? nullptr
                             : one_pass ? (g + 1 < ahead_end ? panel + kPanelAhead : nullptr)
                             : g + 1 < ahead_end ? panel + panel_floats : nullptr;
        for (int64_t m = m0; m < m1; m += plan.tile_m) {
          const int mr = static_cast<int>(std::min<int64_t>(plan.tile_m, m1 - m));
          kPanelTiles[mr - 1](x + m * xs + k0, xs, panel, y + m * out + g * kPackRows, out, kn,
                              k0 > 0, valid, m == m0 ? ahead : nullptr);
        }
      }
    }
  }
}
}  // namespace

// Tasks of whole units (tiles, or packed groups) of `unit_rows` rows, >= ~16K floats of W each,
// so small layers do not pay for waking threads.
inline int64_t linear_grain(int64_t in, int64_t unit_rows) {
  return std::max<int64_t>(1, (16 * 1024) / std::max<int64_t>(in * unit_rows, 1));
}

// Chunks a team claims (Team::for_shares): at most ~256 KB of W (smaller as a share runs out),
// so a claim (an atomic add and a new stream) is noise next to reading the chunk. SmolLM2
// batch-1 steps, alternated: 128-512 KB alike, 64 KB 1% slower, 32 KB 6%, 1 MB 2%.
constexpr int64_t kClaimBytes = 256 * 1024;

void linear_team(const float* x, int64_t xs, const float* w, bool packed, const float* bias,
                 float* y, int64_t rows, int64_t in, int64_t out, const Team& team,
                 ShareClaim* claims) {
  linear_team_plan(x, xs, w, packed, bias, y, rows, in, out,
                   resolve_linear_plan(tuned_linear_plan(in, out, rows), rows, in, packed), team,
                   claims);
}

void linear_team_plan(const float* x, int64_t xs, const float* w, bool packed, const float* bias,
                      float* y, int64_t rows, int64_t in, int64_t out, const LinearPlan& shape,
                      const Team& team, ShareClaim* claims) {
  const int64_t unit_rows = packed ? kPackRows : shape.tile_n;   // a packed group, or a tile
  const int64_t units = (out + unit_rows - 1) / unit_rows;
  const int64_t chunk = std::max<int64_t>(1, kClaimBytes / (unit_rows * in * 4));
  team.for_shares(units, chunk, claims, [&](int64_t u0, int64_t u1, int64_t ahead_end) {
    if (packed)
      linear_packed_range(x, xs, w, y, rows, in, out, u0, u1, shape, ahead_end);
    else
      linear_rows_range(x, xs, w, y, rows, in, out, u0 * shape.tile_n,
                        std::min(out, u1 * shape.tile_n), shape,
                        std::min(out, ahead_end * shape.tile_n));
    if (bias != nullptr) {
      const int64_t c0 = u0 * unit_rows, c1 = std::min(out, u1 * unit_rows);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = c0; c < c1; ++c) y[r * out + c] += bias[c];
    }
  });
}

// Standalone (the LM head, the Python layers): a team of its own when there is enough W (less
// than ~16K floats per thread runs on the calling thread alone, a team of one).
void linear_standalone(const float* x, int64_t xs, const float* w, bool packed, float* y,
                       int64_t rows, int64_t in, int64_t out, const LinearPlan& plan) {
  const int64_t unit_rows = packed ? kPackRows : plan.tile_n;
  std::vector<ShareClaim> claims(at::get_num_threads());
  const auto run = [&](const Team& team) {
    linear_team_plan(x, xs, w, packed, nullptr, y, rows, in, out, plan, team, claims.data());
  };
  if ((out + unit_rows - 1) / unit_rows <= linear_grain(in, unit_rows)) {
    TeamSync alone;
    run(Team(0, 1, alone));
  } else {
    run_team(run);
  }
}

void linear_rows(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out) {
  linear_standalone(x, xs, w, false, y, rows, in, out,
                    resolve_linear_plan(tuned_linear_plan(in, out, rows), rows, in, false));
}

void linear_packed(const float* x, int64_t xs, const float* packed, float* y, int64_t rows,
                   int64_t in, int64_t out) {
  linear_standalone(x, xs, packed, true, y, rows, in, out,
                    resolve_linear_plan(tuned_linear_plan(in, out, rows), rows, in, true));
}

at::Tensor linear_rows_op(at::Tensor x, at::Tensor weight) {
  check_fp32_cpu(x, "x");
  check_fp32_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shape mismatch");
  TORCH_CHECK(x.stride(1) == 1 && weight.is_contiguous(), "rows must be contiguous");
  TORCH_CHECK(x.size(0) >= 1, "linear_rows needs at least one row");
  auto y = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), y.data_ptr<float>(),
              x.size(0), x.size(1), weight.size(0));
  return y;
}

void check_packed_weight(const at::Tensor& packed, int64_t in, int64_t out) {
  check_fp32_cpu(packed, "packed weight");
  TORCH_CHECK(out >= 1 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(0) == (out + kPackRows - 1) / kPackRows &&
                  packed.size(1) * kPackLanes == in && packed.size(2) == kPackRows &&
                  packed.size(3) == kPackLanes,
              "packed weight must be [ceil(out / ", kPackRows, "), in / ", kPackLanes, ", ",
              kPackRows, ", ", kPackLanes, "] for in = ", in, ", out = ", out);
}

at::Tensor linear_packed_op(at::Tensor x, at::Tensor packed, int64_t out_features) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) >= 1,
              "x must be [rows >= 1, in] with contiguous rows");
  const int64_t in = x.size(1);
  check_packed_weight(packed, in, out_features);
  auto y = at::empty({x.size(0), out_features}, x.options());
  linear_packed(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), y.data_ptr<float>(),
                x.size(0), in, out_features);
  return y;
}
// rows `ids` of a packed weight [out, in] as a row-major [len(ids), in] (a tied LM head's
// embedding lookup): row i is panel i / R, at position i % R of each k row
at::Tensor packed_rows(at::Tensor packed, at::Tensor ids, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 4, "packed weight must be 4-D");
  const int64_t in = packed.size(1) * kPackLanes;
  check_packed_weight(packed, in, out_features);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous() &&
                  ids.device().is_cpu(), "ids must be a contiguous int64 CPU vector");
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < out_features, "token id ", id[t], " out of range [0, ",
                out_features, ")");
  auto rows = at::empty({n, in}, packed.options());
  for (int64_t t = 0; t < n; ++t)
    packed_row(packed.data_ptr<float>(), in, id[t], rows.data_ptr<float>() + t * in);
  return rows;
}

void packed_row(const float* packed, int64_t in, int64_t row, float* out) {
  const float* group =
      packed + (row / kPackRows) * kPackRows * in + (row % kPackRows) * kPackLanes;
  for (int64_t kb = 0; kb < in / kPackLanes; ++kb)
    std::copy(group + kb * kPackRows * kPackLanes, group + kb * kPackRows * kPackLanes + kPackLanes,
              out + kb * kPackLanes);
}

}  // namespace kvforge
