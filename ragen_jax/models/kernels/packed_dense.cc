// y = x @ W for a few rows of x (a decode step) with W in panels: the CPU matmul of the decode loop.
//
// A decode step multiplies a handful of rows by every weight of the model, each read from memory once.
// XLA's CPU matmul repacks a weight on every call, which on such shapes halves its speed; here the
// weights are repacked once per `generate` call (models/cpu_kernels.py: pack_panels) into panels of 32
// columns that lie contiguous along K, and each panel is streamed once for all rows.
//
// Operands: x f32 [M, K]; w f32 [N / 32, K, 32] (panel p holds columns 32p .. 32p + 31). Result: f32 [M, N].
// RagenPackedDenseBf16 takes w as bfloat16 bits (u16, same layout): half the bytes a decode step streams.
// Each weight widens exactly to f32 (its bits shifted up); with x already rounded to bfloat16 by the
// caller every product is exact in f32, so the result is a bfloat16 matmul accumulated in float32.
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
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Row k of a panel as two vectors of 16 floats.
inline void Load(const float* row, f16v& w0, f16v& w1) {
  w0 = *reinterpret_cast<const f16v*>(row);
  w1 = *reinterpret_cast<const f16v*>(row + 16);
}
inline void Load(const uint16_t* row, f16v& w0, f16v& w1) {
  const u32x16 a = __builtin_convertvector(*reinterpret_cast<const u16x16*>(row), u32x16) << 16;
  const u32x16 b = __builtin_convertvector(*reinterpret_cast<const u16x16*>(row + 16), u32x16) << 16;
  w0 = reinterpret_cast<const f16v&>(a);
  w1 = reinterpret_cast<const f16v&>(b);
}

template <int R, typename W>
inline void Block(const float* __restrict x, const W* __restrict panel, float* __restrict y, int64_t K,
                  int64_t N) {
  f16v lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = f16v{};
  for (int64_t k = 0; k < K; ++k) {
    f16v w0, w1;
    Load(panel + k * kPanel, w0, w1);
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

template <typename W>
struct Job {
  const float* x;
  const W* w;
  float* y;
  int64_t M, K, N, panels;
};

// A task is one panel times one chunk of rows; tasks run chunk-major, so a thread keeps its chunk of x
// in cache while the panels stream past (a prefill of thousands of rows would otherwise re-read all of
// x for every panel). A decode step is one chunk.
template <typename W>
void Task(const Job<W>& j, int64_t task) {
  const int64_t chunk = task / j.panels, p = task % j.panels;
  const W* panel = j.w + p * j.K * kPanel;
  float* y = j.y + p * kPanel;
  const int64_t end = std::min(j.M, (chunk + 1) * kChunkRows);
  int64_t m = chunk * kChunkRows;
  for (; m + kRows <= end; m += kRows) Block<kRows>(j.x + m * j.K, panel, y + m * j.N, j.K, j.N);
  for (; m < end; ++m) Block<1>(j.x + m * j.K, panel, y + m * j.N, j.K, j.N);
}

template <ffi::DataType T, typename W>
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || wd[1] != xd[1])
    return ffi::Error::InvalidArgument("packed_dense: x must be [M, K] and w [N / 32, K, 32]");
  Job<W> j;
  j.x = x.typed_data();
  j.w = reinterpret_cast<const W*>(w.typed_data());
  j.y = y->typed_data();
  j.M = xd[0];
  j.K = xd[1];
  j.panels = wd[0];
  j.N = wd[0] * kPanel;
  ragen::ParallelFor(pool, j.panels * ((j.M + kChunkRows - 1) / kChunkRows), [j](int64_t task) { Task(j, task); });
  return ffi::Error::Success();
}

ffi::Error PackedDense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  return Run<ffi::F32, float>(pool, x, w, y);
}

ffi::Error PackedDenseBf16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  return Run<ffi::U16, uint16_t>(pool, x, w, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagenPackedDense, PackedDense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagenPackedDenseBf16, PackedDenseBf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
