"""The reference of the causal conv (cairn/kernels/conv/reference.py, the contract every
implementation is held to) against transformers' `causal_conv1d_fn` and against itself split in calls, at odd shapes in fp32. Buffers an op writes into start as NaN,
so reading an unwritten slot fails loudly. The ops run through `cairn.kernels` with the references
forced.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
)

from cairn.kernels import (
    causal_conv1d,
    causal_conv1d_update,
)
from tests.kernels.conventions import TOL

CHANNELS, WIDTH = 10, 4


pytestmark = pytest.mark.usefixtures("the_references")


def conv_inputs(length: int, seed: int = 0, lead: tuple[int, ...] = ()):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, length, CHANNELS, generator=gen), torch.randn(CHANNELS, WIDTH, generator=gen)


@pytest.mark.parametrize("length", [1, 2, 75])
def test_conv_on_a_fresh_sequence_equals_transformers_and_keeps_the_last_inputs_as_state(length):
    x, weight = conv_inputs(length)
    out, state = causal_conv1d(x, weight, None)
    want = causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    torch.testing.assert_close(out, want, **TOL)
    padded = torch.cat((torch.zeros(CHANNELS, WIDTH - 1), x.t()), dim=1)
    assert state.dtype == torch.float32
    torch.testing.assert_close(state, padded[:, -(WIDTH - 1):], atol=0, rtol=0)


@pytest.mark.parametrize("split", [1, 2, 40, 74])
def test_splitting_a_sequence_in_two_calls_with_the_carried_state_equals_one_call(split):
    x, weight = conv_inputs(75)
    whole, whole_state = causal_conv1d(x, weight, None)
    first, state = causal_conv1d(x[:split], weight, None)
    second, state = causal_conv1d(x[split:], weight, state)
    torch.testing.assert_close(torch.cat((first, second)), whole, **TOL)
    torch.testing.assert_close(state, whole_state, atol=0, rtol=0)


def test_conv_update_token_by_token_equals_causal_conv1d_for_a_batch_with_their_own_states():
    batch, length = 3, 7
    x, weight = conv_inputs(length, lead=(batch,))
    init = torch.randn(batch, CHANNELS, WIDTH - 1)
    state = init.clone()
    stepped = torch.stack([causal_conv1d_update(x[:, t], weight, state) for t in range(length)], dim=1)
    for b in range(batch):
        want_out, want_state = causal_conv1d(x[b], weight, init[b])
        torch.testing.assert_close(stepped[b], want_out, **TOL)
        torch.testing.assert_close(state[b], want_state, atol=0, rtol=0)


def test_conv_output_follows_x_dtype_and_state_follows_the_state_dtype():
    x, weight = conv_inputs(5)
    out, state = causal_conv1d(x.bfloat16(), weight, torch.zeros(CHANNELS, WIDTH - 1, dtype=torch.float64))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float64

