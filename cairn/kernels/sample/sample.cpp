// Sampling's reads of the logits on CPU, a row per thread at a time.
//
// Op: argmax_rows(logits [N, V] fp32 or bf16) -> [N] int64: the index of the first maximum of
// each row, or -1 for a row whose maximum is not finite (a NaN anywhere, a +inf, or nothing but
// -inf), as torch.max's value then reads.
//
// Op: sample_rows(x [N, V] fp32, temperature [N] fp32, top_k [N] int64, top_p [N] fp32,
// min_p [N] fp32, u [N] fp32) -> [N] int64: one draw per row from the changed logits x, as
// `reference.sample_rows` (see it for the rules). Per row: one pass for the maximum, one for the
// weights exp((x - max) / T) into a scratch row that stays in cache, then min-p, top-k and top-p
// on that row, each a radix select over the weights' float bits (a histogram of the high 16
// bits, then of the low 16 inside the boundary bucket: no sort), and a scan for the draw.
// Top-k keeps exactly k (ties at the boundary by lowest index); with top-p as well, the k are
// sorted and the nucleus taken among them. A top-k up to 1,024 skips the weights' pass: a heap
// over the logits finds the k in one pass, and only they are weighed. A temperature whose max / T overflows is the argmax.
//
// Op: penalise_rows(x [N, V] fp32, at [M] int64, rows [M] int64, counts [R, V] int32,
// prompt [R, V] bool, values [M, 3] fp32) -> (): in place, row at[i] of x takes the penalties
// (repetition, frequency, presence) = values[i] from token-count row rows[i], as
// `torch_ops.penalise_rows`: one pass per row.
//
// Op: mask_rows(x [N, V] fp32, at [M] int64, words [M, W] int32) -> (): in place, row at[i] of x
// keeps the tokens whose bit is set in words[i] (bit j of word k: token 32 k + j) and the others
// become -inf, as `torch_ops.mask_rows`.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "native.h"

namespace cairn {
namespace {

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  vec16 best = vsplat(-std::numeric_limits<float>::infinity());
  typedef int32_t i32v __attribute__((vector_size(64)));
  i32v at = i32v{} - 1, lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  i32v nans = i32v{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vec16 x = vload_as_f32(row + j);
    nans |= x != x;
    const i32v take = x > best;
    best = take ? x : best;
    at = take ? lane + static_cast<int32_t>(j) : at;
  }
  bool nan = false;
  for (int i = 0; i < kLanes; ++i) nan |= nans[i] != 0;
  float top = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
  for (int i = 0; i < kLanes; ++i)
    if (at[i] >= 0 && (best[i] > top || (best[i] == top && at[i] < index))) top = best[i], index = at[i];
  for (; j < n; ++j) {
    const float x = to_f32(row[j]);
    nan |= x != x;
    if (x > top) top = x, index = j;
  }
  return nan || !(top < std::numeric_limits<float>::infinity()) || index < 0 ? -1 : index;
}

at::Tensor argmax_rows(const at::Tensor& logits_in) {
  TORCH_CHECK_VALUE(logits_in.dim() == 2, "expected logits [N, V], got ", logits_in.dim(), " dims");
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    parallel_items(rows, 2 * n, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) ids[r] = row_argmax(base + r * logits.stride(0), n);
    });
  });
  return out;
}

// The boundary of a radix select over non-negative weights w[0..n): the bits b such that the
// tokens kept are those with bits > b, plus (`ties` of them, in index order) those equal to b.
// By count (keep exactly `k`) or by mass (keep a token when the mass of strictly larger weights
// is below `target`: every tie of the boundary kept).
struct Boundary {
  uint32_t bits;
  int64_t ties;  // tokens with bits == `bits` to keep; -1: all of them
};

class RadixSelect {
 public:
  Boundary by_count(const float* w, int64_t n, int64_t k) { return select(w, n, static_cast<double>(k), true); }
  Boundary by_mass(const float* w, int64_t n, double target) { return select(w, n, target, false); }

 private:
  std::vector<double> mass_;
  std::vector<int64_t> count_;

