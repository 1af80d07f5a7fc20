// y = x @ W for a few rows of x (a decode step) with W in panels: the CPU matmul of the decode loop.
//
// A decode step multiplies a handful of rows by every weight of the model, each read from memory once.
// XLA's CPU matmul repacks a weight on every call, which on such shapes halves its speed; here the
// weights are repacked once per `generate` call (models/cpu_kernels.py: pack_panels) into panels of 32
// columns that lie contiguous along K, and each panel is streamed once for all rows.
//
// Operands: x f32 [M, K]; w f32 [N / 32, K, 32] (panel p holds columns 32p .. 32p + 31). Result: f32 [M, N].
// Work is split over panels and chunks of rows on XLA's intra-op thread pool.
#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using ragen::f16v;

namespace {

constexpr int kPanel = 32;
constexpr int kRows = 8;  // rows per register block: 8 x 2 accumulators of 16 floats
constexpr int64_t kChunkRows = 64;  // rows per task
template <int R>
inline void Block(const float* __restrict x, const float* __restrict panel, float* __restrict y, int64_t K,
                  int64_t N) {
  f16v lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = f16v{};
  for (int64_t k = 0; k < K; ++k) {
    const f16v w0 = *reinterpret_cast<const f16v*>(panel + k * kPanel);
    const f16v w1 = *reinterpret_cast<const f16v*>(panel + k * kPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      lo[r] += xv * w0;
      hi[r] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    *reinterpret_cast<f16v*>(y + r * N) = lo[r];
    *reinterpret_cast<f16v*>(y + r * N + 16) = hi[r];
  }
}

struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, panels;
};

// A task is one panel times one chunk of rows; tasks run chunk-major, so a thread keeps its chunk of x
// in cache while the panels stream past (a prefill of thousands of rows would otherwise re-read all of
// x for every panel). A decode step is one chunk.
void Task(const Job& j, int64_t task) {
  const int64_t chunk = task / j.panels, p = task % j.panels;
  const float* panel = j.w + p * j.K * kPanel;
  float* y = j.y + p * kPanel;
  const int64_t end = std::min(j.M, (chunk + 1) * kChunkRows);
  int64_t m = chunk * kChunkRows;
  for (; m + kRows <= end; m += kRows) Block<kRows>(j.x + m * j.K, panel, y + m * j.N, j.K, j.N);
  for (; m < end; ++m) Block<1>(j.x + m * j.K, panel, y + m * j.N, j.K, j.N);
}

ffi::Error PackedDense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("packed_dense: x must be [M, K] and w [N / 32, K, 32]");
  Job j;
  j.x = x.typed_data();
  j.w = w.typed_data();
  j.y = y->typed_data();
  j.M = xd[0];
  j.K = xd[1];
  j.panels = wd[0];
  j.N = wd[0] * kPanel;
  ragen::ParallelFor(pool, j.panels * ((j.M + kChunkRows - 1) / kChunkRows), [j](int64_t task) { Task(j, task); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagenPackedDense, PackedDense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
