// Shared by this project's C++ CPU kernels (XLA FFI custom calls built by cpu_ffi.py):
// a vectorisable exp and a parallel loop over XLA's intra-op thread pool.
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

namespace jaxserve {

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
