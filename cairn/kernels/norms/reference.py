"""The row-wise ops in plain torch: the norms (with the residual add), q/k norm with rotary, and the
Gated DeltaNet gates, each computing exactly what transformers computes, in the order and dtypes
it does: the oracle of the Triton ops (one launch each) and of the C++ ones, and the slow
fallback (`cairn.kernels.common.dispatch`).
- `rms_norm(x, weight, eps, residual=None)`: zero-centred RMSNorm, y = x / rms(x) * (1 + w), the
  statistics and the product in fp32, y in x's dtype. With `residual`, x is first replaced by
  x + residual (in x's dtype, as the decoder adds its residual stream), and (y, that sum) is
  returned.
- `gated_rms_norm(x, gate, weight, eps)`: plain-weight RMSNorm (w * normed, in x's dtype) times
  silu(gate) in fp32, cast back: the DeltaNet output norm. x, gate [N, D].
- `qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps)`: `rms_norm` of every head of
  q [T, H_q, D] and k [T, H_kv, D], then partial RoPE (rotate-half) on the first 2 * len(inv_freq)
  channels at `positions` [T] (cos and sin in fp32, cast to the data's dtype). Returns new (q, k).
- `delta_gates(a, b, A_log, dt_bias)`: g = -exp(A_log) * softplus(a + dt_bias) in fp32 and
  beta = sigmoid(b) in b's dtype, a, b [T, H_v].
- `sigmoid_gate(x, gate)`: x * sigmoid(gate), both [T, N] in one dtype (the gated attention's
  output gate): the sigmoid rounded to the dtype, then the product.
- `silu_mul(gate, up)`: silu(gate) * up, both [T, N] in one dtype (SwiGLU's activation): the silu
  rounded to the dtype, then the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _normed(x: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) in fp32 (torch's fused op: the same arithmetic, one op on CPU)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    if residual is not None:
        x = x + residual
    y = (_normed(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return y if residual is None else (y, x)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    y = weight * _normed(x, eps).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    dim = 2 * cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    c, s = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :], torch.cat((sin, sin), dim=-1).to(x.dtype)[:, None, :]
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * c + rotated * s, rest), dim=-1)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor, inv_freq: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    cos, sin = freqs.cos(), freqs.sin()
    return (_rope(rms_norm(q, q_weight, eps), cos, sin), _rope(rms_norm(k, k_weight, eps), cos, sin))


def delta_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    return x * torch.sigmoid(gate)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up
