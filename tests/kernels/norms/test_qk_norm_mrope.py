"""`qk_norm_rope` with M-RoPE (positions [3, T], `rope_axes` [R]) on every backend: the reference
against a token-by-token rotation by transformers' formula (angle[t, i] = pos[axis(i), t] *
inv_freq[i], rotate-half over the first 2R channels), the Triton kernel (interpreted, small
shapes, NaN-filled buffers) and the C++ op against the reference, in fp32 and bf16, on strided q
and positions of either index dtype; with three equal rows, each is its own [T] rotation exactly;
and bad shapes are refused alike.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cairn.kernels.norms import cpu_ops as norms_cpu
from cairn.kernels.norms import reference as norms_ref
from cairn.kernels.norms import triton_ops as norms_triton
from tests.kernels.conventions import BF16, TOL, needs_compiler, rand, triton_interpreted

AXES = torch.tensor([0, 1, 2, 0, 1, 2, 0, 0, 0, 1, 0, 2])  # rotary dim 24 over head dim 40: a pass-through tail
T, H_Q, H_KV, D = 7, 3, 2, 40
CPU, TRITON = pytest.param("cpu", marks=needs_compiler), pytest.param("triton", marks=triton_interpreted)


def backend(request) -> object:
    """The op of request.param's backend, with what its tests use (the built library, NaN buffers)."""
    if request.param == "cpu":
        request.getfixturevalue("native_library")
        return norms_cpu.qk_norm_rope
    if request.param == "triton":
        request.getfixturevalue("nan_filled_buffers")
        return norms_triton.qk_norm_rope
    return norms_ref.qk_norm_rope


@pytest.fixture(params=["reference", CPU, TRITON])
def op(request):
    return backend(request)


@pytest.fixture(params=[CPU, TRITON])
def kernel(request):
    return backend(request)


def inputs(dtype=torch.float32, pos_dtype=torch.int64, seed=0):
    """q a strided view (q_proj's [query | gate] per head), positions [3, T] a strided view too."""
    q = rand(T, H_Q, 2 * D, seed=seed, dtype=dtype)[..., :D]
    k = rand(T, H_KV, D, seed=seed + 1, dtype=dtype)
    wq, wk = rand(D, seed=seed + 2, scale=0.1).to(dtype), rand(D, seed=seed + 3, scale=0.1).to(dtype)
    rows = torch.tensor([[0, 3, 3, 3, 3, 7, 4095], [1, 3, 3, 4, 4, 7, 4095], [2, 3, 4, 3, 4, 7, 4095]])
    positions = torch.stack((rows, -rows), dim=-1).to(pos_dtype)[..., 0]  # [3, T], stride 2 along T
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 2 * len(AXES), 2, dtype=torch.float32) / (2 * len(AXES))))
    return q, k, wq, wk, positions, inv_freq


def rotated_token_by_token(x, weight, positions, inv_freq, axes):
    """transformers' formula, one token and one frequency at a time, after the reference's norm."""
    x = norms_ref.rms_norm(x, weight, 1e-6)
    out, half = x.clone(), len(axes)
    for t in range(x.shape[0]):
        for i in range(half):
            angle = positions[axes[i], t].float() * inv_freq[i]
            lo, hi = x[t, :, i], x[t, :, i + half]
            out[t, :, i] = lo * angle.cos() - hi * angle.sin()
            out[t, :, i + half] = hi * angle.cos() + lo * angle.sin()
    return out


def test_the_reference_turns_each_frequency_by_its_axis_position():
    q, k, wq, wk, positions, inv_freq = inputs()
    got_q, got_k = norms_ref.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6, rope_axes=AXES)
    torch.testing.assert_close(got_q, rotated_token_by_token(q, wq, positions, inv_freq, AXES), **TOL)
    torch.testing.assert_close(got_k, rotated_token_by_token(k, wk, positions, inv_freq, AXES), **TOL)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_backend_matches_the_reference(kernel, dtype, pos_dtype):
    q, k, wq, wk, positions, inv_freq = inputs(dtype, pos_dtype, seed=5)
    axes = AXES.to(pos_dtype)
    got = kernel(q, k, wq, wk, positions, inv_freq, 1e-6, rope_axes=axes)
    want = norms_ref.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6, rope_axes=axes)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        # bf16: cos and sin by libm (C++) or the interpreter, by torch in the reference: a rounding apart
        torch.testing.assert_close(g, w, **(TOL if dtype == torch.float32 else
                                            BF16 if kernel is norms_triton.qk_norm_rope else dict(atol=0, rtol=2 ** -7)))


def test_three_equal_rows_are_exactly_the_one_row_rotation(op):
    q, k, wq, wk, positions, inv_freq = inputs(torch.bfloat16, seed=9)
    one_row = positions[1].contiguous()
    flat = op(q, k, wq, wk, one_row, inv_freq, 1e-6)
    equal_rows = op(q, k, wq, wk, one_row.expand(3, T), inv_freq, 1e-6, rope_axes=AXES)
    for a, b in zip(flat, equal_rows):
        assert torch.equal(a, b)


@pytest.mark.parametrize("positions, axes, what", [
    (torch.zeros(T, dtype=torch.long), AXES, r"positions \[3, T\]"),  # one row with axes
    (torch.zeros(3, T + 1, dtype=torch.long), AXES, r"positions \[3, T\]"),
    (torch.zeros(2, T, dtype=torch.long), AXES, r"positions \[3, T\]"),
    (torch.zeros(3, T, dtype=torch.long), AXES[:-1], r"rope_axes \[R\]"),  # an axis short
    (torch.zeros(3, T), AXES, "int32 or int64"),  # float positions
    (torch.zeros(3, T, dtype=torch.long), AXES.float(), "int32 or int64"),
    (torch.zeros(3, T, dtype=torch.long), torch.stack((AXES, AXES), 1)[:, 0], "contiguous rope_axes"),
    (torch.zeros(3, T, dtype=torch.long), None, r"positions \[T\]"),  # three rows without axes
])
def test_bad_positions_or_axes_are_refused_alike(op, positions, axes, what):
    q, k, wq, wk, _, inv_freq = inputs()
    with pytest.raises(ValueError, match=f"expected .*{what}.*, got"):
        op(q, k, wq, wk, positions, inv_freq, 1e-6, rope_axes=axes)


@needs_compiler
@pytest.mark.usefixtures("native_library")
def test_the_cpu_op_refuses_an_axis_past_width():
    q, k, wq, wk, positions, inv_freq = inputs()
    bad = AXES.clone()
    bad[3] = 3
    with pytest.raises(RuntimeError, match="expected axes in 0..2"):
        norms_cpu.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6, rope_axes=bad)


@triton_interpreted
@pytest.mark.usefixtures("nan_filled_buffers")
def test_the_triton_launch_is_one_kernel_and_allocations(monkeypatch):
    """No cast of positions or axes, no index arithmetic on the host: a capturable launch."""
    launched, seen = [], []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    class Stub:
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(kw["MROPE"])

    monkeypatch.setattr(norms_triton, "_qk_norm_rope_kernel", Stub())
    q, k, wq, wk, positions, inv_freq = inputs(pos_dtype=torch.int32)
    with Ops():
        norms_triton.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6, rope_axes=AXES)
    assert launched == [True]
    assert set(seen) <= {"full", "empty"}, seen
