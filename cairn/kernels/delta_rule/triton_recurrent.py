"""Triton gated delta rule, token by token: the decode step (states updated in place, in their
slots) and the whole-sequence recurrence.

Same contracts as `reference.recurrent_gated_delta_rule`, `gated_delta_rule_step` and
`reference.gated_delta_rule_step_slots`. Shapes: q, k [N, H_k, D_k]; v [N, H_v, D_v];
g, beta [N, H_v]; a state pool [num_slots, H_v, D_k, D_v] fp32 (any strides) indexed by
state_slots [B] int64 (distinct); value head h reads key head h // (H_v / H_k). q and k are
L2-normalised in the kernel; math in fp32.

Launch: `_recurrent_kernel`, grid (B, H_v, cdiv(D_v, BV)), BV by `step_shape` (the widest value
block that still fills the device): a [D_k, BV] tile of one sequence's state stays in registers
while the sequence's tokens run (one token, row b, for a decode step;
rows cu_seqlens[b]..cu_seqlens[b+1] otherwise), then goes back to its slot. A decode step is
memory-bound: it reads and writes each state once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common import triton_helpers as tc
from cairn.kernels.common.checks import check_delta, check_state_pool, expect, expect_dtype, expect_shape
from cairn.kernels.delta_rule.tuning import STEP_PROGRAMS_PER_SM, STEP_SHAPES

F32 = tl.float32


@triton.jit(do_not_specialize_on_alignment=["slots", "cu"])
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, out, pool, slots, cu,
                      sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h,
                      sp_n, sp_h, sp_k, sp_v, scale, Dk, Dv,
                      RATIO: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2: tl.constexpr,
                      VARLEN: tl.constexpr):
    b = tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // RATIO
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    dk = tl.arange(0, BK)
    vmask = dv < Dv
    kmask = dk < Dk
    hmask = kmask[:, None] & vmask[None, :]
    if VARLEN:
        first = tl.load(cu + b)
        last = tl.load(cu + b + 1)
    else:  # a decode step: token b of sequence b
        first = b
        last = b + 1
    slot = tl.load(slots + b).to(tl.int64)
    hmask = hmask & (tl.zeros([BK, BV], dtype=tl.int64) + slot >= 0)  # slot -1: a padding row: zeros in, no write
    state_at = pool + tl.maximum(slot, 0) * sp_n + hv * sp_h + dk[:, None] * sp_k + dv[None, :] * sp_v
    h = tl.load(state_at, mask=hmask, other=0.0)
    for i in range(0, last - first):
        t64 = (first + i).to(tl.int64)
        q = tl.load(q_ptr + t64 * sq_t + hk * sq_h + dk, mask=kmask, other=0.0).to(F32)
        k = tl.load(k_ptr + t64 * sk_t + hk * sk_h + dk, mask=kmask, other=0.0).to(F32)
        if L2:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + t64 * sv_t + hv * sv_h + dv, mask=vmask, other=0.0).to(F32)
        g = tl.load(g_ptr + t64 * sg_t + hv).to(F32)
        beta = tl.load(b_ptr + t64 * sb_t + hv).to(F32)
        h = h * tl.exp(g)
        delta = beta * (v - tl.sum(k[:, None] * h, axis=0))
        h = h + k[:, None] * delta[None, :]
        o = tl.sum((q * scale)[:, None] * h, axis=0)
        tl.store(out + t64 * so_t + hv * so_h + dv, o.to(out.dtype.element_ty), mask=vmask)
    tl.store(state_at, h, mask=hmask)


def _unit(*ts: Tensor) -> list[Tensor]:
    return [tc.unit_last(t) for t in ts]


def step_shape(batch: int, h_v: int, d_v: int, sms: int) -> tuple[int, int]:
    """(BV, warps): the widest of STEP_SHAPES whose grid gives each of `sms` SMs
    STEP_PROGRAMS_PER_SM programs, else the narrowest (delta_rule/tuning.py)."""
    for bv, warps in STEP_SHAPES:
        if batch * h_v * triton.cdiv(d_v, bv) >= STEP_PROGRAMS_PER_SM * sms:
            return bv, warps
    return STEP_SHAPES[-1]


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, slots: Tensor,
               cu: Tensor | None, batch: int, scale: float | None, use_qk_l2norm: bool) -> Tensor:
    rows, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    q, k, v, g, beta = _unit(q, k, v, g, beta)
    out = tc.empty(rows, h_v, d_v, dtype=v.dtype, device=v.device)
    if batch == 0:
        return out
    bv, warps = step_shape(batch, h_v, d_v, tc.sm_count(v.device))
    _recurrent_kernel[(batch, h_v, triton.cdiv(d_v, bv))](
        q, k, v, g, beta, out, pool, slots, slots if cu is None else cu,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), out.stride(0), out.stride(1), *pool.stride(),
        d_k ** -0.5 if scale is None else float(scale), d_k, d_v,
        RATIO=h_v // k.shape[1], BK=tc.pow2(d_k), BV=bv, L2=bool(use_qk_l2norm), VARLEN=cu is not None,
        num_warps=warps)
    return out


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None, *, scale: float | None = None,
                               use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """See `reference.recurrent_gated_delta_rule`."""
    length, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    if initial_state is None:
        pool = torch.zeros(1, h_v, d_k, d_v, dtype=torch.float32, device=v.device)
    else:
        expect_shape("initial_state", initial_state, "H_v, D_k, D_v", (h_v, d_k, d_v))
        pool = initial_state.to(torch.float32, copy=True)[None]
    slots = torch.zeros(1, dtype=torch.int64, device=v.device)
    cu = torch.tensor([0, length], dtype=torch.int32).to(v.device)
    out = _recurrent(q, k, v, g, beta, pool, slots, cu, 1, scale, use_qk_l2norm)
    return out, pool[0]


def gated_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
                          scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    """See `reference.gated_delta_rule_step`."""
    batch, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "B")
    expect_shape("state", state, "B, H_v, D_k, D_v", (batch, h_v, d_k, d_v))
    expect_dtype("state", state, torch.float32)
    expect(state.is_contiguous(), "a contiguous state (it is updated in place)", "a strided view")
    slots = torch.arange(batch, dtype=torch.int64, device=v.device)
    return _recurrent(q, k, v, g, beta, state, slots, None, batch, scale, use_qk_l2norm)


def gated_delta_rule_step_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                                state_slots: Tensor, *, scale: float | None = None,
                                use_qk_l2norm: bool = True) -> Tensor:
    """See `reference.gated_delta_rule_step_slots`."""
    batch, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "B")
    check_state_pool(state_pool, state_slots, batch, h_v, d_k, d_v)
    return _recurrent(q, k, v, g, beta, state_pool, state_slots.contiguous(), None, batch, scale, use_qk_l2norm)
