"""Triton causal conv1d (depthwise, SiLU after) over varlen sequences, and its one-token update.

Same contracts as `reference.causal_conv1d` / `causal_conv1d_update`, plus slot-indexed forms
(`reference.causal_conv1d_varlen` / `causal_conv1d_update_slots`) that read and write a
conv-state pool in place, so a batch takes one launch instead of a gather and a scatter.

Shapes: x [T, C] (B sequences concatenated, `cu_seqlens` [B+1] int32) or [B, C] for a decode
step; weight [C, K]; a conv state [C, K-1] holds the K-1 inputs before the next token, oldest
first; a pool [num_slots, C, K-1] (any strides, e.g. the view `conv_states[:, r]`), indexed by
state_slots [B] int64 (distinct). Math in fp32; out in x's dtype, states in the pool's dtype.

Launches:
- `_conv_fwd_kernel`, grid (num_blocks, cdiv(C, BC)): a block is <= BT rows of one sequence
  (block table built on the host from cu_seqlens); taps before the sequence's first token read
  the old state. Writes out only.
- `_conv_state_kernel`, grid (B, cdiv(C, BC)), launched after: new state = the last K-1 entries
  of cat(old state, x_b). Each program reads its own slot before writing it, so in place is safe.
- `_conv_update_kernel`, grid (B, cdiv(C, BC)): one token per sequence, state shifted in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common import triton_helpers as tc
from cairn.kernels.common.checks import check_slots, expect, expect_shape
from cairn.kernels.common.varlen_plan import VarlenPlan, checked_plan
from cairn.kernels.conv.tuning import CONV_ROWS, STATE_CHANNELS, VARLEN_CONFIGS


@tc.tuned(VARLEN_CONFIGS, key=["C", "K"])
@triton.jit(do_not_specialize_on_alignment=["slots", "cu", "block_seq", "block_row"])
def _conv_fwd_kernel(x, w, out, state, slots, cu, block_seq, block_row,
                     sx_t, sw_c, sw_k, so_t, ss_n, ss_c, ss_k, C,
                     K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    b = tl.load(block_seq + blk)
    row0 = tl.load(block_row + blk)
    start = tl.load(cu + b)
    end = tl.load(cu + b + 1)
    slot = tl.load(slots + b).to(tl.int64)
    rows = row0 + tl.arange(0, BT)
    rmask = rows < end
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for i in tl.static_range(K):
        src = rows - (K - 1) + i  # the input row this tap reads; < start means the old state
        wi = tl.load(w + cols * sw_c + i * sw_k, mask=cmask, other=0.0).to(tl.float32)
        in_x = rmask[:, None] & cmask[None, :] & (src >= start)[:, None]
        xv = tl.load(x + src[:, None].to(tl.int64) * sx_t + cols[None, :], mask=in_x, other=0.0).to(tl.float32)
        in_state = rmask[:, None] & cmask[None, :] & (src < start)[:, None]
        col = (K - 1) + (src - start)
        sv = tl.load(state + slot * ss_n + cols[None, :] * ss_c + col[:, None] * ss_k, mask=in_state,
                     other=0.0).to(tl.float32)
        acc += (xv + sv) * wi[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out + rows[:, None].to(tl.int64) * so_t + cols[None, :], y.to(out.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize_on_alignment=["in_slots", "out_slots", "cu"])
def _conv_state_kernel(x, state_in, in_slots, state_out, out_slots, cu,
                       sx_t, si_n, si_c, si_k, so_n, so_c, so_k, C,
                       KM1: tl.constexpr, BKS: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    start = tl.load(cu + b)
    length = tl.load(cu + b + 1) - start
    src_slot = tl.load(in_slots + b).to(tl.int64)
    dst_slot = tl.load(out_slots + b).to(tl.int64)
    j = tl.arange(0, BKS)
    idx = length + j  # index into cat(old state [K-1], x_b [length])
    jmask = j < KM1
    from_state = cmask[:, None] & (jmask & (idx < KM1))[None, :]
    from_x = cmask[:, None] & (jmask & (idx >= KM1))[None, :]
    sv = tl.load(state_in + src_slot * si_n + cols[:, None] * si_c + idx[None, :] * si_k, mask=from_state,
                 other=0.0)
    xrow = (start + idx - KM1).to(tl.int64)
    xv = tl.load(x + xrow[None, :] * sx_t + cols[:, None], mask=from_x, other=0.0)
    new = tl.where(from_state, sv.to(tl.float32), xv.to(tl.float32))
    tl.store(state_out + dst_slot * so_n + cols[:, None] * so_c + j[None, :] * so_k,
             new.to(state_out.dtype.element_ty), mask=cmask[:, None] & jmask[None, :])


@triton.jit(do_not_specialize_on_alignment=["slots"])
def _conv_update_kernel(x, w, out, state, slots, sx_b, sw_c, sw_k, so_b, ss_n, ss_c, ss_k, C,
                        KM1: tl.constexpr, BKS: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    slot = tl.load(slots + b).to(tl.int64)
    live = cmask & (tl.zeros([BC], dtype=tl.int64) + slot >= 0)  # slot -1: a padding row, no state read or written
    j = tl.arange(0, BKS)
    jmask = j < KM1
    m2 = live[:, None] & jmask[None, :]
    base = state + tl.maximum(slot, 0) * ss_n + cols[:, None] * ss_c
    old = tl.load(base + j[None, :] * ss_k, mask=m2, other=0.0).to(tl.float32)  # [BC, BKS]
    xv = tl.load(x + b * sx_b + cols, mask=cmask, other=0.0).to(tl.float32)
    wold = tl.load(w + cols[:, None] * sw_c + j[None, :] * sw_k, mask=m2, other=0.0).to(tl.float32)
    wlast = tl.load(w + cols * sw_c + KM1 * sw_k, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.sum(old * wold, axis=1) + xv * wlast
    shifted = tl.load(base + (j[None, :] + 1) * ss_k, mask=live[:, None] & (j + 1 < KM1)[None, :],
                      other=0.0).to(tl.float32)
    new = tl.where((j == KM1 - 1)[None, :], xv[:, None], shifted)
    tl.store(base + j[None, :] * ss_k, new.to(state.dtype.element_ty), mask=m2)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out + b * so_b + cols, y.to(out.dtype.element_ty), mask=cmask)


def _run_varlen(x: Tensor, weight: Tensor, plan: VarlenPlan, cu: Tensor, state_in: Tensor, in_slots: Tensor,
                state_out: Tensor, out_slots: Tensor) -> Tensor:
    """Both launches over a varlen batch; returns out [T, C]."""
    channels, width = weight.shape
    x = tc.unit_last(x)
    out = tc.empty_like(x)
    tiles = plan.tables["conv_tiles"].shape[1]
    bc = min(STATE_CHANNELS, tc.pow2(channels))
    if tiles:
        table = plan.device("conv_tiles")
        _conv_fwd_kernel[lambda meta: (tiles, triton.cdiv(channels, meta["BC"]))](
            x, weight, out, state_in, in_slots, cu, table[0], table[1],
            x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            state_in.stride(0), state_in.stride(1), state_in.stride(2), channels,
            K=width, BT=CONV_ROWS)
    batch = plan.batch
    if batch and width > 1:
        _conv_state_kernel[(batch, triton.cdiv(channels, bc))](
            x, state_in, in_slots, state_out, out_slots, cu, x.stride(0),
            state_in.stride(0), state_in.stride(1), state_in.stride(2),
            state_out.stride(0), state_out.stride(1), state_out.stride(2), channels,
            KM1=width - 1, BKS=tc.pow2(width - 1, least=1), BC=bc)
    return out


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """See `reference.causal_conv1d` (conv_state is read, never written; a new state is returned)."""
    expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    expect_shape("x", x, "T, C", (None, channels))
    if conv_state is None:
        conv_state = torch.zeros(channels, width - 1, dtype=torch.float32, device=x.device)
    expect_shape("conv_state", conv_state, "C, K-1", (channels, width - 1))
    new_state = tc.empty(1, channels, width - 1, dtype=conv_state.dtype, device=x.device)
    slot = torch.zeros(1, dtype=torch.int64, device=x.device)
    length = x.shape[0]
    plan = VarlenPlan.build([0, length]).on(x.device)
    out = _run_varlen(x, weight, plan, plan.device("cu"), conv_state[None], slot, new_state, slot)
    return out, new_state[0]


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor,
                         state_slots: Tensor, plan: VarlenPlan | None = None) -> Tensor:
    """See `reference.causal_conv1d_varlen`; `plan` holds the tiles (without one,
    cu_seqlens is read back once)."""
    expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    expect_shape("x", x, "T, C", (None, channels))
    plan = checked_plan(cu_seqlens, x.shape[0], plan)
    check_slots("conv_pool", conv_pool, "num_slots, C, K-1", (channels, width - 1), state_slots, plan.batch)
    slots = state_slots.contiguous()
    return _run_varlen(x, weight, plan, cu_seqlens.contiguous(), conv_pool, slots, conv_pool, slots)


def _update(x: Tensor, weight: Tensor, pool: Tensor, slots: Tensor) -> Tensor:
    channels, width = weight.shape
    x = tc.unit_last(x)
    out = tc.empty_like(x)
    batch = x.shape[0]
    if batch == 0:
        return out
    expect(width >= 2, "a conv width K >= 2 for the update", width)
    bc = min(STATE_CHANNELS, tc.pow2(channels))
    _conv_update_kernel[(batch, triton.cdiv(channels, bc))](
        x, weight, out, pool, slots, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        pool.stride(0), pool.stride(1), pool.stride(2), channels,
        KM1=width - 1, BKS=tc.pow2(width - 1, least=1), BC=bc)
    return out


def causal_conv1d_update(x: Tensor, weight: Tensor, conv_state: Tensor) -> Tensor:
    """See `reference.causal_conv1d_update`."""
    expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    expect_shape("x", x, "B, C", (None, channels))
    expect_shape("conv_state", conv_state, "B, C, K-1", (x.shape[0], channels, width - 1))
    slots = torch.arange(x.shape[0], dtype=torch.int64, device=x.device)
    return _update(x, weight, conv_state, slots)


def causal_conv1d_update_slots(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor) -> Tensor:
    """See `reference.causal_conv1d_update_slots`."""
    expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    expect_shape("x", x, "B, C", (None, channels))
    check_slots("conv_pool", conv_pool, "num_slots, C, K-1", (channels, width - 1), state_slots, x.shape[0])
    return _update(x, weight, conv_pool, state_slots.contiguous())
