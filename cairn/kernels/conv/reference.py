"""The Gated DeltaNet's causal conv in plain fp32 torch, sequence by sequence and row by row: the
oracle every implementation is tested against (and transformers' `causal_conv1d_fn` is the
oracle of this one), and the slow fallback (`cairn.kernels.common.dispatch`).

The ops' contract, which every implementation keeps:
- Depthwise, weight [C, K], no bias, SiLU after. A conv state [C, K-1] holds the K-1 inputs that
  precede the next token, oldest first (zeros for a fresh sequence). Math in fp32; out in x's
  dtype, states in their own dtype.
- Varlen: x [T, C] concatenates B sequences (`cu_seqlens` [B+1] int32; a sequence may be empty,
  its state then left as it is). Pools: [num_slots, C, K-1] (any strides, e.g. the per-layer view
  `conv_states[:, r]`) indexed by state_slots [B] int64, distinct within a call, read and written
  in place. `plan`, when given, is cu_seqlens' `VarlenPlan`: its host copy of the boundaries is
  used instead of reading cu_seqlens back.
- In `causal_conv1d_update_slots` a slot of -1 is a padding row (a CUDA graph's batch bucket): it
  starts from a zero state and writes none.
- Only the `_update` ops and the varlen op write into their arguments (states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cairn.kernels.common.checks import check_conv, check_conv_pool, expect_shape
from cairn.kernels.common.varlen_plan import VarlenPlan, checked_plan

_F32 = torch.float32


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """SiLU of the causal depthwise conv over one sequence, continuing from `conv_state`.

    x [T, C]; weight [C, K]; conv_state [C, K-1] (the inputs preceding x; None = zeros).
    Returns (out [T, C] in x's dtype, new_state [C, K-1] = the last K-1 inputs of
    cat(conv_state, x) along time, in conv_state's dtype, fp32 if None).
    """
    channels, width = check_conv(x, weight)
    state_dtype = _F32 if conv_state is None else conv_state.dtype
    if conv_state is None:
        conv_state = torch.zeros(channels, width - 1, dtype=_F32, device=x.device)
    expect_shape("conv_state", conv_state, "C, K-1", (channels, width - 1))
    history = torch.cat((conv_state.float().t(), x.float()))  # [K-1+T, C]
    out = (history.unfold(0, width, 1) * weight.float()).sum(-1)  # [T, C]: window t is history[t : t + K]
    return F.silu(out).to(x.dtype), history[history.shape[0] - (width - 1):].t().to(state_dtype)


def causal_conv1d_update(x: Tensor, weight: Tensor, conv_state: Tensor) -> Tensor:
    """One decode step of `causal_conv1d` for B sequences.

    x [B, C]; weight [C, K]; conv_state [B, C, K-1], updated in place (shifted left, x appended).
    Returns silu(conv) [B, C] in x's dtype.
    """
    channels, width = check_conv(x, weight)
    expect_shape("conv_state", conv_state, "B, C, K-1", (x.shape[0], channels, width - 1))
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        out[b:b + 1], conv_state[b] = causal_conv1d(x[b:b + 1], weight, conv_state[b])
    return out


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor,
                         state_slots: Tensor, plan: VarlenPlan | None = None) -> Tensor:
    """`causal_conv1d` over B sequences, each continuing from and leaving its conv state in its
    slot: x [T, C]; weight [C, K]; cu_seqlens [B+1] int32; conv_pool [num_slots, C, K-1] (its dtype
    is the states'). Returns out [T, C] in x's dtype."""
    check_conv(x, weight)
    cu = checked_plan(cu_seqlens, x.shape[0], plan).cu
    check_conv_pool(conv_pool, weight, state_slots, len(cu) - 1)
    out = torch.empty_like(x)
    for b, slot in enumerate(state_slots.tolist()):
        if cu[b + 1] > cu[b]:
            out[cu[b]:cu[b + 1]], conv_pool[slot] = causal_conv1d(x[cu[b]:cu[b + 1]], weight, conv_pool[slot])
    return out


def causal_conv1d_update_slots(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor) -> Tensor:
    """`causal_conv1d_update` on states kept in a pool: x [B, C]; conv_pool [num_slots, C, K-1],
    rows state_slots [B] int64 updated in place. Returns [B, C] in x's dtype."""
    check_conv(x, weight)
    check_conv_pool(conv_pool, weight, state_slots, x.shape[0])
    out = torch.empty_like(x)
    for b, slot in enumerate(state_slots.tolist()):
        state = conv_pool[slot] if slot >= 0 else torch.zeros_like(conv_pool[0])
        out[b:b + 1], new_state = causal_conv1d(x[b:b + 1], weight, state)
        if slot >= 0:
            conv_pool[slot] = new_state
    return out
