// Run-time plans of the tiled linear kernel (linear.cpp): which register tile, which cache
// blocking, how far ahead W is prefetched, or MKL, per weight shape and row range. The
// defaults come from the build (tile widths of its register file) and this CPU's cache sizes;
// kvforge/kernels/tune.py times the candidates on the machine and installs the winners here
// (set_linear_plans), so a CPU with other caches, registers or memory gets its own choice.
//
// Defaults, in AVX2 terms (16 ymm registers; per k step a tile of MR x rows by NR W rows
// loads MR + NR vectors for MR * NR FMAs, and needs MR * NR accumulators + MR + 1 registers):
//
//   tile    registers   loads / FMA    |  few rows (<= kFewRowsMax, one pass over W):
//   3 x 4      16          0.58        |    MR = rows, NR as wide as the registers allow,
//   2 x 6      15          0.67        |    so several W streams are in flight
//   5 x 2      16          0.70        |
//   4 x 3      17 (spills) 0.58        |  Zen 2 issues 2 loads + 2 FMAs a cycle: every tile
//                                      |  here is FMA-bound from L1; they differ in L2 traffic
//
// Blocking: K is split when a W tile [NR x K] would not stay in a quarter of L2 (every split
// adds a pass of horizontal sums and a read-modify-write of y); x rows are taken in blocks
// whose [block_m x block_k] floats fit half of L2 only when the tuner finds that faster (W is
// then read once per row block), so the default is one block of all rows.
#include "kernels.h"

#include <unistd.h>

#include <atomic>
#include <map>