  Boundary select(const float* w, int64_t n, double target, bool counting) {
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(w);
    // level 1: the high 16 bits (a non-negative float's bits order as its value)
    uint32_t high = 0;
    double above = 0;
    int64_t above_n = 0;
    if (!level(bits, n, target, counting, 16, 0, 0, &high, &above, &above_n)) return {0, -1};
    uint32_t low = 0;
    level(bits, n, target, counting, 0, 0xFFFF0000u, high << 16, &low, &above, &above_n);
    const uint32_t b = (high << 16) | low;
    return {b, counting ? static_cast<int64_t>(target) - above_n : -1};
  }

  // Histograms the tokens whose bits & mask == want by (bits >> shift) & 0xFFFF, and walks the
  // buckets from the top: the bucket where the kept set ends goes to *at; *above and *above_n
  // gain the mass and count of the buckets above it. False if every token is kept.
  bool level(const uint32_t* bits, int64_t n, double target, bool counting, int shift, uint32_t mask,
             uint32_t want, uint32_t* at, double* above, int64_t* above_n) {
    mass_.assign(65536, 0.0);
    count_.assign(65536, 0);
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t b = bits[j];
      if ((b & mask) != want) continue;
      const uint32_t key = (b >> shift) & 0xFFFFu;
      float v;
      std::memcpy(&v, &b, 4);
      mass_[key] += v;
      ++count_[key];
    }
    for (int64_t key = 65535; key >= 0; --key) {
      if (count_[key] == 0) continue;
      const bool ends = counting ? *above_n + count_[key] >= target : *above + mass_[key] >= target;
      if (ends) {
        *at = static_cast<uint32_t>(key);
        return true;
      }
      *above += mass_[key];
      *above_n += count_[key];
    }
    *at = 0;
    return false;
  }
};

// Zeroes the weights outside the boundary; returns the kept mass.
double keep_within(float* w, int64_t n, Boundary b) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(w);
  double kept = 0;
  int64_t ties = b.ties;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t x = bits[j];
    if (x > b.bits) {
      kept += w[j];
    } else if (x == b.bits && ties != 0) {
      kept += w[j];
      if (ties > 0) --ties;
    } else {
      w[j] = 0.f;
    }
  }
  return kept;
}

using Scored = std::pair<float, int64_t>;
constexpr int64_t kHeapTopK = 1024;  // top_k up to this: a heap over the logits, one pass

