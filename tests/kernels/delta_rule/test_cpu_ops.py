"""The C++ CPU kernels of the gated delta rule (cairn/kernels/delta_rule/*.cpp, launched by cpu_ops.py) against
the op's reference, at odd shapes (odd lengths, empty and short segments, head dims off the vector
width, more value heads than key heads), on the strided pools and pages the engine passes, in
fp32 and bf16. Pool slots the op must not touch, and the rest of every buffer, start as NaN: a
kernel that reads or writes outside its rows fails loudly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cairn.kernels.delta_rule import cpu_ops as delta_rule_cpu
from cairn.kernels.delta_rule import reference as delta_rule_ref
from tests.kernels.conventions import BF16, TOL, layer_pool, needs_compiler, rand

pytestmark = [needs_compiler, pytest.mark.usefixtures("native_library")]


HEADS = [(2, 4, 16, 16), (1, 2, 24, 40), (4, 8, 64, 64), (2, 4, 128, 128)]  # H_k, H_v, D_k, D_v


def delta_inputs(total, heads, dtype, seed=0):
    h_k, h_v, d_k, d_v = heads
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(total, h_k, d_k, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(total, h_v, d_v, generator=gen).to(dtype)
    g = F.logsigmoid(2 * torch.randn(total, h_v, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(total, h_v, generator=gen)).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_varlen_delta_rule_equals_the_reference_with_states_at_positions(heads, dtype, tol):
    lengths = [75, 0, 3, 130, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, g, beta = delta_inputs(int(cu[-1]), heads, dtype)
    h_v, d_k, d_v = heads[1:]
    whole, pool = layer_pool(8, (h_v, d_k, d_v))
    slots = torch.tensor([6, 0, 2, 5, 3])
    pool[slots] = rand(5, h_v, d_k, d_v, seed=3, scale=0.5)
    positions = [[1, 16, 64, 75], [], [2], [63, 130], [1]]
    want_whole = whole.clone()
    want_out, want_states = delta_rule_ref.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, want_whole[:, 1], slots,
                                                                     state_positions=positions)
    out, states = delta_rule_cpu.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, slots, state_positions=positions)
    assert out.dtype == dtype and states.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(states, want_states, **TOL)
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)  # the final states; the rest NaN still


def test_an_explicit_scale_and_no_l2_norm_reach_the_kernel():
    q, k, v, g, beta = delta_inputs(40, HEADS[0], torch.float32)
    q, k = q / 4, k / 4  # unnormalised keys of norm about 1: a contracting recurrence, as in a model
    cu = torch.tensor([0, 40], dtype=torch.int32)
    for kwargs in (dict(scale=0.3), dict(use_qk_l2norm=False, scale=0.1)):
        a, b = torch.zeros(2, 4, 16, 16), torch.zeros(2, 4, 16, 16)
        want, _ = delta_rule_ref.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, a, torch.tensor([1]), **kwargs)
        out, _ = delta_rule_cpu.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, b, torch.tensor([1]), **kwargs)
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(b, a, **TOL)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_decode_step_in_slots_leaves_padding_rows_unwritten(heads, dtype, tol):
    q, k, v, g, beta = delta_inputs(5, heads, dtype, seed=4)
    h_v, d_k, d_v = heads[1:]
    whole, pool = layer_pool(7, (h_v, d_k, d_v))
    slots = torch.tensor([4, -1, 0, 6, -1])
    pool[slots[slots >= 0]] = rand(3, h_v, d_k, d_v, seed=5, scale=0.5)
    want_whole = whole.clone()
    want = delta_rule_ref.gated_delta_rule_step_slots(q, k, v, g, beta, want_whole[:, 1], slots)
    out = delta_rule_cpu.gated_delta_rule_step_slots(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(out.float(), want.float(), **tol)
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)

