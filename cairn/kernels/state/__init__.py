"""Recurrent state pools: `copy_state_slots` (checkpoint save and restore, many slots a call). The
op's one entry point (`cairn.kernels.common.dispatch`); contract: state/reference.py.

| device | copy_state_slots |
|---|---|
| CUDA | triton_ops (one launch per pool) |
| CPU | torch_ops (a gather and a scatter per pool) |
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cairn.kernels.common.dispatch import Ops

__all__ = ["copy_state_slots"]

OPS = Ops(cuda=("cairn.kernels.state.triton_ops",), cpu=("cairn.kernels.state.torch_ops",),
          fallback="cairn.kernels.state.reference")


def copy_state_slots(tensors: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    OPS.pick("copy_state_slots", tensors[0] if tensors else src_slots)(tensors, src_slots, dst_slots)
