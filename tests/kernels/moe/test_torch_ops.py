"""The CPU's mixture of experts (moe/torch_ops.py: a gathered matmul pair per expert that got
tokens) against the reference's token-by-token definition, in fp32 and bf16, with and without a
shared expert, renormalised or not."""

from __future__ import annotations

import pytest
import torch

from cairn.kernels.moe import reference, torch_ops
from tests.kernels.moe.test_triton_ops import moe_inputs, shared_inputs


@pytest.mark.parametrize("dtype, tol", [(torch.float32, dict(atol=2e-5, rtol=1e-4)),
                                        (torch.bfloat16, dict(atol=2e-2, rtol=2e-2))])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("with_shared", [False, True])
def test_the_torch_op_equals_the_reference(dtype, tol, renormalize, with_shared):
    x, logits, gate_up, down = moe_inputs(19, 8, seed=3, dtype=dtype)
    shared = shared_inputs(dtype=dtype) if with_shared else None
    got = torch_ops.fused_moe(x, logits, gate_up, down, 3, renormalize, shared)
    want = reference.fused_moe(x, logits, gate_up, down, 3, renormalize, shared)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_no_tokens_give_an_empty_output():
    x, logits, gate_up, down = moe_inputs(0, 8)
    assert torch_ops.fused_moe(x, logits, gate_up, down, 2).shape == reference.fused_moe(x, logits, gate_up, down, 2).shape
