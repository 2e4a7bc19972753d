"""The reference of the slot copy (cairn/kernels/state/reference.py, the contract every
implementation is held to), at odd shapes in fp32. Buffers an op writes into start as NaN,
so reading an unwritten slot fails loudly. The ops run through `cairn.kernels` with the references
forced.
"""

from __future__ import annotations

import pytest
import torch

from cairn.kernels import (
    copy_state_slots,
)

pytestmark = pytest.mark.usefixtures("the_references")


def test_copy_state_slots_copies_whole_slots_and_leaves_the_others_untouched():
    conv, ssm = torch.randn(6, 3, 5), torch.randn(6, 2, 3, 4)
    before = [conv.clone(), ssm.clone()]
    copy_state_slots([conv, ssm], torch.tensor([1, 4]), torch.tensor([3, 0]))
    for pool, old in zip((conv, ssm), before):
        assert torch.equal(pool[3], old[1]) and torch.equal(pool[0], old[4])
        assert torch.equal(pool[[1, 2, 4, 5]], old[[1, 2, 4, 5]])

