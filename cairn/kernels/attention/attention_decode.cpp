// Paged attention for decode on CPU: one new token per sequence over its cached pages.
//
// Each (sequence, KV head) is one work item: its GQA group of query heads walks the sequence's
// pages once, K and V read in the cache's dtype straight from the pages (no gather), so the K/V
// of a group are read once, not once per query head. Tokens go in blocks of 16 within a page:
// the block's K transposed, so its 16 scores are one vector FMA per channel, then an online
// softmax over blocks in fp32 (m: running max, l: running sum, acc rescaled by exp(m - m_new)).
//
// Op (shapes and conventions are kernels.reference's):
//   attention_decode(query [B, H_q, D], k_cache, v_cache [num_pages, page_size, H_kv, D],
//                    page_table [B, max_pages] int32, seq_lens [B] int32, scale) -> [B, H_q, D]
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "native.h"

namespace cairn {
namespace {

constexpr int kMaxHeadDim = 512;
constexpr int kMaxGroup = 64;
constexpr int64_t kBlock = 16;  // tokens scored at once: one vector of scores per query head

template <typename Q, typename KV>
void decode_typed(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& page_table, const at::Tensor& seq_lens, float scale, at::Tensor& out) {
  const int64_t batch = query.size(0), h_q = query.size(1), d = query.size(2);
  const int64_t page_size = k_cache.size(1), h_kv = k_cache.size(2), group = h_q / h_kv;
  const Q* q = query.data_ptr<Q>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1), ts0 = page_table.stride(0);
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max<int64_t>(longest, lens[b]);
  Q* o = out.data_ptr<Q>();
  parallel_items(batch * h_kv, 4 * group * d * std::max<int64_t>(longest, 1), [&](int64_t first, int64_t last) {
    // per block: K transposed [d][kBlock] (scores are then one FMA per channel), V [kBlock][d]
    std::vector<float> qf(group * d), acc(group * d), kt(d * kBlock), vf(kBlock * d), row(d);
    alignas(64) float s[kBlock];
    float m[kMaxGroup], l[kMaxGroup];
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / h_kv, h = item % h_kv;
      for (int64_t g = 0; g < group; ++g) {
        load_row(q + b * qs0 + (h * group + g) * qs1, qf.data() + g * d, d);
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] *= scale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t len = lens[b];
      for (int64_t start = 0; start < len;) {
        // a block: tokens of one page, at most kBlock
        const int64_t page = table[b * ts0 + start / page_size], off = start % page_size;
        const int64_t n = std::min({kBlock, page_size - off, len - start});
        for (int64_t t = 0; t < n; ++t) {
          load_row(kc + page * ks0 + (off + t) * ks1 + h * ks2, row.data(), d);
          for (int64_t i = 0; i < d; ++i) kt[i * kBlock + t] = row[i];
          load_row(vc + page * vs0 + (off + t) * vs1 + h * vs2, vf.data() + t * d, d);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * d;
#pragma omp simd
          for (int64_t t = 0; t < kBlock; ++t) s[t] = 0.f;
          for (int64_t i = 0; i < d; ++i) {
            const float qi = qg[i];
            const float* ki = kt.data() + i * kBlock;
#pragma omp simd
            for (int64_t t = 0; t < kBlock; ++t) s[t] += qi * ki[t];
          }
          float top = m[g];
          for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
          const float c = exp_approx(m[g] - top);  // rescales what was summed (0 before the first block)
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            s[t] = exp_approx(s[t] - top);
            sum += s[t];
          }
          l[g] = l[g] * c + sum;
          m[g] = top;
          float* ag = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ag[i] *= c;
          for (int64_t t = 0; t < n; ++t) {
            const float p = s[t];
            const float* vt = vf.data() + t * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] += p * vt[i];
          }
        }
        start += n;
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t i = 0; i < d; ++i) acc[g * d + i] *= inv;
        store_row(acc.data() + g * d, o + (b * h_q + h * group + g) * d, d);
      }
    }
  });
}

at::Tensor attention_decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected query [B, H_q, D] and caches [num_pages, page_size, H_kv, D]");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(2) <= kMaxHeadDim, "expected head dims to agree");
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0 && query.size(1) / k_cache.size(2) <= kMaxGroup,
              "expected H_q a multiple of H_kv");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "expected D contiguous in the caches");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "expected int32 page_table and seq_lens");
  const at::Tensor q = query.stride(2) == 1 ? query : query.contiguous();
  const at::Tensor table = page_table.stride(1) == 1 ? page_table : page_table.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "attention_decode", [&] {
    using Q = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "attention_decode_kv", [&] {
      decode_typed<Q, scalar_t>(q, k_cache, v_cache, table, lens, static_cast<float>(scale), out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cairn_cpu, m) {
  m.def("attention_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(cairn_cpu, CPU, m) {
  m.impl("attention_decode", &attention_decode);
}

}  // namespace cairn
