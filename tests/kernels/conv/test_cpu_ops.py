"""The C++ CPU kernels of the causal conv (cairn/kernels/conv/*.cpp, launched by cpu_ops.py) against
the op's reference, at odd shapes (odd lengths, empty and short segments, head dims off the vector
width, more value heads than key heads), on the strided pools and pages the engine passes, in
fp32 and bf16. Pool slots the op must not touch, and the rest of every buffer, start as NaN: a
kernel that reads or writes outside its rows fails loudly.
"""

from __future__ import annotations

import pytest
import torch

from cairn.kernels.conv import cpu_ops as conv_cpu
from cairn.kernels.conv import reference as conv_ref
from tests.kernels.conventions import BF16, TOL, layer_pool, needs_compiler, rand

pytestmark = [needs_compiler, pytest.mark.usefixtures("native_library")]


@pytest.mark.parametrize("channels", [24, 300, 1024])
@pytest.mark.parametrize("dtype, pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_varlen_conv_equals_the_reference_for_segments_shorter_than_its_window(channels, dtype, pool_dtype):
    lengths = [0, 1, 2, 3, 70, 130]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = rand(int(cu[-1]), channels, seed=1, dtype=dtype)
    weight = rand(channels, 4, seed=2)
    whole, pool = layer_pool(9, (channels, 3), dtype=pool_dtype)
    slots = torch.tensor([8, 1, 2, 0, 5, 7])
    pool[slots] = rand(6, channels, 3, seed=3, dtype=pool_dtype)
    want_whole = whole.clone()
    want = conv_ref.causal_conv1d_varlen(x, weight, cu, want_whole[:, 1], slots)
    out = conv_cpu.causal_conv1d_varlen(x, weight, cu, pool, slots)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), **(TOL if dtype == torch.float32 else BF16))
    assert torch.equal(whole.isnan(), want_whole.isnan())
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)  # states are copies: exact


def test_conv_reads_strided_rows_of_its_input():
    mixed = rand(50, 96, seed=1)
    x = mixed[7:40, 8:72]  # rows of a wider projection
    weight, cu = rand(64, 4, seed=2), torch.tensor([0, 10, 33], dtype=torch.int32)
    a, b = rand(3, 64, 3, seed=3), None
    b = a.clone()
    want = conv_ref.causal_conv1d_varlen(x, weight, cu, a, torch.tensor([2, 0]))
    torch.testing.assert_close(conv_cpu.causal_conv1d_varlen(x, weight, cu, b, torch.tensor([2, 0])), want, **TOL)
    torch.testing.assert_close(b, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_in_slots_leaves_padding_rows_unwritten(dtype):
    x, weight = rand(4, 40, seed=1, dtype=dtype), rand(40, 4, seed=2)
    whole, pool = layer_pool(5, (40, 3), dtype=dtype)
    slots = torch.tensor([3, -1, 0, 4])
    pool[slots[slots >= 0]] = rand(3, 40, 3, seed=3, dtype=dtype)
    want_whole = whole.clone()
    want = conv_ref.causal_conv1d_update_slots(x, weight, want_whole[:, 1], slots)
    out = conv_cpu.causal_conv1d_update_slots(x, weight, pool, slots)
    torch.testing.assert_close(out.float(), want.float(), **(TOL if dtype == torch.float32 else BF16))
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)

