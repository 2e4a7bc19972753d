// Prefill attention on CPU with the AMX tile unit: flash attention over paged K/V in bf16.
//
// Op (shapes and conventions are kernels.reference's paged_attention_prefill):
//   attention_prefill(query [T, H_q, 64] bf16, k_cache, v_cache [num_pages, page_size, H_kv, 64]
//                     bf16, page_table [B, max_pages] int32, cu [B+1] (host), seq_lens [B] int32,
//                     scale) -> [T, H_q, 64] bf16
//   amx_available() -> bool: whether this build and this CPU run it (else the caller falls back).
// New token i of sequence b sits at position seq_len - q_len + i and sees keys [0, position].
//
// How: each sequence's K and V (cached and new, for one KV head) are first laid out in the tile
// unit's operand layouts, in blocks of 32 keys (K transposed in pairs of channels, V in pairs of
// keys). Then each work item, 16 query rows of one query head, keeps its Q in two tiles and its
// output in four fp32 tiles for the whole walk over the key blocks: per block, S = Q K^T in one
// tile (twice, for 32 keys), the softmax in AVX-512 (a row of 16 scores is one vector), P rounded
// to bf16 as torch's flash kernel rounds it, and O += P V in the tiles. The running maximum is
// applied lazily: O is rescaled (taken out of the tiles) only when a row's maximum grows by more
// than kLazy, so the exponentials stay below e^kLazy; O / l at the end. Items are taken longest
// first from a shared counter (dynamic), as the causal walk makes later rows longer.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <vector>

#include "native.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__) && defined(__linux__)
#define CAIRN_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>
#endif

