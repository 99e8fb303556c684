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
// take them from a shared counter. One item walks the row run's pages once (prefetching the
// next page while it computes on this one), and for each page updates every (row, query head
// of the group) it serves with an online softmax, so a K/V page is read from memory once per
// item and reused from L1 by the group's query heads. Head dims that are a multiple of 16 (up
// to 256) take the vector path: up to four query heads at a time, their query vectors and
// accumulators in registers across the page, each K / V row loaded once for all of them.
// Other head dims take the same walk with plain loops.
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

using jaxserve::HSum;
using jaxserve::HSum8;
using jaxserve::kLanes;
using jaxserve::Load;
using jaxserve::Store;
using jaxserve::Vec;

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

// Where the row kernel streams the next page from (nullptr: no next page).
struct NextPage {
  const float* k;
  const float* v;
};

// Positions [begin, end) of one page for kHeads query heads of one row: their scores, then the
// online-softmax update of m, l (kHeads each) and acc (kHeads x H). kNv > 0: head dim
// kNv * 16 in vector registers; kNv == 0: head dim p.head_dim, plain loops. Scores are kept
// position-major, s[c * kHeads + g]; with four heads two positions are reduced together.
template <int64_t kNv, int64_t kHeads>
void UpdateHeads(const Problem& p, const float* q, const float* kp, const float* vp,
                 int64_t begin, int64_t end, NextPage next, float* m, float* l, float* acc,
                 float* s) {
  const int64_t H = kNv > 0 ? kNv * kLanes : p.head_dim;
  auto prefetch = [&](int64_t c) {
    if (next.k == nullptr) return;
    for (int64_t i = 0; i < H; i += 16) {
      __builtin_prefetch(next.k + c * H + i, 0, 3);
      __builtin_prefetch(next.v + c * H + i, 0, 3);
    }
  };

  // Scores.
  if constexpr (kNv > 0) {
    Vec qr[kHeads][kNv];
    for (int64_t g = 0; g < kHeads; ++g)
      for (int64_t i = 0; i < kNv; ++i) qr[g][i] = Load(q + g * H + i * kLanes) * p.scale;
    int64_t c = begin;
    if constexpr (kHeads == 4) {
      for (; c + 1 < end; c += 2) {
        prefetch(c);
        prefetch(c + 1);
        const float* kr = kp + c * H;
        Vec d[8];  // position c: d[0..3], c + 1: d[4..7]
        for (int64_t g = 0; g < 4; ++g) {
          d[g] = qr[g][0] * Load(kr);
          d[4 + g] = qr[g][0] * Load(kr + H);
        }
        for (int64_t i = 1; i < kNv; ++i) {
          const Vec k0 = Load(kr + i * kLanes), k1 = Load(kr + H + i * kLanes);
          for (int64_t g = 0; g < 4; ++g) {
            d[g] += qr[g][i] * k0;
            d[4 + g] += qr[g][i] * k1;
          }
        }
        HSum8(d, s + c * 4);
      }
    }
    for (; c < end; ++c) {
      prefetch(c);
      const float* kr = kp + c * H;
      for (int64_t g = 0; g < kHeads; ++g) {
        Vec d = qr[g][0] * Load(kr);
        for (int64_t i = 1; i < kNv; ++i) d += qr[g][i] * Load(kr + i * kLanes);
        s[c * kHeads + g] = HSum(d);
      }
    }
  } else {
    for (int64_t c = begin; c < end; ++c) {
      prefetch(c);
      for (int64_t g = 0; g < kHeads; ++g) {
        float x = 0.f;
        for (int64_t h = 0; h < H; ++h) x += q[g * H + h] * kp[c * H + h];
        s[c * kHeads + g] = x * p.scale;
      }
    }
  }

  // Online softmax over the page's scores.
  float* sb = s + begin * kHeads;
  const int64_t n = (end - begin) * kHeads;
  if (p.cap > 0.f)
    for (int64_t i = 0; i < n; ++i) sb[i] = p.cap * std::tanh(sb[i] / p.cap);
  float mx[kHeads], rescale[kHeads], sum[kHeads];
  for (int64_t g = 0; g < kHeads; ++g) mx[g] = kMask;
  for (int64_t i = 0; i < n; i += kHeads)
    for (int64_t g = 0; g < kHeads; ++g) mx[g] = std::max(mx[g], sb[i + g]);
  for (int64_t g = 0; g < kHeads; ++g) {
    const float m_new = std::max(m[g], mx[g]);
    rescale[g] = m_new > m[g] ? std::exp(m[g] - m_new) : 1.f;
    m[g] = m_new;
    sum[g] = 0.f;
  }
  for (int64_t i = 0; i < n; i += kHeads)
    for (int64_t g = 0; g < kHeads; ++g) sb[i + g] -= m[g];
  jaxserve::ExpNonPositive(sb, n);
  for (int64_t i = 0; i < n; i += kHeads)
    for (int64_t g = 0; g < kHeads; ++g) sum[g] += sb[i + g];
  for (int64_t g = 0; g < kHeads; ++g) l[g] = l[g] * rescale[g] + sum[g];

  // acc = acc * rescale + probabilities x V.
  if constexpr (kNv > 0) {
    Vec a[kHeads][kNv];
    for (int64_t g = 0; g < kHeads; ++g)
      for (int64_t i = 0; i < kNv; ++i) a[g][i] = Load(acc + g * H + i * kLanes) * rescale[g];
    for (int64_t c = begin; c < end; ++c) {
      const float* vr = vp + c * H;
      for (int64_t i = 0; i < kNv; ++i) {
        const Vec v = Load(vr + i * kLanes);
        for (int64_t g = 0; g < kHeads; ++g) a[g][i] += s[c * kHeads + g] * v;
      }
    }
    for (int64_t g = 0; g < kHeads; ++g)
      for (int64_t i = 0; i < kNv; ++i) Store(acc + g * H + i * kLanes, a[g][i]);
  } else {
    for (int64_t g = 0; g < kHeads; ++g) {
      float* a = acc + g * H;
      for (int64_t h = 0; h < H; ++h) a[h] *= rescale[g];
      for (int64_t c = begin; c < end; ++c) {
        const float e = s[c * kHeads + g];
        const float* vr = vp + c * H;
        for (int64_t h = 0; h < H; ++h) a[h] += e * vr[h];
      }
    }
  }
}

