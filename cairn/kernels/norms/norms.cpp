// The row-wise ops around the matmuls, one pass over memory each, rounding where transformers
// rounds (norms/reference.py states each op's dtypes; `rd<T>` is a rounding to T).
//
// Ops (rows [N, D] with D contiguous, any float dtype T; weights come as fp32, prepared by the
// launcher exactly as the reference computes them):
//   rms_norm(x, weight, eps, residual?) -> (y, sum)   zero-centred: y = rd<T>(normed * (1 + w)); with
//       residual, x + residual is rounded to T first and returned as `sum` (else `sum` is empty)
//   gated_rms_norm(x, gate, w, eps, round_product) -> y
//       rd<T>(rd<P>(w * rd<T>(normed)) * silu(gate)), P = T if round_product else fp32
//   silu_mul(gate, up) -> rd<T>(rd<T>(silu(gate)) * up)            (SwiGLU's activation)
//   sigmoid_mul(x, gate) -> rd<T>(x * rd<T>(sigmoid(gate)))          (gated attention's output)
//   qk_norm_rope(q [T, H_q, D], k [T, H_kv, D], q_weight, k_weight, positions [T], inv_freq [R], eps,
//                rope_axes? [R]) -> (q, k): each head zero-centred-normed and rounded, then rotate-half over
//       its first 2R channels at angle position * inv_freq (fp32), cos/sin rounded to T, products and
//       sums rounded. With rope_axes (M-RoPE), positions [3, T] (int32 or int64) and frequency j
//       turns by row rope_axes[j]'s position (an axis outside 0..2 is refused)
//   delta_gates(a, b [T, H], A_log, dt_bias [H]) -> (g fp32, beta in b's dtype)
//       g = -exp(A_log) * softplus(a + dt_bias) (softplus(x) = x past 20), beta = sigmoid(b)
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "native.h"

namespace cairn {
namespace {

template <typename T>
inline float rd(float x) { return to_f32(from_f32<T>(x)); }

template <typename T>
inline const T* rows_of(const at::Tensor& t) { return t.data_ptr<T>(); }

at::Tensor rowwise(const at::Tensor& x) {  // [N, D] with D contiguous
  TORCH_CHECK(x.dim() >= 1, "expected rows");
  at::Tensor r = x.reshape({-1, x.size(-1)});
  return r.stride(1) == 1 ? r : r.contiguous();
}


template <typename T>
void rms_rows(const at::Tensor& x, const at::Tensor* residual, const float* w, float eps, at::Tensor& y,
              at::Tensor& sum) {
  const int64_t n = x.size(0), d = x.size(1);
  parallel_items(n, 6 * d, [&](int64_t first, int64_t last) {
    std::vector<float> row(d);
    for (int64_t i = first; i < last; ++i) {
      load_row(x.data_ptr<T>() + i * x.stride(0), row.data(), d);
      if (residual) {
        std::vector<float> r(d);
        load_row(residual->data_ptr<T>() + i * residual->stride(0), r.data(), d);
        for (int64_t j = 0; j < d; ++j) row[j] = rd<T>(row[j] + r[j]);
        store_row(row.data(), sum.data_ptr<T>() + i * d, d);
      }
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < d; ++j) sq += row[j] * row[j];
      const float inv = 1.f / std::sqrt(sq / d + eps);
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) row[j] = row[j] * inv * (1.f + w[j]);
      store_row(row.data(), y.data_ptr<T>() + i * d, d);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual_in) {
  const at::Tensor x = rowwise(x_in);
  const std::vector<float> w = as_floats(weight);
  TORCH_CHECK(static_cast<int64_t>(w.size()) == x.size(1), "expected a weight per channel");
  at::Tensor y = at::empty(x_in.sizes(), x_in.options());
  at::Tensor sum, residual;
  if (residual_in) {
    TORCH_CHECK(residual_in->sizes() == x_in.sizes() && residual_in->scalar_type() == x_in.scalar_type(),
                "expected a residual like x");
    residual = rowwise(*residual_in);
    sum = at::empty(x_in.sizes(), x_in.options());
  }
  at::Tensor y2 = y.view({-1, x.size(1)}), sum2 = residual_in ? sum.view({-1, x.size(1)}) : sum;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x, residual_in ? &residual : nullptr, w.data(), static_cast<float>(eps), y2, sum2);
  });
  return {y, sum};
}

