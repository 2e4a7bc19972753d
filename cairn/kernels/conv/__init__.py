"""The Gated DeltaNet's causal conv: `causal_conv1d_varlen` (prefill) and `causal_conv1d_update_slots`
(decode) over state pools, the forms the engine runs; `causal_conv1d` and `causal_conv1d_update`
over one sequence's state (the Triton kernels' single-sequence launchers, and the tests'). The
op's one entry point (`cairn.kernels.common.dispatch`); contracts: conv/reference.py.

| device | varlen, update_slots | causal_conv1d, causal_conv1d_update |
|---|---|---|
| CUDA | triton_ops | triton_ops |
| CPU (C++ library) | cpu_ops | reference (the engine does not run them) |
| CPU (no library) | reference (the slow fallback) | reference |
"""

from __future__ import annotations

from torch import Tensor

from cairn.kernels.common.dispatch import Ops
from cairn.kernels.common.varlen_plan import VarlenPlan

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_varlen", "causal_conv1d_update_slots"]

OPS = Ops(cuda=("cairn.kernels.conv.triton_ops",), cpu=("cairn.kernels.conv.cpu_ops",),
          fallback="cairn.kernels.conv.reference")


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor | None) -> tuple[Tensor, Tensor]:
    return OPS.pick("causal_conv1d", x)(x, weight, conv_state)


def causal_conv1d_update(x: Tensor, weight: Tensor, conv_state: Tensor) -> Tensor:
    return OPS.pick("causal_conv1d_update", x)(x, weight, conv_state)


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor,
                         state_slots: Tensor, plan: VarlenPlan | None = None) -> Tensor:
    return OPS.pick("causal_conv1d_varlen", x)(x, weight, cu_seqlens, conv_pool, state_slots, plan)


def causal_conv1d_update_slots(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor) -> Tensor:
    return OPS.pick("causal_conv1d_update_slots", x)(x, weight, conv_pool, state_slots)
