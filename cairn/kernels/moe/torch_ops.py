"""The mixture of experts as torch ops: what a CPU runs (the chosen implementation there, not a
reference: on a CPU, where a host sync costs nothing, finding the experts that received tokens on
the host and running one gathered matmul pair each is faster than any batched gather of expert
weights, and faster than a C++ loop of ours would be: the matmuls are oneDNN's).

Contract: moe/reference.py's `fused_moe`. The expert matmuls run in x's dtype, as the model's
other linears do (bf16 on a CPU with native bf16), not in fp32; routing's softmax and top-k in
fp32 (torch.topk), its weights then cast to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cairn.kernels.common.checks import check_moe, check_shared_expert
from cairn.kernels.moe.expert import SharedExpert, shared_expert


def fused_moe(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
              renormalize: bool = True, shared: SharedExpert | None = None) -> Tensor:
    check_moe(x, logits, gate_up, down, top_k)
    if shared is not None:
        check_shared_expert(x, shared)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, which = torch.where(experts == e)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[rows, which, None]
        out.index_add_(0, rows, y)
    return out if shared is None else out + shared_expert(x, shared)
