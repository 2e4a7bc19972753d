"""The fused row-wise ops (norms with the residual add, q/k norm with rotary, the DeltaNet gates,
the gates' products), Triton interpreted on CPU, against their references at odd widths, on
strided inputs as the model passes them, in fp32 and in bf16; and one launch each, with no other
op than allocations.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cairn.kernels.norms import reference as norms_ref
from cairn.kernels.norms import triton_ops as norms_triton
from tests.kernels.conventions import BF16, TOL, rand, triton_interpreted

pytestmark = [triton_interpreted, pytest.mark.usefixtures("nan_filled_buffers")]


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
@pytest.mark.parametrize("rows, width", [(1, 40), (7, 96), (65, 33)])
def test_rms_norm_with_and_without_the_residual_add(dtype, tol, rows, width):
    x, res, w = rand(rows, width, seed=1, dtype=dtype), rand(rows, width, seed=2, dtype=dtype), rand(width, seed=3)
    torch.testing.assert_close(norms_triton.rms_norm(x, w.to(dtype), 1e-6), norms_ref.rms_norm(x, w.to(dtype), 1e-6), **tol)
    got_y, got_r = norms_triton.rms_norm(x, w.to(dtype), 1e-6, res)
    want_y, want_r = norms_ref.rms_norm(x, w.to(dtype), 1e-6, res)
    # the residual stream is the same sum; in bf16 within one rounding (the interpreter truncates
    # fp32 -> bf16 where a GPU rounds to nearest, as torch does)
    torch.testing.assert_close(got_r, want_r, **(dict(atol=0, rtol=0) if dtype == torch.float32 else
                                                dict(atol=0, rtol=2 ** -7)))
    torch.testing.assert_close(got_y, want_y, **tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_gated_rms_norm_on_strided_rows(dtype, tol):
    base = rand(9, 2, 24, seed=4, dtype=dtype)
    x, gate = base[:, 0], rand(9, 24, seed=5, dtype=dtype)  # x's rows are strided, as a reshaped view's
    w = rand(24, seed=6, dtype=dtype)
    torch.testing.assert_close(norms_triton.gated_rms_norm(x, gate, w, 1e-6), norms_ref.gated_rms_norm(x, gate, w, 1e-6), **tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, dict(atol=1e-4, rtol=1e-4)), (torch.bfloat16, BF16)])
@pytest.mark.parametrize("head_dim, rotary", [(32, 8), (24, 24), (16, 4)])
def test_qk_norm_rope_matches_norm_then_rotary(dtype, tol, head_dim, rotary):
    t, h_q, h_kv = 11, 4, 2
    qg = rand(t, h_q, 2 * head_dim, seed=7, dtype=dtype)
    q = qg[..., :head_dim]  # q_proj's output holds [query | gate] per head: q is a strided view
    k = rand(t, h_kv, head_dim, seed=8, dtype=dtype)
    wq, wk = rand(head_dim, seed=9, scale=0.1).to(dtype), rand(head_dim, seed=10, scale=0.1).to(dtype)
    positions = torch.tensor([0, 1, 2, 3, 5, 8, 13, 100, 1000, 4095, 32767])
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
    got = norms_triton.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6)
    want = norms_ref.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_gates_including_softplus_past_its_threshold(dtype):
    a, b = rand(13, 6, seed=11, dtype=dtype, scale=10.0), rand(13, 6, seed=12, dtype=dtype, scale=3.0)
    a[0, 0] = 25.0  # softplus is x itself past 20
    A_log, dt_bias = rand(6, seed=13), rand(6, seed=14).to(dtype)
    got_g, got_beta = norms_triton.delta_gates(a, b, A_log, dt_bias)
    want_g, want_beta = norms_ref.delta_gates(a, b, A_log, dt_bias)
    assert got_g.dtype == torch.float32 and got_beta.dtype == dtype
    torch.testing.assert_close(got_g, want_g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_beta, want_beta, **(TOL if dtype == torch.float32 else BF16))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_sigmoid_gate_on_a_strided_gate(dtype, tol):
    qg = rand(6, 2 * 1100, seed=15, dtype=dtype)
    x, gate = rand(6, 1100, seed=16, dtype=dtype), qg[:, 1100:]  # more than one block of a row
    torch.testing.assert_close(norms_triton.sigmoid_gate(x, gate), norms_ref.sigmoid_gate(x, gate), **tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_silu_mul_on_halves_of_one_projection(dtype, tol):
    gate_up = rand(6, 2 * 1100, seed=17, dtype=dtype, scale=3)
    gate, up = gate_up[:, :1100], gate_up[:, 1100:]  # strided rows, more than one block of a row
    torch.testing.assert_close(norms_triton.silu_mul(gate, up), norms_ref.silu_mul(gate, up), **tol)


def test_each_op_is_one_launch_and_allocations():
    """Nothing but the kernel: no cast of a weight, no arithmetic around it (the interpreter's own
    tensors aside, which a compiled launch does not make)."""
    launches = []
    originals = {}
    for name in ("_rms_norm_kernel", "_gated_rms_norm_kernel", "_qk_norm_rope_kernel", "_delta_gates_kernel",
                 "_sigmoid_gate_kernel", "_silu_mul_kernel"):
        kernel = getattr(norms_triton, name)
        originals[name] = kernel

        class Stub:
            def __init__(self, name):
                self.name = name

            def __getitem__(self, grid):
                return lambda *a, **k: launches.append(self.name)

        setattr(norms_triton, name, Stub(name))
    try:
        x, w = rand(5, 16, dtype=torch.bfloat16), rand(16, dtype=torch.bfloat16)
        q, k = rand(5, 4, 16, dtype=torch.bfloat16), rand(5, 2, 16, dtype=torch.bfloat16)
        positions, inv_freq, zeros = torch.arange(5), torch.ones(4), torch.zeros(4)
        a, b = x[:, :4], x[:, 4:8]
        with _Ops() as seen:
            norms_triton.rms_norm(x, w, 1e-6, x)
            norms_triton.gated_rms_norm(x, x, w, 1e-6)
            norms_triton.qk_norm_rope(q, k, w, w, positions, inv_freq, 1e-6)
            norms_triton.delta_gates(a, b, zeros, zeros)
            norms_triton.sigmoid_gate(x, x)
            norms_triton.silu_mul(x, x)
    finally:
        for name, kernel in originals.items():
            setattr(norms_triton, name, kernel)
    assert launches == ["_rms_norm_kernel", "_gated_rms_norm_kernel", "_qk_norm_rope_kernel", "_delta_gates_kernel",
                        "_sigmoid_gate_kernel", "_silu_mul_kernel"]
    assert set(seen.ops) <= {"full", "empty", "view", "_unsafe_view", "slice"}, seen.ops

