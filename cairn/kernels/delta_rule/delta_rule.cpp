// The gated delta rule on CPU, token by token with each head's state held in cache.
//
// Per value head, with state S [D_k, D_v] and per token: a = exp(g), then
//   ks = S^T k, qs = S^T q                (one pass over S)
//   delta = beta (v - a ks)
//   o = a qs + (k . q) delta              (= q^T S_new)
//   S = a S + k delta^T                   (a second pass; see kRescale for how a is applied)
// q and k are L2-normed (x * rsqrt(sum x^2 + 1e-6)) when asked, and q is scaled, once per token
// and key head before the recurrences (`prepare`). Each (sequence, value head) runs on one
// thread, its state (16 KiB at D = 64, 64 KiB at D = 128) staying in L1/L2 for the whole segment:
// the recurrence costs about 3 D^2 multiply-adds a token, against the chunked form's 7 D^2 on
// top of its solve, and it keeps no temporaries.
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

#include "native.h"

namespace cairn {
namespace {

constexpr int kMaxDim = 256;

// The state is held divided by the running product c of the decays (S = c S~): a token then
// updates S~ with one multiply-add per element, S~ += k (delta / c)^T, instead of scaling all of S
// by its decay first; reads scale by c instead (S^T k = c S~^T k). Where c would fall below
// kRescale (or a decay alone is that small: a state all but erased), the token folds c into the
// state as it updates it, S~ = c S~ + k delta^T, and c restarts at 1.
// Each token's update pass also reads the next token's S~^T k and S~^T q from the rows it has just
// written: one load and one store of the state per token, three multiply-adds per element.
constexpr float kRescale = 0x1p-64f;

struct Token {  // what one token of a value head reads, in fp32
  const float *q, *k, *v;
  float kq, decay, beta;
};

// A value head's tokens over S~ [D_k, D_v] in place, D_v = 16 W.
template <int W>
struct Recurrence {
  // Runs tokens(0) .. tokens(n - 1); `emit(i, o, S, c)` after token i with its output and state (S c).
  template <typename Tokens, typename Emit>
  static void run(float* __restrict S, int dk, int64_t n, const Tokens& tokens, const Emit& emit) {
    if (n == 0) return;
    vec16 ks[W], qs[W];
    alignas(64) float o[kLanes * W];
    float c = 1.f;
    Token cur = tokens(0);
    reads(S, dk, cur, ks, qs);
    for (int64_t i = 0; i < n; ++i) {
      const float c_new = c * cur.decay;
      const bool fold = !(c_new >= kRescale);
      vec16 u[W];
      const vec16 cv = vsplat(c_new), bv = vsplat(cur.beta), kqv = vsplat(cur.kq), inv = vsplat(fold ? 1.f : 1.f / c_new);
      for (int j = 0; j < W; ++j) {
        const vec16 delta = bv * (vload(cur.v + kLanes * j) - cv * ks[j]);
        vstore(o + kLanes * j, cv * qs[j] + kqv * delta);
        u[j] = delta * inv;
      }
      c = fold ? 1.f : c_new;
      const bool more = i + 1 < n;
      const Token next = more ? tokens(i + 1) : cur;
      for (int j = 0; j < W; ++j) ks[j] = qs[j] = vec16{};
      if (fold) {
        update<true>(S, dk, cur.k, u, c_new, next, more, ks, qs);
      } else if (more) {
        update<false>(S, dk, cur.k, u, 1.f, next, true, ks, qs);
      } else {
        update<false>(S, dk, cur.k, u, 1.f, next, false, ks, qs);
      }
      emit(i, o, S, c);
      cur = next;
    }
    for (int64_t e = 0; e < static_cast<int64_t>(dk) * kLanes * W; ++e) S[e] *= c;
  }

  __attribute__((always_inline)) static void reads(const float* S, int dk, const Token& t, vec16* ks, vec16* qs) {
    for (int j = 0; j < W; ++j) ks[j] = qs[j] = vec16{};
    for (int i = 0; i < dk; ++i) {
      const float* row = S + static_cast<int64_t>(i) * kLanes * W;
      const vec16 ki = vsplat(t.k[i]), qi = vsplat(t.q[i]);
      for (int j = 0; j < W; ++j) {
        const vec16 r = vload(row + kLanes * j);
        ks[j] += ki * r;
        qs[j] += qi * r;
      }
    }
  }

