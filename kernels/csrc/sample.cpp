// Greedy sampling's read of the logits on CPU: each row's argmax, one pass.
//
// Op: argmax_rows(logits [N, V] fp32 or bf16) -> [N] int64: the index of the first maximum of
// each row, or -1 for a row whose maximum is not finite (a NaN anywhere, a +inf, or nothing but
// -inf), as torch.max's value then reads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

#include "common.h"

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(cairn_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(cairn_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}

}  // namespace cairn
