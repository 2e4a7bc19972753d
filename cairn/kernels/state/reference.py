"""Copying recurrent states between slots of their pools, slot by slot: the oracle of the Triton
copy (state/triton_ops.py) and of the torch op (state/torch_ops.py), and the slow fallback.

`copy_state_slots(tensors, src_slots, dst_slots)`: for each pool (dim 0 = slot),
tensor[dst_slots] = tensor[src_slots], in place; src_slots, dst_slots [N] int64, disjoint. A
state pool's slots are the engine's checkpoints and running sequences (the conv and delta-rule
states of every layer).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cairn.kernels.common.checks import check_copy_slots, expect


def copy_state_slots(tensors: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    check_copy_slots(src_slots, dst_slots)
    for pool in tensors:
        expect(pool.dim() >= 1, "state pools with a slot dim", list(pool.shape))
        for src, dst in zip(src_slots.tolist(), dst_slots.tolist()):
            pool[dst] = pool[src].clone()