template <typename T>
void gated_rows(const at::Tensor& x, const at::Tensor& gate, const float* w, float eps, bool round_product,
                at::Tensor& y) {
  const int64_t n = x.size(0), d = x.size(1);
  parallel_items(n, 16 * d, [&](int64_t first, int64_t last) {
    std::vector<float> row(d), g(d);
    for (int64_t i = first; i < last; ++i) {
      load_row(x.data_ptr<T>() + i * x.stride(0), row.data(), d);
      load_row(gate.data_ptr<T>() + i * gate.stride(0), g.data(), d);
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < d; ++j) sq += row[j] * row[j];
      const float inv = 1.f / std::sqrt(sq / d + eps);
      int64_t j = 0;
      const vec16 vinv = vsplat(inv);
      for (; j + kLanes <= d; j += kLanes) {
        const vec16 normed = vround<T>(vload(row.data() + j) * vinv);
        const vec16 weighted = round_product ? vround<T>(vload(w + j) * normed) : vload(w + j) * normed;
        vstore(row.data() + j, weighted * vsilu(vload(g.data() + j)));
      }
      for (; j < d; ++j) {
        const float weighted = round_product ? rd<T>(w[j] * rd<T>(row[j] * inv)) : w[j] * rd<T>(row[j] * inv);
        row[j] = weighted * silu(g[j]);
      }
      store_row(row.data(), y.data_ptr<T>() + i * d, d);
    }
  });
}

at::Tensor gated_rms_norm(const at::Tensor& x_in, const at::Tensor& gate_in, const at::Tensor& weight, double eps,
                          bool round_product) {
  TORCH_CHECK(gate_in.sizes() == x_in.sizes() && gate_in.scalar_type() == x_in.scalar_type(),
              "expected a gate like x");
  const at::Tensor x = rowwise(x_in), gate = rowwise(gate_in);
  const std::vector<float> w = as_floats(weight);
  TORCH_CHECK(static_cast<int64_t>(w.size()) == x.size(1), "expected a weight per channel");
  at::Tensor y = at::empty(x_in.sizes(), x_in.options());
  at::Tensor y2 = y.view({-1, x.size(1)});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_rms_norm", [&] {
    gated_rows<scalar_t>(x, gate, w.data(), static_cast<float>(eps), round_product, y2);
  });
  return y;
}

// out = Op(a, b) elementwise over rows: Op::v on whole vectors of 16, Op::s on the tail.
template <typename T, typename Op>
void pairwise(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const int64_t n = a.size(0), d = a.size(1);
  parallel_items(n, 16 * d, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const T* pa = a.data_ptr<T>() + i * a.stride(0);
      const T* pb = b.data_ptr<T>() + i * b.stride(0);
      T* po = out.data_ptr<T>() + i * d;
      int64_t j = 0;
      for (; j + kLanes <= d; j += kLanes)
        vstore_from_f32(po + j, Op::template v<T>(vload_as_f32(pa + j), vload_as_f32(pb + j)));
      for (; j < d; ++j) po[j] = from_f32<T>(Op::template s<T>(to_f32(pa[j]), to_f32(pb[j])));
    }
  });
}

struct SiluMul {  // rd(rd(silu(gate)) * up)
  template <typename T>
  static vec16 v(vec16 g, vec16 u) { return vround<T>(vsilu(g)) * u; }
  template <typename T>
  static float s(float g, float u) { return rd<T>(silu(g)) * u; }
};

struct SigmoidMul {  // rd(x * rd(sigmoid(gate)))
  template <typename T>
  static vec16 v(vec16 x, vec16 g) { return x * vround<T>(vsigmoid(g)); }
  template <typename T>
  static float s(float x, float g) { return x * rd<T>(1.f / (1.f + exp_approx(-g))); }
};

at::Tensor silu_mul(const at::Tensor& gate_in, const at::Tensor& up_in) {
  TORCH_CHECK(gate_in.sizes() == up_in.sizes() && gate_in.scalar_type() == up_in.scalar_type(),
              "expected gate and up alike");
  const at::Tensor gate = rowwise(gate_in), up = rowwise(up_in);
  at::Tensor out = at::empty(gate_in.sizes(), gate_in.options());
  at::Tensor out2 = out.view({-1, gate.size(1)});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "silu_mul", [&] {
    pairwise<scalar_t, SiluMul>(gate, up, out2);
  });
  return out;
}

at::Tensor sigmoid_mul(const at::Tensor& x_in, const at::Tensor& gate_in) {
  TORCH_CHECK(gate_in.sizes() == x_in.sizes() && gate_in.scalar_type() == x_in.scalar_type(),
              "expected x and gate alike");
  const at::Tensor x = rowwise(x_in), gate = rowwise(gate_in);
  at::Tensor out = at::empty(x_in.sizes(), x_in.options());
  at::Tensor out2 = out.view({-1, x.size(1)});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "sigmoid_mul", [&] {
    pairwise<scalar_t, SigmoidMul>(x, gate, out2);
  });
  return out;
}

