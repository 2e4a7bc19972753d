"""The gated delta rule: `chunk_gated_delta_rule_varlen` (prefill, chunked) and
`gated_delta_rule_step_slots` (decode, recurrent) over state pools, the forms the engine runs;
`chunk_gated_delta_rule`, `recurrent_gated_delta_rule` and `gated_delta_rule_step` over one
sequence's state (the Triton kernels' single-sequence launchers, and the tests'). The op's one
entry point (`cairn.kernels.common.dispatch`); contracts: delta_rule/reference.py.

| device | varlen, step_slots | single-sequence forms |
|---|---|---|
| CUDA | triton_chunk (chunked), triton_recurrent (recurrent) | the same |
| CPU (C++ library) | cpu_ops | reference (the engine does not run them) |
| CPU (no library) | reference (the slow fallback) | reference |
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cairn.kernels.common.dispatch import Ops
from cairn.kernels.common.varlen_plan import VarlenPlan

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_rule_step", "chunk_gated_delta_rule_varlen", "gated_delta_rule_step_slots"]

OPS = Ops(cuda=("cairn.kernels.delta_rule.triton_chunk", "cairn.kernels.delta_rule.triton_recurrent"),
          cpu=("cairn.kernels.delta_rule.cpu_ops",), fallback="cairn.kernels.delta_rule.reference")


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, *, scale: float | None = None,
                           chunk_size: int = 64, use_qk_l2norm: bool = True,
                           state_positions: Sequence[int] = ()) -> tuple[Tensor, Tensor, Tensor]:
    return OPS.pick("chunk_gated_delta_rule", v)(q, k, v, g, beta, initial_state, scale=scale, chunk_size=chunk_size,
                                                 use_qk_l2norm=use_qk_l2norm, state_positions=state_positions)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None, *, scale: float | None = None,
                               use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    return OPS.pick("recurrent_gated_delta_rule", v)(q, k, v, g, beta, initial_state, scale=scale,
                                                     use_qk_l2norm=use_qk_l2norm)


def gated_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
                          scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    return OPS.pick("gated_delta_rule_step", v)(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm)


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  state_pool: Tensor, state_slots: Tensor, *, scale: float | None = None,
                                  use_qk_l2norm: bool = True, state_positions: Sequence[Sequence[int]] = (),
                                  plan: VarlenPlan | None = None) -> tuple[Tensor, Tensor]:
    return OPS.pick("chunk_gated_delta_rule_varlen", v)(q, k, v, g, beta, cu_seqlens, state_pool, state_slots,
                                                        scale=scale, use_qk_l2norm=use_qk_l2norm,
                                                        state_positions=state_positions, plan=plan)


def gated_delta_rule_step_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                                state_slots: Tensor, *, scale: float | None = None,
                                use_qk_l2norm: bool = True) -> Tensor:
    return OPS.pick("gated_delta_rule_step_slots", v)(q, k, v, g, beta, state_pool, state_slots, scale=scale,
                                                      use_qk_l2norm=use_qk_l2norm)
