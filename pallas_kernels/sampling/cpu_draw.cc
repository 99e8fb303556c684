// The sampler's draw for the CPU: an XLA FFI custom call.
//
// One token per row from softmax(x * inv_t) restricted to the tokens with
// x >= max(row_max + floor_offset, threshold), by inverting its CDF at the row's uniform:
// the same two-level draw as sampler.py's _inverse_cdf_draw (chunk masses, then a token in the
// chunk; the first cumulative mass above the target, clamped to the last positive entry, so a
// masked token is never drawn). XLA:CPU makes that several passes over the [R, V] logits (max,
// exp, chunk sums, cumulative sums); here a row is read once from memory for its max and once
// more, from cache, for the exp and the chunk masses.
//
// Layout: x f32[R, V]; uniform, inv_t, floor_offset, threshold f32[R]; out i32[R].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kChunk = 256;  // sampler.py's _DRAW_CHUNK

// p[i] = exp((x[i] - max) * inv_t) where x[i] >= floor, else 0; returns their sum.
inline float ChunkProbs(const float* __restrict x, int64_t n, float max, float inv_t,
                        float floor, float* __restrict p) {
  for (int64_t i = 0; i < n; ++i) p[i] = (x[i] - max) * inv_t;
  jaxserve::ExpNonPositive(p, n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    p[i] = x[i] >= floor ? p[i] : 0.f;
    sum += p[i];
  }
  return sum;
}

// Row maximum over 16-float vectors (GCC / Clang vector extension; a running std::max is one
// scalar dependency chain, which the compiler does not vectorise). NaNs are skipped.
inline float RowMax(const float* __restrict x, int64_t n) {
  using jaxserve::kLanes;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  jaxserve::Vec m;
  for (int64_t l = 0; l < kLanes; ++l) m[l] = -kInf;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const jaxserve::Vec v = jaxserve::Load(x + i);
    m = v > m ? v : m;
  }
  float best = -kInf;
  for (int64_t l = 0; l < kLanes; ++l) best = m[l] > best ? m[l] : best;
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

// cum[i] = p[0] + ... + p[i], summed in order (the last is the total); returns the first i
// with cum[i] > target, clamped to the last positive p (a masked entry is never picked).
inline int64_t FirstAbove(const float* p, int64_t n, float target, float* cum) {
  float sum = 0.f;
  int64_t first = n, last_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum += p[i];
    cum[i] = sum;
    if (first == n && sum > target) first = i;
    if (p[i] > 0.f) last_positive = i;
  }
  return std::min(first, last_positive);
}

int32_t DrawRow(const float* __restrict x, int64_t V, float u, float inv_t, float offset,
                float threshold, std::vector<float>& scratch) {
  const float max = RowMax(x, V);
  const float floor = std::max(max + offset, threshold);
  const int64_t num_chunks = (V + kChunk - 1) / kChunk;
  scratch.resize(2 * num_chunks + 2 * kChunk);
  float* mass = scratch.data();
  float* cum = mass + num_chunks;
  float* p = cum + num_chunks;
  float* inner_cum = p + kChunk;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk;
    mass[c] = ChunkProbs(x + begin, std::min(kChunk, V - begin), max, inv_t, floor, p);
  }
  // The total is known only after the sums: a first scan with target = +inf fills cum.
  FirstAbove(mass, num_chunks, std::numeric_limits<float>::infinity(), cum);
  const float target = u * cum[num_chunks - 1];
  const int64_t chunk = FirstAbove(mass, num_chunks, target, cum);
  const float before = chunk > 0 ? cum[chunk - 1] : 0.f;
  const int64_t begin = chunk * kChunk;
  const int64_t n = std::min(kChunk, V - begin);
  ChunkProbs(x + begin, n, max, inv_t, floor, p);
  return static_cast<int32_t>(begin + FirstAbove(p, n, target - before, inner_cum));
}

ffi::Error CpuDrawImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                       ffi::Buffer<ffi::F32> uniform, ffi::Buffer<ffi::F32> inv_t,
                       ffi::Buffer<ffi::F32> floor_offset, ffi::Buffer<ffi::F32> threshold,
                       ffi::ResultBuffer<ffi::S32> out) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] < 1) {
    return ffi::Error::InvalidArgument("cpu_draw: x must be [R, V] with V >= 1");
  }
  const int64_t R = xd[0], V = xd[1];
  if (uniform.element_count() != R || inv_t.element_count() != R ||
      floor_offset.element_count() != R || threshold.element_count() != R ||
      out->element_count() != R) {
    return ffi::Error::InvalidArgument("cpu_draw: every per-row argument must have R entries");
  }
  const float* xs = x.typed_data();
  const float* us = uniform.typed_data();
  const float* ts = inv_t.typed_data();
  const float* offs = floor_offset.typed_data();
  const float* thr = threshold.typed_data();
  int32_t* tokens = out->typed_data();
  jaxserve::ParallelFor(pool, R, [&](int64_t r) {
    thread_local std::vector<float> scratch;
    tokens[r] = DrawRow(xs + r * V, V, us[r], ts[r], offs[r], thr[r], scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSamplerCpuDraw, CpuDrawImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // uniform
                                  .Arg<ffi::Buffer<ffi::F32>>()  // inv_t
                                  .Arg<ffi::Buffer<ffi::F32>>()  // floor_offset
                                  .Arg<ffi::Buffer<ffi::F32>>()  // threshold
                                  .Ret<ffi::Buffer<ffi::S32>>());  // token ids
