"""Plain-torch reference of the fused mixture-of-experts op: the CPU path, and the oracle for
`cairn.kernels.triton_moe`.

`fused_moe(x, logits, gate_up, down, top_k, renormalize)`, for tokens x [T, H]:
- routing: probs = softmax(logits) in fp32; the top_k experts of each token by prob (torch.topk;
  the Triton kernel breaks exact ties toward the lower expert id), with those probs as weights, divided by their sum when
  `renormalize`; the weights are then cast to x's dtype (transformers' Qwen3-Next and Qwen3.5
  MoE blocks do the same);
- expert e on token t: down[e] @ (silu(g) * u), where [g; u] = gate_up[e] @ x[t] (the first I
  rows of gate_up[e] are the gate's, the next I the up projection's);
- out[t] = sum over t's experts of weight * expert(x[t]), in x's dtype.

Shapes: x [T, H]; logits [T, E] (any float dtype); gate_up [E, 2I, H]; down [E, H, I] with x's
dtype. Under tensor parallelism each rank passes its slice of I and sums the ranks' outputs.

`shared` (a `SharedExpert`, optional): a SwiGLU expert every token takes, scaled by
sigmoid(x . gate), added after the routed experts' sum: out + sigmoid(x gate^T) * down(silu(g) * u),
in x's dtype, as transformers' Qwen3-Next and Qwen3.5 MoE blocks add it. Its weights are
[I_s, H], [I_s, H], [H, I_s] and [1, H]; the Triton op batches it with the routed experts when
I_s == I (every published Qwen shape), else it runs it beside them.

On CPU, where a host sync costs nothing, the experts that received tokens are found on the host
and each runs one gathered matmul pair: faster here than any batched gather of expert weights.
The expert matmuls run in x's dtype, as the model's other linears do (bf16 on a CPU with native
bf16), not in fp32. No CUDA tensor takes this path unless the references are forced
(`kernels.force_reference`); the Triton op makes no host sync and no routing-dependent shape.
Validation raises ValueError("expected …, got …"), like every reference op.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from cairn.kernels.reference import _expect, _expect_shape


class SharedExpert(NamedTuple):
    gate_proj: Tensor  # [I_s, H]
    up_proj: Tensor  # [I_s, H]
    down_proj: Tensor  # [H, I_s]
    gate: Tensor  # [1, H]: its sigmoid scales the expert's output


def check_shared(x: Tensor, shared: SharedExpert) -> None:
    H = x.shape[1]
    i_s = shared.gate_proj.shape[0]
    for name, t, shape in (("shared gate_proj", shared.gate_proj, (i_s, H)), ("shared up_proj", shared.up_proj, (i_s, H)),
                           ("shared down_proj", shared.down_proj, (H, i_s)), ("shared gate", shared.gate, (1, H))):
        _expect_shape(name, t, "..", shape)
        _expect(t.dtype == x.dtype, f"{name} of x's dtype {x.dtype}", t.dtype)


def shared_expert(x: Tensor, shared: SharedExpert) -> Tensor:
    """sigmoid(x gate^T) * down(silu(x g^T) * (x u^T)), in x's dtype."""
    h = F.silu(F.linear(x, shared.gate_proj)) * F.linear(x, shared.up_proj)
    return torch.sigmoid(F.linear(x, shared.gate)) * F.linear(h, shared.down_proj)


def check_moe_args(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int) -> None:
    _expect_shape("x", x, "T, H", (None, None))
    T, H = x.shape
    _expect_shape("gate_up", gate_up, "E, 2I, H", (None, None, H))
    E, two_i = gate_up.shape[0], gate_up.shape[1]
    _expect(two_i % 2 == 0, "gate_up's rows = 2 I (gate, then up)", two_i)
    _expect_shape("down", down, "E, H, I", (E, H, two_i // 2))
    _expect_shape("logits", logits, "T, E", (T, E))
    _expect(isinstance(top_k, int) and 1 <= top_k <= E, f"1 <= top_k <= E = {E}", top_k)
    _expect(gate_up.dtype == x.dtype and down.dtype == x.dtype, f"expert weights of x's dtype {x.dtype}",
            (gate_up.dtype, down.dtype))


def route(logits: Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(weights [T, top_k] of `dtype`, expert ids [T, top_k] int64), best first."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def fused_moe(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
              renormalize: bool = True, shared: SharedExpert | None = None) -> Tensor:
    """See the module docstring."""
    check_moe_args(x, logits, gate_up, down, top_k)
    if shared is not None:
        check_shared(x, shared)
    weights, experts = route(logits, top_k, renormalize, x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, which = torch.where(experts == e)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[rows, which, None]
        out.index_add_(0, rows, y)
    return out if shared is None else out + shared_expert(x, shared)
