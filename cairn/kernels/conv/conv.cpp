// The depthwise causal conv1d + SiLU of the Gated DeltaNet on CPU, states kept in slot pools.
//
// A conv state [C, K-1] holds the K-1 inputs before the next token, oldest first. Output token t
// of a segment is silu(sum_j w[c, j] * h[t + j]), h being the segment's state then its tokens.
//
// Ops (shapes and conventions are conv/reference.py's):
//   conv_varlen(x, weight, cu, conv_pool, state_slots) -> out
//     x [T, C]; weight [C, K]; segments [cu[b], cu[b+1]) continue from and leave their state in
//     conv_pool[state_slots[b]] ([num_slots, C, K-1], any float dtype). Work is split into tiles
//     of tokens x channels, each tile reading its K-1 rows of history first.
//   conv_update(x, weight, conv_pool, state_slots) -> out
//     one token per row; a slot of -1 is a padding row: zero state, nothing written.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "native.h"

namespace cairn {
namespace {

constexpr int64_t kTileTokens = 64;

template <typename X>
void silu_store(const float* acc, X* out, int64_t n) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) vstore_from_f32(out + c, vsilu(vload(acc + c)));
  for (; c < n; ++c) out[c] = from_f32<X>(silu(acc[c]));
}
constexpr int64_t kTileChannels = 256;
constexpr int kMaxWidth = 8;

struct ConvArgs {
  at::Tensor x;  // with C contiguous
  std::vector<float> weight_t;  // [K, C]
  int64_t channels;
  int width;
};

ConvArgs conv_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pool) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 2 && x.size(1) == weight.size(0),
              "expected x [T, C] and weight [C, K]");
  TORCH_CHECK(weight.size(1) >= 1 && weight.size(1) <= kMaxWidth, "expected a conv width of 1..", kMaxWidth);
  TORCH_CHECK(pool.dim() == 3 && pool.size(1) == x.size(1) && pool.size(2) == weight.size(1) - 1,
              "expected conv_pool [num_slots, C, K-1]");
  ConvArgs a;
  a.x = x.stride(1) == 1 ? x : x.contiguous();
  a.channels = x.size(1);
  a.width = static_cast<int>(weight.size(1));
  const std::vector<float> w = as_floats(weight);  // [C, K]
  a.weight_t.resize(w.size());
  for (int64_t c = 0; c < a.channels; ++c)
    for (int j = 0; j < a.width; ++j) a.weight_t[j * a.channels + c] = w[c * a.width + j];
  return a;
}

template <typename X, typename P>
void conv_varlen_typed(const ConvArgs& a, at::IntArrayRef cu, at::Tensor& pool, const int64_t* slots, at::Tensor& out) {
  const int64_t C = a.channels, k1 = a.width - 1, batch = static_cast<int64_t>(cu.size()) - 1;
  const X* x = a.x.data_ptr<X>();
  const int64_t xs = a.x.stride(0);
  const float* w = a.weight_t.data();
  P* p = pool.data_ptr<P>();
  const int64_t ps0 = pool.stride(0), ps1 = pool.stride(1), ps2 = pool.stride(2);
  X* o = out.data_ptr<X>();
  // Tiles: (segment, first token, first channel).
  std::vector<int64_t> tiles;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = cu[b]; t < cu[b + 1]; t += kTileTokens)
      for (int64_t c = 0; c < C; c += kTileChannels) tiles.insert(tiles.end(), {b, t, c});
  const int64_t n_tiles = static_cast<int64_t>(tiles.size()) / 3;
  at::parallel_for(0, n_tiles, 1, [&](int64_t first, int64_t last) {
    alignas(64) float hist[(kTileTokens + kMaxWidth) * kTileChannels];
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = tiles[3 * i], t0 = tiles[3 * i + 1], c0 = tiles[3 * i + 2];
      const int64_t t1 = std::min(t0 + kTileTokens, cu[b + 1]), nc = std::min(kTileChannels, C - c0);
      const P* state = p + slots[b] * ps0 + c0 * ps1;
      // hist row r holds input t0 - k1 + r: from the state where that is before the segment
      for (int64_t r = 0; r < t1 - t0 + k1; ++r) {
        const int64_t t = t0 - k1 + r;
        float* dst = hist + r * kTileChannels;
        if (t >= cu[b]) {
          load_row(x + t * xs + c0, dst, nc);
        } else {
          const int64_t j = k1 - (cu[b] - t);  // column of the state: k1 - 1 is the newest
          for (int64_t c = 0; c < nc; ++c) dst[c] = to_f32(state[c * ps1 + j * ps2]);
        }
      }
      for (int64_t t = t0; t < t1; ++t) {
        alignas(64) float acc[kTileChannels];
        const float* h0 = hist + (t - t0) * kTileChannels;
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) acc[c] = w[c0 + c] * h0[c];
        for (int j = 1; j < a.width; ++j) {
          const float* hj = h0 + j * kTileChannels;
          const float* wj = w + j * C + c0;
#pragma omp simd
          for (int64_t c = 0; c < nc; ++c) acc[c] += wj[c] * hj[c];
        }
        silu_store(acc, o + t * C + c0, nc);
      }
    }
  });
  // New states, once every tile has read the old ones: the last K-1 inputs of state then tokens.
  at::parallel_for(0, batch, 1, [&](int64_t first, int64_t last) {
    std::vector<float> old(C * k1);
    for (int64_t b = first; b < last; ++b) {
      P* state = p + slots[b] * ps0;
      const int64_t n = cu[b + 1] - cu[b];
      if (n == 0) continue;
      for (int64_t c = 0; c < C; ++c)
        for (int64_t j = 0; j < k1; ++j) old[c * k1 + j] = to_f32(state[c * ps1 + j * ps2]);
      for (int64_t j = 0; j < k1; ++j) {
        const int64_t t = n - k1 + j;  // from the segment's start; negative: the old state's
        for (int64_t c = 0; c < C; ++c) {
          const float value = t >= 0 ? to_f32(x[(cu[b] + t) * xs + c]) : old[c * k1 + (k1 + t)];
          state[c * ps1 + j * ps2] = from_f32<P>(value);
        }
      }
    }
  });
}