// Draws among `kept` (logits and ids; any order) with weights exp((x - peak) * inv): min-p, then
// the nucleus of them sorted, then the draw in id order.
int64_t draw_among(std::vector<Scored>& kept, float peak, float inv, float top_p, float min_p, float u) {
  std::sort(kept.begin(), kept.end(),
            [](const Scored& a, const Scored& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  double total = 0;
  for (auto& [v, i] : kept) {
    const float z = (v - peak) * inv;
    v = z < -80.f ? 0.f : exp_approx(z);  // the logit becomes its weight
    if (v < min_p) v = 0.f;
    total += v;
  }
  if (top_p < 1.f) {
    double before = 0;
    const double target = static_cast<double>(top_p) * total;
    for (auto& [v, i] : kept) {
      const float w = v;
      if (!(before < target)) v = 0.f;
      before += w;
    }
  }
  std::sort(kept.begin(), kept.end(), [](const Scored& a, const Scored& b) { return a.second < b.second; });
  total = 0;
  for (const auto& [v, i] : kept) total += v;
  const double target = static_cast<double>(u) * total;
  double cum = 0;
  int64_t last = -1;
  for (const auto& [v, i] : kept) {
    if (v <= 0.f) continue;
    cum += v;
    last = i;
    if (cum > target) return i;
  }
  return last;
}

// The k largest logits (a tie at the boundary to the lowest id): a min-heap that a token enters
// only when it beats the heap's smallest, tested 16 at a time, which past the first thousands of
// tokens almost none does.
void top_k_logits(const float* x, int64_t n, int64_t k, std::vector<Scored>& heap) {
  auto smaller = [](const Scored& a, const Scored& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  heap.clear();
  int64_t j = 0;
  for (; j < n && static_cast<int64_t>(heap.size()) < k; ++j) {
    heap.emplace_back(x[j], j);
    std::push_heap(heap.begin(), heap.end(), smaller);
  }
  auto offer = [&](int64_t i) {
    if (x[i] > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), smaller);
      heap.back() = {x[i], i};
      std::push_heap(heap.begin(), heap.end(), smaller);
    }
  };
  for (; j < n && j % kLanes; ++j) offer(j);
  typedef int32_t i32v __attribute__((vector_size(64)));
  for (; j + kLanes <= n; j += kLanes) {
    const i32v above = vload(x + j) > vsplat(heap.front().first);
    bool any = false;
    for (int l = 0; l < kLanes; ++l) any |= above[l] != 0;
    if (any)
      for (int l = 0; l < kLanes; ++l) offer(j + l);
  }
  for (; j < n; ++j) offer(j);
}

int64_t sample_row(const float* x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p,
                   float u, std::vector<float>& scratch, RadixSelect& radix, std::vector<Scored>& heap) {
  const float inv = 1.f / temperature;
  if (top_k > 0 && top_k < n && top_k <= kHeapTopK) {
    top_k_logits(x, n, top_k, heap);
    float peak = -std::numeric_limits<float>::infinity();
    int64_t first = -1;
    for (const auto& [v, i] : heap)
      if (v > peak || (v == peak && i < first)) peak = v, first = i;
    if (!std::isfinite(peak * inv)) return first;  // an overflowing temperature: greedy
    return draw_among(heap, peak, inv, top_p, min_p, u);
  }
  vec16 best = vsplat(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) best = vload(x + j) > best ? vload(x + j) : best;
  float peak = vmax(best);
  for (; j < n; ++j) peak = std::max(peak, x[j]);
  if (!std::isfinite(peak * inv)) {  // an overflowing temperature: greedy
    for (int64_t i = 0; i < n; ++i)
      if (x[i] == peak) return i;
    return -1;
  }
  scratch.resize(n);
  float* w = scratch.data();
  const vec16 top = vsplat(peak), scale = vsplat(inv);  // (x - max) first: exactly 0 at the max
  vec16 acc = vsplat(0.f);
  j = 0;
  // a weight below e^-80 of the likeliest token's is 0 (at most 1e-29 of the mass at any
  // vocabulary size): exp's intermediates there are subnormal, which costs a microcode assist per
  // operation, and a masked row (-inf outside its grammar) would be all of them
  const vec16 lowest = vsplat(-80.f);
  for (; j + kLanes <= n; j += kLanes) {
    const vec16 z = (vload(x + j) - top) * scale;
    const vec16 e = z < lowest ? vsplat(0.f) : vexp(z < lowest ? lowest : z);
    vstore(w + j, e);
    acc += e;
  }
  double total = vsum(acc);
  for (; j < n; ++j) {
    const float z = (x[j] - peak) * inv;
    total += (w[j] = z < -80.f ? 0.f : exp_approx(z));
  }
  if (min_p > 0.f) {  // the likeliest token has weight 1
    total = 0;
    for (int64_t i = 0; i < n; ++i) total += (w[i] = w[i] >= min_p ? w[i] : 0.f);
  }
  if (top_k > 0 && top_k < n) {
    total = keep_within(w, n, radix.by_count(w, n, top_k));
    if (top_p < 1.f) {  // the nucleus among the k, sorted
      std::vector<std::pair<float, int64_t>> kept;
      kept.reserve(top_k);
      for (int64_t i = 0; i < n; ++i)
        if (w[i] > 0.f) kept.emplace_back(w[i], i);
      std::stable_sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
      double before = 0;
      const double target = static_cast<double>(top_p) * total;
      for (const auto& [v, i] : kept) {
        if (!(before < target)) w[i] = 0.f;
        before += v;
      }
      total = 0;
      for (const auto& [v, i] : kept) total += w[i];
    }
  } else if (top_p < 1.f) {
    total = keep_within(w, n, radix.by_mass(w, n, static_cast<double>(top_p) * total));
  }
  // the draw: the first token whose cumulative weight passes u x total (never one of weight 0)
  const double target = static_cast<double>(u) * total;
  double cum = 0;
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] <= 0.f) continue;
    cum += w[i];
    last = i;
    if (cum > target) return i;
  }
  return last;
}

