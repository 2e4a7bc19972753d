"""The CPU's slot copy (state/torch_ops.py: a gather and a scatter per pool) against the
reference's slot-by-slot copy, over strided per-layer pool views."""

from __future__ import annotations

import torch

from cairn.kernels.state import reference, torch_ops


def test_the_copy_equals_the_reference_and_leaves_other_slots_alone():
    g = torch.Generator().manual_seed(0)
    pools = [torch.randn(6, 3, 4, 5, generator=g)[:, 1], torch.randn(6, 2, 7, generator=g).bfloat16()]
    src, dst = torch.tensor([0, 4]), torch.tensor([5, 1])
    mine, theirs = [p.clone() for p in pools], [p.clone() for p in pools]
    torch_ops.copy_state_slots(mine, src, dst)
    reference.copy_state_slots(theirs, src, dst)
    for got, want, before in zip(mine, theirs, pools):
        assert torch.equal(got, want) and torch.equal(got[[5, 1]], before[[0, 4]])
        assert torch.equal(got[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