namespace cairn {
namespace {

constexpr int kDim = 64;        // the head dim this kernel takes
constexpr int kKeys = 32;       // keys per block (the k of O += P V)
constexpr int kRows = 16;       // query rows per item (a tile's rows)
constexpr float kLazy = 8.f;    // how far a row's maximum may outgrow the one its exponentials use

#if defined(CAIRN_AMX)

bool amx_ready() {
  static const bool ready = [] {
    // Linux grants a process the tile unit's state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {  // eight tiles of 16 rows x 64 bytes
  TileConfig cfg{};
  cfg.palette = 1;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// K of one (sequence, KV head), transposed in channel pairs: block kb, channel half s (32
// channels), key half j (16 keys): 16 rows (channel pairs) x 16 keys x 2. V in key pairs: block
// kb, channel tile t (16 channels): 16 rows (key pairs) x 16 channels x 2. Keys past the end: 0.
struct Packed {
  std::vector<uint16_t> kt, v;
  int64_t blocks = 0;
  const uint16_t* k_tile(int64_t kb, int s, int j) const { return kt.data() + ((kb * 2 + s) * 2 + j) * 512; }
  const uint16_t* v_tile(int64_t kb, int t) const { return v.data() + (kb * 4 + t) * 512; }
};

void pack(Packed& p, const uint16_t* kc, const uint16_t* vc, const int32_t* pages, int64_t len, int64_t page_size,
          int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1) {
  p.blocks = (len + kKeys - 1) / kKeys;
  p.kt.assign(p.blocks * 4 * 512, 0);
  p.v.assign(p.blocks * 4 * 512, 0);
  for (int64_t n = 0; n < len; ++n) {
    const int64_t page = pages[n / page_size], off = n % page_size;
    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(kc + page * ks0 + off * ks1);  // channel pairs
    const uint16_t* vrow = vc + page * vs0 + off * vs1;
    const int64_t kb = n / kKeys, j = (n % kKeys) / 16, c = n % 16, pair = (n % kKeys) / 2, e = n % 2;
    for (int s = 0; s < 2; ++s) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(p.kt.data() + ((kb * 2 + s) * 2 + j) * 512);
      for (int r = 0; r < 16; ++r) tile[r * 16 + c] = k32[s * 16 + r];
    }
    for (int t = 0; t < 4; ++t) {
      uint16_t* tile = p.v.data() + (kb * 4 + t) * 512;
      for (int ch = 0; ch < 16; ++ch) tile[pair * 32 + ch * 2 + e] = vrow[t * 16 + ch];
    }
  }
}

struct Item {
  int64_t b, hq, first, cost;  // sequence, query head, first new token of the 16, key blocks walked
};

void run_item(const Item& it, const Packed& p, const uint16_t* q, int64_t qs0, int64_t qs1, uint16_t* out,
              int64_t os0, int64_t os1, int64_t row0, int64_t n_new, int64_t len, float scale) {
  const int64_t cached = len - n_new, rows = std::min<int64_t>(kRows, n_new - it.first);
  alignas(64) uint16_t qbuf[kRows * kDim];
  alignas(64) float sbufs[2][kRows * kKeys];
  alignas(64) uint16_t pbuf[kRows * kKeys];
  alignas(64) float obuf[kRows * kDim];
  float m[kRows];
  vec16 lsum[kRows];  // each row's sum of probabilities, in 16 lanes
  int64_t limit[kRows];  // the last key each row sees
  for (int r = 0; r < kRows; ++r) {
    m[r] = -std::numeric_limits<float>::infinity(), lsum[r] = vec16{};
    limit[r] = r < rows ? cached + it.first + r : -1;
  }
  for (int r = 0; r < kRows; ++r) {
    if (r < rows) {
      std::memcpy(qbuf + r * kDim, q + (row0 + it.first + r) * qs0 + it.hq * qs1, kDim * 2);
    } else {
      std::memset(qbuf + r * kDim, 0, kDim * 2);
    }
  }
  configure_tiles();
  _tile_loadd(0, qbuf, kDim * 2);
  _tile_loadd(1, qbuf + 32, kDim * 2);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  const int64_t last = limit[rows - 1], blocks = last / kKeys + 1;
  const vec16 lane = [] { vec16 v; for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(i); return v; }();
  // S of the next block is issued to the tile unit before this block's softmax, which the
  // vector units run meanwhile: the scores alternate between two buffers.
  auto scores = [&](int64_t kb, float* dst) {
    for (int j = 0; j < 2; ++j) {  // S for keys 16 j .. 16 j + 15 of the block
      _tile_zero(6);
      _tile_loadd(7, p.k_tile(kb, 0, j), 64);
      _tile_dpbf16ps(6, 0, 7);
      _tile_loadd(7, p.k_tile(kb, 1, j), 64);
      _tile_dpbf16ps(6, 1, 7);
      _tile_stored(6, dst + 16 * j, kKeys * 4);
    }
  };
  scores(0, sbufs[0]);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    float* sbuf = sbufs[kb & 1];
    if (kb + 1 < blocks) scores(kb + 1, sbufs[(kb + 1) & 1]);
    const bool masked = (kb + 1) * kKeys - 1 > limit[0];  // some row sees only part of this block
    bool rescale = false;
    float grow[kRows];
    const vec16 minus = vsplat(-std::numeric_limits<float>::infinity());
    for (int r = 0; r < kRows; ++r) {
      // scores unscaled here (scale > 0 keeps their order); m[r] is in the same units
      vec16 s0 = vload(sbuf + r * kKeys), s1 = vload(sbuf + r * kKeys + 16);
      if (masked) {
        const vec16 first = vsplat(static_cast<float>(kb * kKeys - limit[r]));  // key - limit, as floats
        s0 = first + lane > 0.f ? minus : s0;
        s1 = first + lane + 16.f > 0.f ? minus : s1;
      }
      grow[r] = 1.f;
      const vec16 both = s0 > s1 ? s0 : s1;
      const vec16 bound = vsplat(m[r] + kLazy / scale);  // -inf until the row has a maximum
      if (__builtin_expect(vmax(both > bound ? both : bound) > bound[0] || m[r] == -INFINITY, 0)) {
        const float top = vmax(both);
        if (top > -INFINITY && (top > m[r] + kLazy / scale || m[r] == -INFINITY)) {
          if (m[r] > -INFINITY) {
            grow[r] = std::exp((m[r] - top) * scale);
            rescale = true;
          }
          m[r] = top;
        }
      }
      const vec16 shift = vsplat(m[r] == -INFINITY ? 0.f : -m[r] * scale), sv = vsplat(scale);
      const vec16 p0 = vexp_coarse(s0 * sv + shift), p1 = vexp_coarse(s1 * sv + shift);
      lsum[r] = lsum[r] * grow[r] + (p0 + p1);
      vstore_from_f32(reinterpret_cast<c10::BFloat16*>(pbuf + r * kKeys), p0);
      vstore_from_f32(reinterpret_cast<c10::BFloat16*>(pbuf + r * kKeys + 16), p1);
    }
    if (rescale) {  // O's rows that outgrew their maximum, scaled: out of the tiles and back
      _tile_stored(2, obuf, kDim * 4);
      _tile_stored(3, obuf + 16, kDim * 4);
      _tile_stored(4, obuf + 32, kDim * 4);
      _tile_stored(5, obuf + 48, kDim * 4);
      for (int r = 0; r < kRows; ++r) {
        if (grow[r] == 1.f) continue;
        for (int t = 0; t < 4; ++t) vstore(obuf + r * kDim + 16 * t, vload(obuf + r * kDim + 16 * t) * grow[r]);
      }
      _tile_loadd(2, obuf, kDim * 4);
      _tile_loadd(3, obuf + 16, kDim * 4);
      _tile_loadd(4, obuf + 32, kDim * 4);
      _tile_loadd(5, obuf + 48, kDim * 4);
    }
    _tile_loadd(6, pbuf, kKeys * 2);
    _tile_loadd(7, p.v_tile(kb, 0), 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(7, p.v_tile(kb, 1), 64);
    _tile_dpbf16ps(3, 6, 7);
    _tile_loadd(7, p.v_tile(kb, 2), 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(7, p.v_tile(kb, 3), 64);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(2, obuf, kDim * 4);
  _tile_stored(3, obuf + 16, kDim * 4);
  _tile_stored(4, obuf + 32, kDim * 4);
  _tile_stored(5, obuf + 48, kDim * 4);
  _tile_release();
  for (int r = 0; r < rows; ++r) {
    const float inv = 1.f / vsum(lsum[r]);
    c10::BFloat16* dst = reinterpret_cast<c10::BFloat16*>(out + (row0 + it.first + r) * os0 + it.hq * os1);
    for (int t = 0; t < 4; ++t) vstore_from_f32(dst + 16 * t, vload(obuf + r * kDim + 16 * t) * inv);
  }
}

at::Tensor attention_prefill(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& page_table, at::IntArrayRef cu, const at::Tensor& seq_lens,
                             double scale) {
  TORCH_CHECK(amx_ready(), "the tile unit is not available to this process");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "expected bf16 query and caches");
  TORCH_CHECK(query.dim() == 3 && query.size(2) == kDim && k_cache.size(3) == kDim && query.stride(2) == 1 &&
                  k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "expected a head dim of ", kDim, ", contiguous");
  const int64_t batch = static_cast<int64_t>(cu.size()) - 1, h_q = query.size(1), h_kv = k_cache.size(2);
  const int64_t group = h_q / h_kv, page_size = k_cache.size(1);
  const at::Tensor table = page_table.contiguous(), lens_t = seq_lens.contiguous();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  at::Tensor out = at::empty(query.sizes(), query.options());
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // K and V of every (sequence, KV head), in the tiles' layouts
  std::vector<Packed> packed(batch * h_kv);
  const int threads = at::get_num_threads();
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
  {
    for (int64_t i = next++; i < batch * h_kv; i = next++) {
      const int64_t b = i / h_kv, h = i % h_kv;
      if (cu[b + 1] == cu[b]) continue;
      pack(packed[i], kc + h * k_cache.stride(2), vc + h * v_cache.stride(2), table.data_ptr<int32_t>() + b * table.stride(0),
           lens[b], page_size, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1));
    }
  }
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n_new = cu[b + 1] - cu[b], cached = lens[b] - n_new;
    for (int64_t first = 0; first < n_new; first += kRows)
      for (int64_t hq = 0; hq < h_q; ++hq)
        items.push_back({b, hq, first, (cached + std::min(first + kRows, n_new)) / kKeys + 1});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  next = 0;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const float s = static_cast<float>(scale);
#pragma omp parallel num_threads(threads)
  {
    for (int64_t i = next++; i < n_items; i = next++) {
      const Item& it = items[i];
      run_item(it, packed[it.b * h_kv + it.hq / group], q, query.stride(0), query.stride(1), o, out.stride(0),
               out.stride(1), cu[it.b], cu[it.b + 1] - cu[it.b], lens[it.b], s);
    }
  }
  return out;
}

bool amx_available() { return amx_ready(); }

#else

at::Tensor attention_prefill(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             at::IntArrayRef, const at::Tensor&, double) {
  TORCH_CHECK(false, "this build of the CPU kernels has no AMX prefill attention");
}

bool amx_available() { return false; }

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(cairn_cpu, m) {
  m.def("attention_prefill(Tensor query, Tensor k_cache, Tensor v_cache, Tensor page_table, int[] cu, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
}

TORCH_LIBRARY_IMPL(cairn_cpu, CPU, m) {
  m.impl("attention_prefill", &attention_prefill);
}

}  // namespace cairn
