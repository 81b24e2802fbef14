// A team of threads that runs a whole decode step inside one OpenMP parallel region
// (decode_stack.cpp), and the balanced split of a projection's columns that every packed matmul
// uses (linear.cpp).
//
// Why one region: a step is ~150 small parallel ops (4 projections and attention per layer).
// As one `omp parallel` each, every op paid a fork/join (~0.8 us when the VM's two vCPUs share
// a core, ~1.7 us on separate cores) and every thread waited for the slower one at each join.
// In one region the ops are separated by a spin barrier (~0.03 / ~0.16 us), and the work of an
// op is claimed in chunks, so a thread that runs ahead takes over the tail of the other's share
// instead of waiting for it.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>

namespace kvforge {

// What the team shares: one barrier.
struct TeamSync {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> phase{0};
};

// Claims on one thread's share of a range of work units, on a cache line of its own: the units
// taken from the front (by the owner) in the low 32 bits, from the back (by the others) in the
// high 32. One atomic add per chunk; a claim holds the units of its chunk that front + back
// taken had left before it.
struct alignas(64) ShareClaim {
  std::atomic<int64_t> taken{0};
};

class Team {
 public:
  Team(int rank, int size, TeamSync& sync) : rank_(rank), size_(size), sync_(sync) {}

  int rank() const { return rank_; }
  int size() const { return size_; }

  // [begin, end) of an even split of `total` into `size` parts: part `part`
  static int64_t split(int64_t total, int part, int parts) { return total * part / parts; }

  // Sense-reversing barrier. Spins (the wait is a few microseconds between ops), then yields,
  // so more threads than cores still make progress.
  void barrier() const {
    if (size_ == 1) return;
    const int phase = sync_.phase.load(std::memory_order_relaxed);   // before arriving
    if (sync_.arrived.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
      sync_.arrived.store(0, std::memory_order_relaxed);
      sync_.phase.store(phase + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; sync_.phase.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < kSpinsBeforeYield)
        pause();
      else
        std::this_thread::yield();
    }
  }

  // Runs f(u0, u1, ahead_end) over units [0, total) in chunks of at most `max_chunk` units
  // (ahead_end: where this thread's reading may run on to, for prefetches: its share's end, or
  // the stolen chunk's end, since it steals backwards): units are split in `size` even
  // contiguous shares; each thread takes its own share's chunks from the front, then the other
  // shares' chunks from their back, so every thread streams forward through its own share and
  // the faster one finishes what is left of the slower one's:
  //
  //   share of thread 0: [c0   c1   c2  c3 c4 c5 c6   c7  ]   thread 0 takes c0, c1, ... (front)
  //                                        ^--   thread 1, done with its own share, takes c7, c6
  //
  // Chunks shrink as a share runs out (a 1/(2 size) part of what is left, guided-scheduling
  // style): big chunks while the share is long, so a claim is noise next to its reading, and
  // single units where the two ends meet, so neither thread waits at the next barrier for the
  // other's last big chunk. `claims`: `size` zeroed ShareClaims, used once. Each unit runs
  // exactly once: a claim's atomic add returns the exact front + back before it, and it takes
  // only what they left.
  template <class F>
  void for_shares(int64_t total, int64_t max_chunk, ShareClaim* claims, F&& f) const {
    constexpr int64_t kLow = 0xffffffff;
    for (int v = 0; v < size_; ++v) {
      const int owner = (rank_ + v) % size_;
      const int64_t s0 = split(total, owner, size_), s1 = split(total, owner + 1, size_);
      const int64_t units = s1 - s0;
      const bool own = v == 0;
      std::atomic<int64_t>& taken = claims[owner].taken;
      while (true) {
        const int64_t seen = taken.load(std::memory_order_relaxed);   // sizes the chunk only
        const int64_t seen_left = units - (seen & kLow) - (seen >> 32);
        if (seen_left <= 0) break;
        const int64_t want = std::clamp<int64_t>(seen_left / (2 * size_), 1, max_chunk);
        const int64_t before =
            taken.fetch_add(own ? want : want << 32, std::memory_order_relaxed);
        const int64_t front = before & kLow, back = before >> 32;
        const int64_t got = std::min(want, units - front - back);
        if (got <= 0) break;
        const int64_t u0 = own ? s0 + front : s1 - back - got;
        f(u0, u0 + got, own ? s1 : u0 + got);
      }
    }
  }

 private:
  static constexpr int kSpinsBeforeYield = 1 << 14;

  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  int rank_, size_;
  TeamSync& sync_;
};

// Runs body(team) on every thread of one OpenMP region of torch's thread count (the region may
// get fewer threads; nested inside another region it is one). body must not throw.
template <class F>
void run_team(F&& body) {
  TeamSync sync;
  const int want = at::get_num_threads();
  if (want <= 1 || at::in_parallel_region()) {
    body(Team(0, 1, sync));
    return;
  }
#pragma omp parallel num_threads(want)
  body(Team(omp_get_thread_num(), omp_get_num_threads(), sync));
}

}  // namespace kvforge