namespace kvforge {
namespace {

#if defined(__AVX512F__)
constexpr int kRegisters = 32;
constexpr int kTileM = 4, kTileN = 6;
constexpr int kFewRowsN[kFewRowsMax + 1] = {0, 8, 8, 8, 6, 4, 4, 3, 3};
#else
constexpr int kRegisters = 16;
constexpr int kTileM = 3, kTileN = 4;
constexpr int kFewRowsN[kFewRowsMax + 1] = {0, 8, 6, 4, 2};
#endif
constexpr int kMaxTileSide = 8;              // linear.cpp's tile table: MR, NR in 1..8
constexpr int64_t kPanelSplitRowsMax = 256;  // panels: K blocks up to here (below)
constexpr int kDefaultPrefetchTiles = 2;     // linear.cpp's header: two tiles of distance

int64_t cache_bytes(int name, int64_t fallback) {
  const long v = sysconf(name);
  return v > 0 ? static_cast<int64_t>(v) : fallback;
}

// (in, out) -> ranges of rows, rows_max ascending; the last range is open-ended
struct PlanRange {
  int64_t rows_max;
  LinearPlan plan;
};
using PlanTable = std::map<std::pair<int64_t, int64_t>, std::vector<PlanRange>>;
// Replaced whole by set_linear_plans and read without a lock by every projection call (decode
// steps run it from team threads); a replaced table is kept, so a reader never sees it freed.
std::atomic<const PlanTable*> g_plans{nullptr};
std::vector<std::unique_ptr<const PlanTable>> g_retired;
std::mutex g_plans_mutex;

}  // namespace

CacheSizes detected_cache_sizes() {
  static const CacheSizes sizes{cache_bytes(_SC_LEVEL1_DCACHE_SIZE, 32 << 10),
                                cache_bytes(_SC_LEVEL2_CACHE_SIZE, 512 << 10)};
  return sizes;
}

LinearPlan tuned_linear_plan(int64_t in, int64_t out, int64_t rows) {
  const PlanTable* table = g_plans.load(std::memory_order_acquire);
  if (table == nullptr) return {};
  const auto it = table->find({in, out});
  if (it == table->end()) return {};
  for (const PlanRange& r : it->second)
    if (rows <= r.rows_max) return r.plan;
  return {};
}

LinearPlan resolve_linear_plan(LinearPlan plan, int64_t rows, int64_t in, bool packed) {
  TORCH_CHECK(plan.tile_m >= 0 && plan.tile_m <= kMaxTileSide && plan.tile_n >= 0 &&
                  plan.tile_n <= kMaxTileSide,
              "tile ", plan.tile_m, " x ", plan.tile_n, " outside 1..", kMaxTileSide);
  if (plan.tile_m == 0 || plan.tile_n == 0) {
    if (packed) {      // whole panels (tile_n below), up to kPanelRowsMax rows a tile
      plan.tile_m = static_cast<int>(std::min<int64_t>(rows, kPanelRowsMax));
    } else if (rows <= kFewRowsMax) {
      plan.tile_m = static_cast<int>(rows);
      plan.tile_n = kFewRowsN[rows];
    } else {
      plan.tile_m = kTileM;
      plan.tile_n = kTileN;
    }
  }
  const CacheSizes caches = detected_cache_sizes();
  if (packed) {        // panels: every tile is a whole panel wide, up to kPanelRowsMax rows
    // (a plan tuned for a row-major weight of the same shape may ask for more: clamped)
    plan.tile_m = std::min(plan.tile_m, kPanelRowsMax);
    plan.tile_n = kPanelVecs;
    // One row tile: one pass, no K split. Up to kPanelSplitRowsMax rows: a panel block stays
    // in half of L1, in equal blocks (K = 576 in three of 192, not 256 + 256 + 64). More rows:
    // every K block would read and write y again, which no longer fits the caches (2048 rows
    // of SmolLM2's projections: 149 GFLOP/s split, 195 unsplit in x blocks of L2 / 4, MKL 197).
    if (plan.block_k <= 0 && rows > plan.tile_m && rows <= kPanelSplitRowsMax) {
      const int64_t target = std::max<int64_t>(16, caches.l1d / 2 / (4 * kPackRows));
      const int64_t blocks = (in + target - 1) / target;
      plan.block_k = ((in + blocks - 1) / blocks + 7) / 8 * 8;
    } else if (plan.block_k <= 0) {
      plan.block_k = in;
    }
    if (plan.block_m <= 0 && rows > kPanelSplitRowsMax)
      plan.block_m = std::max<int64_t>(caches.l2 / 4 / (4 * std::max<int64_t>(in, 1)), 16);
  }
  if (plan.block_k <= 0)
    plan.block_k = std::max<int64_t>(256, caches.l2 / 4 / (4 * plan.tile_n) / kLanes * kLanes);
  plan.block_k = std::min(plan.block_k, std::max<int64_t>(in, 1));
  if (plan.block_m <= 0) plan.block_m = std::max<int64_t>(rows, 1);
  if (plan.block_m < rows)   // whole row tiles per block, except a last partial one
    plan.block_m = std::max<int64_t>(plan.block_m / plan.tile_m * plan.tile_m, plan.tile_m);
  if (plan.prefetch_tiles < 0) plan.prefetch_tiles = kDefaultPrefetchTiles;
  return plan;
}

LinearPlan linear_plan_default_blocked(int64_t rows, int64_t in, int tile_m, int tile_n) {
  LinearPlan plan = resolve_linear_plan(LinearPlan{tile_m, tile_n}, rows, in, false);
  plan.block_m = detected_cache_sizes().l2 / 2 / (4 * plan.block_k);
  return resolve_linear_plan(plan, rows, in, false);
}

int linear_register_count() { return kRegisters; }

// entries: (in, out, rows_max, tile_m, tile_n, block_k, block_m, prefetch_tiles, use_mkl),
// ranges of one shape in ascending rows_max; an empty list forgets every plan
void set_linear_plans(const std::vector<std::vector<int64_t>>& entries) {
  auto table = std::make_unique<PlanTable>();
  for (const auto& e : entries) {
    TORCH_CHECK(e.size() == 9, "a linear plan is (in, out, rows_max, tile_m, tile_n, block_k, "
                "block_m, prefetch_tiles, use_mkl), got ", e.size(), " values");
    LinearPlan p{static_cast<int>(e[3]), static_cast<int>(e[4]), e[5], e[6],
                 static_cast<int>(e[7]), e[8] != 0};
    resolve_linear_plan(p, 1, std::max<int64_t>(e[0], 1), false);   // throws for a bad tile
    TORCH_CHECK(e[0] > 0 && e[1] > 0 && e[2] > 0, "plan shape and rows_max must be positive");
    auto& ranges = (*table)[{e[0], e[1]}];
    TORCH_CHECK(ranges.empty() || ranges.back().rows_max < e[2],
                "plan ranges of one shape must ascend in rows_max");
    ranges.push_back({e[2], p});
  }
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  const PlanTable* old = g_plans.exchange(entries.empty() ? nullptr : table.release(),
                                          std::memory_order_acq_rel);
  if (old != nullptr) g_retired.emplace_back(old);
}

// y = x @ W^T with an explicit plan (the tuner's candidates): W row-major [out, in], or packed
// when out_features >= 0 (the packed layout holds `out_features` rows)
at::Tensor linear_with_plan(at::Tensor x, at::Tensor weight, int64_t out_features, int64_t tile_m,
                            int64_t tile_n, int64_t block_k, int64_t block_m,
                            int64_t prefetch_tiles) {
  check_fp32_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(0) >= 1,
              "x must be [rows >= 1, in] with contiguous rows");
  const bool packed = out_features >= 0;
  const int64_t rows = x.size(0), in = x.size(1);
  int64_t out = out_features;
  if (packed) {
    check_packed_weight(weight, in, out);
  } else {
    check_fp32_cpu(weight, "weight");
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == in,
                "weight must be a contiguous [out, ", in, "]");
    out = weight.size(0);
  }
  const LinearPlan plan = resolve_linear_plan(
      LinearPlan{static_cast<int>(tile_m), static_cast<int>(tile_n), block_k, block_m,
                 static_cast<int>(prefetch_tiles)}, rows, in, packed);
  auto y = at::empty({rows, out}, x.options());
  linear_standalone(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), packed,
                    y.data_ptr<float>(), rows, in, out, plan);
  return y;
}

