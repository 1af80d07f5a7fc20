// Attention of new queries over one layer of the stacked KV cache, read in place (XLA FFI, CPU).
//
// XLA's CPU backend copies every cache block out of the stacked [L, B, K, S, Hd] buffer before the
// two small batched matmuls of attention, and runs each of the ~10 operations per block as its own
// kernel. This handler reads each (row, kv head)'s filled slots straight from the buffer, once for all
// of the kv head's query heads and queries, and does the softmax in between: one call per layer.
//
// Operands (shapes as in models/kv_cache.py):
//   q          f32 [B, T, H, Hd]      H = K * G; query head h = k * G + g (GQA grouping)
//   cache_k/v  f32 or u16 [L, B, K, S, Hd]   u16 = a bfloat16 cache held as its bits (kv_cache.as_bits)
//   layer      s32 []
//   positions  s32 [B, T]            query [b, t] sees slots 0 .. positions[b, t] (clipped to S - 1)
// Result:
//   out        f32 [B, T, H, Hd]      a query that sees no slot (a negative position) gets zeros
//
// Work is split over the B * K (row, kv head) pairs on XLA's intra-op thread pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using ragen::f16v;

namespace {

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  bool bits;  // cache held as bfloat16 bits
  const int32_t* positions;
  float* out;
  int64_t B, T, H, Hd, K, S, layer;
};

// One (row, kv head): scores for its G * T queries over the visible slots, softmax, weighted values.
void AttendPair(const Problem& p, int64_t pair, std::vector<float>& scores, std::vector<float>& row) {
  const int64_t b = pair / p.K, k = pair % p.K, G = p.H / p.K, T = p.T, Hd = p.Hd;
  const int64_t base = (((p.layer * p.B + b) * p.K + k) * p.S) * Hd;
  int64_t last = -1;  // furthest visible slot over this row's queries
  for (int64_t t = 0; t < T; ++t) last = std::max<int64_t>(last, std::min<int64_t>(p.positions[b * T + t], p.S - 1));
  const int64_t n = last + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(Hd));
  if (n > 0) {
    scores.resize(static_cast<size_t>(G * T * n));
    row.resize(static_cast<size_t>(Hd));
  }
  auto slot_row = [&](const void* cache, int64_t s) -> const float* {
    if (!p.bits) return static_cast<const float*>(cache) + base + s * Hd;
    const uint16_t* src = static_cast<const uint16_t*>(cache) + base + s * Hd;
    for (int64_t d = 0; d < Hd; ++d) row[d] = Bf16ToFloat(src[d]);
    return row.data();
  };
  // Scores: each key row is read once and dotted with every query of this kv head (16 lanes at a time
  // when the head dim allows, one horizontal sum per score).
  for (int64_t s = 0; s < n; ++s) {
    const float* key = slot_row(p.k, s);
    for (int64_t t = 0; t < T; ++t) {
      const float* qt = p.q + ((b * T + t) * p.H + k * G) * Hd;
      for (int64_t g = 0; g < G; ++g) {
        const float* qv = qt + g * Hd;
        float dot = 0.0f;
        if (Hd % 16 == 0) {
          f16v acc = f16v{};
          for (int64_t d = 0; d < Hd; d += 16)
            acc += *reinterpret_cast<const f16v*>(qv + d) * *reinterpret_cast<const f16v*>(key + d);
          for (int i = 0; i < 16; ++i) dot += acc[i];
        } else {
          for (int64_t d = 0; d < Hd; ++d) dot += qv[d] * key[d];
        }
        scores[(g * T + t) * n + s] = dot * scale;
      }
    }
  }
  // Softmax over each query's visible slots 0 .. limit - 1, normalised in place.
  for (int64_t t = 0; t < T; ++t) {
    const int64_t limit = std::min<int64_t>(p.positions[b * T + t], p.S - 1) + 1;
    for (int64_t g = 0; g < G; ++g) {
      float* out = p.out + ((b * T + t) * p.H + k * G + g) * Hd;
      std::fill(out, out + Hd, 0.0f);
      if (limit <= 0) continue;
      float* sc = scores.data() + (g * T + t) * n;
      float m = sc[0];
      for (int64_t s = 1; s < limit; ++s) m = std::max(m, sc[s]);
      float sum = 0.0f;
      for (int64_t s = 0; s < limit; ++s) {
        sc[s] = std::exp(sc[s] - m);
        sum += sc[s];
      }
      const float inv = 1.0f / sum;
      for (int64_t s = 0; s < limit; ++s) sc[s] *= inv;
    }
  }
  // Weighted values: each value row is read once and added into every query that sees its slot.
  for (int64_t s = 0; s < n; ++s) {
    const float* value = slot_row(p.v, s);
    for (int64_t t = 0; t < T; ++t) {
      if (s > std::min<int64_t>(p.positions[b * T + t], p.S - 1)) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[(g * T + t) * n + s];
        float* out = p.out + ((b * T + t) * p.H + k * G + g) * Hd;
        if (Hd % 16 == 0) {
          for (int64_t d = 0; d < Hd; d += 16)
            *reinterpret_cast<f16v*>(out + d) += w * *reinterpret_cast<const f16v*>(value + d);
        } else {
          for (int64_t d = 0; d < Hd; ++d) out[d] += w * value[d];
        }
      }
    }
  }
}

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer cache_k,
                          ffi::AnyBuffer cache_v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                          ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto cd = cache_k.dimensions();
  if (qd.size() != 4 || cd.size() != 5 || positions.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("cache_attention: q must be [B, T, H, Hd], the cache [L, B, K, S, Hd], "
                                       "positions [B, T]");
  const bool bits = cache_k.element_type() == ffi::U16;
  if (!bits && cache_k.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("cache_attention: the cache must be float32 or bfloat16 bits (uint16)");
  if (cache_v.element_type() != cache_k.element_type())
    return ffi::Error::InvalidArgument("cache_attention: keys and values must share a dtype");
  Problem p;
  p.B = qd[0]; p.T = qd[1]; p.H = qd[2]; p.Hd = qd[3];
  p.K = cd[2]; p.S = cd[3];
  if (cd[1] != p.B || cd[4] != p.Hd || p.H % p.K != 0)
    return ffi::Error::InvalidArgument("cache_attention: q and the cache disagree on batch, head_dim or kv heads");
  p.layer = layer.typed_data()[0];
  if (p.layer < 0 || p.layer >= cd[0]) return ffi::Error::InvalidArgument("cache_attention: layer out of range");
  p.q = q.typed_data();
  p.k = cache_k.untyped_data();
  p.v = cache_v.untyped_data();
  p.bits = bits;
  p.positions = positions.typed_data();
  p.out = out->typed_data();
  ragen::ParallelFor(pool, p.B * p.K, [p](int64_t pair) {
    thread_local std::vector<float> scores, row;  // scratch, kept per thread across calls
    AttendPair(p, pair, scores, row);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RagenCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