at::Tensor conv_varlen(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef cu, at::Tensor conv_pool,
                       const at::Tensor& state_slots) {
  const ConvArgs a = conv_args(x, weight, conv_pool);
  const int64_t batch = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(state_slots.numel() == batch && state_slots.scalar_type() == at::kLong,
              "expected one int64 state slot per segment");
  at::Tensor out = at::empty({x.size(0), a.channels}, x.options());
  const at::Tensor slots = state_slots.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_varlen", [&] {
    using X = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, conv_pool.scalar_type(), "conv_varlen_pool", [&] {
      conv_varlen_typed<X, scalar_t>(a, cu, conv_pool, slots.data_ptr<int64_t>(), out);
    });
  });
  return out;
}

// A state [C, K1] (K1 contiguous) to rows [K1][C] of fp32, and back.
template <int K1, typename P>
void transpose_in(const P* state, float* rows, int64_t C) {
  for (int j = 0; j < K1; ++j) {
    float* row = rows + j * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) row[c] = to_f32(state[c * K1 + j]);
  }
}

template <int K1, typename P>
void transpose_out(const float* rows, P* state, int64_t C) {
  for (int j = 0; j < K1; ++j) {
    const float* row = rows + j * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) state[c * K1 + j] = from_f32<P>(row[c]);
  }
}

template <typename X, typename P>
void conv_update_typed(const ConvArgs& a, at::Tensor& pool, const int64_t* slots, at::Tensor& out) {
  const int64_t C = a.channels, k1 = a.width - 1, batch = a.x.size(0);
  const X* x = a.x.data_ptr<X>();
  const float* w = a.weight_t.data();
  P* p = pool.data_ptr<P>();
  const int64_t ps0 = pool.stride(0), ps1 = pool.stride(1), ps2 = pool.stride(2);
  X* o = out.data_ptr<X>();
  parallel_items(batch, C * a.width * 4, [&](int64_t first, int64_t last) {
    std::vector<float> hist(kMaxWidth * C), acc(C);
    for (int64_t b = first; b < last; ++b) {
      // hist row j: tap j's inputs across channels (the state's K-1, then the token)
      P* state = slots[b] >= 0 ? p + slots[b] * ps0 : nullptr;
      if (!state) {
        std::fill(hist.begin(), hist.begin() + k1 * C, 0.f);
      } else if (k1 == 3 && ps1 == 3 && ps2 == 1) {  // the pools' layout: constant strides, which vectorise
        transpose_in<3>(state, hist.data(), C);
      } else {
        for (int64_t j = 0; j < k1; ++j)
          for (int64_t c = 0; c < C; ++c) hist[j * C + c] = to_f32(state[c * ps1 + j * ps2]);
      }
      load_row(x + b * a.x.stride(0), hist.data() + k1 * C, C);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) acc[c] = w[c] * hist[c];
      for (int j = 1; j < a.width; ++j) {
        const float* wj = w + j * C;
        const float* hj = hist.data() + j * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[c] += wj[c] * hj[c];
      }
      silu_store(acc.data(), o + b * C, C);
      if (state && k1 == 3 && ps1 == 3 && ps2 == 1) {
        transpose_out<3>(hist.data() + C, state, C);
      } else if (state) {
        for (int64_t j = 0; j < k1; ++j) {
          const float* src = hist.data() + (j + 1) * C;
          for (int64_t c = 0; c < C; ++c) state[c * ps1 + j * ps2] = from_f32<P>(src[c]);
        }
      }
    }
  });
}

at::Tensor conv_update(const at::Tensor& x, const at::Tensor& weight, at::Tensor conv_pool,
                       const at::Tensor& state_slots) {
  const ConvArgs a = conv_args(x, weight, conv_pool);
  TORCH_CHECK(state_slots.numel() == x.size(0) && state_slots.scalar_type() == at::kLong,
              "expected one int64 state slot per row");
  at::Tensor out = at::empty({x.size(0), a.channels}, x.options());
  const at::Tensor slots = state_slots.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "conv_update", [&] {
    using X = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, conv_pool.scalar_type(), "conv_update_pool", [&] {
      conv_update_typed<X, scalar_t>(a, conv_pool, slots.data_ptr<int64_t>(), out);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cairn_cpu, m) {
  m.def("conv_varlen(Tensor x, Tensor weight, int[] cu, Tensor(a!) conv_pool, Tensor state_slots) -> Tensor");
  m.def("conv_update(Tensor x, Tensor weight, Tensor(a!) conv_pool, Tensor state_slots) -> Tensor");
}

TORCH_LIBRARY_IMPL(cairn_cpu, CPU, m) {
  m.impl("conv_varlen", &conv_varlen);
  m.impl("conv_update", &conv_update);
}

}  // namespace cairn
