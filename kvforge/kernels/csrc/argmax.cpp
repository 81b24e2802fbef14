// Greedy sampling's argmax over each row of the logits, as torch.argmax(dim=-1): the first
// index of the maximum, and the first NaN when a row holds one (NaN counts as the maximum).
//
// Why: torch's CPU argmax walks a row of SmolLM2's 49,152 logits in 60-85 us (a scalar loop), a
// few % of a batch-1 decode step and ~5 ms of a batch-64 one. Here one vector pass keeps, per
// lane l, the running maximum and the first block of L floats (L = kVecLanes: 16 with AVX-512,
// 8 with AVX2) that reached it:
//
//   row:   [ b0: 0..L-1 | b1: L..2L-1 | ... ]   lane l of block b is index L b + l
//   max[l]   = max over b of row[L b + l]       (strict >: the first block keeps it)
//   block[l] = first b where row[L b + l] == max[l]
//   result   = min over lanes with max[l] == max of all (L block[l] + l), then the < L tail
#include "kernels.h"

namespace kvforge {

int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t L = kVecLanes;
  vecn best = vecn{} - INFINITY;
  ivecn block{}, nan_seen{};
  int64_t b = 0;
  for (; (b + 1) * L <= n; ++b) {
    const vecn v = loadn(x + b * L);
    const ivecn greater = v > best;        // all ones where the lane improves
    best = greater ? v : best;
    block = greater ? ivecn{} + static_cast<int32_t>(b) : block;
    nan_seen |= v != v;
  }
  int64_t index = -1;
  float top = -INFINITY;
  bool nan = false;
  for (int l = 0; l < L; ++l) nan = nan || nan_seen[l] != 0;
  for (int64_t i = b * L; i < n && !nan; ++i) nan = x[i] != x[i];
  if (nan) {                                // rare: the first NaN, as torch returns
    for (int64_t i = 0; i < n; ++i)
      if (x[i] != x[i]) return i;
  }
  if (b > 0) {
    for (int l = 0; l < L; ++l) top = std::max(top, best[l]);
    for (int l = 0; l < L; ++l) {
      const int64_t i = static_cast<int64_t>(block[l]) * L + l;
      if (best[l] == top && (index < 0 || i < index)) index = i;
    }
  }
  for (int64_t i = b * L; i < n; ++i) {     // the tail comes after every vector lane
    if (index < 0 || x[i] > top) {
      top = x[i];
      index = i;
    }
  }
  return index < 0 ? 0 : index;             // a row of -inf: index 0, as torch
}

at::Tensor argmax_rows(at::Tensor logits) {
  check_fp32_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) >= 1,
              "logits must be [rows, vocab >= 1] with contiguous rows");
  const int64_t rows = logits.size(0), cols = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(x + r * stride, cols);
  });
  return out;
}

}  // namespace kvforge
