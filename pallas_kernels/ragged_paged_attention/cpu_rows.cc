// Ragged paged attention, one query row at a time, for the CPU: an XLA FFI custom call.
//
// Semantics are reference.py's (causal over each row's own context, optional sliding window
// and tanh soft cap, zero output on padding rows), restricted to the rows each sequence has
// past its first skip_rows[r]: the xla backend's tile pass computes those with XLA's GEMMs.
// Those rows, and every padding row, come out zero.
//
// Layout: q f32[T, N, H]; k_pages, v_pages f32[K, S, P, H]; kv_lens i32[R];
// block_tables i32[R, B]; cu_q_lens i32[R + 1]; num_seqs i32[1]; skip_rows i32[R].
//
// Work items are (sequence, run of rows, kv head); the caller and XLA's intra-op thread pool
// take them from a shared counter. One item walks the row run's pages once, and for each page
// updates every (row, query head of the group) it serves with an online softmax, so a K/V
// page is read from memory once per item and reused from L1 by the group's query heads.
// Every index read from the arrays is clamped: bad lengths or block ids give wrong numbers
// for that row, never an out-of-bounds read.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMask = -1e30f;
// Query rows of one sequence per work item: a short prefill chunk's rows share its pages.
constexpr int64_t kRowsPerItem = 8;

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const int32_t* kv_lens;
  const int32_t* tables;
  float* out;
  int64_t num_q_heads, head_dim, num_kv_heads, num_pages, page_size, width;
  float scale;
  int32_t window;  // 0: none
  float cap;       // 0: none
};

struct Item {
  int64_t seq, row_begin, row_end, first_pos, kv_head;
};

inline float Dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One item: rows [row_begin, row_end) of one sequence (positions first_pos + i), one kv head,
// its `group` query heads. Scratch holds m, l, acc and the page's scores.
void RunItem(const Problem& p, const Item& it, std::vector<float>& scratch) {
  const int64_t H = p.head_dim, P = p.page_size;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = it.row_end - it.row_begin;
  const int64_t nq = rows * group;
  scratch.resize(nq * (H + 2) + P);
  float* m = scratch.data();
  float* l = m + nq;
  float* acc = l + nq;
  float* s = acc + nq * H;
  std::fill(m, m + nq, kMask);
  std::fill(l, l + nq, 0.f);
  std::fill(acc, acc + nq * H, 0.f);

  const int64_t last_pos = std::min(it.first_pos + rows - 1, p.width - 1);
  int64_t lo = 0;
  if (p.window > 0) lo = std::max<int64_t>(0, it.first_pos - p.window + 1);
  const int32_t* table = p.tables + it.seq * (p.width / P);
  const float* q_base = p.q + it.row_begin * p.num_q_heads * H + it.kv_head * group * H;

  for (int64_t page = lo / P; page * P <= last_pos; ++page) {
    const int64_t id = std::clamp<int64_t>(table[page], 0, p.num_pages - 1);
    const int64_t offset = ((it.kv_head * p.num_pages) + id) * P * H;
    const float* kp = p.k + offset;
    const float* vp = p.v + offset;
    const int64_t c0 = page * P;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = std::min(it.first_pos + r, p.width - 1);
      if (it.first_pos + r < 0) continue;
      const int64_t begin = std::max<int64_t>(c0, p.window > 0 ? pos - p.window + 1 : 0) - c0;
      const int64_t end = std::min<int64_t>(c0 + P - 1, pos) - c0 + 1;  // exclusive
      if (begin >= end) continue;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t j = r * group + g;
        const float* qv = q_base + (r * p.num_q_heads + g) * H;
        float mx = kMask;
        for (int64_t c = begin; c < end; ++c) {
          float x = Dot(qv, kp + c * H, H) * p.scale;
          if (p.cap > 0.f) x = p.cap * std::tanh(x / p.cap);
          s[c] = x;
          mx = std::max(mx, x);
        }
        const float m_new = std::max(m[j], mx);
        float* a = acc + j * H;
        if (m_new > m[j]) {
          const float alpha = std::exp(m[j] - m_new);
          l[j] *= alpha;
          for (int64_t h = 0; h < H; ++h) a[h] *= alpha;
          m[j] = m_new;
        }
        for (int64_t c = begin; c < end; ++c) s[c] -= m_new;
        jaxserve::ExpNonPositive(s + begin, end - begin);
        float sum = 0.f;
        for (int64_t c = begin; c < end; ++c) {
          const float e = s[c];
          sum += e;
          const float* vr = vp + c * H;
          for (int64_t h = 0; h < H; ++h) a[h] += e * vr[h];
        }
        l[j] += sum;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = p.out + (it.row_begin + r) * p.num_q_heads * H + it.kv_head * group * H;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = r * group + g;
      const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
      for (int64_t h = 0; h < H; ++h) o[g * H + h] = acc[j * H + h] * inv;
    }
  }
}

ffi::Error CpuRowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> kv_lens,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> cu_q_lens,
                       ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> skip_rows,
                       ffi::ResultBuffer<ffi::F32> out, float sm_scale, int32_t sliding_window,
                       float soft_cap) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto td = tables.dimensions();
  auto vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 ||
      !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end())) {
    return ffi::Error::InvalidArgument("cpu_rows: bad ranks or mismatched k/v pages");
  }
  const int64_t T = qd[0], N = qd[1], H = qd[2];
  const int64_t K = kd[0], S = kd[1], P = kd[2], R = td[0], B = td[1];
  if (kd[3] != H || K < 1 || N % K != 0 || cu_q_lens.element_count() != R + 1 ||
      kv_lens.element_count() != R || skip_rows.element_count() != R) {
    return ffi::Error::InvalidArgument("cpu_rows: inconsistent shapes");
  }
  const Problem problem{q.typed_data(), k.typed_data(), v.typed_data(), kv_lens.typed_data(),
                        tables.typed_data(), out->typed_data(), N, H, K, S, P, B * P,
                        sm_scale, sliding_window, soft_cap};
  std::vector<Item> items;
  std::memset(out->typed_data(), 0, sizeof(float) * T * N * H);

  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* lens = kv_lens.typed_data();
  const int32_t* skip = skip_rows.typed_data();
  const int64_t seqs = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, R);
  for (int64_t r = 0; r < seqs; ++r) {
    const int64_t begin = std::clamp<int64_t>(cu[r], 0, T);
    const int64_t end = std::clamp<int64_t>(cu[r + 1], begin, T);
    const int64_t first_pos = static_cast<int64_t>(lens[r]) - (end - begin);
    for (int64_t row = begin + std::clamp<int64_t>(skip[r], 0, end - begin); row < end;
         row += kRowsPerItem) {
      const int64_t row_end = std::min(row + kRowsPerItem, end);
      for (int64_t h = 0; h < K; ++h) {
        items.push_back(Item{r, row, row_end, first_pos + (row - begin), h});
      }
    }
  }
  // Longest items first, so the last ones to finish are short.
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.first_pos + (a.row_end - a.row_begin) > b.first_pos + (b.row_end - b.row_begin);
  });
  jaxserve::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    thread_local std::vector<float> scratch;
    RunItem(problem, items[i], scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionCpuRows, CpuRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // skip_rows
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
