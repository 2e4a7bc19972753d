"""Plain-torch reference of every op the engine runs: the CPU path, and the oracle for Triton.

Rules every op keeps:
- Math in fp32. Inputs are upcast right after reading; outputs are cast back to the dtype each
  docstring names. Recurrent states are fp32 unless a docstring says otherwise. One exception:
  on a CPU, prefill attention over bf16 queries and caches runs torch's flash kernel on the bf16
  values (oneDNN's matrix engine; scores, softmax and sums accumulate in fp32 inside it), about
  2.7x faster there than in fp32; the ops on CUDA tensors, the oracles of the Triton kernels,
  stay fp32.
- Tokens are rows. One sequence is [T, H, D]; a varlen prefill concatenates B sequences' new
  tokens into [T, H, D] with `cu_seqlens_q` [B+1] int32 offsets; a decode batch is [B, H, D],
  one token per sequence.
- Units: positions and lengths count tokens, `page_table` holds page ids, a KV slot is
  `page * page_size + offset_in_page` (token units), a state slot is a row of a state pool.
- Paged KV: `k_cache`, `v_cache` are [num_pages, page_size, H_kv, D]. Token p of sequence b lives
  in page `page_table[b, p // page_size]` at offset `p % page_size`. `seq_lens` counts a
  sequence's tokens including the new ones, whose K/V are stored before attention runs. Entries of
  `page_table` past a sequence's ceil(seq_len / page_size) pages are garbage and never read; so
  are unwritten slots of the caches.
- GQA: query head h reads KV head h // (H_q // H_kv). Gated DeltaNet: value head h reads key head
  h // (H_v // H_k) (transformers' repeat_interleave).
- Gated delta rule, per value head, with state S [D_k, D_v] and per token t:
      S = S * exp(g_t);  S = S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
  g is a log decay (<= 0). With `use_qk_l2norm`, q and k are first mapped to
  x * rsqrt(sum(x * x) + 1e-6); q is then scaled by `scale` (default D_k ** -0.5).
- Causal conv: depthwise, weight [C, K], no bias, SiLU after. A conv state [C, K-1] holds the
  K-1 inputs that precede the next token, oldest first (zeros for a fresh sequence).
- Mutation: only `store_kv` (caches), `causal_conv1d_update` (conv state),
  `gated_delta_rule_step` (state) and `copy_state_slots` (pools) write into their arguments.
- Validation is cheap: ranks, sizes and dtypes raise ValueError("expected …, got …"); values
  (slots in range, page ids valid) are the caller's contract.

Must match transformers' Qwen3-Next (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn`) numerically in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

_F32 = torch.float32


def _expect_shape(name: str, t: Tensor, layout: str, shape: Sequence[int | None]) -> None:
    """Raise unless `t` has len(shape) dims and matches every non-None size."""
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"expected {name} [{layout}] = [{want}], got {list(t.shape)}")


def _expect_dtype(name: str, t: Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"expected {name} of dtype {dtype}, got {t.dtype}")


def _expect(ok: bool, what: str, got: object) -> None:
    if not ok:
        raise ValueError(f"expected {what}, got {got}")


# ---------------------------------------------------------------- paged KV and attention


def _check_caches(k_cache: Tensor, v_cache: Tensor) -> None:
    """Paged caches: [num_pages, page_size, H_kv, D], K and V alike, D contiguous. Pages may be
    strided (views over the engine's arena, one page per arena block)."""
    _expect_shape("k_cache", k_cache, "num_pages, page_size, H_kv, D", (None, None, None, None))
    _expect_shape("v_cache", v_cache, "num_pages, page_size, H_kv, D", tuple(k_cache.shape))
    _expect(k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1,
            "K and V caches with equal strides and D contiguous", (k_cache.stride(), v_cache.stride()))


def _check_store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                    slot_mapping: Tensor) -> tuple[int, int]:
    """store_kv's arguments as every implementation takes them; returns (H_kv, D)."""
    _check_caches(k_cache, v_cache)
    _, _, h_kv, d = k_cache.shape
    _expect_shape("key", key, "T, H_kv, D", (None, h_kv, d))
    _expect_shape("value", value, "T, H_kv, D", tuple(key.shape))
    _expect_shape("slot_mapping", slot_mapping, "T", (key.shape[0],))
    _expect_dtype("slot_mapping", slot_mapping, torch.int64)
    return h_kv, d


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write each token's K/V into its cache slot, cast to the cache dtype; negative slots are skipped.

    key, value [T, H_kv, D]; k_cache, v_cache [num_pages, page_size, H_kv, D] (written in place;
    pages may be strided); slot_mapping [T] int64, slot = page * page_size + offset_in_page.
    """
    _check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = key[keep].to(k_cache.dtype)
    v_cache[pages, offsets] = value[keep].to(v_cache.dtype)


def _check_paged(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                 seq_lens: Tensor) -> tuple[int, int]:
    """Validate the inputs both attention ops share; return (batch size, query heads per KV head)."""
    _check_caches(k_cache, v_cache)
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    _expect_shape("query", query, "T, H_q, D", (None, None, d))
    _expect(query.shape[1] % h_kv == 0, f"H_q a multiple of H_kv = {h_kv}", query.shape[1])
    _expect_shape("page_table", page_table, "B, max_pages", (None, None))
    _expect_dtype("page_table", page_table, torch.int32)
    _expect_shape("seq_lens", seq_lens, "B", (page_table.shape[0],))
    _expect_dtype("seq_lens", seq_lens, torch.int32)
    return page_table.shape[0], query.shape[1] // h_kv


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float, plan=None) -> Tensor:
    """Causal attention of B sequences' new tokens over their cached prefix and themselves.

    query [T, H_q, D] (new tokens of B sequences concatenated); k_cache, v_cache
    [num_pages, page_size, H_kv, D]; page_table [B, max_pages] int32; cu_seqlens_q [B+1] int32;
    seq_lens [B] int32, totals including the new tokens. New token i of sequence b sits at
    position seq_lens[b] - q_len_b + i and attends to positions [0, that position].
    Returns [T, H_q, D] in query's dtype. `plan` (cairn.kernels.varlen_plan.VarlenPlan of cu_seqlens_q),
    when given, spares reading the boundaries back.
    """
    batch, group = _check_paged(query, k_cache, v_cache, page_table, seq_lens)
    _expect_shape("cu_seqlens_q", cu_seqlens_q, "B+1", (batch + 1,))
    _expect_dtype("cu_seqlens_q", cu_seqlens_q, torch.int32)
    page_size = k_cache.shape[1]
    cu, lens = (cu_seqlens_q.tolist() if plan is None else plan.cu), seq_lens.tolist()
    _expect(cu[0] == 0 and cu[-1] == query.shape[0], f"cu_seqlens_q from 0 to T = {query.shape[0]}", cu)
    out, work, h_kv = torch.empty_like(query), _attention_dtype(query), k_cache.shape[2]
    for b in range(batch):
        start, end, total = cu[b], cu[b + 1], lens[b]
        n_new = end - start
        _expect(0 <= n_new <= total <= page_table.shape[1] * page_size,
                f"0 <= q_len <= seq_len <= max_pages * page_size for sequence {b}", (n_new, total))
        if n_new == 0:
            continue
        pages = page_table[b, : -(-total // page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:total].to(work).transpose(0, 1)  # [H_kv, total, D]
        v = v_cache[pages].flatten(0, 1)[:total].to(work).transpose(0, 1)
        q = query[start:end].to(work).transpose(0, 1)  # [H_q, n_new, D]
        cached = total - n_new  # keys before the new tokens: all visible; the new ones causally
        o, lse = _flash(q[None], k[None, :, cached:].repeat_interleave(group, 1),
                        v[None, :, cached:].repeat_interleave(group, 1), True, scale)
        if cached:  # every new token sees them all: a KV head's query heads fold into its rows
            folded = q.reshape(h_kv, group * n_new, q.shape[-1])[None]
            o_old, lse_old = _flash(folded, k[None, :, :cached], v[None, :, :cached], False, scale)
            o_old, lse_old = o_old.reshape(o.shape), lse_old.reshape(lse.shape)
            top = torch.maximum(lse, lse_old)
            w, w_old = (lse - top).exp()[..., None], (lse_old - top).exp()[..., None]
            o = (o.float() * w + o_old.float() * w_old) / (w + w_old)
        out[start:end] = o[0].transpose(0, 1).to(query.dtype)
    return out


def _attention_dtype(query: Tensor) -> torch.dtype:
    """fp32, except bf16 on a CPU (the module's one exception to fp32 math, see its rules)."""
    return torch.bfloat16 if query.device.type == "cpu" and query.dtype == torch.bfloat16 else _F32


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale) v over [1, H, n, D] fp32 blocks (causal: query i sees keys <= i), and
    the rows' log-sum-exp [1, H, n], with torch's CPU flash-attention kernel: two blocks' results
    merge exactly by their log-sum-exps, so a prefix needs no mask. Elsewhere (references forced on
    CUDA tensors), the same, spelled out."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ v, lse


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    """One new token per sequence attends to its sequence's positions [0, seq_lens[b]).

    query [B, H_q, D]; k_cache, v_cache [num_pages, page_size, H_kv, D]; page_table
    [B, max_pages] int32; seq_lens [B] int32 (>= 1, the new token's K/V already stored).
    Returns [B, H_q, D] in query's dtype. Batched: pages of every sequence are gathered into a
    [B, max(seq_lens), H_kv, D] tensor, padding zeroed and masked out of one softmax.
    """
    batch, group = _check_paged(query, k_cache, v_cache, page_table, seq_lens)
    _expect_shape("query", query, "B, H_q, D", (batch, None, None))
    if batch == 0:
        return torch.empty_like(query)
    page_size, h_kv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    lens = seq_lens.long()
    longest, shortest = int(lens.max()), int(lens.min())
    _expect(1 <= shortest and longest <= page_table.shape[1] * page_size,
            "1 <= seq_lens <= max_pages * page_size", (shortest, longest))
    n_pages = -(-longest // page_size)
    # Garbage page-table entries (past a sequence's own pages) are redirected to page 0, then masked.
    own_page = torch.arange(n_pages, device=lens.device)[None, :] < (lens[:, None] + page_size - 1) // page_size
    pages = torch.where(own_page, page_table[:, :n_pages].long(), 0)  # [B, n_pages]
    live = torch.arange(longest, device=lens.device)[None, :] < lens[:, None]  # [B, longest]
    # Padding scores are masked to -inf below; padding values must be zeroed too (0 * NaN = NaN).
    k = k_cache[pages].flatten(1, 2)[:, :longest].float()  # [B, longest, H_kv, D]
    v = v_cache[pages].flatten(1, 2)[:, :longest].float()  # a fresh copy: safe to zero in place
    v.masked_fill_(~live[:, :, None, None], 0.0)
    q = query.float().reshape(batch, h_kv, group, d)
    scores = torch.einsum("bhgd,bkhd->bhgk", q, k) * scale  # [B, H_kv, group, longest]
    probs = scores.masked_fill(~live[:, None, None, :], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, v)
    return out.reshape(batch, h_kv * group, d).to(query.dtype)


# ---------------------------------------------------------------- causal conv1d


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """SiLU of the causal depthwise conv over one sequence, continuing from `conv_state`.

    x [T, C]; weight [C, K]; conv_state [C, K-1] (the inputs preceding x; None = zeros).
    Returns (out [T, C] in x's dtype, new_state [C, K-1] = the last K-1 inputs of
    cat(conv_state, x) along time, in conv_state's dtype, fp32 if None).
    """
    _expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    _expect_shape("x", x, "T, C", (None, channels))
    state_dtype = _F32 if conv_state is None else conv_state.dtype
    if conv_state is None:
        conv_state = torch.zeros(channels, width - 1, dtype=_F32, device=x.device)
    _expect_shape("conv_state", conv_state, "C, K-1", (channels, width - 1))
    history = torch.cat((conv_state.float().t(), x.float()))  # [K-1+T, C]
    new_state = history[history.shape[0] - (width - 1):].t().to(state_dtype)
    return F.silu(_windows(history, weight, x.shape[0])).to(x.dtype), new_state


def _windows(history: Tensor, weight: Tensor, rows: int) -> Tensor:
    """The depthwise causal conv over `history` [rows + K-1, C] fp32: row r of the result is
    sum_j weight[:, j] * history[r + j] ([rows, C] fp32; a multiply-add per tap, about twice as
    fast on CPU as conv1d's depthwise kernel)."""
    w = weight.float()
    out = history[0:rows] * w[:, 0]
    for j in range(1, w.shape[1]):
        out.addcmul_(history[j:j + rows], w[:, j])
    return out


def causal_conv1d_update(x: Tensor, weight: Tensor, conv_state: Tensor) -> Tensor:
    """One decode step of `causal_conv1d` for B sequences.

    x [B, C]; weight [C, K]; conv_state [B, C, K-1], updated in place (shifted left, x appended).
    Returns silu(conv) [B, C] in x's dtype.
    """
    _expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    _expect_shape("x", x, "B, C", (None, channels))
    _expect_shape("conv_state", conv_state, "B, C, K-1", (x.shape[0], channels, width - 1))
    window = torch.cat((conv_state.float(), x.float()[:, :, None]), dim=2)  # [B, C, K]
    out = (window * weight.float()).sum(dim=2)
    conv_state.copy_(window[:, :, 1:])
    return F.silu(out).to(x.dtype)


# ---------------------------------------------------------------- gated delta rule


def _check_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, rows: str) -> tuple[int, ...]:
    """Validate q, k [N, H_k, D_k], v [N, H_v, D_v], g, beta [N, H_v]; return (N, H_v, D_k, D_v)."""
    _expect_shape("q", q, f"{rows}, H_k, D_k", (None, None, None))
    n, h_k, d_k = q.shape
    _expect_shape("k", k, f"{rows}, H_k, D_k", (n, h_k, d_k))
    _expect_shape("v", v, f"{rows}, H_v, D_v", (n, None, None))
    h_v, d_v = v.shape[1], v.shape[2]
    _expect(h_v % h_k == 0, f"H_v a multiple of H_k = {h_k}", h_v)
    _expect_shape("g", g, f"{rows}, H_v", (n, h_v))
    _expect_shape("beta", beta, f"{rows}, H_v", (n, h_v))
    return n, h_v, d_k, d_v


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
             use_qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32 copies of the inputs, q and k normalised, q scaled, key heads repeated to H_v."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    repeat = v.shape[-2] // k.shape[-2]
    return q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2), v, g, beta


