"""The delta rule's C++ CPU kernel (delta_rule.cpp), launched over `torch.ops.cairn_cpu`: the
varlen (prefill, token by token in the kernel) and per-slot (decode) forms the engine runs.
Contracts: delta_rule/reference.py's, to rounding (the reference runs chunk by chunk)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cairn.kernels.common.checks import check_delta, check_state_pool, expect
from cairn.kernels.common.varlen_plan import VarlenPlan, checked_plan

NATIVE = True  # runs only where the C++ library is loaded
_ops = torch.ops.cairn_cpu


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  state_pool: Tensor, state_slots: Tensor, *, scale: float | None = None,
                                  use_qk_l2norm: bool = True, state_positions: Sequence[Sequence[int]] = (),
                                  plan: VarlenPlan | None = None) -> tuple[Tensor, Tensor]:
    total, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    plan = checked_plan(cu_seqlens, total, plan, state_positions)
    batch = plan.batch
    check_state_pool(state_pool, state_slots, batch, h_v, d_k, d_v)
    positions = [list(plan.positions[b]) if b < len(plan.positions) else [] for b in range(batch)]
    offsets = [0]
    for b, ps in enumerate(positions):
        expect(not ps or plan.cu[b] < plan.cu[b + 1], f"no state_positions for the empty sequence {b}", ps)
        offsets.append(offsets[-1] + len(ps))
    return _ops.delta_rule_varlen(q, k, v, g, beta, plan.cu, state_pool, state_slots,
                                  [p for ps in positions for p in ps], offsets, scale or 0.0, use_qk_l2norm)


def gated_delta_rule_step_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                                state_slots: Tensor, *, scale: float | None = None,
                                use_qk_l2norm: bool = True) -> Tensor:
    batch, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "B")
    check_state_pool(state_pool, state_slots, batch, h_v, d_k, d_v)
    return _ops.delta_rule_step(q, k, v, g, beta, state_pool, state_slots, scale or 0.0, use_qk_l2norm)