void bind_linear_plan(pybind11::module& m) {
  m.def("set_linear_plans", &set_linear_plans,
        "install tuned plans: (in, out, rows_max, tile_m, tile_n, block_k, block_m, "
        "prefetch_tiles, use_mkl) per row range; [] forgets them");
  m.def("linear_plan", [](int64_t in, int64_t out, int64_t rows, bool packed) {
    const LinearPlan tuned = tuned_linear_plan(in, out, rows);
    const LinearPlan p = resolve_linear_plan(tuned, rows, in, packed);
    return std::make_tuple(p.tile_m, p.tile_n, p.block_k, p.block_m, p.prefetch_tiles,
                           tuned.use_mkl);
  }, "the plan a product of rows x in @ [out, in]^T runs now: (tile_m, tile_n, block_k, "
     "block_m, prefetch_tiles, use_mkl)");
  m.def("linear_blocked_rows", [](int64_t rows, int64_t in, int tile_m, int tile_n) {
    return linear_plan_default_blocked(rows, in, tile_m, tile_n).block_m;
  }, "x rows per block that fit half of L2 for this tile");
  m.def("linear_with_plan", &linear_with_plan, pybind11::arg("x"), pybind11::arg("weight"),
        pybind11::arg("out_features"), pybind11::arg("tile_m"), pybind11::arg("tile_n"),
        pybind11::arg("block_k") = 0, pybind11::arg("block_m") = 0,
        pybind11::arg("prefetch_tiles") = -1,
        "x @ W^T by the tiled kernel with the given plan (0 / -1: defaults); "
        "out_features >= 0: W is packed", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("cache_sizes", [] {
    const CacheSizes c = detected_cache_sizes();
    return std::make_tuple(c.l1d, c.l2);
  }, "(L1d, L2) bytes per core the kernels block for (sysconf; 32 / 512 KiB where unknown)");
  m.attr("linear_registers") = kRegisters;
  m.attr("linear_tile_max") = kMaxTileSide;
}

}  // namespace kvforge