def _delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of the recurrence: q, k [..., D_k], v [..., D_v], g, beta [...], state [..., D_k, D_v]."""
    state = state * g.exp()[..., None, None]
    recalled = torch.einsum("...k,...kv->...v", k, state)
    state = state + k[..., :, None] * (beta[..., None] * (v - recalled))[..., None, :]
    return torch.einsum("...k,...kv->...v", q, state), state


def _initial_state(initial_state: Tensor | None, h_v: int, d_k: int, d_v: int, device: torch.device) -> Tensor:
    if initial_state is None:
        return torch.zeros(h_v, d_k, d_v, dtype=_F32, device=device)
    _expect_shape("initial_state", initial_state, "H_v, D_k, D_v", (h_v, d_k, d_v))
    return initial_state.float()


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None, *, scale: float | None = None,
                               use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """The gated delta rule over one sequence, token by token (the oracle for the chunked form).

    q, k [T, H_k, D_k]; v [T, H_v, D_v]; g, beta [T, H_v]; initial_state [H_v, D_k, D_v] or None.
    Returns (out [T, H_v, D_v] in v's dtype, final_state [H_v, D_k, D_v] fp32).
    """
    length, h_v, d_k, d_v = _check_delta(q, k, v, g, beta, "T")
    state = _initial_state(initial_state, h_v, d_k, d_v, v.device)
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    out = torch.empty(length, h_v, d_v, dtype=_F32, device=v.device)
    for t in range(length):
        out[t], state = _delta_step(q[t], k[t], vf[t], g[t], beta[t], state)
    return out.to(v.dtype), state


def _chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """The state-independent terms of every chunk at once (UT transform).

    q, k [..., C, D_k]; v [..., C, D_v]; g, beta [..., C] (any leading dims: chunks, sequences,
    heads). With G the in-chunk cumulative log decay and A[t, j] = beta_t e^(G_t - G_j) k_t.k_j
    for j < t, a chunk that starts from state S has updates u = W - K S where (I + A) W = beta v
    and (I + A) K = beta e^G k. Then o = (e^G q) S + (q k^T * D) u, and the state after the
    first r tokens is e^(G_r) S + sum_{j<r} e^(G_r - G_j) k_j u_j^T, with D[t, j] = e^(G_t - G_j)
    for j <= t. Returns (W, K, intra = q k^T * D, decayed q, cum G).
    """
    size = g.shape[-1]
    cum = g.cumsum(dim=-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()
    # I + A: the solve reads only the strict lower triangle (unitriangular, lower), so neither
    # the unit diagonal nor the zeros above it are written
    system = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta[..., :, None])
    rhs = torch.cat((beta[..., None] * v, (beta * cum.exp())[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w, kk = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = (q @ k.transpose(-1, -2)).mul_(decay)
    return w, kk, intra, cum.exp()[..., None] * q, cum


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, *, scale: float | None = None,
                           chunk_size: int = 64, use_qk_l2norm: bool = True,
                           state_positions: Sequence[int] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """The gated delta rule over one sequence, chunk by chunk; also the states at chosen positions.

    q, k [T, H_k, D_k]; v [T, H_v, D_v]; g, beta [T, H_v]; initial_state [H_v, D_k, D_v] or None;
    T >= 1. The in-chunk terms of all chunks are solved in one batch; only the state scan loops.
    state_positions: strictly increasing ints, 0 < p <= T, anywhere (not only on chunk bounds).
    Returns (out [T, H_v, D_v] in v's dtype, final_state [H_v, D_k, D_v] fp32, states
    [len(state_positions), H_v, D_k, D_v] fp32, states[i] being the state after the first
    state_positions[i] tokens).
    """
    length, h_v, d_k, d_v = _check_delta(q, k, v, g, beta, "T")
    _expect(length >= 1, "T >= 1", length)
    _expect(chunk_size >= 1, "chunk_size >= 1", chunk_size)
    positions = [int(p) for p in state_positions]
    _expect(all(0 < p <= length for p in positions) and all(a < b for a, b in zip(positions, positions[1:])),
            f"state_positions strictly increasing in (0, {length}]", positions)
    state = _initial_state(initial_state, h_v, d_k, d_v, v.device)
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    size = min(chunk_size, length)
    pad = -(-length // size) * size - length  # padded tokens have g = 0 and beta = 0: they change nothing
    q, k, vf, g, beta = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))[None] for t in (q, k, vf, g, beta))
    out, state, saved = delta_chunks(q, k, vf, g, beta, state[None], [positions], size)
    return out[0, :length].to(v.dtype), state[0], saved


def delta_chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                 positions: Sequence[Sequence[int]], size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked rule over B sequences at once, each padded to L = N * size tokens.

    q, k [B, L, H_v, D_k], v [B, L, H_v, D_v], g, beta [B, L, H_v], fp32 and prepared
    (`_prepare`), zeros past each sequence's end (g = beta = 0 there: no effect); state
    [B, H_v, D_k, D_v] fp32, each sequence's initial state (not modified); positions[b]: the
    states wanted, 0 < p <= its length. The in-chunk terms of every chunk of every sequence are
    solved in one batch; only the state scan loops, over the chunks. Returns (out [B, L, H_v, D_v]
    fp32, final states [B, H_v, D_k, D_v], the states at the positions [P, H_v, D_k, D_v],
    sequence by sequence, position by position).
    """
    batch, length, h_v = g.shape
    d_v, num_chunks = v.shape[-1], length // size

    def chunked(t: Tensor) -> Tensor:  # [B, L, H, ...] -> [N, B, H, C, ...], chunk-major and contiguous:
        t = t.reshape(batch, num_chunks, size, *t.shape[2:])  # the scan reads chunk n as one block, and
        return t.permute(1, 0, 3, 2, *range(4, t.dim())).contiguous()  # no product copies its operands

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    w, kk, intra, q_decayed, cum = _chunk_terms(q, k, v, g, beta)
    k_to_end = ((cum[..., -1:] - cum).exp()[..., None] * k).transpose(-1, -2)  # [N, B, H, D_k, C]
    decay_end = cum[..., -1].exp()[..., None, None]  # [N, B, H, 1, 1]
    out = torch.empty(num_chunks, batch, h_v, size, d_v, dtype=_F32, device=v.device)
    wanted: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (sequence, tokens into it, order)
    order = 0
    for b, ps in enumerate(positions):
        for p in ps:
            wanted.setdefault((p - 1) // size, []).append((b, p - ((p - 1) // size) * size, order))
            order += 1
    saved: list[Tensor | None] = [None] * order
    for n in range(num_chunks):
        u = w[n] - kk[n] @ state  # [B, H, C, D_v]
        torch.matmul(q_decayed[n], state, out=out[n])
        out[n].add_(intra[n] @ u)
        for b, r, at in wanted.get(n, []):  # state after the first r tokens of this chunk
            c = cum[n, b, :, :r]
            part = (c[:, -1:] - c).exp()[..., None] * k[n, b, :, :r]
            saved[at] = c[:, -1].exp()[:, None, None] * state[b] + part.transpose(-1, -2) @ u[b, :, :r]
        state = decay_end[n] * state + k_to_end[n] @ u
    out = out.permute(1, 0, 3, 2, 4).reshape(batch, length, h_v, d_v)
    states = torch.stack(saved) if saved else torch.empty(0, h_v, k.shape[-1], d_v, dtype=_F32, device=v.device)
    return out, state, states


def gated_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
                          scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    """One decode token for each of B sequences.

    q, k [B, H_k, D_k]; v [B, H_v, D_v]; g, beta [B, H_v]; state [B, H_v, D_k, D_v] fp32,
    updated in place. Returns out [B, H_v, D_v] in v's dtype.
    """
    batch, h_v, d_k, d_v = _check_delta(q, k, v, g, beta, "B")
    _expect_shape("state", state, "B, H_v, D_k, D_v", (batch, h_v, d_k, d_v))
    _expect_dtype("state", state, _F32)
    _expect(state.is_contiguous(), "a contiguous state (it is updated in place)", "a strided view")
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    # The decode hot path on CPU: batched matmuls and in-place updates touch the state a few
    # times instead of materialising an outer product per step.
    flat = state.view(batch * h_v, d_k, d_v)
    flat.mul_(g.exp().reshape(-1, 1, 1))
    k_rows = k.reshape(batch * h_v, 1, d_k)
    recalled = torch.bmm(k_rows, flat)  # [B*H_v, 1, D_v]
    delta = (vf.reshape(batch * h_v, 1, d_v) - recalled) * beta.reshape(-1, 1, 1)
    flat.baddbmm_(k_rows.transpose(1, 2), delta)
    out = torch.bmm(q.reshape(batch * h_v, 1, d_k), flat)
    return out.view(batch, h_v, d_v).to(v.dtype)


# ---------------------------------------------------------------- state pools


def copy_state_slots(tensors: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """For each pool (dim 0 = slot): tensor[dst_slots] = tensor[src_slots], in place.

    src_slots, dst_slots [N] int64, disjoint.
    """
    _expect_shape("src_slots", src_slots, "N", (None,))
    _expect_shape("dst_slots", dst_slots, "N", (src_slots.shape[0],))
    _expect_dtype("src_slots", src_slots, torch.int64)
    _expect_dtype("dst_slots", dst_slots, torch.int64)
    for pool in tensors:
        _expect(pool.dim() >= 1, "state pools with a slot dim", list(pool.shape))
        pool.index_copy_(0, dst_slots, pool.index_select(0, src_slots))


# ---------------------------------------------------------------- sampling


def argmax_rows(logits: Tensor) -> Tensor:
    """Greedy sampling's ids: logits [N, V] (any float dtype) -> [N] int64, the first index of each
    row's maximum, or -1 for a row whose maximum is not finite (a NaN, a +inf, all -inf)."""
    _expect_shape("logits", logits, "N, V", (None, None))
    best, index = torch.max(logits, dim=-1)
    return torch.where(torch.isfinite(best), index, -1)
