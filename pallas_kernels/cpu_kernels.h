// Shared by this project's C++ CPU kernels (XLA FFI custom calls built by cpu_ffi.py): a
// 16-float vector type and its lane sums, a vectorisable exp and a parallel loop over XLA's
// intra-op thread pool.
#ifndef JAXSERVE_PALLAS_KERNELS_CPU_KERNELS_H_
#define JAXSERVE_PALLAS_KERNELS_CPU_KERNELS_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

#ifdef __has_builtin
#if __has_builtin(__builtin_shufflevector)
#define JAXSERVE_HAS_SHUFFLEVECTOR 1  // GCC >= 12, Clang
#endif
#endif
#ifndef JAXSERVE_HAS_SHUFFLEVECTOR
#define JAXSERVE_HAS_SHUFFLEVECTOR 0
#endif

namespace jaxserve {

// 16 floats: one AVX-512 register, two AVX2 ones (GCC / Clang vector extension).
typedef float Vec __attribute__((vector_size(64)));
constexpr int64_t kLanes = sizeof(Vec) / sizeof(float);

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

inline float HSum(Vec v) {
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// out[i] = HSum(d[i]) for i < 8. With __builtin_shufflevector the eight reductions share
// their shuffles (halves added pairwise, level by level: two shuffles per vector instead of
// four, and one 8-float store).
inline void HSum8(const Vec* d, float* out) {
#if JAXSERVE_HAS_SHUFFLEVECTOR
#define JAXSERVE_HALVES(a, b)                                                                  \
  (__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +      \
   __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define JAXSERVE_QUARTERS(a, b)                                                                \
  (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +    \
   __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
  // Eight partial sums of d[0] then of d[1] (and so on), then four of each of four.
  const Vec v01 = JAXSERVE_HALVES(d[0], d[1]), v23 = JAXSERVE_HALVES(d[2], d[3]);
  const Vec v45 = JAXSERVE_HALVES(d[4], d[5]), v67 = JAXSERVE_HALVES(d[6], d[7]);
  const Vec w0 = JAXSERVE_QUARTERS(v01, v23), w1 = JAXSERVE_QUARTERS(v45, v67);
#undef JAXSERVE_HALVES
#undef JAXSERVE_QUARTERS
  // Two of each of eight, then the eight sums.
  const Vec z =
      __builtin_shufflevector(w0, w1, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
      __builtin_shufflevector(w0, w1, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const Vec sums =
      __builtin_shufflevector(z, z, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
      __builtin_shufflevector(z, z, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
  std::memcpy(out, &sums, 8 * sizeof(float));
#else
  for (int64_t i = 0; i < 8; ++i) out[i] = HSum(d[i]);
#endif
}

// x[i] = exp(x[i]) for x[i] <= 0, in a loop the compiler vectorises (std::exp is a scalar
// libm call). Range reduction x = k ln2 + r, |r| <= ln2 / 2, then a degree-6 Taylor polynomial
// (relative error < 2e-7) scaled by 2^k through the exponent bits; below -87 (exp < 2^-125),
// -inf included, the result is 0.
inline void ExpNonPositive(float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.f);
    const float k = std::floor(v * 1.44269504f + 0.5f);
    const float r = (v - k * 0.693145751953125f) - k * 1.428606765330187e-6f;
    const float p =
        1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r / 720)))));
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = x[i] < -87.f ? 0.f : p * scale;
  }
}

// Runs fn(i) for every i in [0, n) on the calling thread and up to pool.num_threads() helpers
// of XLA's intra-op pool (without them a kernel runs at half speed on 2 cores), handing items
// out from a shared counter; returns when all n are done. Helpers hold the counter state by
// shared_ptr: one that starts after the return finds no item left and calls nothing.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const Fn& fn) {
  if (n <= 0) return;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  const Fn* body = &fn;  // only dereferenced for an item taken before all n are done
  auto drain = [state, body, n] {
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) {
      (*body)(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain] { drain(); });
  drain();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace jaxserve

#endif  // JAXSERVE_PALLAS_KERNELS_CPU_KERNELS_H_
