"""The Triton kernels of the gated delta rule against the op's reference, interpreted on CPU (conftest sets
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
import torch.nn.functional as F

from cairn.kernels.delta_rule import reference as delta_rule_ref
from cairn.kernels.delta_rule import triton_chunk as delta_rule_chunk
from cairn.kernels.delta_rule import triton_recurrent as delta_rule_recurrent
from cairn.kernels.delta_rule.tuning import STEP_SHAPES
from tests.kernels.conventions import STATE_TOL, TOL, triton_interpreted

H_K, H_V, D_K, D_V = 2, 6, 24, 20  # more value heads than key heads, head dims not powers of two


pytestmark = [triton_interpreted, pytest.mark.usefixtures("nan_filled_buffers")]


def nan_pool(*inner: int, slots: int = 7, layers: int = 2, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool [slots, layers, *inner] of NaN, its per-layer view [slots, *inner]: strided, like the engine's)."""
    pool = torch.full((slots, layers, *inner), math.nan)
    return pool, pool[:, layer]


def delta_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, H_K, D_K, generator=gen)
    k = torch.randn(length, H_K, D_K, generator=gen)
    v = torch.randn(length, H_V, D_V, generator=gen)
    g = F.logsigmoid(2 * torch.randn(length, H_V, generator=gen) + 2)  # log decay: some near 0, some strong
    beta = torch.sigmoid(torch.randn(length, H_V, generator=gen))
    return q, k, v, g, beta


def random_states(*lead: int, seed: int = 1) -> torch.Tensor:
    return 0.5 * torch.randn(*lead, H_V, D_K, D_V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [1, 63, 75])
def test_chunked_delta_rule_equals_the_reference_with_states_at_any_positions(length):
    q, k, v, g, beta = delta_inputs(length)
    init = random_states()
    positions = [p for p in (1, 16, 17, 40, 64, 75) if p <= length]  # on and off page and chunk bounds
    out, final, states = delta_rule_chunk.chunk_gated_delta_rule(q, k, v, g, beta, init, state_positions=positions)
    want_out, want_final, want_states = delta_rule_ref.chunk_gated_delta_rule(q, k, v, g, beta, init,
                                                                         state_positions=positions)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(final, want_final, **STATE_TOL)
    torch.testing.assert_close(states, want_states, **STATE_TOL)
    assert final.dtype == states.dtype == torch.float32


def test_chunked_delta_rule_from_zeros_without_l2_norm_and_with_a_scale():
    q, k, v, g, beta = delta_inputs(40, seed=3)
    q, k = 0.3 * q, 0.3 * k  # unnormalised keys: keep the recurrence stable
    got = delta_rule_chunk.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.7, use_qk_l2norm=False)
    want = delta_rule_ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.7, use_qk_l2norm=False)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **STATE_TOL)


def test_varlen_delta_rule_equals_a_per_sequence_loop_over_state_slots():
    lengths, used = [75, 1, 0, 33], [5, 0, 3, 6]
    positions = [[16, 64, 75], [1], [], [5, 32]]
    q, k, v, g, beta = delta_inputs(sum(lengths), seed=4)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    pool, view = nan_pool(H_V, D_K, D_V, layer=0)
    view[used] = random_states(len(used))
    want_pool = pool.clone()
    slots = torch.tensor(used)
    out, states = delta_rule_chunk.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, view, slots, state_positions=positions)
    want_out, want_states = delta_rule_ref.chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, cu, want_pool[:, 0], slots, state_positions=positions)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(states, want_states, **STATE_TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **STATE_TOL)


def test_recurrent_delta_rule_equals_the_reference():
    q, k, v, g, beta = delta_inputs(20, seed=5)
    init = random_states()
    out, final = delta_rule_recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, init)
    want_out, want_final = delta_rule_ref.recurrent_gated_delta_rule(q, k, v, g, beta, init)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(final, want_final, **STATE_TOL)


def test_decode_steps_update_states_in_place_in_a_batch_and_in_slots():
    q, k, v, g, beta = delta_inputs(3, seed=6)  # three sequences, one token each
    init = random_states(3)
    got, want = init.clone(), init.clone()
    out = delta_rule_recurrent.gated_delta_rule_step(q, k, v, g, beta, got)
    torch.testing.assert_close(out, delta_rule_ref.gated_delta_rule_step(q, k, v, g, beta, want), **TOL)
    torch.testing.assert_close(got, want, **STATE_TOL)

    pool, view = nan_pool(H_V, D_K, D_V)
    slots = torch.tensor([2, 6, 0])
    view[slots] = init
    want_pool = pool.clone()
    out = delta_rule_recurrent.gated_delta_rule_step_slots(q, k, v, g, beta, view, slots)
    want = delta_rule_ref.gated_delta_rule_step_slots(q, k, v, g, beta, want_pool[:, 1], slots)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **STATE_TOL)



@pytest.mark.parametrize("batch", [1, 3, 33])
@pytest.mark.parametrize("h_k, h_v", [(2, 6), (1, 5), (3, 3)])
def test_decode_steps_at_every_launch_shape_and_head_ratio_equal_the_reference(batch, h_k, h_v):
    """Batches of 1, 3 and 33 take the narrow, middle and wide value blocks here (the interpreted
    launcher sizes its grid for 8 SMs); value heads 3, 5 or 1 to a key head."""
    gen = torch.Generator().manual_seed(batch * h_v)
    q, k = torch.randn(batch, h_k, D_K, generator=gen), torch.randn(batch, h_k, D_K, generator=gen)
    v = torch.randn(batch, h_v, D_V, generator=gen)
    g = F.logsigmoid(2 * torch.randn(batch, h_v, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(batch, h_v, generator=gen))
    pool, view = nan_pool(h_v, D_K, D_V, slots=batch + 2)
    slots = torch.randperm(batch + 2, generator=gen)[:batch]
    view[slots] = 0.5 * torch.randn(batch, h_v, D_K, D_V, generator=gen)
    want_pool = pool.clone()
    out = delta_rule_recurrent.gated_delta_rule_step_slots(q, k, v, g, beta, view, slots)
    want = delta_rule_ref.gated_delta_rule_step_slots(q, k, v, g, beta, want_pool[:, 1], slots)
    torch.testing.assert_close(out, want, **TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **STATE_TOL)


def test_the_decode_step_takes_the_widest_value_block_that_fills_the_device():
    """H200: 132 SMs; Qwen3.5-35B-A3B: 32 value heads of 128."""
    shape = delta_rule_recurrent.step_shape
    assert [shape(b, 32, 128, 132) for b in (1, 4, 64, 256)] == [STEP_SHAPES[2], STEP_SHAPES[1], STEP_SHAPES[0],
                                                                  STEP_SHAPES[0]]
    assert [shape(b, 6, D_V, 8) for b in (1, 3, 33)] == [STEP_SHAPES[2], STEP_SHAPES[1], STEP_SHAPES[0]]