  // S~_i = m S~_i + k_i u for every row i (m = 1 unless FOLD); with `more`, the next token's reads
  // of the rows just written.
  template <bool FOLD>
  __attribute__((always_inline)) static void update(float* S, int dk, const float* k, const vec16* u, float m, const Token& next, bool more,
                     vec16* ks, vec16* qs) {
    const vec16 mv = vsplat(m);
    for (int i = 0; i < dk; ++i) {
      float* row = S + static_cast<int64_t>(i) * kLanes * W;
      const vec16 ki = vsplat(k[i]);
      if (more) {
        const vec16 nk = vsplat(next.k[i]), nq = vsplat(next.q[i]);
        for (int j = 0; j < W; ++j) {
          const vec16 r = (FOLD ? mv * vload(row + kLanes * j) : vload(row + kLanes * j)) + ki * u[j];
          vstore(row + kLanes * j, r);
          ks[j] += nk * r;
          qs[j] += nq * r;
        }
      } else {
        for (int j = 0; j < W; ++j)
          vstore(row + kLanes * j, (FOLD ? mv * vload(row + kLanes * j) : vload(row + kLanes * j)) + ki * u[j]);
      }
    }
  }

};

// The same for any D_v, a scalar loop: the tiny test models' shapes.
struct ScalarRecurrence {
  template <typename Tokens, typename Emit>
  static void run(float* S, int dk, int dv, int64_t n, const Tokens& tokens, const Emit& emit) {
    float ks[kMaxDim], qs[kMaxDim], u[kMaxDim], o[kMaxDim];
    for (int64_t t = 0; t < n; ++t) {
      const auto cur = tokens(t);
      for (int j = 0; j < dv; ++j) ks[j] = qs[j] = 0.f;
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) {
          ks[j] += cur.k[i] * S[i * dv + j];
          qs[j] += cur.q[i] * S[i * dv + j];
        }
      const float a = cur.decay;
      for (int j = 0; j < dv; ++j) {
        const float delta = cur.beta * (cur.v[j] - a * ks[j]);
        o[j] = a * qs[j] + cur.kq * delta;
        u[j] = delta;
      }
      for (int i = 0; i < dk; ++i)
        for (int j = 0; j < dv; ++j) S[i * dv + j] = a * S[i * dv + j] + cur.k[i] * u[j];
      emit(t, o, S, 1.f);
    }
  }
};

void scale(float* x, int64_t n, float by) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= by;
}

// q and k of every token, normed (q scaled too) once per key head, and k . q, in fp32; the
// decays exp(g) and beta in fp32: what every value head's recurrence reads.
struct Prepared {
  std::vector<float> q, k, kq, decay, beta;  // [T, H_k, D_k] twice, [T, H_k], [T, H_v] twice
};

template <typename T>
Prepared prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& beta, int h_v,
                 float scale_q, bool l2norm) {
  const int64_t tokens = q.size(0), h_k = q.size(1), d = q.size(2);
  Prepared p;
  p.q.resize(tokens * h_k * d), p.k.resize(tokens * h_k * d), p.kq.resize(tokens * h_k);
  p.decay.resize(tokens * h_v), p.beta.resize(tokens * h_v);
  const T* qv = q.data_ptr<T>();
  const T* kv = k.data_ptr<T>();
  const float* gv = g.data_ptr<float>();
  const at::Tensor beta_f = beta.to(at::kFloat).contiguous();
  const float* bv = beta_f.data_ptr<float>();
  parallel_items(tokens, 8 * h_k * d, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (int64_t h = 0; h < h_k; ++h) {
        float* qn = p.q.data() + (t * h_k + h) * d;
        float* kn = p.k.data() + (t * h_k + h) * d;
        load_row(qv + t * q.stride(0) + h * q.stride(1), qn, d);
        load_row(kv + t * k.stride(0) + h * k.stride(1), kn, d);
        float sq = 0.f, sk = 0.f;
#pragma omp simd reduction(+ : sq, sk)
        for (int64_t i = 0; i < d; ++i) {
          sq += qn[i] * qn[i];
          sk += kn[i] * kn[i];
        }
        scale(qn, d, scale_q * (l2norm ? 1.f / std::sqrt(sq + 1e-6f) : 1.f));
        if (l2norm) scale(kn, d, 1.f / std::sqrt(sk + 1e-6f));
        float kq = 0.f;
#pragma omp simd reduction(+ : kq)
        for (int64_t i = 0; i < d; ++i) kq += kn[i] * qn[i];
        p.kq[t * h_k + h] = kq;
      }
      for (int64_t h = 0; h < h_v; ++h) {
        p.decay[t * h_v + h] = std::exp(gv[t * h_v + h]);
        p.beta[t * h_v + h] = bv[t * h_v + h];
      }
    }
  });
  return p;
}

