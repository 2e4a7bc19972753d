"""The fused mixture of experts: `fused_moe`, with an optional `SharedExpert`. The op's one entry
point (`cairn.kernels.common.dispatch`); contract: moe/reference.py.

| device | fused_moe |
|---|---|
| CUDA | triton_ops (five launches, no host sync) |
| CPU | torch_ops (the chosen CPU implementation: a gathered matmul pair per expert hit) |
"""

from __future__ import annotations

from torch import Tensor

from cairn.kernels.common.dispatch import Ops
from cairn.kernels.moe.expert import SharedExpert

__all__ = ["fused_moe", "SharedExpert"]

OPS = Ops(cuda=("cairn.kernels.moe.triton_ops",), cpu=("cairn.kernels.moe.torch_ops",),
          fallback="cairn.kernels.moe.reference")


def fused_moe(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
              renormalize: bool = True, shared: SharedExpert | None = None) -> Tensor:
    return OPS.pick("fused_moe", x)(x, logits, gate_up, down, top_k, renormalize, shared)
