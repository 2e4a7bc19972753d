"""State-slot copies as torch ops: what a CPU runs (one gather and one scatter per pool, no kernel
of ours needed). Contract: state/reference.py's."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cairn.kernels.common.checks import check_copy_slots, expect


def copy_state_slots(tensors: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    check_copy_slots(src_slots, dst_slots)
    for pool in tensors:
        expect(pool.dim() >= 1, "state pools with a slot dim", list(pool.shape))
        pool.index_copy_(0, dst_slots, pool.index_select(0, src_slots))