struct Inputs {
  at::Tensor q, k, v, g, beta;  // q, k, v with D contiguous; g fp32 contiguous [T, H_v]
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
  in.beta = beta;
  in.h_k = q.size(1), in.h_v = v.size(1), in.dk = q.size(2), in.dv = v.size(2);
  TORCH_CHECK(in.h_v % in.h_k == 0, "expected H_v a multiple of H_k");
  TORCH_CHECK(in.dk <= kMaxDim && in.dv <= kMaxDim, "expected head dims of at most ", kMaxDim);
  in.scale = scale > 0 ? static_cast<float>(scale) : 1.f / std::sqrt(static_cast<float>(in.dk));
  in.l2norm = l2norm;
  return in;
}

// Runs tokens [begin, end) of value head h over state S (in place), writing out rows; after each
// token whose count (from begin) is in `at`, copies the state to the matching `saved` pointer.
template <typename T>
void run_head(const Inputs& in, const Prepared& p, int h, int64_t begin, int64_t end, float* S, T* out,
              const int64_t* at, float* const* saved, int64_t num_saved) {
  const int hk = h / (in.h_v / in.h_k), dk = in.dk, dv = in.dv, h_k = in.h_k, h_v = in.h_v;
  const int64_t elems = static_cast<int64_t>(dk) * dv;
  const T* v = in.v.data_ptr<T>();
  std::vector<float> vf(static_cast<size_t>(2) * dv);  // the current and the next token's v, in fp32
  int64_t next_saved = 0;
  auto tokens = [&](int64_t i) {
    const int64_t t = begin + i, row = t * h_k + hk;
    float* dst = vf.data() + (i & 1) * dv;
    load_row(v + t * in.v.stride(0) + h * in.v.stride(1), dst, dv);
    return Token{p.q.data() + row * dk, p.k.data() + row * dk, dst, p.kq[row], p.decay[t * h_v + h],
                 p.beta[t * h_v + h]};
  };
  auto emit = [&](int64_t i, const float* o, const float* state, float c) {
    store_row(o, out + ((begin + i) * h_v + h) * dv, dv);
    while (next_saved < num_saved && at[next_saved] == i + 1) {
      float* dst = saved[next_saved++];
#pragma omp simd
      for (int64_t e = 0; e < elems; ++e) dst[e] = state[e] * c;
    }
  };
  const int64_t n = end - begin;
  switch (dv) {
    case 16: Recurrence<1>::run(S, dk, n, tokens, emit); break;
    case 32: Recurrence<2>::run(S, dk, n, tokens, emit); break;
    case 64: Recurrence<4>::run(S, dk, n, tokens, emit); break;
    case 128: Recurrence<8>::run(S, dk, n, tokens, emit); break;
    case 256: Recurrence<16>::run(S, dk, n, tokens, emit); break;
    default: ScalarRecurrence::run(S, dk, dv, n, tokens, emit);
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
    const Prepared prepared = prepare<scalar_t>(in.q, in.k, in.g, in.beta, in.h_v, in.scale, in.l2norm);
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
        run_head<scalar_t>(in, prepared, h, cu[b], cu[b + 1], S, o, positions.data() + p0, saved.data(), p1 - p0);
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
    const Prepared prepared = prepare<scalar_t>(in.q, in.k, in.g, in.beta, in.h_v, in.scale, in.l2norm);
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
        run_head<scalar_t>(in, prepared, h, b, b + 1, S, o, nullptr, nullptr, 0);
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