at::Tensor sample_rows(const at::Tensor& x_in, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& u) {
  TORCH_CHECK_VALUE(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "expected x [N, V] fp32");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &min_p, &u})
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows && t->is_contiguous(), "expected [N] per-row values");
  const at::Tensor k64 = top_k.to(at::kLong);
  const at::Tensor t32 = temperature.to(at::kFloat), p32 = top_p.to(at::kFloat), m32 = min_p.to(at::kFloat),
                   u32 = u.to(at::kFloat);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  const float* base = x.data_ptr<float>();
  const float *ts = t32.data_ptr<float>(), *ps = p32.data_ptr<float>(), *ms = m32.data_ptr<float>(),
              *us = u32.data_ptr<float>();
  const int64_t* ks = k64.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch;
    RadixSelect radix;
    std::vector<Scored> heap;
    for (int64_t r = first; r < last; ++r)
      ids[r] = sample_row(base + r * x.stride(0), n, ts[r], ks[r], ps[r], ms[r], us[r], scratch, radix, heap);
  });
  return out;
}

void penalise_rows(at::Tensor& x, const at::Tensor& at_rows, const at::Tensor& count_rows, const at::Tensor& counts,
                   const at::Tensor& prompt, const at::Tensor& values) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "expected x [N, V] fp32");
  TORCH_CHECK_VALUE(counts.scalar_type() == at::kInt && counts.is_contiguous() && counts.size(1) == x.size(1),
                    "expected counts [R, V] int32");
  TORCH_CHECK_VALUE(prompt.scalar_type() == at::kBool && prompt.is_contiguous() && prompt.size(1) == x.size(1),
                    "expected prompt [R, V] bool");
  const at::Tensor a = at_rows.to(at::kLong).contiguous(), r = count_rows.to(at::kLong).contiguous();
  const at::Tensor v = values.to(at::kFloat).contiguous();
  const int64_t m = a.size(0), n = x.size(1);
  TORCH_CHECK_VALUE(r.size(0) == m && v.numel() == 3 * m, "expected at, rows [M] and values [M, 3]");
  const int64_t* as = a.data_ptr<int64_t>();
  const int64_t* rs = r.data_ptr<int64_t>();
  const float* vs = v.data_ptr<float>();
  float* base = x.data_ptr<float>();
  const int32_t* cs = counts.data_ptr<int32_t>();
  const bool* ps = prompt.data_ptr<bool>();
  parallel_items(m, 4 * n, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      float* row = base + as[i] * x.stride(0);
      const int32_t* c = cs + rs[i] * n;
      const bool* p = ps + rs[i] * n;
      const float rep = vs[3 * i], freq = vs[3 * i + 1], pres = vs[3 * i + 2];
      for (int64_t j = 0; j < n; ++j) {
        const bool seen = c[j] > 0;
        float y = row[j];
        if (seen || p[j]) y = y > 0 ? y / rep : y * rep;
        row[j] = y - freq * static_cast<float>(c[j]) - (seen ? pres : 0.f);
      }
    }
  });
}

void mask_rows(at::Tensor& x, const at::Tensor& at_rows, const at::Tensor& words_in) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "expected x [N, V] fp32");
  const at::Tensor a = at_rows.to(at::kLong).contiguous(), words = words_in.contiguous();
  TORCH_CHECK_VALUE(words.scalar_type() == at::kInt && words.dim() == 2 && words.size(0) == a.size(0) &&
                        words.size(1) * 32 >= x.size(1), "expected words [M, ceil(V / 32)] int32");
  const int64_t m = a.size(0), n = x.size(1), w = words.size(1);
  const int64_t* as = a.data_ptr<int64_t>();
  const uint32_t* ws = reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>());
  float* base = x.data_ptr<float>();
  const float lowest = -std::numeric_limits<float>::infinity();
  parallel_items(m, n, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      float* row = base + as[i] * x.stride(0);
      const uint32_t* bits = ws + i * w;
      for (int64_t k = 0; k * 32 < n; ++k) {
        const uint32_t word = bits[k];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t end = std::min<int64_t>(n, k * 32 + 32);
        for (int64_t j = k * 32; j < end; ++j)
          if (!((word >> (j - k * 32)) & 1u)) row[j] = lowest;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cairn_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor u) -> Tensor");
  m.def("mask_rows(Tensor(a!) x, Tensor at, Tensor words) -> ()");
  m.def("penalise_rows(Tensor(a!) x, Tensor at, Tensor rows, Tensor counts, Tensor prompt, Tensor values) -> ()");
}

TORCH_LIBRARY_IMPL(cairn_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
  m.impl("penalise_rows", &penalise_rows);
  m.impl("mask_rows", &mask_rows);
}

}  // namespace cairn
