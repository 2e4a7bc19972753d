"""The row-wise ops a GPU runs fused, one launch each: `rms_norm` (with the residual add),
`gated_rms_norm`, `qk_norm_rope`, `delta_gates`, `sigmoid_gate`, `silu_mul`. The op's one entry
point (`cairn.kernels.common.dispatch`); contracts: norms/reference.py.

| device | every op |
|---|---|
| CUDA | triton_ops |
| CPU (C++ library) | cpu_ops |
| CPU (no library) | reference (the slow fallback) |
"""

from __future__ import annotations

from torch import Tensor

from cairn.kernels.common.dispatch import Ops

__all__ = ["rms_norm", "gated_rms_norm", "qk_norm_rope", "delta_gates", "sigmoid_gate", "silu_mul"]

OPS = Ops(cuda=("cairn.kernels.norms.triton_ops",), cpu=("cairn.kernels.norms.cpu_ops",),
          fallback="cairn.kernels.norms.reference")


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    return OPS.pick("rms_norm", x)(x, weight, eps, residual)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    return OPS.pick("gated_rms_norm", x)(x, gate, weight, eps)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor, inv_freq: Tensor,
                 eps: float, *, rope_axes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """positions [T]; with rope_axes [R] (M-RoPE), positions [3, T] (reference.qk_norm_rope)."""
    return OPS.pick("qk_norm_rope", q)(q, k, q_weight, k_weight, positions, inv_freq, eps, rope_axes=rope_axes)


def delta_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    return OPS.pick("delta_gates", a)(a, b, A_log, dt_bias)


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    return OPS.pick("sigmoid_gate", x)(x, gate)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return OPS.pick("silu_mul", gate)(gate, up)
