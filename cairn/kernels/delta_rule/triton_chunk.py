"""Triton gated delta rule, chunked (64 tokens) for prefill: varlen batches, states in slots, and
the states at requested positions. The token-by-token forms live in `triton_delta_recurrent`.

Same contracts as `reference.chunk_gated_delta_rule` and
`reference.chunk_gated_delta_rule_varlen`. Shapes: q, k [T, H_k, D_k]; v [T, H_v, D_v];
g, beta [T, H_v] (B sequences concatenated, cu_seqlens [B+1] int32); a state pool
[num_slots, H_v, D_k, D_v] fp32 (any strides) indexed by state_slots [B] int64 (distinct): a
sequence starts from its slot and leaves its final state there. Value head h reads key head
h // (H_v / H_k). States are fp32; scratch and matmul operands are in the input dtype (fp32 in,
exact fp32 dots; bf16 in, tensor cores).

States at positions: the host cuts every sequence into chunks of at most 64 tokens that also end
at each requested position, so the state after p tokens is a chunk's end state: exact for any
0 < p <= T (page boundaries, not only multiples of 64), for one shorter chunk per position. The
chunk_size argument is accepted for parity with the reference and not used.

Launches (NC chunks; rows of a chunk past its length read g = beta = 0, k = v = 0: no effect):
1. `_l2norm_kernel`, grid (cdiv(T * H_k, 16),): q, k normalised (q also scaled), contiguous.
2. `_chunk_prepare_kernel` (NC, H_v): G = cumsum g; A = beta_i k_i.k_j e^(G_i - G_j), i > j;
   T = (I + A)^-1 (16x16 diagonal blocks by forward substitution, the rest by a block Neumann
   series); w = T (beta e^G k), u = T (beta v).
3. `_chunk_scan_kernel` (B, H_v, cdiv(D_v, BV)): per sequence, chunk by chunk, the state tile h
   in registers: h saved for step 4; u becomes v_new = u - w h; h = e^(G_last) h +
   k^T (e^(G_last - G) v_new); the end states of chunks that close a requested position are saved.
4. `_chunk_out_kernel` (NC, H_v, cdiv(D_v, BV)): o = (e^G q) h + (q k^T e^(G_i - G_j), j <= i) v_new.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common import triton_helpers as tc
from cairn.kernels.common.checks import check_delta, check_state_pool, expect, expect_dtype, expect_shape
from cairn.kernels.common.varlen_plan import VarlenPlan, checked_plan
from cairn.kernels.delta_rule.tuning import CHUNK_TUNE, DELTA_CHUNK, OUT_CONFIGS

CHUNK = DELTA_CHUNK
BT = tl.constexpr(CHUNK)
F32 = tl.float32


@triton.jit(do_not_specialize=["n_rows"])
def _l2norm_kernel(x, y, s_t, s_h, n_rows, H, D, scale, ROWS: tl.constexpr, BD: tl.constexpr,
                   L2: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (d < D)[None, :]
    t = (rows // H).to(tl.int64)
    v = tl.load(x + t[:, None] * s_t + (rows % H)[:, None] * s_h + d[None, :], mask=mask, other=0.0).to(F32)
    if L2:
        v = v * tl.rsqrt(tl.sum(v * v, axis=1) + 1e-6)[:, None]
    tl.store(y + rows[:, None].to(tl.int64) * D + d[None, :], (v * scale).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _invert_unit_lower(a, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower [64, 64] a: diagonal 16x16 blocks by forward substitution
    (the four at once), then (I + A)^-1 = (I - N + N^2 - N^3) D^-1 with N = D^-1 L, L the part of a
    below the diagonal blocks (N is nilpotent: N^4 = 0 over four blocks)."""
    r = tl.arange(0, 64)
    b = tl.arange(0, 4)
    same = b[:, None, None, None] == b[None, None, :, None]  # [4, 1, 4, 1]
    t = -tl.sum(tl.where(same, tl.reshape(a, (4, 16, 4, 16)), 0.0), axis=2)  # [4, 16, 16] diagonal blocks
    i16 = tl.arange(0, 16)
    for i in range(1, 16):
        pick = (i16 == i)[None, :, None]
        x = tl.sum(tl.where(pick, t, 0.0), axis=1)  # row i of each block, still -a[i, :]
        x = x + tl.sum(x[:, :, None] * t, axis=1)  # rows above i already hold the inverse's rows
        t = tl.where(pick, x[:, None, :], t)
    t = t + (i16[:, None] == i16[None, :]).to(F32)[None, :, :]
    d_inv = tl.reshape(tl.where(same, t[:, :, None, :], 0.0), (64, 64))
    n = tl.dot(d_inv, tl.where((r[:, None] // 16) > (r[None, :] // 16), a, 0.0), input_precision=PREC)
    n2 = tl.dot(n, n, input_precision=PREC)
    eye = (r[:, None] == r[None, :]).to(F32)
    series = eye - n + n2 - tl.dot(n2, n, input_precision=PREC)
    return tl.dot(series, d_inv, input_precision=PREC)


@triton.jit(do_not_specialize_on_alignment=["chunk_start", "chunk_len"])
def _chunk_prepare_kernel(k_ptr, v_ptr, g_ptr, b_ptr, chunk_start, chunk_len, gbuf, wbuf, ubuf,
                          sv_t, sv_h, sg_t, sb_t, H_k, H_v, Dk, Dv,
                          RATIO: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, DT: tl.constexpr,
                          PREC: tl.constexpr):
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    start = tl.load(chunk_start + c)
    n = tl.load(chunk_len + c)
    r = tl.arange(0, BT)
    rmask = r < n
    rows = (start + r).to(tl.int64)
    cbase = (c * H_v + hv).to(tl.int64)
    g = tl.cumsum(tl.load(g_ptr + rows * sg_t + hv, mask=rmask, other=0.0).to(F32), axis=0)
    beta = tl.load(b_ptr + rows * sb_t + hv, mask=rmask, other=0.0).to(F32)
    tl.store(gbuf + cbase * BT + r, g)
    k_rows = k_ptr + (rows * H_k + hk)[:, None] * Dk  # normalised keys, contiguous [T, H_k, D_k]
    kk = tl.zeros((BT, BT), dtype=F32)
    for d0 in range(0, Dk, KB):
        dk = d0 + tl.arange(0, KB)
        kt = tl.load(k_rows + dk[None, :], mask=rmask[:, None] & (dk < Dk)[None, :], other=0.0).to(F32)
        kk += tl.dot(kt.to(DT), tl.trans(kt.to(DT)), input_precision=PREC)
    below = r[:, None] > r[None, :]
    a = tl.where(below, kk * beta[:, None] * tl.exp(tl.where(below, g[:, None] - g[None, :], 0.0)), 0.0)
    t = _invert_unit_lower(a, PREC).to(DT)
    coef = beta * tl.exp(g)
    for d0 in range(0, Dk, KB):
        dk = d0 + tl.arange(0, KB)
        kt = tl.load(k_rows + dk[None, :], mask=rmask[:, None] & (dk < Dk)[None, :], other=0.0).to(F32)
        w = tl.dot(t, (kt * coef[:, None]).to(DT), input_precision=PREC)
        tl.store(wbuf + (cbase * BT + r[:, None]) * Dk + dk[None, :], w.to(wbuf.dtype.element_ty),
                 mask=(dk < Dk)[None, :])
    for d0 in range(0, Dv, VB):
        dv = d0 + tl.arange(0, VB)
        vt = tl.load(v_ptr + rows[:, None] * sv_t + hv * sv_h + dv[None, :], mask=rmask[:, None] & (dv < Dv)[None, :],
                     other=0.0).to(F32)
        u = tl.dot(t, (vt * beta[:, None]).to(DT), input_precision=PREC)
        tl.store(ubuf + (cbase * BT + r[:, None]) * Dv + dv[None, :], u.to(ubuf.dtype.element_ty),
                 mask=(dv < Dv)[None, :])


@triton.jit(do_not_specialize_on_alignment=["chunk_start", "chunk_len", "chunk_save", "seq_chunks", "slots"])
def _chunk_scan_kernel(k_ptr, chunk_start, chunk_len, chunk_save, seq_chunks, gbuf, wbuf, ubuf, hbuf,
                       pool, slots, saved, sp_n, sp_h, sp_k, sp_v, H_k, H_v, Dk, Dv,
                       RATIO: tl.constexpr, HK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                       PREC: tl.constexpr):
    """The state tile is kept as two halves of HK rows of D_k, so w and k load half a row at a time."""
    b = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    d1 = tl.arange(0, HK)
    d2 = HK + tl.arange(0, HK)
    r = tl.arange(0, BT)
    vmask = dv < Dv
    m1 = (d1 < Dk)[:, None] & vmask[None, :]
    m2 = (d2 < Dk)[:, None] & vmask[None, :]
    slot = tl.load(slots + b).to(tl.int64)
    state_at = pool + slot * sp_n + hv * sp_h + dv[None, :] * sp_v
    h1 = tl.load(state_at + d1[:, None] * sp_k, mask=m1, other=0.0)
    h2 = tl.load(state_at + d2[:, None] * sp_k, mask=m2, other=0.0)
    for c in range(tl.load(seq_chunks + b), tl.load(seq_chunks + b + 1)):
        cbase = (c * H_v + hv).to(tl.int64)
        h_at = hbuf + (cbase * Dk) * Dv + dv[None, :]
        tl.store(h_at + d1[:, None] * Dv, h1.to(hbuf.dtype.element_ty), mask=m1)
        tl.store(h_at + d2[:, None] * Dv, h2.to(hbuf.dtype.element_ty), mask=m2)
        w_at = wbuf + (cbase * BT + r[:, None]) * Dk
        w1 = tl.load(w_at + d1[None, :], mask=(d1 < Dk)[None, :], other=0.0).to(F32)
        w2 = tl.load(w_at + d2[None, :], mask=(d2 < Dk)[None, :], other=0.0).to(F32)
        u_at = ubuf + (cbase * BT + r[:, None]) * Dv + dv[None, :]
        v_new = tl.load(u_at, mask=vmask[None, :], other=0.0).to(F32)
        v_new -= tl.dot(w1.to(DT), h1.to(DT), input_precision=PREC)
        v_new -= tl.dot(w2.to(DT), h2.to(DT), input_precision=PREC)
        tl.store(u_at, v_new.to(ubuf.dtype.element_ty), mask=vmask[None, :])
        start = tl.load(chunk_start + c)
        rmask = r < tl.load(chunk_len + c)
        g = tl.load(gbuf + cbase * BT + r)
        g_last = tl.load(gbuf + cbase * BT + BT - 1)  # rows past the length carry g = 0: G_last = G[n - 1]
        k_at = k_ptr + ((start + r).to(tl.int64) * H_k + hk)[:, None] * Dk
        k1 = tl.load(k_at + d1[None, :], mask=rmask[:, None] & (d1 < Dk)[None, :], other=0.0).to(F32)
        k2 = tl.load(k_at + d2[None, :], mask=rmask[:, None] & (d2 < Dk)[None, :], other=0.0).to(F32)
        v_dec = (v_new * tl.exp(g_last - g)[:, None]).to(DT)
        decay = tl.exp(g_last)
        h1 = h1 * decay + tl.dot(tl.trans(k1.to(DT)), v_dec, input_precision=PREC)
        h2 = h2 * decay + tl.dot(tl.trans(k2.to(DT)), v_dec, input_precision=PREC)
        save = tl.load(chunk_save + c)
        if save >= 0:
            s_at = saved + ((save * H_v + hv).to(tl.int64) * Dk) * Dv + dv[None, :]
            tl.store(s_at + d1[:, None] * Dv, h1, mask=m1)
            tl.store(s_at + d2[:, None] * Dv, h2, mask=m2)
    tl.store(state_at + d1[:, None] * sp_k, h1, mask=m1)
    tl.store(state_at + d2[:, None] * sp_k, h2, mask=m2)


@tc.tuned(OUT_CONFIGS, key=["Dk", "Dv", "RATIO"])
@triton.jit(do_not_specialize_on_alignment=["chunk_start", "chunk_len"])
def _chunk_out_kernel(q_ptr, k_ptr, out, chunk_start, chunk_len, gbuf, hbuf, ubuf, so_t, so_h, H_k, H_v, Dk, Dv,
                      RATIO: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                      PREC: tl.constexpr):
    c = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    vmask = dv < Dv
    r = tl.arange(0, BT)
    rmask = r < tl.load(chunk_len + c)
    rows = (tl.load(chunk_start + c) + r).to(tl.int64)
    cbase = (c * H_v + hv).to(tl.int64)
    s = tl.zeros((BT, BT), dtype=F32)
    o = tl.zeros((BT, BV), dtype=F32)
    for d0 in range(0, Dk, KB):
        dk = d0 + tl.arange(0, KB)
        m = rmask[:, None] & (dk < Dk)[None, :]
        q = tl.load(q_ptr + (rows * H_k + hk)[:, None] * Dk + dk[None, :], mask=m, other=0.0).to(F32)
        k = tl.load(k_ptr + (rows * H_k + hk)[:, None] * Dk + dk[None, :], mask=m, other=0.0).to(F32)
        h = tl.load(hbuf + (cbase * Dk + dk[:, None]) * Dv + dv[None, :], mask=(dk < Dk)[:, None] & vmask[None, :],
                    other=0.0).to(F32)
        s += tl.dot(q.to(DT), tl.trans(k.to(DT)), input_precision=PREC)
        o += tl.dot(q.to(DT), h.to(DT), input_precision=PREC)
    g = tl.load(gbuf + cbase * BT + r)
    causal = r[:, None] >= r[None, :]
    s = tl.where(causal, s * tl.exp(tl.where(causal, g[:, None] - g[None, :], 0.0)), 0.0)
    v_new = tl.load(ubuf + (cbase * BT + r[:, None]) * Dv + dv[None, :], mask=vmask[None, :], other=0.0).to(F32)
    o = o * tl.exp(g)[:, None] + tl.dot(s.to(DT), v_new.to(DT), input_precision=PREC)
    tl.store(out + rows[:, None] * so_t + hv * so_h + dv[None, :], o.to(out.dtype.element_ty),
             mask=rmask[:, None] & vmask[None, :])


# ---------------------------------------------------------------- launchers


def _normalised(x: Tensor, scale: float, l2: bool, dtype: torch.dtype) -> Tensor:
    """x [T, H, D] L2-normalised (optionally) and scaled, contiguous, in `dtype`."""
    length, heads, dim = x.shape
    y = tc.empty(length, heads, dim, dtype=dtype, device=x.device)
    if length:
        _l2norm_kernel[(triton.cdiv(length * heads, 16),)](x, y, x.stride(0), x.stride(1), length * heads, heads,
                                                           dim, scale, ROWS=16, BD=tc.pow2(dim), L2=l2)
    return y


def _chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, plan: VarlenPlan,
             pool: Tensor, slots: Tensor, scale: float | None, use_qk_l2norm: bool) -> tuple[Tensor, Tensor]:
    length, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    h_k, dev = k.shape[1], v.device
    q, k, v, g, beta = (tc.unit_last(t) for t in (q, k, v, g, beta))
    nc, batch, num_saved = plan.tables["chunks"].shape[1], plan.batch, plan.num_saved
    out = tc.empty(length, h_v, d_v, dtype=v.dtype, device=dev)
    saved = tc.empty(num_saved, h_v, d_k, d_v, dtype=torch.float32, device=dev)
    if batch == 0:
        return out, saved
    data = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    dt = tc.dot_dtype(v)
    prec = "ieee" if data == torch.float32 else "tf32x3"  # fp32 dots: exact, or 3-pass tf32 for 16-bit data
    scale = d_k ** -0.5 if scale is None else float(scale)
    qn = _normalised(q, scale, bool(use_qk_l2norm), data)
    kn = _normalised(k, 1.0, bool(use_qk_l2norm), data)
    chunks, seq_chunks = plan.device("chunks"), plan.device("seq_chunks")
    rows = max(nc, 1)
    gbuf = tc.empty(rows, h_v, CHUNK, dtype=torch.float32, device=dev)
    wbuf = tc.empty(rows, h_v, CHUNK, d_k, dtype=data, device=dev)
    ubuf = tc.empty(rows, h_v, CHUNK, d_v, dtype=data, device=dev)  # u, then v_new in place
    hbuf = tc.empty(rows, h_v, d_k, d_v, dtype=data, device=dev)
    kb, bk = min(64, tc.pow2(d_k)), tc.pow2(d_k, least=32)
    scan_bv = min(tc.pow2(d_v), CHUNK_TUNE["scan_bv"])
    common = dict(RATIO=h_v // h_k, DT=dt, PREC=prec)
    if nc:
        _chunk_prepare_kernel[(nc, h_v)](
            kn, v, g, beta, chunks[0], chunks[1], gbuf, wbuf, ubuf, v.stride(0), v.stride(1), g.stride(0),
            beta.stride(0), h_k, h_v, d_k, d_v, KB=kb, VB=min(64, tc.pow2(d_v)),
            num_warps=CHUNK_TUNE["prepare_warps"], **common)
    _chunk_scan_kernel[(batch, h_v, triton.cdiv(d_v, scan_bv))](
        kn, chunks[0], chunks[1], chunks[2], seq_chunks, gbuf, wbuf, ubuf, hbuf, pool, slots, saved,
        *pool.stride(), h_k, h_v, d_k, d_v, HK=bk // 2, BV=scan_bv, num_warps=CHUNK_TUNE["scan_warps"], **common)
    if nc:
        _chunk_out_kernel[lambda meta: (nc, h_v, triton.cdiv(d_v, meta["BV"]))](
            qn, kn, out, chunks[0], chunks[1], gbuf, hbuf, ubuf, out.stride(0), out.stride(1), h_k, h_v, d_k, d_v,
            KB=kb, **common)
    return out, saved


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, *, scale: float | None = None,
                           chunk_size: int = 64, use_qk_l2norm: bool = True,
                           state_positions: Sequence[int] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """See `reference.chunk_gated_delta_rule` (chunks are always 64 tokens, cut at the positions)."""
    length, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    expect(length >= 1, "T >= 1", length)
    expect(chunk_size >= 1, "chunk_size >= 1", chunk_size)
    if initial_state is None:
        pool = torch.zeros(1, h_v, d_k, d_v, dtype=torch.float32, device=v.device)
    else:
        expect_shape("initial_state", initial_state, "H_v, D_k, D_v", (h_v, d_k, d_v))
        pool = initial_state.to(torch.float32, copy=True)[None]
    slots = torch.zeros(1, dtype=torch.int64, device=v.device)
    plan = VarlenPlan.build([0, length], [list(state_positions)]).on(v.device)
    out, saved = _chunked(q, k, v, g, beta, plan, pool, slots, scale, use_qk_l2norm)
    return out, pool[0], saved


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  state_pool: Tensor, state_slots: Tensor, *, scale: float | None = None,
                                  use_qk_l2norm: bool = True, state_positions: Sequence[Sequence[int]] = (),
                                  plan: VarlenPlan | None = None) -> tuple[Tensor, Tensor]:
    """See `reference.chunk_gated_delta_rule_varlen`; `plan` holds the chunks (cut at
    `state_positions`, which it then supersedes); without one, cu_seqlens is read back once."""
    length, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    expect_shape("cu_seqlens", cu_seqlens, "B+1", (None,))
    expect_dtype("cu_seqlens", cu_seqlens, torch.int32)
    batch = cu_seqlens.shape[0] - 1
    check_state_pool(state_pool, state_slots, batch, h_v, d_k, d_v)
    expect(len(state_positions) <= batch, f"at most B = {batch} lists of state_positions", len(state_positions))
    plan = checked_plan(cu_seqlens, length, plan, state_positions)
    return _chunked(q, k, v, g, beta, plan, state_pool, state_slots.contiguous(), scale, use_qk_l2norm)
