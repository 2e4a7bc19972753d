// The gated delta rule on CPU, token by token with each head's state held in cache.
//
// Per value head, with state S [D_k, D_v] and per token: a = exp(g), then
//   ks = S^T k, qs = S^T q                (one pass over S)
//   delta = beta (v - a ks)
//   o = a qs + (k . q) delta              (= q^T S_new)
//   S = a S + k delta^T                   (a second pass)
// q and k are L2-normed (x * rsqrt(sum x^2 + 1e-6)) when asked, and q is scaled. Each (sequence,
// value head) runs on one thread, its state (16 KiB at D = 64, 64 KiB at D = 128) staying in L1/L2
// for the whole segment: the recurrence costs about 4 D^2 multiply-adds a token, against the
// chunked form's 7 C D^2 / C per token on top of its solve, and it keeps no temporaries.
//
// Ops (schemas at the bottom; shapes and conventions are kernels.reference's):
//   delta_rule_varlen(q, k, v, g, beta, cu, state_pool, state_slots, positions, position_offsets,
//                     scale, l2norm) -> (out, states)
//     segments [cu[b], cu[b+1]) start from and end in state_pool[state_slots[b]]; states[i] is
//     the state after positions[i] tokens of its segment (position_offsets[b] .. [b+1] are b's).
//   delta_rule_step(q, k, v, g, beta, state_pool, state_slots, scale, l2norm) -> out
//     one token per row, in place in its slot; a slot of -1 starts from zeros and writes nothing.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "common.h"

namespace cairn {
namespace {

constexpr int kMaxDim = 256;

// The state's columns as NV vectors of 16 floats (D_v = 16 NV), or NV = 0: any D_v, scalar.
template <int NV>
struct Token {
  static void run(float* __restrict S, const float* __restrict q, const float* __restrict k,
                  const float* __restrict v, float a, float beta, float* __restrict o, int dk, int dv) {
    vec16 ks[NV], qs[NV];
    for (int j = 0; j < NV; ++j) ks[j] = qs[j] = vec16{};
    float kq = 0.f;
    for (int i = 0; i < dk; ++i) {
      const float* row = S + static_cast<int64_t>(i) * dv;
      const vec16 ki = vsplat(k[i]), qi = vsplat(q[i]);
      for (int j = 0; j < NV; ++j) {
        const vec16 r = vload(row + kLanes * j);
        ks[j] += ki * r;
        qs[j] += qi * r;
      }
      kq += k[i] * q[i];
    }
    vec16 delta[NV];
    const vec16 av = vsplat(a), bv = vsplat(beta), kqv = vsplat(kq);
    for (int j = 0; j < NV; ++j) {
      delta[j] = bv * (vload(v + kLanes * j) - av * ks[j]);
      vstore(o + kLanes * j, av * qs[j] + kqv * delta[j]);
    }
    for (int i = 0; i < dk; ++i) {
      float* row = S + static_cast<int64_t>(i) * dv;
      const vec16 ki = vsplat(k[i]);
      for (int j = 0; j < NV; ++j) vstore(row + kLanes * j, av * vload(row + kLanes * j) + ki * delta[j]);
    }
  }
};

template <>
struct Token<0> {
  static void run(float* __restrict S, const float* __restrict q, const float* __restrict k,
                  const float* __restrict v, float a, float beta, float* __restrict o, int dk, int dv) {
    float ks[kMaxDim] = {}, qs[kMaxDim] = {}, delta[kMaxDim];
    float kq = 0.f;
    for (int i = 0; i < dk; ++i) {
      const float* row = S + static_cast<int64_t>(i) * dv;
      for (int j = 0; j < dv; ++j) {
        ks[j] += k[i] * row[j];
        qs[j] += q[i] * row[j];
      }
      kq += k[i] * q[i];
    }
    for (int j = 0; j < dv; ++j) {
      delta[j] = beta * (v[j] - a * ks[j]);
      o[j] = a * qs[j] + kq * delta[j];
    }
    for (int i = 0; i < dk; ++i) {
      float* row = S + static_cast<int64_t>(i) * dv;
      for (int j = 0; j < dv; ++j) row[j] = a * row[j] + k[i] * delta[j];
    }
  }
};

using TokenFn = void (*)(float*, const float*, const float*, const float*, float, float, float*, int, int);

TokenFn token_fn(int dv) {
  switch (dv) {
    case 16: return Token<1>::run;
    case 32: return Token<2>::run;
    case 64: return Token<4>::run;
    case 128: return Token<8>::run;
    case 256: return Token<16>::run;
    default: return Token<0>::run;
  }
}

void normalise(float* x, int n, float scale, bool l2norm) {
  float s = scale;
  if (l2norm) {
    float sq = 0.f;
    for (int i = 0; i < n; ++i) sq += x[i] * x[i];
    s *= 1.f / std::sqrt(sq + 1e-6f);
  }
  for (int i = 0; i < n; ++i) x[i] *= s;
}

struct Inputs {
  at::Tensor q, k, v, g, beta;  // q, k, v with D contiguous; g, beta fp32 contiguous [T, H_v]
  int h_k, h_v, dk, dv;
  float scale;
  bool l2norm;
};

Inputs inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
              const at::Tensor& beta, double scale, bool l2norm) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "expected q, k [T, H_k, D_k] and v [T, H_v, D_v]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "expected q, k and v of one dtype");
  Inputs in;
  in.q = q.stride(2) == 1 ? q : q.contiguous();
  in.k = k.stride(2) == 1 ? k : k.contiguous();
  in.v = v.stride(2) == 1 ? v : v.contiguous();
  in.g = g.to(at::kFloat).contiguous();
  in.beta = beta.to(at::kFloat).contiguous();
  in.h_k = q.size(1), in.h_v = v.size(1), in.dk = q.size(2), in.dv = v.size(2);
  TORCH_CHECK(in.h_v % in.h_k == 0, "expected H_v a multiple of H_k");
  TORCH_CHECK(in.dk <= kMaxDim && in.dv <= kMaxDim, "expected head dims of at most ", kMaxDim);
  in.scale = scale > 0 ? static_cast<float>(scale) : 1.f / std::sqrt(static_cast<float>(in.dk));
  in.l2norm = l2norm;
  return in;
}

