"""Plain-torch references of the slot-indexed and varlen ops, over `reference`'s math: the varlen
conv and delta rule run every sequence of the batch at once (no Python loop over sequences).

These are the entry points an engine adopts to run a whole batch in one launch per op (on CPU the
varlen conv, too, runs every segment in one pass): states
live in pools and are read from and written back to slots in place, instead of being gathered
into a batch tensor and scattered back. Conventions are `reference`'s; in addition:
- A pool is [num_slots, ...] (any strides, e.g. the per-layer view `ssm_states[:, r]`) indexed by
  state_slots [B] int64; the slots of one call are distinct (the caller's contract).
- A varlen batch may hold empty sequences (cu_seqlens[b] == cu_seqlens[b+1]); their state is
  left as it is.
- In the decode ops (`gated_delta_rule_step_slots`, `causal_conv1d_update_slots`) a slot of -1
  is a padding row (a CUDA graph's batch bucket): it starts from a zero state and writes none.
- `plan`, when given, is cu_seqlens' `cairn.kernels.varlen_plan.VarlenPlan`: its host copy of the
  boundaries is used instead of reading cu_seqlens back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from cairn.kernels import reference
from cairn.kernels.reference import _check_delta, _expect, _expect_dtype, _expect_shape, _windows
from cairn.kernels.varlen_plan import VarlenPlan


def _plan(cu_seqlens: Tensor, total: int, plan: VarlenPlan | None,
          positions: Sequence[Sequence[int]] = ()) -> VarlenPlan:
    """The varlen plan of cu_seqlens: the caller's, or built from cu_seqlens read back; checked to
    cover `total` rows."""
    _expect_shape("cu_seqlens", cu_seqlens, "B+1", (None,))
    _expect_dtype("cu_seqlens", cu_seqlens, torch.int32)
    plan = plan or VarlenPlan.of(cu_seqlens, positions)
    _expect(plan.batch == cu_seqlens.shape[0] - 1, f"a plan of B = {cu_seqlens.shape[0] - 1} sequences", plan.batch)
    _expect(plan.total == total, f"cu_seqlens non-decreasing from 0 to T = {total}", plan.cu)
    return plan


def _gather(pool: Tensor, state_slots: Tensor) -> tuple[Tensor, Tensor | slice]:
    """A copy of the slots' states (zeros for a padding row's -1), and which rows are live (all of
    them, `slice(None)`, when no row pads: a host sync, which costs nothing on the CPU path)."""
    live = state_slots >= 0
    if bool(live.all()):
        return pool[state_slots], slice(None)
    state = pool[state_slots.clamp(min=0)]
    state[~live] = 0
    return state, live


def _check_slots(name: str, pool: Tensor, layout: str, inner: tuple[int, ...], state_slots: Tensor,
                 batch: int) -> None:
    _expect_shape(name, pool, layout, (None, *inner))
    _expect_shape("state_slots", state_slots, "B", (batch,))
    _expect_dtype("state_slots", state_slots, torch.int64)


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  state_pool: Tensor, state_slots: Tensor, *, scale: float | None = None,
                                  use_qk_l2norm: bool = True, state_positions: Sequence[Sequence[int]] = (),
                                  plan: VarlenPlan | None = None) -> tuple[Tensor, Tensor]:
    """The chunked delta rule over B sequences, each starting from and ending in its state slot.

    q, k [T, H_k, D_k]; v [T, H_v, D_v]; g, beta [T, H_v]; cu_seqlens [B+1] int32; state_pool
    [num_slots, H_v, D_k, D_v] fp32, state_pool[state_slots[b]] read as sequence b's initial state
    and overwritten with its final state. state_positions: per sequence (a shorter list means no
    positions for the rest), strictly increasing 0 < p <= len_b. Returns (out [T, H_v, D_v] in v's
    dtype, states [P, H_v, D_k, D_v] fp32: the state after state_positions[b][i] tokens of
    sequence b, sequence by sequence, position by position).
    """
    total, h_v, d_k, d_v = _check_delta(q, k, v, g, beta, "T")
    plan = _plan(cu_seqlens, total, plan, state_positions)
    cu, state_positions = plan.cu, plan.positions
    batch = len(cu) - 1
    _check_slots("state_pool", state_pool, "num_slots, H_v, D_k, D_v", (h_v, d_k, d_v), state_slots, batch)
    _expect_dtype("state_pool", state_pool, torch.float32)
    _expect(len(state_positions) <= batch, f"at most B = {batch} lists of state_positions", len(state_positions))
    for b in range(batch):
        if cu[b] == cu[b + 1]:
            _expect(not (b < len(state_positions) and state_positions[b]),
                    f"no state_positions for the empty sequence {b}", state_positions[b] if b < len(state_positions) else [])
    # Every sequence at once, each padded to the longest one's chunks (the padding has no effect).
    lengths = [cu[b + 1] - cu[b] for b in range(batch)]
    size = 64
    padded = -(-max(lengths + [1]) // size) * size
    segment = torch.repeat_interleave(torch.arange(batch), torch.tensor(lengths))
    offset = torch.arange(total) - torch.tensor(cu[:-1])[segment]
    qp, kp, vp, gp, bp = reference._prepare(q, k, v, g, beta, scale, use_qk_l2norm)

    def laid_out(t: Tensor) -> Tensor:  # [T, ...] -> [B, padded, ...], zeros past each end
        if batch == 1:  # one segment (a long prompt's chunk): padded at its end, not scattered
            return F.pad(t, (0, 0) * (t.dim() - 1) + (0, padded - total))[None]
        out = torch.zeros(batch, padded, *t.shape[1:], dtype=t.dtype, device=t.device)
        out[segment, offset] = t
        return out

    out, final, states = reference.delta_chunks(*(laid_out(t) for t in (qp, kp, vp, gp, bp)), state_pool[state_slots],
                                                [list(state_positions[b]) if b < len(state_positions) else []
                                                 for b in range(batch)], size)
    state_pool[state_slots] = final
    return (out[0, :total] if batch == 1 else out[segment, offset]).to(v.dtype), states


def gated_delta_rule_step_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                                state_slots: Tensor, *, scale: float | None = None,
                                use_qk_l2norm: bool = True) -> Tensor:
    """`reference.gated_delta_rule_step` on states kept in a pool: state_pool [num_slots, H_v, D_k,
    D_v] fp32, rows state_slots [B] int64 updated in place. Returns out [B, H_v, D_v] in v's dtype."""
    batch, h_v, d_k, d_v = _check_delta(q, k, v, g, beta, "B")
    _check_slots("state_pool", state_pool, "num_slots, H_v, D_k, D_v", (h_v, d_k, d_v), state_slots, batch)
    _expect_dtype("state_pool", state_pool, torch.float32)
    state, live = _gather(state_pool, state_slots)
    out = reference.gated_delta_rule_step(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    state_pool[state_slots[live]] = state[live]
    return out


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor,
                         state_slots: Tensor, plan: VarlenPlan | None = None) -> Tensor:
    """`reference.causal_conv1d` over B sequences, each continuing from and leaving its conv state in
    its slot: x [T, C]; weight [C, K]; cu_seqlens [B+1] int32; conv_pool [num_slots, C, K-1] (its
    dtype is the states'). Returns out [T, C] in x's dtype."""
    _expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    _expect_shape("x", x, "T, C", (None, channels))
    cu = _plan(cu_seqlens, x.shape[0], plan).cu
    batch, k1 = len(cu) - 1, width - 1
    _check_slots("conv_pool", conv_pool, "num_slots, C, K-1", (channels, width - 1), state_slots, batch)
    if batch == 0:
        return torch.empty_like(x)
    # All segments at once: each one's conv state (K-1 rows) then its tokens, end to end; the
    # windows slide over the whole of it, and only those ending on a token are kept.
    xf, states = x.float(), conv_pool[state_slots].float().transpose(1, 2)  # [T, C], [B, K-1, C]
    history = torch.cat([part for b in range(batch) for part in (states[b], xf[cu[b]:cu[b + 1]])])
    lengths = torch.tensor([cu[b + 1] - cu[b] for b in range(batch)])
    segment = torch.repeat_interleave(torch.arange(batch), lengths)
    out = _windows(history, weight, history.shape[0] - k1)[torch.arange(x.shape[0]) + k1 * segment]
    ends = torch.tensor(cu[1:]) + k1 * torch.arange(1, batch + 1)  # one past each segment's history
    last = ends[:, None] - k1 + torch.arange(k1)[None, :]  # [B, K-1]: the rows that are its new state
    conv_pool[state_slots] = history[last].transpose(1, 2).to(conv_pool.dtype)
    return F.silu(out).to(x.dtype)


def causal_conv1d_update_slots(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor) -> Tensor:
    """`reference.causal_conv1d_update` on states kept in a pool: x [B, C]; conv_pool
    [num_slots, C, K-1], rows state_slots [B] int64 updated in place. Returns [B, C] in x's dtype."""
    _expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    _expect_shape("x", x, "B, C", (None, channels))
    _check_slots("conv_pool", conv_pool, "num_slots, C, K-1", (channels, width - 1), state_slots, x.shape[0])
    state, live = _gather(conv_pool, state_slots)
    out = reference.causal_conv1d_update(x, weight, state)
    conv_pool[state_slots[live]] = state[live]
    return out
