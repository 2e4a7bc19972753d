"""The fused mixture-of-experts op, defined token by token: the oracle the Triton op and the torch
op (the CPU's) are tested against, and the slow fallback (`cairn.kernels.common.dispatch`).

`fused_moe(x, logits, gate_up, down, top_k, renormalize, shared)`, for tokens x [T, H]:
- routing: probs = softmax(logits) in fp32; the top_k experts of each token by prob (exact ties:
  the lower expert id), with those probs as weights, divided by their sum when `renormalize`;
  the weights are then cast to x's dtype (transformers' Qwen3-Next and Qwen3.5 MoE blocks do the
  same);
- expert e on token t: down[e] @ (silu(g) * u), where [g; u] = gate_up[e] @ x[t] (the first I
  rows of gate_up[e] are the gate's, the next I the up projection's), in x's dtype;
- out[t] = sum over t's experts of weight * expert(x[t]), in x's dtype;
- `shared` (a `SharedExpert`, optional): a SwiGLU expert every token takes, scaled by
  sigmoid(x . gate), added after the routed experts' sum.
Shapes: x [T, H]; logits [T, E] (any float dtype); gate_up [E, 2I, H]; down [E, H, I] with x's
dtype; a shared expert's weights [I_s, H], [I_s, H], [H, I_s] and [1, H]. Under tensor
parallelism each rank passes its slice of I and sums the ranks' outputs. Validation raises
ValueError("expected …, got …").

`align(ids, num_experts, block_m)`: the layout the Triton op's expert GEMMs read (its align step),
for the expert ids [N] of N (token, expert) pairs (pair p = token p // top_k, its (p % top_k)-th
choice): each expert's pairs in pair order, its run padded to a multiple of block_m, the runs in
expert order. Returns `sorted_pairs` [MAX_PADDED] int32 (pair ids, N in the padding and past the
last run), `block_expert` [MAX_PADDED / block_m] int32 (the expert whose run holds each block;
num_experts past the last run) and `num_padded` [1] int32 (where the last run ends), with
MAX_PADDED = N + num_experts * (block_m - 1) rounded up to a multiple of block_m: the most any
routing pads to, so every size is fixed by (N, num_experts, block_m).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cairn.kernels.common.checks import check_moe, check_shared_expert
from cairn.kernels.moe.expert import SharedExpert


def align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    n = ids.shape[0]
    max_padded = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((max_padded,), n, dtype=torch.int32)
    block_expert = torch.full((max_padded // block_m,), num_experts, dtype=torch.int32)
    start = 0
    for e in range(num_experts):
        mine = (ids.long() == e).nonzero().flatten()  # in pair order
        sorted_pairs[start:start + len(mine)] = mine.to(torch.int32)
        blocks = -(-len(mine) // block_m)
        block_expert[start // block_m:start // block_m + blocks] = e
        start += blocks * block_m
    return sorted_pairs, block_expert, torch.tensor([start], dtype=torch.int32)


def _swiglu(row: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return down @ (torch.nn.functional.silu(gate @ row) * (up @ row))


def fused_moe(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
              renormalize: bool = True, shared: SharedExpert | None = None) -> Tensor:
    check_moe(x, logits, gate_up, down, top_k)
    if shared is not None:
        check_shared_expert(x, shared)
    inter = down.shape[2]
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        probs = logits[t].float().softmax(-1)
        chosen = torch.sort(probs, descending=True, stable=True).indices[:top_k].tolist()  # ties: lower id
        weights = probs[chosen]
        if renormalize:
            weights = weights / weights.sum()
        acc = torch.zeros_like(x[t])
        for e, w in zip(chosen, weights.to(x.dtype)):
            acc += w * _swiglu(x[t], gate_up[e, :inter], gate_up[e, inter:], down[e])
        if shared is not None:
            gated = torch.sigmoid(shared.gate[0] @ x[t])
            acc += gated * _swiglu(x[t], shared.gate_proj, shared.up_proj, shared.down_proj)
        out[t] = acc
    return out