template <typename T>
void norm_rope_rows(const at::Tensor& x, const float* w, const float* cos, const float* sin, int64_t pairs,
                    float eps, at::Tensor& y) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  parallel_items(tokens, 8 * heads * d, [&](int64_t first, int64_t last) {
    std::vector<float> row(d), out(d);
    for (int64_t t = first; t < last; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        load_row(x.data_ptr<T>() + t * x.stride(0) + h * x.stride(1), row.data(), d);
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (int64_t j = 0; j < d; ++j) sq += row[j] * row[j];
        const float inv = 1.f / std::sqrt(sq / d + eps);
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) row[j] = rd<T>(row[j] * inv * (1.f + w[j]));
        for (int64_t j = 0; j < pairs; ++j) {
          const float c = cos[t * pairs + j], s = sin[t * pairs + j];
          const float lo = row[j], hi = row[j + pairs];
          out[j] = rd<T>(rd<T>(lo * c) + rd<T>(-hi * s));
          out[j + pairs] = rd<T>(rd<T>(hi * c) + rd<T>(lo * s));
        }
        for (int64_t j = 2 * pairs; j < d; ++j) out[j] = row[j];
        store_row(out.data(), y.data_ptr<T>() + (t * heads + h) * d, d);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& q_weight,
                                                const at::Tensor& k_weight, const at::Tensor& positions,
                                                const at::Tensor& inv_freq, double eps,
                                                const std::optional<at::Tensor>& rope_axes) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && k_in.size(0) == q_in.size(0) && k_in.size(2) == q_in.size(2) &&
                  k_in.scalar_type() == q_in.scalar_type(),
              "expected q [T, H_q, D] and k [T, H_kv, D] of one dtype");
  const int64_t tokens = q_in.size(0), d = q_in.size(2), pairs = inv_freq.numel();
  TORCH_CHECK(2 * pairs <= d, "expected 2R <= D");
  std::vector<int64_t> row(pairs, 0);  // frequency j's positions start at row[j] * tokens
  if (rope_axes) {
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == 3 && positions.size(1) == tokens &&
                    rope_axes->numel() == pairs,
                "expected positions [3, T] and an axis per frequency");
    const at::Tensor axes = rope_axes->to(at::kLong).contiguous();
    for (int64_t j = 0; j < pairs; ++j) {
      TORCH_CHECK(0 <= axes.data_ptr<int64_t>()[j] && axes.data_ptr<int64_t>()[j] < 3, "expected axes in 0..2");
      row[j] = axes.data_ptr<int64_t>()[j] * tokens;
    }
  } else {
    TORCH_CHECK(positions.numel() == tokens, "expected a position per token");
    TORCH_CHECK(positions.scalar_type() == at::kLong, "expected int64 positions");
  }
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const std::vector<float> freq = as_floats(inv_freq);
  std::vector<float> cos(tokens * pairs), sin(tokens * pairs);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q_in.scalar_type(), "qk_rope_angles", [&] {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < pairs; ++j) {
        const float f = static_cast<float>(pp[row[j] + t]) * freq[j];
        cos[t * pairs + j] = rd<scalar_t>(std::cos(f));
        sin[t * pairs + j] = rd<scalar_t>(std::sin(f));
      }
    }
  });
  std::tuple<at::Tensor, at::Tensor> out;
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& in = which ? k_in : q_in;
    const at::Tensor x = in.stride(2) == 1 ? in : in.contiguous();
    const std::vector<float> w = as_floats(which ? k_weight : q_weight);
    TORCH_CHECK(static_cast<int64_t>(w.size()) == d, "expected a norm weight per channel");
    at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qk_norm_rope", [&] {
      norm_rope_rows<scalar_t>(x, w.data(), cos.data(), sin.data(), pairs, static_cast<float>(eps), y);
    });
    (which ? std::get<1>(out) : std::get<0>(out)) = y;
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> delta_gates(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& A_log,
                                               const at::Tensor& dt_bias) {
  TORCH_CHECK(a_in.dim() == 2 && b_in.sizes() == a_in.sizes() && A_log.numel() == a_in.size(1) &&
                  dt_bias.numel() == a_in.size(1),
              "expected a, b [T, H] and A_log, dt_bias [H]");
  const at::Tensor b = b_in.contiguous();
  const std::vector<float> av = as_floats(a_in), al = as_floats(A_log), dv = as_floats(dt_bias);
  const int64_t n = a_in.size(0), h = a_in.size(1);
  at::Tensor g = at::empty({n, h}, b.options().dtype(at::kFloat));
  at::Tensor beta = at::empty({n, h}, b.options());
  std::vector<float> decay(h);
  for (int64_t j = 0; j < h; ++j) decay[j] = -std::exp(al[j]);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, b.scalar_type(), "delta_gates", [&] {
    const scalar_t* bv = b.data_ptr<scalar_t>();
    float* gv = g.data_ptr<float>();
    scalar_t* betav = beta.data_ptr<scalar_t>();
    for (int64_t i = 0; i < n * h; ++i) {
      const float x = av[i] + dv[i % h];
      gv[i] = decay[i % h] * (x > 20.f ? x : std::log1p(std::exp(x)));
      betav[i] = from_f32<scalar_t>(1.f / (1.f + std::exp(-to_f32(bv[i]))));
    }
  });
  return {g, beta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cairn_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps, bool round_product) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("sigmoid_mul(Tensor x, Tensor gate) -> Tensor");
  m.def("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor inv_freq, "
        "float eps, Tensor? rope_axes=None) -> (Tensor, Tensor)");
  m.def("delta_gates(Tensor a, Tensor b, Tensor A_log, Tensor dt_bias) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cairn_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("sigmoid_mul", &sigmoid_mul);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("delta_gates", &delta_gates);
}

}  // namespace cairn