// One item: rows [row_begin, row_end) of one sequence (positions first_pos + i), one kv head,
// its `group` query heads, in blocks of kBlock heads. Scratch holds m, l, acc and the page's
// scores.
template <int64_t kNv>
void RunItem(const Problem& p, const Item& it, std::vector<float>& scratch) {
  // Four heads' queries and accumulators fit the registers up to head dim 64.
  constexpr int64_t kBlock = kNv == 0 ? 1 : kNv <= 4 ? 4 : 2;
  const int64_t H = kNv > 0 ? kNv * kLanes : p.head_dim;
  const int64_t P = p.page_size;
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  const int64_t rows = it.row_end - it.row_begin;
  const int64_t nq = rows * group;
  scratch.resize(nq * (H + 2) + kBlock * P);
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
  auto page_offset = [&](int64_t page) {
    const int64_t id = std::clamp<int64_t>(table[page], 0, p.num_pages - 1);
    return ((it.kv_head * p.num_pages) + id) * P * H;
  };

  for (int64_t page = lo / P; page * P <= last_pos; ++page) {
    const int64_t offset = page_offset(page);
    const float* kp = p.k + offset;
    const float* vp = p.v + offset;
    NextPage next{nullptr, nullptr};  // prefetched by the page's first update
    if ((page + 1) * P <= last_pos) {
      const int64_t next_offset = page_offset(page + 1);
      next = NextPage{p.k + next_offset, p.v + next_offset};
    }
    const int64_t c0 = page * P;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = std::min(it.first_pos + r, p.width - 1);
      if (it.first_pos + r < 0) continue;
      const int64_t begin = std::max<int64_t>(c0, p.window > 0 ? pos - p.window + 1 : 0) - c0;
      const int64_t end = std::min<int64_t>(c0 + P - 1, pos) - c0 + 1;  // exclusive
      if (begin >= end) continue;
      const float* q_row = q_base + r * p.num_q_heads * H;
      for (int64_t g = 0; g < group;) {
        const int64_t j = r * group + g;
        if (g + kBlock <= group) {
          UpdateHeads<kNv, kBlock>(p, q_row + g * H, kp, vp, begin, end, next, m + j, l + j,
                                   acc + j * H, s);
          g += kBlock;
        } else {
          UpdateHeads<kNv, 1>(p, q_row + g * H, kp, vp, begin, end, next, m + j, l + j,
                              acc + j * H, s);
          g += 1;
        }
        next = NextPage{nullptr, nullptr};
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

void Run(const Problem& p, const Item& it, std::vector<float>& scratch) {
  switch (p.head_dim) {
    case 16: return RunItem<1>(p, it, scratch);
    case 32: return RunItem<2>(p, it, scratch);
    case 64: return RunItem<4>(p, it, scratch);
    case 128: return RunItem<8>(p, it, scratch);
    case 256: return RunItem<16>(p, it, scratch);
    default: return RunItem<0>(p, it, scratch);
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
    Run(problem, items[i], scratch);
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
