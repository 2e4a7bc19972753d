"""`SharedExpert`: the weights of the SwiGLU expert every token takes beside its routed ones
(Qwen3-Next's and Qwen3.5's MoE blocks), and `shared_expert`, its output as the implementations
add it: sigmoid(x gate^T) * down(silu(x g^T) * (x u^T)), in x's dtype."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class SharedExpert(NamedTuple):
    gate_proj: Tensor  # [I_s, H]
    up_proj: Tensor  # [I_s, H]
    down_proj: Tensor  # [H, I_s]
    gate: Tensor  # [1, H]: its sigmoid scales the expert's output


def shared_expert(x: Tensor, shared: SharedExpert) -> Tensor:
    h = F.silu(F.linear(x, shared.gate_proj)) * F.linear(x, shared.up_proj)
    return torch.sigmoid(F.linear(x, shared.gate)) * F.linear(h, shared.down_proj)
