"""The C++ CPU kernels of the row-wise ops (cairn/kernels/norms/*.cpp, launched by cpu_ops.py) against
the op's reference, at odd shapes (odd lengths, empty and short segments, head dims off the vector
width, more value heads than key heads), on the strided pools and pages the engine passes, in
fp32 and bf16. Pool slots the op must not touch, and the rest of every buffer, start as NaN: a
kernel that reads or writes outside its rows fails loudly.
They round where the reference rounds: in bf16 they are bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from cairn.kernels.norms import cpu_ops as norms_cpu
from cairn.kernels.norms import reference as norms_ref
from tests.kernels.conventions import TOL, needs_compiler, rand

pytestmark = [needs_compiler, pytest.mark.usefixtures("native_library")]


def same(got, want, dtype):
    """bf16: bit for bit; fp32: to rounding."""
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 40), (7, 96), (65, 33)])
def test_rms_norm_rounds_as_the_reference_with_and_without_the_residual(dtype, rows, width):
    x, res = rand(rows, width, seed=1, dtype=dtype), rand(rows, width, seed=2, dtype=dtype)
    weight = rand(width, seed=3, dtype=dtype, scale=0.1)
    same(norms_cpu.rms_norm(x, weight, 1e-6), norms_ref.rms_norm(x, weight, 1e-6), dtype)
    y, total = norms_cpu.rms_norm(x, weight, 1e-6, res)
    want_y, want_total = norms_ref.rms_norm(x, weight, 1e-6, res)
    same(y, want_y, dtype)
    same(total, want_total, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_rounds_its_product_as_the_reference(dtype, weight_dtype):
    wide = rand(9, 40, seed=1, dtype=dtype)
    x, gate = wide[:, :20], wide[:, 20:]  # strided rows, as the layer passes them
    weight = rand(20, seed=3, dtype=weight_dtype)
    same(norms_cpu.gated_rms_norm(x, gate, weight, 1e-6), norms_ref.gated_rms_norm(x, gate, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, pairs", [(32, 4), (24, 12), (64, 8)])
def test_qk_norm_rope_rounds_as_the_reference(dtype, head_dim, pairs):
    q = rand(11, 6, 2 * head_dim, seed=1, dtype=dtype)[:, :, :head_dim]  # strided heads
    k = rand(11, 2, head_dim, seed=2, dtype=dtype)
    wq, wk = rand(head_dim, seed=3, dtype=dtype, scale=0.1), rand(head_dim, seed=4, dtype=dtype, scale=0.1)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 5, 6, 9, 3000, 12])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * pairs, 2, dtype=torch.float32) / (2 * pairs)))
    got = norms_cpu.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6)
    want = norms_ref.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6)
    for a, b in zip(got, want):
        if dtype == torch.bfloat16:  # cos and sin by libm here, by torch there: at most a rounding apart
            torch.testing.assert_close(a, b, atol=0, rtol=2 ** -7)
        else:
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_round_as_the_reference(dtype):
    a, b = rand(5, 300, seed=1, dtype=dtype, scale=4), rand(5, 300, seed=2, dtype=dtype, scale=4)
    same(norms_cpu.silu_mul(a, b), norms_ref.silu_mul(a, b), dtype)
    same(norms_cpu.sigmoid_gate(a, b), norms_ref.sigmoid_gate(a, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_gates_including_softplus_past_its_threshold(dtype):
    a = torch.tensor([[-30.0, -1.0, 0.0, 19.0], [20.5, 40.0, 3.0, -5.0]]).to(dtype)
    b = rand(2, 4, seed=1, dtype=dtype)
    A_log, dt_bias = rand(4, seed=2), rand(4, seed=3, dtype=dtype)
    g, beta = norms_cpu.delta_gates(a, b, A_log, dt_bias)
    want_g, want_beta = norms_ref.delta_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, want_g, **TOL)
    same(beta, want_beta, dtype)

