"""The row ops' C++ CPU kernels (norms.cpp), launched over `torch.ops.cairn_cpu`: each row's data
stays in cache through the norm, the rotary and the gates. Contracts: norms/reference.py's."""

from __future__ import annotations

import torch
from torch import Tensor

from cairn.kernels.common.checks import check_rope_axes, expect_shape

NATIVE = True  # runs only where the C++ library is loaded
_ops = torch.ops.cairn_cpu


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    expect_shape("weight", weight, "D", (x.shape[-1],))
    y, total = _ops.rms_norm(x, weight, eps, residual)
    return y if residual is None else (y, total)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The weighted row is rounded to the dtype the reference's product has (x's, unless one of
    them is fp32)."""
    expect_shape("x", x, "N, D", (None, weight.shape[0]))
    expect_shape("gate", gate, "N, D", tuple(x.shape))
    return _ops.gated_rms_norm(x, gate, weight, eps, torch.promote_types(weight.dtype, x.dtype) == x.dtype)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor, inv_freq: Tensor,
                 eps: float, *, rope_axes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """With rope_axes, the op also refuses an axis outside 0..2."""
    expect_shape("q", q, "T, H_q, D", (None, None, None))
    expect_shape("k", k, "T, H_kv, D", (q.shape[0], None, q.shape[2]))
    if rope_axes is None:
        expect_shape("positions", positions, "T", (q.shape[0],))
    else:
        check_rope_axes(positions, rope_axes, q.shape[0], inv_freq.shape[0])
    return _ops.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, rope_axes)


def delta_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    expect_shape("a", a, "T, H_v", (None, A_log.shape[0]))
    expect_shape("b", b, "T, H_v", tuple(a.shape))
    return _ops.delta_gates(a, b, A_log, dt_bias)


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    expect_shape("gate", gate, "T, N", tuple(x.shape))
    return _ops.sigmoid_mul(x, gate)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    expect_shape("up", up, "T, N", tuple(gate.shape))
    return _ops.silu_mul(gate, up)