// Runs tokens [begin, end) of value head h over state S, writing out rows; after each token whose
// count (from begin) is in `at`, copies S to the matching `saved` pointer.
template <typename T>
void run_head(const Inputs& in, int h, int64_t begin, int64_t end, float* S, T* out, const int64_t* at,
              float* const* saved, int64_t num_saved) {
  const int hk = h / (in.h_v / in.h_k), dk = in.dk, dv = in.dv;
  const TokenFn fn = token_fn(dv);
  const T* q = in.q.data_ptr<T>();
  const T* k = in.k.data_ptr<T>();
  const T* v = in.v.data_ptr<T>();
  const float* g = in.g.data_ptr<float>();
  const float* beta = in.beta.data_ptr<float>();
  alignas(64) float qf[kMaxDim], kf[kMaxDim], vf[kMaxDim], of[kMaxDim];
  int64_t next = 0;
  for (int64_t t = begin; t < end; ++t) {
    load_row(q + t * in.q.stride(0) + hk * in.q.stride(1), qf, dk);
    load_row(k + t * in.k.stride(0) + hk * in.k.stride(1), kf, dk);
    load_row(v + t * in.v.stride(0) + h * in.v.stride(1), vf, dv);
    normalise(qf, dk, in.scale, in.l2norm);
    normalise(kf, dk, 1.f, in.l2norm);
    fn(S, qf, kf, vf, std::exp(g[t * in.h_v + h]), beta[t * in.h_v + h], of, dk, dv);
    store_row(of, out + (t * in.h_v + h) * dv, dv);
    while (next < num_saved && at[next] == t - begin + 1) {
      std::memcpy(saved[next], S, sizeof(float) * dk * dv);
      ++next;
    }
  }
}

void check_pool(const at::Tensor& pool, const Inputs& in) {
  TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.dim() == 4 && pool.size(1) == in.h_v &&
                  pool.size(2) == in.dk && pool.size(3) == in.dv,
              "expected state_pool [num_slots, H_v, D_k, D_v] fp32");
  TORCH_CHECK(pool.stride(3) == 1 && pool.stride(2) == in.dv, "expected each state's D_k x D_v contiguous");
}

