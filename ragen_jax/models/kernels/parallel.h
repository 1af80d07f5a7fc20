// What the CPU kernels share: a 16-float vector type and the split of a kernel's work over XLA's
// intra-op thread pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ragen {

// 16 floats; aligned(4) makes loads and stores through it unaligned-safe. GCC and Clang lower it to
// the widest vectors the target has (AVX-512, AVX2 pairs, NEON quads).
typedef float f16v __attribute__((vector_size(64), aligned(4)));

// body(i) for every i in [0, n), on the calling thread and the pool's threads, each taking the next i
// from one counter until none is left; returns when all n are done. The counter and the body live in
// shared state, so a pool task that starts after the work is gone only drops its reference and the
// caller never waits for a task the pool has not started. body must be safe to call concurrently.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Body body) {
  struct State {
    State(Body b, int64_t count) : body(std::move(b)), n(count) {}
    Body body;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>(std::move(body), n);
  auto work = [](State& s) {
    int64_t finished = 0;
    for (int64_t i; (i = s.next.fetch_add(1)) < s.n; ++finished) s.body(i);
    s.done.fetch_add(finished);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state, work] { work(*state); });
  work(*state);
  while (state->done.load() < n) std::this_thread::yield();
}

}  // namespace ragen
