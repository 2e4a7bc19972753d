"""Triton forms of `cairn.kernels.norms.reference`: each op one launch, its weights read in their own
dtype (no cast launched per call), math in fp32, every value the reference rounds to the data's
dtype rounded there too (the residual sum, the normed row before rotary, cos and sin).

Launches, one program per row (a token, or a token's head):
- `_rms_norm_kernel` (N,): optional residual add, then zero-centred RMSNorm;
- `_gated_rms_norm_kernel` (N,): plain-weight RMSNorm times silu(gate);
- `_qk_norm_rope_kernel` (T, H_q + H_kv): a head of q or of k, normed, then rotated (MROPE: each
  frequency at the position of its axis, positions [3, T]);
- `_delta_gates_kernel` (cdiv(T * H_v, 256),): g and beta;
- `_sigmoid_gate_kernel` (T, cdiv(N, 1024)): x * sigmoid(gate);
- `_silu_mul_kernel` (T, cdiv(N, 1024)): silu(gate) * up.
A row is one block of `pow2(D)` lanes: D up to 16k fits with 8 warps; the warps are tuned
(norms/tuning.py, triton_helpers.tuned), the first config interpreted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common import triton_helpers as tc
from cairn.kernels.common.checks import check_rope_axes, expect, expect_shape
from cairn.kernels.norms.tuning import ROW_WARPS

F32 = tl.float32


@tc.tuned(ROW_WARPS, key=["D"])
@triton.jit
def _rms_norm_kernel(x, res, y, res_out, w, s_x, s_r, s_y, s_ro, D, eps, HAS_RES: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    v = tl.load(x + row * s_x + d, mask=m, other=0.0).to(F32)
    if HAS_RES:
        v = v + tl.load(res + row * s_r + d, mask=m, other=0.0).to(F32)
        v = v.to(res_out.dtype.element_ty).to(F32)  # the residual stream is kept in the data's dtype
        tl.store(res_out + row * s_ro + d, v.to(res_out.dtype.element_ty), mask=m)
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    wv = tl.load(w + d, mask=m, other=0.0).to(F32)
    tl.store(y + row * s_y + d, (v * inv * (1.0 + wv)).to(y.dtype.element_ty), mask=m)


@tc.tuned(ROW_WARPS, key=["D"])
@triton.jit
def _gated_rms_norm_kernel(x, gate, w, y, s_x, s_g, s_y, D, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    v = tl.load(x + row * s_x + d, mask=m, other=0.0).to(F32)
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    normed = (v * inv).to(y.dtype.element_ty).to(F32)
    scaled = (tl.load(w + d, mask=m, other=0.0).to(F32) * normed).to(y.dtype.element_ty).to(F32)
    z = tl.load(gate + row * s_g + d, mask=m, other=0.0).to(F32)
    tl.store(y + row * s_y + d, (scaled * z / (1.0 + tl.exp(-z))).to(y.dtype.element_ty), mask=m)


@triton.jit
def _norm_rope_row(src, dst, w, inv_freq, pos, s_src, s_dst, D, eps, HALF: tl.constexpr, BD: tl.constexpr,
                   BH: tl.constexpr):
    d = tl.arange(0, BD)
    m = d < D
    v = tl.load(src + d, mask=m, other=0.0).to(F32)
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
    out_ty = dst.dtype.element_ty
    normed = (v * inv * (1.0 + tl.load(w + d, mask=m, other=0.0).to(F32))).to(out_ty)
    tl.store(dst + d, normed, mask=m & (d >= 2 * HALF))  # past the rotary channels: as normed
    j = tl.arange(0, BH)
    jm = j < HALF
    x1 = tl.load(src + j, mask=jm, other=0.0).to(F32)
    x2 = tl.load(src + j + HALF, mask=jm, other=0.0).to(F32)
    y1 = (x1 * inv * (1.0 + tl.load(w + j, mask=jm, other=0.0).to(F32))).to(out_ty).to(F32)
    y2 = (x2 * inv * (1.0 + tl.load(w + j + HALF, mask=jm, other=0.0).to(F32))).to(out_ty).to(F32)
    f = pos * tl.load(inv_freq + j, mask=jm, other=0.0)
    c, s = tl.cos(f).to(out_ty).to(F32), tl.sin(f).to(out_ty).to(F32)
    tl.store(dst + j, (y1 * c - y2 * s).to(out_ty), mask=jm)
    tl.store(dst + j + HALF, (y2 * c + y1 * s).to(out_ty), mask=jm)


@tc.tuned(ROW_WARPS, key=["D"])
@triton.jit(do_not_specialize_on_alignment=["positions"])
def _qk_norm_rope_kernel(q, k, qo, ko, wq, wk, inv_freq, positions, rope_axes, sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h,
                         sko_t, sko_h, sp_axis, sp_t, HQ, D, eps, HALF: tl.constexpr, BD: tl.constexpr,
                         BH: tl.constexpr, MROPE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if MROPE:  # each frequency at the position of its axis: [BH]
        j = tl.arange(0, BH)
        axis = tl.load(rope_axes + j, mask=j < HALF, other=0)
        pos = tl.load(positions + axis * sp_axis + t * sp_t, mask=j < HALF, other=0).to(F32)
    else:  # one position for every frequency (sp_axis, sp_t unread: positions [T] are contiguous)
        pos = tl.load(positions + t).to(F32)
    if h < HQ:
        _norm_rope_row(q + t * sq_t + h * sq_h, qo + t * sqo_t + h * sqo_h, wq, inv_freq, pos, sq_h, sqo_h, D, eps,
                       HALF=HALF, BD=BD, BH=BH)
    else:
        hk = h - HQ
        _norm_rope_row(k + t * sk_t + hk * sk_h, ko + t * sko_t + hk * sko_h, wk, inv_freq, pos, sk_h, sko_h, D,
                       eps, HALF=HALF, BD=BD, BH=BH)


@triton.jit(do_not_specialize=["n"])
def _delta_gates_kernel(a, b, A_log, dt_bias, g, beta, s_a, s_b, n, H, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    t, h = i // H, i % H
    x = tl.load(a + t * s_a + h, mask=m, other=0.0).to(F32) + tl.load(dt_bias + h, mask=m, other=0.0).to(F32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(g + i, -tl.exp(tl.load(A_log + h, mask=m, other=0.0).to(F32)) * softplus, mask=m)
    bv = tl.load(b + t * s_b + h, mask=m, other=0.0).to(F32)
    tl.store(beta + i, (1.0 / (1.0 + tl.exp(-bv))).to(beta.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["N"])
def _sigmoid_gate_kernel(x, gate, y, s_x, s_g, N, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    z = tl.load(gate + t * s_g + n, mask=m, other=0.0).to(F32)
    sig = (1.0 / (1.0 + tl.exp(-z))).to(y.dtype.element_ty).to(F32)
    tl.store(y + t * N + n, (tl.load(x + t * s_x + n, mask=m, other=0.0).to(F32) * sig).to(y.dtype.element_ty),
             mask=m)


@triton.jit(do_not_specialize=["N"])
def _silu_mul_kernel(gate, up, y, s_g, s_u, N, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = n < N
    z = tl.load(gate + t * s_g + n, mask=m, other=0.0).to(F32)
    act = (z / (1.0 + tl.exp(-z))).to(y.dtype.element_ty).to(F32)
    tl.store(y + t * N + n, (act * tl.load(up + t * s_u + n, mask=m, other=0.0).to(F32)).to(y.dtype.element_ty),
             mask=m)


# ---------------------------------------------------------------- launchers


def _rows(x: Tensor, name: str, width: int) -> Tensor:
    expect(x.shape[-1] == width, f"{name}'s last dim = {width}", list(x.shape))
    return tc.unit_last(x.reshape(-1, width))


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """See `reference.rms_norm`."""
    expect_shape("weight", weight, "D", (None,))
    d = weight.shape[0]
    rows = _rows(x, "x", d)
    y = tc.empty(*x.shape, dtype=x.dtype, device=x.device)
    res = _rows(residual, "residual", d) if residual is not None else rows
    if residual is not None:
        expect(tuple(residual.shape) == tuple(x.shape), f"residual of x's shape {list(x.shape)}", list(residual.shape))
    res_out = tc.empty(*x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    if rows.shape[0]:
        bd = tc.pow2(d, least=2)
        _rms_norm_kernel[(rows.shape[0],)](rows, res, y, res_out, weight, rows.stride(0), res.stride(0), d, d, d,
                                           float(eps), HAS_RES=residual is not None, BD=bd)
    return y if residual is None else (y, res_out)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """See `reference.gated_rms_norm`."""
    expect_shape("x", x, "N, D", (None, weight.shape[0]))
    expect_shape("gate", gate, "N, D", tuple(x.shape))
    x, gate = tc.unit_last(x), tc.unit_last(gate)
    d = x.shape[1]
    y = tc.empty(*x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        bd = tc.pow2(d, least=2)
        _gated_rms_norm_kernel[(x.shape[0],)](x, gate, weight, y, x.stride(0), gate.stride(0), d, d, float(eps),
                                              BD=bd)
    return y


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor, inv_freq: Tensor,
                 eps: float, *, rope_axes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """See `reference.qk_norm_rope`; one launch for both. M-RoPE's positions [3, T] are read through
    their strides, in the dtype given (no cast launched)."""
    expect_shape("q", q, "T, H_q, D", (None, None, None))
    t, h_q, d = q.shape
    expect_shape("k", k, "T, H_kv, D", (t, None, d))
    half = inv_freq.shape[0]
    if rope_axes is None:
        expect_shape("positions", positions, "T", (t,))
        axes, sp_axis, sp_t = positions, 0, 1  # `axes` unread
    else:
        check_rope_axes(positions, rope_axes, t, half)
        axes, sp_axis, sp_t = rope_axes, positions.stride(0), positions.stride(1)
    expect(2 * half <= d, f"rotary channels 2 * {half} <= D = {d}", 2 * half)
    q, k = tc.unit_last(q), tc.unit_last(k)
    qo = tc.empty(t, h_q, d, dtype=q.dtype, device=q.device)
    ko = tc.empty(t, k.shape[1], d, dtype=k.dtype, device=k.device)
    if t:
        bd = tc.pow2(d, least=2)
        _qk_norm_rope_kernel[(t, h_q + k.shape[1])](
            q, k, qo, ko, q_weight, k_weight, inv_freq, positions, axes, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), sp_axis, sp_t, h_q, d, float(eps),
            HALF=half, BD=bd, BH=tc.pow2(half, least=2), MROPE=rope_axes is not None)
    return qo, ko


def delta_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """See `reference.delta_gates`."""
    expect_shape("a", a, "T, H_v", (None, A_log.shape[0]))
    expect_shape("b", b, "T, H_v", tuple(a.shape))
    a, b = tc.unit_last(a), tc.unit_last(b)
    t, h = a.shape
    g = tc.empty(t, h, dtype=torch.float32, device=a.device)
    beta = tc.empty(t, h, dtype=b.dtype, device=b.device)
    if t:
        block = 256
        _delta_gates_kernel[(triton.cdiv(t * h, block),)](a, b, A_log, dt_bias, g, beta, a.stride(0), b.stride(0),
                                                          t * h, h, BLOCK=block)
    return g, beta


def _pairwise(kernel, names: tuple[str, str], a: Tensor, b: Tensor) -> Tensor:
    """y = kernel(a, b) elementwise over rows [T, N] (a program per row and 1024 columns)."""
    expect_shape(names[0], a, "T, N", (None, None))
    expect_shape(names[1], b, "T, N", tuple(a.shape))
    a, b = tc.unit_last(a), tc.unit_last(b)
    t, n = a.shape
    y = tc.empty(t, n, dtype=a.dtype, device=a.device)
    if t:
        kernel[(t, triton.cdiv(n, 1024))](a, b, y, a.stride(0), b.stride(0), n, BLOCK=1024, num_warps=4)
    return y


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    """See `reference.sigmoid_gate`."""
    return _pairwise(_sigmoid_gate_kernel, ("x", "gate"), x, gate)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """See `reference.silu_mul`."""
    return _pairwise(_silu_mul_kernel, ("gate", "up"), gate, up)