std::tuple<at::Tensor, at::Tensor> delta_rule_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& g, const at::Tensor& beta, at::IntArrayRef cu,
                                                     at::Tensor state_pool, const at::Tensor& state_slots,
                                                     at::IntArrayRef positions, at::IntArrayRef position_offsets,
                                                     double scale, bool l2norm) {
  const Inputs in = inputs(q, k, v, g, beta, scale, l2norm);
  check_pool(state_pool, in);
  const int64_t batch = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(batch >= 0 && state_slots.numel() == batch && state_slots.scalar_type() == at::kLong,
              "expected one int64 state slot per segment");
  TORCH_CHECK(static_cast<int64_t>(position_offsets.size()) == batch + 1, "expected B+1 position offsets");
  const int64_t num_states = static_cast<int64_t>(positions.size());
  at::Tensor out = at::empty({q.size(0), in.h_v, in.dv}, v.options());
  at::Tensor states = at::empty({num_states, in.h_v, in.dk, in.dv}, state_pool.options().memory_format(
                                                                         at::MemoryFormat::Contiguous));
  const int64_t* slots = state_slots.contiguous().data_ptr<int64_t>();
  float* pool = state_pool.data_ptr<float>();
  const int64_t state_elems = static_cast<int64_t>(in.dk) * in.dv;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "delta_rule_varlen", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * in.h_v, 1, [&](int64_t first, int64_t last) {
      std::vector<float*> saved;
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / in.h_v;
        const int h = static_cast<int>(item % in.h_v);
        if (cu[b] == cu[b + 1]) continue;
        float* S = pool + slots[b] * state_pool.stride(0) + h * state_pool.stride(1);
        const int64_t p0 = position_offsets[b], p1 = position_offsets[b + 1];
        saved.clear();
        for (int64_t p = p0; p < p1; ++p) saved.push_back(states.data_ptr<float>() + (p * in.h_v + h) * state_elems);
        run_head<scalar_t>(in, h, cu[b], cu[b + 1], S, o, positions.data() + p0, saved.data(), p1 - p0);
      }
    });
  });
  return {out, states};
}

at::Tensor delta_rule_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, at::Tensor state_pool, const at::Tensor& state_slots, double scale,
                           bool l2norm) {
  const Inputs in = inputs(q, k, v, g, beta, scale, l2norm);
  check_pool(state_pool, in);
  const int64_t batch = q.size(0);
  TORCH_CHECK(state_slots.numel() == batch && state_slots.scalar_type() == at::kLong,
              "expected one int64 state slot per row");
  at::Tensor out = at::empty({batch, in.h_v, in.dv}, v.options());
  const at::Tensor slots_c = state_slots.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  float* pool = state_pool.data_ptr<float>();
  const int64_t state_elems = static_cast<int64_t>(in.dk) * in.dv;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, v.scalar_type(), "delta_rule_step", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    parallel_items(batch * in.h_v, 5 * in.dk * in.dv, [&](int64_t first, int64_t last) {
      std::vector<float> scratch;
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / in.h_v;
        const int h = static_cast<int>(item % in.h_v);
        float* S;
        if (slots[b] >= 0) {
          S = pool + slots[b] * state_pool.stride(0) + h * state_pool.stride(1);
        } else {  // a padding row: from zeros, into scratch
          scratch.assign(state_elems, 0.f);
          S = scratch.data();
        }
        run_head<scalar_t>(in, h, b, b + 1, S, o, nullptr, nullptr, 0);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cairn_cpu, m) {
  m.def("delta_rule_varlen(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int[] cu, Tensor(a!) state_pool, "
        "Tensor state_slots, int[] positions, int[] position_offsets, float scale, bool l2norm) -> (Tensor, Tensor)");
  m.def("delta_rule_step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state_pool, "
        "Tensor state_slots, float scale, bool l2norm) -> Tensor");
}

TORCH_LIBRARY_IMPL(cairn_cpu, CPU, m) {
  m.impl("delta_rule_varlen", &delta_rule_varlen);
  m.impl("delta_rule_step", &delta_rule_step);
}

}  // namespace cairn
