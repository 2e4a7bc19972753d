"""The causal conv's C++ CPU kernels (conv.cpp), launched over `torch.ops.cairn_cpu`: the varlen
(prefill) and per-slot (decode) forms the engine runs. Contracts: conv/reference.py's."""

from __future__ import annotations

import torch
from torch import Tensor

from cairn.kernels.common.checks import check_conv, check_conv_pool
from cairn.kernels.common.varlen_plan import VarlenPlan, checked_plan

NATIVE = True  # runs only where the C++ library is loaded
_ops = torch.ops.cairn_cpu


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor,
                         state_slots: Tensor, plan: VarlenPlan | None = None) -> Tensor:
    check_conv(x, weight)
    cu = checked_plan(cu_seqlens, x.shape[0], plan).cu
    check_conv_pool(conv_pool, weight, state_slots, len(cu) - 1)
    return _ops.conv_varlen(x, weight, cu, conv_pool, state_slots)


def causal_conv1d_update_slots(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor) -> Tensor:
    check_conv(x, weight)
    check_conv_pool(conv_pool, weight, state_slots, x.shape[0])
    return _ops.conv_update(x, weight, conv_pool, state_slots)
