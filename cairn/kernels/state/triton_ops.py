"""Triton state-slot copy: checkpoint save and restore for many slots in one launch per pool.

`copy_state_slots(pools, src_slots, dst_slots)` does what `reference.copy_state_slots` does:
for every pool, `pool[dst_slots[i]] = pool[src_slots[i]]` for all i.

Shapes: each pool [num_slots, ...] (any dtype; the slot dim may be strided, e.g. a view
`ssm_states[:, r]`, but the elements of one slot must be contiguous); src_slots, dst_slots [N]
int64 on the pool's device, disjoint (the caller's contract: a slot is never both read and
written, so the copies of one launch do not race).

Grid per pool: (N, cdiv(slot_numel, BLOCK)); program (i, j) copies elements
[j * BLOCK, (j + 1) * BLOCK) of slot src_slots[i] into slot dst_slots[i].
"""

from __future__ import annotations

from collections.abc import Sequence

import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common.checks import check_copy_slots, expect
from cairn.kernels.state.tuning import BLOCK


@triton.jit(do_not_specialize_on_alignment=["src_slots", "dst_slots"])
def _copy_slots_kernel(pool, src_slots, dst_slots, slot_stride, slot_numel, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < slot_numel
    src = tl.load(src_slots + i).to(tl.int64)
    dst = tl.load(dst_slots + i).to(tl.int64)
    row = tl.load(pool + src * slot_stride + offs, mask=mask)
    tl.store(pool + dst * slot_stride + offs, row, mask=mask)


def _slot_is_contiguous(pool: Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(pool.shape[1:]), reversed(pool.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def copy_state_slots(tensors: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """See `reference.copy_state_slots`; one launch per pool."""
    check_copy_slots(src_slots, dst_slots)
    n = src_slots.shape[0]
    src, dst = src_slots.contiguous(), dst_slots.contiguous()
    for pool in tensors:
        expect(pool.dim() >= 1, "state pools with a slot dim", list(pool.shape))
        expect(_slot_is_contiguous(pool), "pools whose slots are contiguous", list(pool.stride()))
        slot_numel = pool[0].numel() if pool.shape[0] else 0
        if n == 0 or slot_numel == 0:
            continue
        grid = (n, triton.cdiv(slot_numel, BLOCK))
        _copy_slots_kernel[grid](pool, src, dst, pool.stride(0), slot_numel, BLOCK=BLOCK)
