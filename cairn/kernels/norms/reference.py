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
- `qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, *, rope_axes=None)`: `rms_norm`
  of every head of q [T, H_q, D] and k [T, H_kv, D], then partial RoPE (rotate-half) on the first
  2 * len(inv_freq) channels, frequency i at angle position * inv_freq[i] (in fp32; cos and sin cast
  to the data's dtype), at `positions` [T] int64. M-RoPE (Qwen3.5's images): with `rope_axes` [R]
  (int32 or int64, an axis 0..2 per frequency: cairn.workers.model.mrope.rope_axes), positions are
  [3, T] (int32 or int64, rows t, h, w) and frequency i turns by row rope_axes[i]'s position; with
  three equal rows, exactly the [T] rotation. The axes' values are the caller's contract (the C++
  op refuses one outside 0..2; Triton reads the row it names). Returns new (q, k).
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

from cairn.kernels.common.checks import check_rope_axes, expect_shape



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
                 eps: float, *, rope_axes: Tensor | None = None) -> tuple[Tensor, Tensor]:
    if rope_axes is None:
        expect_shape("positions", positions, "T", (q.shape[0],))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    else:
        check_rope_axes(positions, rope_axes, q.shape[0], inv_freq.shape[0])
        freqs = positions.float()[rope_axes.long()].T * inv_freq[None, :]  # [T, R]: each at its axis's position
    cos, sin = freqs.cos(), freqs.sin()
    return (_rope(rms_norm(q, q_weight, eps), cos, sin), _rope(rms_norm(k, k_weight, eps), cos, sin))


def delta_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    return x * torch.sigmoid(gate)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up
