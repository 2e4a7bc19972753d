"""The Triton kernels of the slot copy against the op's reference, interpreted on CPU (conftest sets
TRITON_INTERPRET=1 before triton is imported), in fp32 at small, deliberately odd shapes: T = 1,
63, 75; head dims that are not powers of two; more value heads than key heads; varlen batches
against a per-sequence loop. Every buffer a launcher allocates starts as NaN, and so do caches
and state slots nobody should read, so a kernel that reads unwritten memory, or leaves part of
its output unwritten, fails.
"""

from __future__ import annotations

import pytest
import torch

from cairn.kernels.state import reference as state_ref
from cairn.kernels.state import triton_ops as state_triton
from tests.kernels.conventions import EXACT, triton_interpreted

pytestmark = [triton_interpreted, pytest.mark.usefixtures("nan_filled_buffers")]


def test_copy_state_slots_copies_whole_slots_of_every_pool_in_one_call():
    conv_pool, ssm_pool = torch.randn(6, 2, 3, 5), torch.randn(6, 2, 3, 4, 7)
    pools = [conv_pool, ssm_pool, ssm_pool[:, 1]]  # whole pools and a strided per-layer view
    want = [p.clone() for p in (conv_pool, ssm_pool)]
    src, dst = torch.tensor([1, 4, 2]), torch.tensor([3, 0, 5])
    state_triton.copy_state_slots(pools, src, dst)
    state_ref.copy_state_slots([want[0], want[1], want[1][:, 1]], src, dst)
    torch.testing.assert_close(conv_pool, want[0], **EXACT)
    torch.testing.assert_close(ssm_pool, want[1], **EXACT)

