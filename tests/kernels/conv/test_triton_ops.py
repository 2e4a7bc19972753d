"""The Triton kernels of the causal conv against the op's reference, interpreted on CPU (conftest sets
TRITON_INTERPRET=1 before triton is imported), in fp32 at small, deliberately odd shapes: T = 1,
63, 75; head dims that are not powers of two; more value heads than key heads; varlen batches
against a per-sequence loop. Every buffer a launcher allocates starts as NaN, and so do caches
and state slots nobody should read, so a kernel that reads unwritten memory, or leaves part of
its output unwritten, fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from cairn.kernels.conv import reference as conv_ref
from cairn.kernels.conv import triton_ops as conv_triton
from tests.kernels.conventions import EXACT, TOL, triton_interpreted

CHANNELS, WIDTH = 10, 4


pytestmark = [triton_interpreted, pytest.mark.usefixtures("nan_filled_buffers")]


def conv_weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(CHANNELS, WIDTH, generator=torch.Generator().manual_seed(seed))


def nan_pool(*inner: int, slots: int = 7, layers: int = 2, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool [slots, layers, *inner] of NaN, its per-layer view [slots, *inner]: strided, like the engine's)."""
    pool = torch.full((slots, layers, *inner), math.nan)
    return pool, pool[:, layer]


@pytest.mark.parametrize("length", [1, 2, 63, 75])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv_equals_the_reference_output_and_new_state(length, with_state):
    x, weight = torch.randn(length, CHANNELS), conv_weight()
    init = torch.randn(CHANNELS, WIDTH - 1) if with_state else None
    out, new_state = conv_triton.causal_conv1d(x, weight, init)
    want_out, want_state = conv_ref.causal_conv1d(x, weight, init)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(new_state, want_state, **EXACT)


def test_conv_varlen_equals_a_per_sequence_loop_and_leaves_other_slots_alone():
    lengths, used = [75, 1, 2, 0, 5], [5, 0, 3, 6, 2]
    x, weight = torch.randn(sum(lengths), CHANNELS), conv_weight(1)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    pool, view = nan_pool(CHANNELS, WIDTH - 1)
    view[used] = torch.randn(len(used), CHANNELS, WIDTH - 1)
    want_pool = pool.clone()
    slots = torch.tensor(used)
    out = conv_triton.causal_conv1d_varlen(x, weight, cu, view, slots)
    want = conv_ref.causal_conv1d_varlen(x, weight, cu, want_pool[:, 1], slots)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **EXACT)


def test_conv_update_equals_the_reference_in_a_batch_and_in_slots():
    x, weight = torch.randn(3, CHANNELS), conv_weight(2)
    init = torch.randn(3, CHANNELS, WIDTH - 1)
    got_state, want_state = init.clone(), init.clone()
    out = conv_triton.causal_conv1d_update(x, weight, got_state)
    torch.testing.assert_close(out, conv_ref.causal_conv1d_update(x, weight, want_state), **TOL)
    torch.testing.assert_close(got_state, want_state, **EXACT)

    pool, view = nan_pool(CHANNELS, WIDTH - 1)
    slots = torch.tensor([4, 1, 6])
    view[slots] = init
    want_pool = pool.clone()
    out = conv_triton.causal_conv1d_update_slots(x, weight, view, slots)
    want = conv_ref.causal_conv1d_update_slots(x, weight, want_pool[:, 1], slots)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **EXACT)

