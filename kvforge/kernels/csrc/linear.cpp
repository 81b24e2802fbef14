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
// Threads split N in contiguous tile ranges; the first row tile of each W tile prefetches the
// W tile after next into L2, spread over its k steps. With few rows each tile is ~60% compute,
// so a prefetch one tile ahead arrived late and the kernel alternated between computing and
// waiting (7 rows: 19.4 ms for SmolLM2's 120 projections); two tiles ahead keeps memory busy
// under the FMAs (15.0 ms, as fast as 1 row: verification rows ride along with the weights).
namespace {

#if defined(__AVX512F__)
typedef float vreg __attribute__((vector_size(64), aligned(4), may_alias));
constexpr int kLanes = 16, kTileM = 4, kTileN = 6, kFewRowsMax = 8;
constexpr int kFewRowsN[kFewRowsMax + 1] = {0, 8, 8, 8, 6, 4, 4, 3, 3};
#else
typedef float vreg __attribute__((vector_size(32), aligned(4), may_alias));
constexpr int kLanes = 8, kTileM = 3, kTileN = 4, kFewRowsMax = 4;
constexpr int kFewRowsN[kFewRowsMax + 1] = {0, 8, 6, 4, 2};
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

// y[0:MR, 0:NR] (+)= x[0:MR, k0:k1] . w[0:NR, k0:k1]; prefetch: a W tile to pull into L2, or
// nullptr
template <int MR, int NR>
void tile(const float* __restrict x, int64_t xs, const float* __restrict w, int64_t ws,
          float* __restrict y, int64_t ys, int64_t k0, int64_t k1, bool accumulate,
          const float* prefetch) {
  vreg acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = vreg{};
  const int64_t kv = k0 + (k1 - k0) / kLanes * kLanes;
  for (int64_t k = k0; k < kv; k += kLanes) {
    if (prefetch) {
      for (int n = 0; n < NR; ++n) __builtin_prefetch(prefetch + n * ws + k, 0, 1);
    }
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
  constexpr TileTable() : fn{} { fill_table(fn, std::make_integer_sequence<int, kMaxTile>{}); }
};
constexpr TileTable kTiles{};

// K is split only when a W tile would not stay in L2 (every split adds a pass of hsums)
constexpr int64_t kBlockK = 4096;

struct TileShape {
  int m, n;
};
inline TileShape tile_shape(int64_t rows) {
  return rows <= kFewRowsMax ? TileShape{static_cast<int>(rows), kFewRowsN[rows]}
                             : TileShape{kTileM, kTileN};
}

// columns [n0, n1) of y; n0 is a multiple of the tile width
void linear_rows_range(const float* x, int64_t xs, const float* w, float* y, int64_t rows,
                       int64_t in, int64_t out, int64_t n0, int64_t n1, TileShape shape) {
  for (int64_t k0 = 0; k0 < in; k0 += kBlockK) {
    const int64_t k1 = std::min(in, k0 + kBlockK);
    for (int64_t n = n0; n < n1; n += shape.n) {
      const int nr = static_cast<int>(std::min<int64_t>(shape.n, n1 - n));
      for (int64_t m = 0; m < rows; m += shape.m) {
        const int mr = static_cast<int>(std::min<int64_t>(shape.m, rows - m));
        // the W tile after next (see the header): two tiles of distance
        const float* ahead =
            (m == 0 && n + 3 * shape.n <= n1) ? w + (n + 2 * shape.n) * in : nullptr;
        kTiles.fn[mr - 1][nr - 1](x + m * xs, xs, w + n * in, in, y + m * out + n, out, k0, k1,
                                  k0 > 0, ahead);
      }
    }
  }
}
}  // namespace

// Tasks of whole tiles, >= ~16K floats of W each, so small layers do not pay for waking threads.
inline int64_t linear_grain(int64_t in, TileShape shape) {
  return std::max<int64_t>(1, (16 * 1024) / std::max<int64_t>(in * shape.n, 1));
}

// Bytes of the next weight each thread pulls into L2 at the end of its share: about what one
// thread streams during the serial work between two projections (~10-40 us).
constexpr int64_t kNextPrefetchBytes = 128 * 1024;

// The calling thread's share of `next` as at::parallel_for will hand it out (OpenMP backend:
// min(threads, tasks) threads, ceil(tiles / threads) tiles each, thread i the i-th run), its
// first kNextPrefetchBytes prefetched into L2. A wrong guess only wastes the hint.
void prefetch_next_share(const NextWeight& next, TileShape shape) {
  const int64_t tiles = (next.out + shape.n - 1) / shape.n;
  const int64_t grain = linear_grain(next.in, shape);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (tiles + grain - 1) / grain);
  const int64_t tid = at::get_thread_num();
  if (tid >= threads) return;
  const int64_t chunk = (tiles + threads - 1) / threads;
  const int64_t row0 = std::min(next.out, tid * chunk * shape.n);
  const int64_t row1 = std::min(next.out, (tid + 1) * chunk * shape.n);
  const char* p = reinterpret_cast<const char*>(next.w + row0 * next.in);
  const int64_t bytes = std::min<int64_t>(kNextPrefetchBytes, (row1 - row0) * next.in * 4);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 1);
}

void linear_rows(const float* x, int64_t xs, const float* w, float* y, int64_t rows, int64_t in,
                 int64_t out, NextWeight next) {
  const TileShape shape = tile_shape(rows);
  const int64_t num_tiles = (out + shape.n - 1) / shape.n;
  at::parallel_for(0, num_tiles, linear_grain(in, shape), [&](int64_t t0, int64_t t1) {
    linear_rows_range(x, xs, w, y, rows, in, out, t0 * shape.n, std::min(out, t1 * shape.n),
                      shape);
    if (next.w != nullptr) prefetch_next_share(next, shape);
  });
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

}  // namespace kvforge
